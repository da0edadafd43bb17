"""An EAGLE-3 head as the draft: one decoder layer run autoregressively over its own hidden
state, fed by the target's.

The head's cache row at position P holds the pair (the token at P + 1, g[P]), g being the
head's encoding of the target's features at P. So the pair of the newest verified
position waits for the token after it: `process` writes every pair it can and keeps the
last g row pending; `draft` runs that pending pair with `last` as the first step (its
logits propose the first token), then feeds each step's pre-norm hidden state and drafted
token to the next, as llama.cpp does. The verified pairs written by the next `process`
overwrite the drafted ones, so nothing needs rolling back.

`draft_steps` yields one `StepCall` per token; where the graphs run on specd's attention,
the steps and the pairs of several slots run in one pass each (the verified tokens'
encodings and pairs wait for `batched_updates` to close), as a DFlash head's do.

The g rows of every position are kept, so a request reusing a prefix of an earlier
request's sequence on the same slot pairs the new token after that prefix with its g
row exactly.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass

import numpy as np

from specd.daemon.spec.drafter import (
    DraftEvidence,
    DraftParams,
    DraftSteps,
    Features,
    Proposal,
    head_input_rows,
)
from specd.daemon.spec.sampling import Sampler
from specd.daemon.text.grammar import GrammarState
from specd.ort_models.head_runner import HeadRunner, StepCall, StepOutput

from .model_backed import ModelBackedDrafter
from .picking import QRow, pick_from_block, pick_spec, pick_token, stack_q


@dataclass
class _SeqState:
    g: np.ndarray  # [n_ctx, E] the head's g row of every position with target features
    known: int = 0  # g rows [0, known) are the target's
    written: int = 0  # cache rows [0, written) hold verified pairs
    sampler: Sampler | None = None


class Eagle3Drafter(ModelBackedDrafter[_SeqState, HeadRunner]):
    name = "eagle3"
    catch_up = 0  # tokens the target decoded alone were paired as they came

    def __init__(self, runner: HeadRunner):
        # the scheduler runs the steps of several sequences in one pass of it
        super().__init__()
        self.runner = self.step_runner = runner
        self.target_layers = runner.built.head.hidden_layers
        # while `batched_updates` is open: the verified tokens whose encoding and pairs
        # wait, (seq, tokens, their feature rows [n, 3*E_t]) in order
        self._batching = 0
        self._waiting: list[tuple[int, list[int], np.ndarray]] = []

    def _encode(self, st: _SeqState, features: Features | None, pos: int, n: int) -> None:
        """The g rows of n target tokens at positions pos.. from their features."""
        rows = head_input_rows(features, self.target_layers, n)  # [n, 3*E_t]
        if n:
            st.g[pos:pos + n] = self.runner.encode(rows)
        st.known = pos + n

    @contextmanager
    def _batched(self) -> Iterator[None]:
        with self.runner.deferred_injections():  # the pairs written at the end: one pass
            self._batching += 1
            try:
                yield
            finally:
                self._batching -= 1
                if not self._batching:
                    self._flush()

    def batched_updates(self) -> AbstractContextManager[None]:
        """The verified tokens of the sequences completed together encoded in one pass and
        their pairs written in one (where the pair graph packs them)."""
        return self._batched()

    def _flush(self, seq: int | None = None) -> None:
        """Encode every waiting token in one pass and write their pairs (seq: only where
        some of that sequence's wait)."""
        if not self._waiting or (seq is not None and all(w[0] != seq for w in self._waiting)):
            return
        waiting, self._waiting = self._waiting, []
        g = self.runner.encode(np.concatenate([rows for _, _, rows in waiting]))  # [S, E]
        start = 0
        for s, tokens, _ in waiting:
            st = self._seqs[s]
            first, n = st.known, len(tokens)
            st.g[first:first + n] = g[start:start + n]
            st.known = first + n
            self._write_pairs(s, st, tokens, first, st.known - 1)
            start += n

    def _write_pairs(self, seq: int, st: _SeqState, tokens: Sequence[int], first: int,
                     end: int) -> None:
        """Write the verified pairs at positions written..end-1 (end: one before the newest
        g row), `tokens` being the sequence's tokens at positions first.. ."""
        start = st.written
        if end <= start:
            return
        if start + 1 < first:
            raise RuntimeError(f"the head's pairs end at {start}, the tokens start at {first}")
        ids = tokens[start + 1 - first:end + 1 - first]  # the tokens at start+1..end
        self.runner.pair(seq, ids, st.g[start:end], start)
        st.written = end

    def begin(self, seq: int, prompt: Sequence[int], sampler: Sampler | None = None,
              features: Features | None = None) -> None:
        """Encode the evaluated prompt tokens and write their pairs (a prefix reused from an
        earlier request on this slot keeps that request's g rows and pairs)."""
        self._ensure_sequence(seq)
        self._flush(seq)
        n = 0 if features is None else next(iter(features.values())).shape[0]
        start = len(prompt) - n
        st = self._seqs.get(seq)
        if st is None:
            st = _SeqState(np.empty((self.runner.n_ctx, self.runner.hp.n_embd), np.float32))
            self._seqs[seq] = st
        if start > st.known:
            raise ValueError(f"the head holds g rows of {st.known} positions, the prompt's "
                             f"features start at {start}")
        st.sampler = sampler
        st.written = min(st.written, max(start - 1, 0))
        self._encode(st, features, start, n)
        self._write_pairs(seq, st, prompt, 0, len(prompt) - 1)

    def draft_steps(self, seq: int, last: int, pos: int, n_max: int, params: DraftParams,
                    grammar: GrammarState | None = None) -> DraftSteps:
        """The draft as yielded StepCalls, one per token (each sent its StepOutput): a
        scheduler runs the steps of several sequences in one pass of the head."""
        self._flush(seq)
        st = self._seqs[seq]
        if st.known != pos or pos == 0:
            raise RuntimeError(f"the head holds g rows of {st.known} positions, the target "
                               f"is at {pos}")
        n = min(n_max, self.runner.n_ctx - pos + 1)
        sampler = st.sampler if params.probabilistic else None  # None: the argmax
        tokens: list[int] = []
        q_rows: list[QRow] = []
        seconds: list[float] = []
        unsure = False
        token, hidden = last, st.g[pos - 1:pos]  # the pending pair first
        st.written = min(st.written, pos - 1)
        in_graph = params.backend_sampling and self.runner.step_samples  # chosen there
        for i in range(n):
            t0 = time.perf_counter()
            spec = (pick_spec(sampler, grammar, pos + 1 + i, params.p_min,
                              self.runner.hp.n_vocab) if in_graph else None)
            t1 = time.perf_counter()
            out: StepOutput = yield StepCall(seq, [token], hidden, pos - 1 + i, [0], spec)
            # what waiting for the other sequences' rows of the pass cost is not this draft's
            waited = max(time.perf_counter() - t1 - out.seconds, 0.0)
            seconds.append(time.perf_counter() - t0 - waited)
            if i == 0:
                st.written = pos  # the pending pair, with the token that follows it
            pick = (pick_token(out.logits[0], sampler, grammar, params.p_min, pos + 1 + i)
                    if out.sampled is None
                    else pick_from_block(out.sampled, sampler is not None, params.p_min))
            if pick.token is None:
                unsure = pick.unsure
                break
            token, hidden = pick.token, out.hidden
            tokens.append(token)
            if pick.q is not None:
                q_rows.append(pick.q)
            if grammar is not None:
                grammar.consume(token)
                if grammar.is_stopped():
                    break
        return Proposal(tokens, stack_q(q_rows),
                        DraftEvidence(step_seconds=tuple(seconds), stopped_unsure=unsure))

    def process(self, seq: int, tokens: Sequence[int],
                features: Features | None = None) -> None:
        """Encode the verified tokens (at positions known..) and write every pair whose
        following token is now known, over the drafted ones."""
        if self._batching and tokens:
            rows = head_input_rows(features, self.target_layers, len(tokens))  # [n, 3*E_t]
            self._waiting.append((seq, list(tokens), rows))
            return
        self._flush(seq)
        st = self._seqs[seq]
        first = st.known
        self._encode(st, features, first, len(tokens))
        self._write_pairs(seq, st, tokens, first, st.known - 1)

