"""Choosing a draft token from a logits row: the part every model-backed drafter shares."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specd.daemon.spec.sampling import Sampler, mask_logits, top_probability
from specd.daemon.text.grammar import GrammarState


@dataclass(frozen=True)
class Pick:
    token: int | None  # None: drafting stops at this row
    q: np.ndarray | None = None  # [vocab] the distribution the token was drawn from
    unsure: bool = False  # stopped because the top probability fell below p_min


def pick_token(row: np.ndarray, sampler: Sampler | None, grammar: GrammarState | None,
               p_min: float) -> Pick:
    """The draft's token for `row` [vocab]: drawn from q (the sampler's distribution, under
    the grammar's mask) where a sampler is given, else the argmax; no token where the grammar
    allows none or (p_min > 0) the top probability is below p_min."""
    mask = None if grammar is None else grammar.allowed(row.shape[0])  # [vocab]
    if mask is not None and not mask.any():
        return Pick(None)
    q = None
    if sampler is not None:
        tok, q = sampler.sample_with_probs(row, mask)
        top = float(q.max())
    else:
        masked = row if mask is None else mask_logits(row, mask)
        tok = int(np.argmax(masked))
        top = top_probability(masked) if p_min > 0 else 1.0
    if p_min > 0 and top < p_min:
        return Pick(None, unsure=True)
    return Pick(tok, q)
