"""An EAGLE-3 head as the draft: one decoder layer run autoregressively over its own hidden
state, fed by the target's.

The head's cache row at position P holds the pair (the token at P + 1, g[P]), g being the
head's encoding of the target's features at P. So the pair of the newest verified
position waits for the token after it: `process` writes every pair it can and keeps the
last g row pending; a draft runs that pending pair with `last` as the first step (its
logits propose the first token), then feeds each step's pre-norm hidden state and drafted
token to the next, as llama.cpp does. The verified pairs written by the next `process`
overwrite the drafted ones, so nothing needs rolling back.

A draft is one `StepCall` per token; where the graphs run on specd's attention,
the steps and the pairs of several slots run in one pass each (the verified tokens'
encodings and pairs wait for `batched_updates` to close), as a DFlash head's do.

The g rows of every position are kept, so a request reusing a prefix of an earlier
request's sequence on the same slot pairs the new token after that prefix with its g
row exactly.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass

import numpy as np

from specd.daemon.spec.drafter import DraftRequest, Features, head_input_rows
from specd.daemon.spec.media import text_ids
from specd.daemon.spec.sampling import Sampler
from specd.ort_models.head_runner import HeadRunner, StepCall, StepOutput

from .model_backed import DraftRun, ModelBackedDrafter
from .picking import pick_from_block, pick_spec, pick_token


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
        super().__init__()
        self.runner = runner
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
        # the tokens at start+1..end; an image's positions pair with a text id (the head
        # embeds ids, and the image's own rows are the target's, through g)
        ids = text_ids(tokens[start + 1 - first:end + 1 - first])
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

    def start(self, request: DraftRequest) -> DraftRun:
        """The draft as StepCalls, one per token: the steps of a batch run in one pass of
        the head."""
        self._flush(request.seq)
        st = self._seqs[request.seq]
        pos = request.pos
        if st.known != pos or pos == 0:
            raise RuntimeError(f"the head holds g rows of {st.known} positions, the target "
                               f"is at {pos}")
        st.written = min(st.written, pos - 1)
        return _StepRun(self, request, st)

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



class _StepRun(DraftRun):
    """An EAGLE-3 head's draft of one sequence: the pending pair with `last` first, then
    each step's hidden state and drafted token."""

    def __init__(self, drafter: Eagle3Drafter, r: DraftRequest, st: _SeqState):
        super().__init__(r.grammar)
        self.d, self.st, self.seq, self.pos, self.params = drafter, st, r.seq, r.pos, r.params
        self.n = min(r.n_max, drafter.runner.n_ctx - r.pos + 1)
        self.sampler = st.sampler if r.params.probabilistic else None  # None: the argmax
        self.in_graph = r.params.backend_sampling and drafter.runner.step_samples
        self.token, self.hidden = r.last, st.g[r.pos - 1:r.pos]  # the pending pair first
        self.done = self.n <= 0

    def call(self) -> StepCall:
        i, p = len(self.tokens), self.params
        spec = (pick_spec(self.sampler, self.grammar, self.pos + 1 + i, p.p_min,
                          self.d.runner.hp.n_vocab) if self.in_graph else None)
        return StepCall(self.seq, [self.token], self.hidden, self.pos - 1 + i, [0], spec)

    def take(self, out: StepOutput) -> None:
        i, p_min = len(self.tokens), self.params.p_min
        if i == 0:
            self.st.written = self.pos  # the pending pair, with the token that follows it
        pick = (pick_token(out.logits[0], self.sampler, self.grammar, p_min, self.pos + 1 + i)
                if out.sampled is None
                else pick_from_block(out.sampled, self.sampler is not None, p_min))
        going = self.add(pick)
        if pick.token is not None:
            self.token, self.hidden = pick.token, out.hidden
        self.done = not going or len(self.tokens) >= self.n
