"""Each emitted token's logprob, as a request asks for it: under the target's raw logits
(OpenAI's `logprobs`, llama.cpp's `n_probs`), or under the distribution the token was
drawn from (llama.cpp's `post_sampling_probs`: after the sampler's bias, penalties,
filters, temperature and the grammar's mask), with the `k` most likely tokens'."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from specd.daemon.text.grammar import GrammarState, GrammarViolation
from specd.ort_models.sampling_op import EmittedLogprobs

from .graph_sampling import emitted_logprob
from .sampling import Sampler, TokenLogprob, post_sampling_logprob, token_logprob


class LogprobRecorder:
    """Logprobs of one request's tokens, `k` most likely each; `post_sampling` under the
    distribution each was drawn from (`sampler`'s, with `grammar`'s mask where given)."""

    def __init__(self, k: int, sampler: Sampler, *, post_sampling: bool = False,
                 grammar: GrammarState | None = None):
        self.k, self.sampler, self.post_sampling = k, sampler, post_sampling
        # post-sampling logprobs under a grammar: its state advanced in step with the
        # tokens recorded, for the mask each one was decided under
        self._grammar = grammar.fork() if grammar is not None and post_sampling else None

    def of_round(self, toks: Sequence[int], rows: np.ndarray, before: Sequence[int],
                 graph: EmittedLogprobs | None = None) -> list[TokenLogprob]:
        """The logprobs of a round's tokens `toks`, decided on the target's logits `rows`
        [>= len(toks), vocab] (or computed by the graph: `graph`), after the request's
        tokens `before`."""
        if graph is not None:
            return [emitted_logprob(graph, i, t) for i, t in enumerate(toks)]
        masks = self._masks(toks, rows)
        history = list(before)
        out = []
        for t, row, mask in zip(toks, rows, masks, strict=False):
            out.append(self._logprob(row, t, mask, history))
            history.append(t)
        return out

    def _masks(self, toks: Sequence[int], rows: np.ndarray) -> list[np.ndarray | None]:
        """The grammar's mask each of the round's tokens was decided under (None where
        there is none); the state they are read from follows every token the round's
        grammar consumed, emitted or not."""
        g = self._grammar
        masks: list[np.ndarray | None] = []
        for t, row in zip(toks, rows, strict=False):
            masks.append(None if g is None else g.allowed(len(row)))
            if g is not None:
                try:
                    g.consume(t)
                except GrammarViolation:  # a dead end: no mask after it
                    g = self._grammar = None
        return masks

    def _logprob(self, row: np.ndarray, token: int, mask: np.ndarray | None,
                 history: list[int]) -> TokenLogprob:
        """A token's logprob: under the target's logits, or (post_sampling) under the
        distribution it was drawn from, with the penalties (and DRY, and XTC's coin) over
        the tokens emitted before it and the grammar's mask."""
        if not self.post_sampling:
            return token_logprob(row, token, self.k)
        return post_sampling_logprob(self.sampler, row, token, self.k, history=history,
                                     mask=mask)
