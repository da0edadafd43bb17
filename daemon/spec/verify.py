"""Verification of a drafted block against one target forward pass (pure numpy).

The target has scored ``[last_token, d_0, ..., d_{n-1}]`` in one pass, giving
``target_rows`` of shape ``[n+1, vocab]``: row i is the target's next-token
logits after the prefix ending in d_{i-1} (row 0: after last_token).  Each
verifier emits the accepted draft tokens followed by exactly one token chosen
by the target (the correction at the first rejection, or the bonus token from
row n), so ``len(tokens) == n_accepted + 1`` (unless a grammar ends the block on an
accepted draft, below).  Every emitted token is pushed to
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

Grammar-constrained requests pass ``grammar`` (a :class:`TokenConstraint`, e.g.
``specd.daemon.text.grammar.GrammarState``) positioned after ``last_token``.  Row i is then
decided under ``grammar.allowed(vocab)`` for the prefix accepted so far, and the verifier
``consume``s every emitted token in order, so afterwards the state sits after the last
emitted token.  If the mask at row i > 0 allows nothing (a grammar dead end) the block
ends after the i tokens accepted so far: the last of them stands in for the target's
token (``n_accepted = i == len(tokens)``) and ``VerifyResult.grammar_dead_end`` is set;
at row 0 it raises :class:`~specd.daemon.spec.sampling.NoAllowedToken` (check ``dead_end``
before a round).  Likewise when an accepted draft completes the grammar, the block ends
on it (``n_accepted == len(tokens)``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from .sampling import NoAllowedToken, Sampler, sample_from_probs

__all__ = [
    "SparseDraftProbs",
    "TokenConstraint",
    "VerifyResult",
    "acceptance_probability",
    "accepts_draft",
    "residual_distribution",
    "to_width",
    "verify_greedy",
    "verify_rejection",
]


@dataclass(frozen=True)
class VerifyResult:
    """Outcome of verifying one drafted block.

    tokens: accepted drafts then one target token, ``len == n_accepted + 1``; or only
    accepted drafts (``len == n_accepted``) where the grammar ended the block on one.
    grammar_dead_end: the grammar allowed no token after ``tokens`` (the block was cut
    there; the request must stop).
    accept_probs: for each draft position decided (up to and including the first
    rejection), the probability that it was accepted given the drafts before it:
    sum(min(p, q)) under rejection sampling, p(d) where the target draws and the draft
    must match (1 or 0 when greedy). Each acceptance outcome is a coin with this bias,
    so its mean estimates acceptance as the outcomes do, without the coins' noise.
    bonus_probs: after full acceptance, the target's distribution [vocab] the bonus token
    was drawn from (a draft's distribution there gives a free sample of the acceptance
    one position further).
    """

    n_accepted: int
    tokens: list[int]
    n_drafted: int
    grammar_dead_end: bool = False
    accept_probs: tuple[float, ...] = field(default=(), compare=False)
    # after full acceptance: the target's distribution the bonus token was drawn from
    bonus_probs: np.ndarray | None = field(default=None, compare=False)  # [vocab]

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

    def __getitem__(self, rows: slice) -> SparseDraftProbs:
        """Some of the rows (as a dense q's rows are sliced)."""
        return SparseDraftProbs(self.token_ids[rows], self.probs[rows])

    def dense_row(self, i: int, vocab: int) -> np.ndarray:
        """Row i as a dense float64 [vocab] array (ids >= vocab dropped)."""
        row = np.zeros(vocab, dtype=np.float64)  # [vocab]
        ids = np.asarray(self.token_ids[i], dtype=np.int64)
        keep = (ids >= 0) & (ids < vocab)
        np.add.at(row, ids[keep], np.asarray(self.probs[i], dtype=np.float64)[keep])
        return row


DraftProbs = np.ndarray | SparseDraftProbs


class TokenConstraint(Protocol):
    """What the verifiers need of a grammar state (``grammar.GrammarState`` has it)."""

    def allowed(self, n_vocab: int) -> np.ndarray:
        """[n_vocab] bool: the tokens that may come next."""
        ...

    def consume(self, token: int) -> None:
        """Advance past ``token`` (one the mask allowed)."""
        ...


def verify_greedy(
    target_rows: np.ndarray,
    draft_tokens: Sequence[int],
    sampler: Sampler,
    grammar: TokenConstraint | None = None,
) -> VerifyResult:
    """Accept drafts while they equal the target sampler's own choice at each row.

    With a greedy sampler this is exact-match verification; with a stochastic one
    each emitted token is still a plain sample from the target, so it stays exact
    (it just accepts less often than :func:`verify_rejection`).  With ``grammar`` the
    choice at each row is made under the grammar's mask after the tokens emitted so
    far, so the output equals constrained decoding without a draft.
    """
    rows = _check_rows(target_rows, draft_tokens)  # [n+1, vocab]
    vocab = rows.shape[1]
    n = len(draft_tokens)
    tokens: list[int] = []
    alphas: list[float] = []
    for i, drafted in enumerate(draft_tokens):
        mask = _mask(grammar, vocab)  # [vocab] or None
        if mask is not None and i > 0 and not mask.any():
            return _dead_end(tokens, n, alphas)
        choice, alpha = sampler.sample_with_prob_of(rows[i], int(drafted), mask)
        alphas.append(alpha)
        _emit(choice, tokens, sampler, grammar)
        if choice != int(drafted):
            return VerifyResult(i, tokens, n, accept_probs=tuple(alphas))
        if _stopped(grammar):  # the constraint is complete: end as plain decoding does
            return VerifyResult(i + 1, tokens, n, accept_probs=tuple(alphas))
    return _with_bonus(rows, tokens, sampler, n, grammar, alphas)


def verify_rejection(
    target_rows: np.ndarray,
    draft_tokens: Sequence[int],
    draft_probs: DraftProbs,
    sampler: Sampler,
    grammar: TokenConstraint | None = None,
    *,
    draft_masked: bool = True,
) -> VerifyResult:
    """Speculative rejection sampling (Leviathan et al. 2023, Chen et al. 2023).

    p_i = ``sampler.probs(row i)`` (the target's filtered distribution), q_i = draft
    row i.  d_i is accepted iff ``u * q_i(d_i) < p_i(d_i)`` for one fresh uniform u,
    i.e. with probability min(1, p/q).  On rejection one more uniform samples the
    correction from normalise(max(0, p_i - q_i)) (p_i if that is all zero) and the
    block ends; after full acceptance the bonus is ``sampler.sample(row n)``.  Every
    emitted token is thereby distributed exactly as sampling the target directly.

    With ``grammar``, p_i is the target's distribution under the grammar's mask for the
    prefix accepted so far (``sampler.probs(row, mask)``), and q_i is restricted to the
    same mask.  ``draft_masked=True`` (the normal case: the draft sampled d_i under a
    fork of the same grammar, which sits at the same position whenever row i is
    reached) renormalises q_i over the mask, so a draft that reports its unmasked
    distribution but drew from the masked one is still verified exactly; a no-op for
    q rows that are already masked.  ``draft_masked=False`` is for a draft that ignored
    the grammar (d_i drawn from q_i itself): q_i is used as is (its mass off the mask
    is rejected), which is what keeps that case exact.  Either way every emitted token
    follows the constrained target distribution exactly.
    """
    rows = _check_rows(target_rows, draft_tokens)  # [n+1, vocab]
    n = len(draft_tokens)
    _check_draft_probs(draft_probs, n)
    vocab = rows.shape[1]
    tokens: list[int] = []
    alphas: list[float] = []
    for i, drafted in enumerate(draft_tokens):
        d = int(drafted)
        mask = _mask(grammar, vocab)  # [vocab] or None
        if mask is not None and i > 0 and not mask.any():
            return _dead_end(tokens, n, alphas)
        p = sampler.probs(rows[i], mask)  # [vocab]
        q = _draft_row(draft_probs, i, vocab)  # [vocab]
        if mask is not None and draft_masked:
            q = _restrict(q, mask)
        p_d = p[d] if 0 <= d < vocab else 0.0
        q_d = q[d] if 0 <= d < vocab else 0.0
        alphas.append(acceptance_probability(p, q))
        if accepts_draft(sampler.uniform(), p_d, q_d):
            _emit(d, tokens, sampler, grammar)
            if _stopped(grammar):  # the constraint is complete: end as plain decoding does
                return VerifyResult(i + 1, tokens, n, accept_probs=tuple(alphas))
            continue
        correction = sample_from_probs(residual_distribution(p, q), sampler.uniform(draw=1))
        _emit(correction, tokens, sampler, grammar)
        return VerifyResult(i, tokens, n, accept_probs=tuple(alphas))
    return _with_bonus(rows, tokens, sampler, n, grammar, alphas)


def _stopped(grammar: TokenConstraint | None) -> bool:
    """The constraint allows nothing but the end: the request stops here."""
    if grammar is None or getattr(grammar, "dead_end", False):
        return False  # a dead end is reported by the next row's empty mask
    return bool(getattr(grammar, "is_stopped", lambda: False)())


def accepts_draft(u: float, p_d: float, q_d: float) -> bool:
    """Accept with probability min(1, p_d / q_d) given u ~ U[0, 1) (no division)."""
    return u * q_d < p_d


def acceptance_probability(p: np.ndarray, q: np.ndarray) -> float:
    """sum(min(p, q)) over [vocab]: the probability that a draft drawn from q is accepted
    against p (for q normalised; a q with mass off p's support is rejected there)."""
    return float(np.minimum(p, q).sum())


def residual_distribution(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """normalise(max(0, p - q)) over [vocab]; falls back to p when p <= q everywhere."""
    r = np.maximum(p - q, 0.0)  # [vocab]
    total = r.sum()
    if not total > 0.0:
        return p
    return r / total


# -- helpers -------------------------------------------------------------------


def _with_bonus(
    rows: np.ndarray,
    tokens: list[int],
    sampler: Sampler,
    n_drafted: int,
    grammar: TokenConstraint | None = None,
    alphas: Sequence[float] = (),
) -> VerifyResult:
    mask = _mask(grammar, rows.shape[1])  # [vocab] or None
    if mask is not None and n_drafted > 0 and not mask.any():
        return _dead_end(tokens, n_drafted, alphas)
    p = None  # greedy: no distribution to weigh a draft's against (nor a sampling draft)
    if sampler.is_greedy:
        bonus = sampler.sample(rows[n_drafted], mask)
    else:
        bonus, p = sampler.sample_with_probs(rows[n_drafted], mask)  # p [vocab]
    _emit(bonus, tokens, sampler, grammar)
    return VerifyResult(n_drafted, tokens, n_drafted, accept_probs=tuple(alphas),
                        bonus_probs=p)


def _emit(token: int, tokens: list[int], sampler: Sampler, grammar: TokenConstraint | None) -> None:
    sampler.accept(token)
    if grammar is not None:
        grammar.consume(token)
    tokens.append(token)


def _mask(grammar: TokenConstraint | None, vocab: int) -> np.ndarray | None:
    return None if grammar is None else grammar.allowed(vocab)


def _dead_end(tokens: list[int], n_drafted: int, alphas: Sequence[float] = ()
              ) -> VerifyResult:
    """Cut the block after the accepted drafts: the last one is the round's final token."""
    if not tokens:  # only reachable at row 0, which the caller must check beforehand
        raise NoAllowedToken("the grammar allows no token")
    return VerifyResult(len(tokens), tokens, n_drafted, grammar_dead_end=True,
                        accept_probs=tuple(alphas))


def _restrict(q: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """q [vocab] zeroed off the mask and renormalised (all zero if no mass is left)."""
    r = np.where(mask, q, 0.0)  # [vocab]
    total = r.sum()
    return r / total if total > 0.0 else r


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
    return to_width(draft_probs[i], vocab)


def to_width(row: np.ndarray, vocab: int) -> np.ndarray:
    """A draft's distribution [vocab_draft] as float64 [vocab]: zero-padded or cut."""
    row = np.asarray(row, dtype=np.float64)  # [vocab_draft]
    if row.shape[0] == vocab:
        return row
    out = np.zeros(vocab, dtype=np.float64)  # [vocab]
    width = min(vocab, row.shape[0])
    out[:width] = row[:width]
    return out
