"""A smaller LLM as the draft: its own runner and KV cache, following the target's context.

Per sequence the drafter keeps the token history and how much of it its cache holds.
Drafting first evaluates whatever the cache lacks (the last token, and after a fully
accepted round the last draft too) in one call, then one token per step.

After rounds the target decoded alone (the adaptive controller found drafting did not
pay), the draft catches up on at most `catch_up` of the tokens it skipped, the latest:
the older ones are left out of its cache, a gap it never fills. A probe then costs the
same however long drafting was off, and a draft's context missing a stretch only changes
what it proposes, never the output.
From the gap on, the draft's cache position of a token is its sequence position less
`offset`, the tokens left out. Catch-up rows checked against the target's tokens, and
after a fully accepted round its guess for the bonus token, are free acceptance samples
for the policy (`DraftEvidence.guess_checks`, `bonus_q`).
"""

from __future__ import annotations

import time
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field

import numpy as np

from specd.daemon.spec.drafter import (
    DraftEvidence,
    DraftParams,
    DraftSteps,
    Features,
    Proposal,
)
from specd.daemon.spec.sampling import Sampler
from specd.daemon.text.grammar import GrammarState
from specd.ort_models.runner import Call, CallOutput, ModelRunner

from .model_backed import ModelBackedDrafter
from .picking import QRow, pick_from_block, pick_spec, pick_token, stack_q


@dataclass
class _SeqState:
    history: list[int] = field(default_factory=list)  # tokens at positions 0..
    n_cached: int = 0  # cache positions [0, n_cached) are in the draft's KV cache
    offset: int = 0  # tokens of the history left out of the cache (catch-ups' gaps)
    gap_at: int | None = None  # cache position of the first gap (None: no gap)
    drafted: list[int] = field(default_factory=list)
    draft_pos: int | None = None  # cache position of `last` in the draft not yet accepted
    full_run: int = 0  # the last round's drafts, all accepted (0: not all, or none)
    sampler: Sampler | None = None


FORCED_ROWS = 16  # late rows checked against the tokens that followed them (their logits
# cost an lm_head row each, little beside the pass, which reads the weights once)
CATCH_UP = 16  # most skipped tokens evaluated before drafting (the latest)


class DraftModelDrafter(ModelBackedDrafter[_SeqState, ModelRunner]):
    name = "draft"

    def __init__(self, runner: ModelRunner, *, vocab_limit: int | None = None,
                 catch_up: int | None = CATCH_UP):
        super().__init__()
        self.runner = self.step_runner = runner
        self.catch_up = catch_up  # None: evaluate every skipped token
        self.vocab_limit = vocab_limit  # the target's vocab size, if smaller
        self._n_vocab = runner.hp.n_vocab  # the draft's own rows

    @property
    def n_ctx(self) -> int:
        return self.runner.n_ctx

    def begin(self, seq: int, prompt: Sequence[int], sampler: Sampler | None = None,
              features: Features | None = None) -> None:
        """Evaluate the prompt on the draft, reusing the prefix its cache already holds."""
        self._ensure_sequence(seq)
        old = self._seqs.get(seq)
        reuse = 0
        if old is not None:
            whole = old.n_cached if old.gap_at is None else min(old.n_cached, old.gap_at)
            cached = old.history[:whole]  # the cache's prefix that matches the history
            n = min(len(cached), len(prompt) - 1)
            while reuse < n and cached[reuse] == prompt[reuse]:
                reuse += 1
        st = _SeqState(history=list(prompt), sampler=sampler)
        self._seqs[seq] = st
        if len(prompt) > reuse:
            self.runner.prefill(seq, self._ids(prompt[reuse:]), reuse)
        st.n_cached = len(prompt)

    def _ids(self, tokens: Sequence[int]) -> list[int]:
        """Token ids as the draft can embed them: a target id past the draft's vocabulary
        (compat allows sizes to differ a little) becomes id 0. Only proposals change."""
        return [t if t < self._n_vocab else 0 for t in tokens]

    def _logits(self, rows: np.ndarray) -> np.ndarray:
        return rows[..., : self.vocab_limit] if self.vocab_limit else rows

    def draft_steps(self, seq: int, last: int, pos: int, n_max: int, params: DraftParams,
                    grammar: GrammarState | None = None) -> DraftSteps:
        st = self._seqs[seq]
        if len(st.history) != pos:
            raise RuntimeError(f"draft history has {len(st.history)} tokens, target at {pos}")
        st.n_cached = min(st.n_cached, pos - st.offset)
        skipped = pos - st.offset - st.n_cached  # history the cache has not seen
        full_run, st.full_run = st.full_run, 0
        if self.catch_up is not None and skipped > self.catch_up:
            if st.gap_at is None:
                st.gap_at = st.n_cached
            st.offset += skipped - self.catch_up
            full_run = 0  # the last round's final draft is left out: its guess unchecked
        p = st.n_cached
        st.draft_pos = pos - st.offset  # last's cache position
        n_max = min(n_max, self.n_ctx - st.draft_pos - 1)
        st.drafted = []
        if n_max <= 0:
            return Proposal([])
        q_rows: list[QRow] = []
        pending = [*st.history[p + st.offset:], last]
        forced: tuple[tuple[int, bool], ...] = ()
        caught_up = len(pending) > 2  # after target-only rounds: a small prefill first
        step_s: list[float] = []
        unsure = False
        sampler = st.sampler if params.probabilistic else None  # None: the argmax
        # the draft's choice made in its graph, where it has a sampler
        in_graph = (params.backend_sampling and self.runner.samples
                    and (self.vocab_limit is None or self.vocab_limit >= self.runner.logits_width))
        bonus_q: tuple[int, np.ndarray] | None = None
        waits: list[float] = []  # seconds a step waited on passes shared with others
        for _ in range(n_max):
            t0 = time.perf_counter()
            waits.clear()
            at = pos + 1 + len(st.drafted)  # the sequence position of this step's token
            if len(pending) > 1 and sampler is None:
                row, forced = yield from self._check_guesses(seq, pending, p, full_run, waits)
                pick = pick_token(row, sampler, grammar, params.p_min, at)
            elif len(pending) == 2 and full_run and grammar is None:
                # pending = [last draft, bonus]: the first row is where the bonus was drawn
                out = (yield from _call(Call(seq, self._ids(pending), p, [0, 1]), waits)
                       ).logits  # [2, vocab]
                assert st.sampler is not None
                bonus_q = (full_run, st.sampler.probs(self._logits(out[0])))  # [vocab]
                pick = pick_token(self._logits(out[1]), sampler, grammar, params.p_min, at)
            else:
                spec = (pick_spec(sampler, grammar, at, params.p_min, self.runner.logits_width)
                        if in_graph else None)
                out1 = yield from _call(Call(seq, self._ids(pending), p, sample=spec), waits)
                pick = (pick_from_block(out1.sampled, sampler is not None, params.p_min)
                        if out1.sampled is not None
                        else pick_token(self._logits(out1.logits[0]), sampler, grammar,
                                        params.p_min, at))
            p += len(pending)
            st.n_cached = p
            if pick.token is None:
                unsure = pick.unsure
                break
            tok = pick.token
            if pick.q is not None:
                q_rows.append(pick.q)
            st.drafted.append(tok)
            pending = [tok]
            step_s.append(time.perf_counter() - t0 - sum(waits))
            if grammar is not None:
                grammar.consume(tok)
                if grammar.is_stopped():
                    break
        return Proposal(list(st.drafted), stack_q(q_rows), DraftEvidence(
            step_seconds=tuple(step_s), includes_catch_up=caught_up, guess_checks=forced,
            bonus_q=bonus_q, stopped_unsure=unsure))

    def _check_guesses(self, seq: int, pending: list[int], pos: int, full_run: int,
                       waits: list[float]) -> Generator[Call, CallOutput,
                                      tuple[np.ndarray, tuple[tuple[int, bool], ...]]]:
        """Evaluate tokens the draft has not seen; the greedy guesses of the last rows are
        checked against the tokens that really followed them. Row 0 follows the last
        round's final draft: after `full_run` accepted drafts it guessed the target's
        bonus token (position full_run); any other row is a teacher-forced position 0."""
        k = min(len(pending) - 1, FORCED_ROWS)
        first = len(pending) - 1 - k
        out = (yield from _call(Call(seq, self._ids(pending), pos,
                                     list(range(first, len(pending)))), waits)
               ).logits  # [k + 1, vocab]
        guesses = self._logits(out[:-1]).argmax(axis=-1)  # [k]
        hits = guesses == np.asarray(pending[first + 1:])  # [k]
        return self._logits(out[-1]), tuple(
            (full_run if first + i == 0 else 0, bool(h)) for i, h in enumerate(hits))

    def accept(self, seq: int, n_accepted: int) -> None:
        st = self._seqs[seq]
        if st.draft_pos is None:
            return  # no draft since the last accept (a target-only round): nothing to drop
        # the cache holds last, d0 .. d_{n-2}; keep last and the accepted drafts
        st.n_cached = min(st.n_cached, st.draft_pos + 1 + n_accepted)
        st.full_run = len(st.drafted) if st.drafted and n_accepted >= len(st.drafted) else 0
        st.drafted, st.draft_pos = [], None

    def process(self, seq: int, tokens: Sequence[int],
                features: Features | None = None) -> None:
        self._seqs[seq].history.extend(tokens)

    def end(self, seq: int) -> None:
        """Keep the history and cache length: the next request on this slot may reuse it."""
        st = self._seqs.get(seq)
        if st is not None:
            st.drafted = []
        super().end(seq)


def _call(call: Call, waits: list[float]) -> Generator[Call, CallOutput, CallOutput]:
    """Yield one call; its output. `waits` gets the seconds spent beyond the call's own
    share of its pass (waiting while a pass shared with other sequences ran)."""
    t = time.perf_counter()
    out = yield call
    waits.append(max(time.perf_counter() - t - out.seconds, 0.0))
    return out
