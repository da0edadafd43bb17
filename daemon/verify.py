"""Verification of a drafted block against one target forward pass (pure numpy).

The target has scored ``[last_token, d_0, ..., d_{n-1}]`` in one pass, giving
``target_rows`` of shape ``[n+1, vocab]``: row i is the target's next-token
logits after the prefix ending in d_{i-1} (row 0: after last_token).  Each
verifier emits the accepted draft tokens followed by exactly one token chosen
by the target (the correction at the first rejection, or the bonus token from
row n), so ``len(tokens) == n_accepted + 1``.  Every emitted token is pushed to
``sampler.accept`` in order, so the repetition-penalty history is correct for
the next row and for the next round.

Draft distributions for rejection sampling are passed either dense, as a float
array ``[n, vocab_draft]`` (row i is the distribution d_i was sampled from), or
sparse, as :class:`SparseDraftProbs` with ``token_ids``/``probs`` of shape
``[n, k]`` (what a top-k draft sampler produces; ids not listed have probability
0).  If ``vocab_draft`` differs from the target vocab (Qwen2.5 pairs pad their
embeddings differently) columns are zero-padded / dropped to the target width;
this keeps the method exact as long as the target never puts mass on ids it
does not have.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .sampling import Sampler, sample_from_probs

__all__ = [
    "SparseDraftProbs",
    "VerifyResult",
    "accepts_draft",
    "residual_distribution",
    "verify_greedy",
    "verify_rejection",
]


@dataclass(frozen=True)
class VerifyResult:
    """Outcome of verifying one drafted block.

    tokens: accepted drafts then one target token, ``len == n_accepted + 1``.
    """

    n_accepted: int
    tokens: list[int]
    n_drafted: int

    @property
    def all_accepted(self) -> bool:
        return self.n_accepted == self.n_drafted


@dataclass(frozen=True)
class SparseDraftProbs:
    """Sparse draft distributions: row i puts ``probs[i, j]`` on token ``token_ids[i, j]``."""

    token_ids: np.ndarray  # [n, k] int
    probs: np.ndarray  # [n, k] float

    def __post_init__(self) -> None:
        if self.token_ids.shape != self.probs.shape or self.token_ids.ndim != 2:
            raise ValueError(
                f"token_ids and probs must both be [n, k], got {self.token_ids.shape} "
                f"and {self.probs.shape}"
            )

    def __len__(self) -> int:
        return self.token_ids.shape[0]

    def dense_row(self, i: int, vocab: int) -> np.ndarray:
        """Row i as a dense float64 [vocab] array (ids >= vocab dropped)."""
        row = np.zeros(vocab, dtype=np.float64)  # [vocab]
        ids = np.asarray(self.token_ids[i], dtype=np.int64)
        keep = (ids >= 0) & (ids < vocab)
        np.add.at(row, ids[keep], np.asarray(self.probs[i], dtype=np.float64)[keep])
        return row


DraftProbs = np.ndarray | SparseDraftProbs


def verify_greedy(
    target_rows: np.ndarray, draft_tokens: Sequence[int], sampler: Sampler
) -> VerifyResult:
    """Accept drafts while they equal the target sampler's own choice at each row.

    With a greedy sampler this is exact-match verification; with a stochastic one
    each emitted token is still a plain sample from the target, so it stays exact
    (it just accepts less often than :func:`verify_rejection`).
    """
    rows = _check_rows(target_rows, draft_tokens)  # [n+1, vocab]
    tokens: list[int] = []
    for i, drafted in enumerate(draft_tokens):
        choice = sampler.sample(rows[i])
        sampler.accept(choice)
        tokens.append(choice)
        if choice != int(drafted):
            return VerifyResult(i, tokens, len(draft_tokens))
    return _with_bonus(rows, tokens, sampler, len(draft_tokens))


def verify_rejection(
    target_rows: np.ndarray,
    draft_tokens: Sequence[int],
    draft_probs: DraftProbs,
    sampler: Sampler,
) -> VerifyResult:
    """Speculative rejection sampling (Leviathan et al. 2023, Chen et al. 2023).

    p_i = ``sampler.probs(row i)`` (the target's filtered distribution), q_i = draft
    row i.  d_i is accepted iff ``u * q_i(d_i) < p_i(d_i)`` for one fresh uniform u,
    i.e. with probability min(1, p/q).  On rejection one more uniform samples the
    correction from normalise(max(0, p_i - q_i)) (p_i if that is all zero) and the
    block ends; after full acceptance the bonus is ``sampler.sample(row n)``.  Every
    emitted token is thereby distributed exactly as sampling the target directly.
    """
    rows = _check_rows(target_rows, draft_tokens)  # [n+1, vocab]
    _check_draft_probs(draft_probs, len(draft_tokens))
    vocab = rows.shape[1]
    tokens: list[int] = []
    for i, drafted in enumerate(draft_tokens):
        d = int(drafted)
        p = sampler.probs(rows[i])  # [vocab]
        q = _draft_row(draft_probs, i, vocab)  # [vocab]
        p_d = p[d] if 0 <= d < vocab else 0.0
        q_d = q[d] if 0 <= d < vocab else 0.0
        if accepts_draft(sampler.uniform(), p_d, q_d):
            sampler.accept(d)
            tokens.append(d)
            continue
        correction = sample_from_probs(residual_distribution(p, q), sampler.uniform())
        sampler.accept(correction)
        tokens.append(correction)
        return VerifyResult(i, tokens, len(draft_tokens))
    return _with_bonus(rows, tokens, sampler, len(draft_tokens))


def accepts_draft(u: float, p_d: float, q_d: float) -> bool:
    """Accept with probability min(1, p_d / q_d) given u ~ U[0, 1) (no division)."""
    return u * q_d < p_d


def residual_distribution(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """normalise(max(0, p - q)) over [vocab]; falls back to p when p <= q everywhere."""
    r = np.maximum(p - q, 0.0)  # [vocab]
    total = r.sum()
    if not total > 0.0:
        return p
    return r / total


# -- helpers -------------------------------------------------------------------


def _with_bonus(
    rows: np.ndarray, tokens: list[int], sampler: Sampler, n_drafted: int
) -> VerifyResult:
    bonus = sampler.sample(rows[n_drafted])
    sampler.accept(bonus)
    tokens.append(bonus)
    return VerifyResult(n_drafted, tokens, n_drafted)


def _check_rows(target_rows: np.ndarray, draft_tokens: Sequence[int]) -> np.ndarray:
    rows = np.asarray(target_rows)
    if rows.ndim != 2 or rows.shape[0] != len(draft_tokens) + 1:
        raise ValueError(
            f"target_rows must be [n_draft+1, vocab] = [{len(draft_tokens) + 1}, vocab], "
            f"got {rows.shape}"
        )
    return rows


def _check_draft_probs(draft_probs: DraftProbs, n_draft: int) -> None:
    if isinstance(draft_probs, SparseDraftProbs):
        n = len(draft_probs)
    else:
        shape = np.shape(draft_probs)
        if len(shape) != 2:
            raise ValueError(f"dense draft_probs must be [n_draft, vocab], got {shape}")
        n = shape[0]
    if n != n_draft:
        raise ValueError(f"draft_probs has {n} rows for {n_draft} drafted tokens")


def _draft_row(draft_probs: DraftProbs, i: int, vocab: int) -> np.ndarray:
    """Draft distribution i as dense float64 [vocab], padded or cut to the target vocab."""
    if isinstance(draft_probs, SparseDraftProbs):
        return draft_probs.dense_row(i, vocab)
    row = np.asarray(draft_probs[i], dtype=np.float64)  # [vocab_draft]
    if row.shape[0] == vocab:
        return row
    out = np.zeros(vocab, dtype=np.float64)  # [vocab]
    width = min(vocab, row.shape[0])
    out[:width] = row[:width]
    return out
