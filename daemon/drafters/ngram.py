"""Prompt lookup: propose what followed the longest recent match of the context's tail.

No model: the history (prompt + output) is searched for the latest earlier occurrence of
its last `n` tokens (n from max_ngram down to min_ngram); the tokens after that
occurrence are the draft. Good for code edits and quoting, free when nothing matches.
"""

from __future__ import annotations

from collections.abc import Sequence

from .base import Draft, Drafter, DraftParams


class NgramDrafter(Drafter):
    name = "ngram"

    def __init__(self, *, min_ngram: int = 2, max_ngram: int = 4, max_history: int = 8192):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.min_ngram, self.max_ngram, self.max_history = min_ngram, max_ngram, max_history
        self._hist: dict[int, list[int]] = {}

    def begin(self, seq: int, prompt: Sequence[int], sampler: object = None) -> None:
        self._hist[seq] = list(prompt)

    def process(self, seq: int, tokens: Sequence[int]) -> None:
        h = self._hist.setdefault(seq, [])
        h.extend(tokens)
        if len(h) > 2 * self.max_history:
            del h[: len(h) - self.max_history]

    def draft(self, seq: int, last: int, pos: int, n_max: int, params: DraftParams,
              grammar: object = None) -> Draft:
        if n_max <= 0:
            return Draft([])
        h = self._hist.get(seq, [])
        ctx = h[-self.max_history:] + [last]
        for n in range(min(self.max_ngram, len(ctx) - 1), self.min_ngram - 1, -1):
            tail = ctx[-n:]
            # latest earlier occurrence of the tail, not the tail itself
            for start in range(len(ctx) - n - 1, -1, -1):
                if ctx[start:start + n] == tail:
                    follow = ctx[start + n:start + n + n_max]
                    if follow:
                        return Draft(follow)
                    break
        return Draft([])

    def end(self, seq: int) -> None:
        self._hist.pop(seq, None)
