"""Tokens decided in the model's graph: a request's sampler and grammar as a call's
`SampleSpec`, and what the graph decided as the round's `VerifyResult`.

The graph (ort_models.sampling_op) runs the host's filter chain and verifiers
(sampling.py, verify.py, in float64) on the logits where they are, so only token ids and a
few probabilities leave the session. A spec carries the request's sampler settings, its
penalty history and logit bias, the grammar's masks along the drafts, and the drafts with
their q as (id, probability) pairs. The distributions are the host's; the uniforms come
from a counter-based generator (Philox4x32-10, philox.py) keyed by the sampler's key and
counted by the token's position, the stream (target or draft) and the draw (coin or
residual), so a seeded request draws the same numbers however its tokens are split into
rounds. Logprobs under the raw logits come out of the graph too; post-sampling ones are
computed on the host from the rows' logits.

Drafters choose their proposals in their graphs through the same specs (drafters/picking.py):
a draft model's step its token and top-k q, a DFlash or DSpark block one pick per row, an
EAGLE-3 step its token. The host path stays the reference and the fallback: a DFlash-family
block under a grammar, DFlash2's lattice walk, drafters that decide acceptance themselves,
graphs without a sampler, a request whose sampler chain the graph does not run (its order
is fixed: penalties, top-k, top-p, min-p, temperature; `runs_in_graph`), and everything
under `--no-backend-sampling` (or a request's `"backend_sampling": false`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from specd.daemon.text.grammar import GrammarState, GrammarViolation
from specd.ort_models.sampling_op import (
    DEAD_END,
    NO_TOKEN,
    TARGET_STREAM,
    EmittedLogprobs,
    SampledBlock,
    SampleSpec,
)

from .sampling import NoAllowedToken, Sampler, SamplerParams, TokenLogprob
from .verify import DraftProbs, SparseDraftProbs, VerifyResult

# sparse q rows wider than this are verified on the host (a draft without top-k)
MAX_Q_WIDTH = 64
# most probable tokens returned of a sampled bonus row: the target's distribution there,
# which the draft-length policy weighs the draft's guess against
BONUS_CANDIDATES = 32


def runs_in_graph(params: SamplerParams) -> bool:
    """Whether the graph's sampler runs this chain: its active steps in the graph's order
    (infill, DRY, typical, XTC and top-n-sigma are the host's alone)."""
    return params.graph_equivalent() is not None


def sample_spec(sampler: Sampler, position: int, vocab: int, *, drafts: Sequence[int] = (),
                q: SparseDraftProbs | None = None, grammar: GrammarState | None = None,
                stream: int = TARGET_STREAM, candidates: int = 0, logprobs: int = -1,
                want_logits: bool = False) -> SampleSpec:
    """The spec that decides a call's rows as `sampler` would on the host: one token at
    `position`, or the verification of `drafts` (by rejection sampling against `q` where
    given, else by the target's own choice) under `grammar`'s masks along the drafts;
    `logprobs`: each emitted token's logprob and the `logprobs` most likely tokens' (-1:
    none); `want_logits`: the rows' logits leave the session too (logprobs on the host)."""
    p = sampler.params.graph_equivalent()
    if p is None:
        raise ValueError("the graph does not run this sampler chain (runs_in_graph)")
    penalised = (p.repeat_penalty != 1.0 or p.presence_penalty != 0.0
                 or p.frequency_penalty != 0.0)
    masks, stop_after = (None, -1) if grammar is None else grammar_masks(grammar, drafts,
                                                                           vocab)
    return SampleSpec(
        key=sampler.key, position=position, temperature=p.temperature, top_k=p.top_k,
        top_p=p.top_p, min_p=p.min_p, repeat_penalty=p.repeat_penalty,
        presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
        temperature_last=p.temperature_last,
        window=p.repeat_last_n if penalised else 0,
        history=sampler.history if penalised else (),
        logit_bias=tuple(sorted((int(t), float(b)) for t, b in p.logit_bias.items())),
        drafts=list(drafts), q_ids=None if q is None else q.token_ids,
        q_probs=None if q is None else q.probs, masks=masks, stop_after=stop_after,
        candidates=candidates, stream=stream, logprobs=logprobs, want_logits=want_logits)


def grammar_masks(grammar: GrammarState, drafts: Sequence[int], vocab: int
                  ) -> tuple[np.ndarray, int]:
    """What the grammar allows at each row of a block along its drafts [n + 1, vocab]
    (rows after a draft it refuses allow nothing: they cannot be reached), and the draft
    whose acceptance completes it (-1: none)."""
    if not drafts:
        return grammar.allowed(vocab)[None], -1
    fork = grammar.fork()
    masks = np.zeros((len(drafts) + 1, vocab), dtype=np.bool_)
    masks[0] = fork.allowed(vocab)
    for i, d in enumerate(drafts):
        try:
            fork.consume(int(d))
        except GrammarViolation:
            return masks, -1
        if fork.is_stopped() and not fork.dead_end:
            return masks, i
        masks[i + 1] = fork.allowed(vocab)
    return masks, -1


def sparse_q(q: DraftProbs | None) -> SparseDraftProbs | None:
    """A draft's q rows as sparse pairs; None where they are too wide to send
    (MAX_Q_WIDTH) or absent."""
    if q is not None and not isinstance(q, SparseDraftProbs):
        q = to_sparse(list(q))
    return q if q is None or q.token_ids.shape[1] <= MAX_Q_WIDTH else None


def to_sparse(rows: Sequence[np.ndarray | tuple[np.ndarray, np.ndarray]]) -> SparseDraftProbs:
    """Distributions, each dense [vocab] (by its nonzero entries) or (ids [k], probs [k]),
    as one SparseDraftProbs [n, max k]."""
    pairs = [(np.flatnonzero(r), r[np.flatnonzero(r)]) if isinstance(r, np.ndarray) else r
             for r in rows]
    width = max([ids.shape[0] for ids, _ in pairs] + [1])
    ids = np.full((len(pairs), width), -1, dtype=np.int64)  # [n, k]
    probs = np.zeros((len(pairs), width), dtype=np.float64)  # [n, k]
    for i, (row_ids, row_probs) in enumerate(pairs):
        ids[i, :row_ids.shape[0]] = row_ids
        probs[i, :row_ids.shape[0]] = row_probs
    return SparseDraftProbs(ids, probs)


def emitted_logprob(lp: EmittedLogprobs, i: int, token: int) -> TokenLogprob:
    """The graph's logprobs of the block's emitted token i (`token`) as the host's
    token_logprob gives them."""
    return TokenLogprob(token, float(lp.logprobs[i]), tuple(
        zip(lp.top_ids[i].tolist(), lp.top_logprobs[i].tolist(), strict=True)))


def candidates_row(block: SampledBlock, row: int) -> tuple[np.ndarray, np.ndarray]:
    """A decided row's candidates: (ids [k], probabilities [k]), most probable first."""
    ids = block.cand_ids[row]
    keep = ids >= 0
    return ids[keep], block.cand_probs[row][keep].astype(np.float64)


def block_result(block: SampledBlock, n_drafted: int, sampler: Sampler,
                 grammar: GrammarState | None, vocab: int, *, bonus: bool = False
                 ) -> VerifyResult:
    """The round's VerifyResult from what the graph decided; the sampler's history and the
    grammar advance over the emitted tokens, as the host verifiers advance them. `bonus`:
    after full acceptance at T > 0, the bonus row's candidates as its distribution [vocab]
    (for the draft-length policy)."""
    if block.status == NO_TOKEN:
        raise NoAllowedToken("no token may be drawn (the grammar or logit_bias allow none)")
    for t in block.tokens:
        sampler.accept(t)
        if grammar is not None:
            grammar.consume(t)
    bonus_p = None  # [vocab]
    if (bonus and not sampler.is_greedy and block.n_accepted == n_drafted
            and len(block.tokens) == n_drafted + 1):
        ids, probs = candidates_row(block, n_drafted)
        bonus_p = SparseDraftProbs(ids[None], probs[None]).dense_row(0, vocab)
    return VerifyResult(block.n_accepted, list(block.tokens), n_drafted,
                        grammar_dead_end=block.status == DEAD_END,
                        accept_probs=block.accept_probs, bonus_probs=bonus_p)
