"""Choosing a draft token from a logits row: the part every model-backed drafter shares.

On the host (`pick_token`, from the logits) or in the draft's graph (`pick_spec` asks the
graph's sampler for the same choice, `pick_from_block` reads what it decided): the same
distribution, the same argmax.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specd.daemon.spec.coupling import CoupledSampler
from specd.daemon.spec.graph_sampling import (
    MAX_Q_WIDTH,
    candidates_row,
    sample_spec,
    to_sparse,
)
from specd.daemon.spec.sampling import Sampler, SamplerParams, mask_logits, top_probability
from specd.daemon.spec.verify import DraftProbs
from specd.daemon.text.grammar import GrammarState
from specd.ort_models.sampling_op import (
    DRAFT_STREAM,
    OK,
    TARGET_STREAM,
    SampledBlock,
    SampleSpec,
)

# the draft's greedy choice in its graph: the argmax of its logits, no sampler settings
_GREEDY = Sampler(SamplerParams(temperature=0.0, seed=0))

QRow = np.ndarray | tuple[np.ndarray, np.ndarray]  # dense [vocab], or (ids [k], probs [k])


@dataclass(frozen=True)
class Pick:
    token: int | None  # None: drafting stops at this row
    q: QRow | None = None  # the distribution the token was drawn from
    unsure: bool = False  # stopped because the top probability fell below p_min


def pick_token(row: np.ndarray, sampler: Sampler | None, grammar: GrammarState | None,
               p_min: float, position: int | None = None) -> Pick:
    """The draft's token for `row` [vocab] at sequence position `position`: drawn from q
    (the sampler's distribution, under the grammar's mask) where a sampler is given, else
    the argmax; no token where the grammar allows none or (p_min > 0) the top probability
    is below p_min."""
    mask = None if grammar is None else grammar.allowed(row.shape[0])  # [vocab]
    if mask is not None and not mask.any():
        return Pick(None)
    q = None
    if sampler is not None:
        tok, q = sampler.sample_with_probs(row, mask, position)
        top = float(q.max())
    else:
        masked = row if mask is None else mask_logits(row, mask)
        tok = int(np.argmax(masked))
        top = top_probability(masked) if p_min > 0 else 1.0
    if p_min > 0 and top < p_min:
        return Pick(None, unsure=True)
    return Pick(tok, q)


def pick_spec(sampler: Sampler | None, grammar: GrammarState | None, position: int,
              p_min: float, vocab: int) -> SampleSpec | None:
    """The graph's decision of `pick_token` for the draft token at `position` (None where
    its q would not fit the candidates a graph returns, or a sampler without top-k)."""
    if sampler is None:
        return sample_spec(_GREEDY, position, vocab, grammar=grammar, stream=DRAFT_STREAM,
                           candidates=1 if p_min > 0 else 0)
    if isinstance(sampler, CoupledSampler):
        # the target's uniform at the position (its key is the target's); no q leaves the
        # graph (the target's own draw decides), only the top probability, for p_min
        return sample_spec(sampler, position, vocab, grammar=grammar, stream=TARGET_STREAM,
                           candidates=1)
    k = sampler.params.top_k
    if not 0 < k <= MAX_Q_WIDTH:
        return None
    return sample_spec(sampler, position, vocab, grammar=grammar, stream=DRAFT_STREAM,
                       candidates=k)


def pick_from_block(block: SampledBlock, sampled: bool, p_min: float) -> Pick:
    """`pick_token`'s answer from what the graph decided (`sampled`: a sampler drew it,
    and its candidates are q)."""
    if block.status != OK or not block.tokens:
        return Pick(None)
    ids, probs = candidates_row(block, 0)
    top = float(probs[0]) if probs.shape[0] else 1.0
    if p_min > 0 and top < p_min:
        return Pick(None, unsure=True)
    return Pick(block.tokens[0], (ids, probs) if sampled else None)


def stack_q(rows: list[QRow]) -> DraftProbs | None:
    """A proposal's q rows: dense [n, vocab] where every row is, else sparse pairs."""
    if not rows:
        return None
    if all(isinstance(r, np.ndarray) for r in rows):
        return np.stack(rows)
    return to_sparse(rows)
