"""Prompt lookup: propose what followed the longest recent match of the context's tail.

No model: the history (prompt + output) is searched for the latest earlier occurrence of
its last `n` tokens (n from max_ngram down to min_ngram); the tokens after that
occurrence are the draft. Good for code edits and quoting, free when nothing matches.

The search is an index, not a scan: per sequence a dict from each n-gram of the history
to its latest start, updated as the sequence grows, so a lookup costs a few dict probes
whatever the context's length. The drafter's proposals are free offers (no model runs).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from specd.daemon.spec.drafter import (
    DraftEvidence,
    DraftRequest,
    Features,
    PerSequenceDrafter,
    Proposal,
)
from specd.daemon.spec.media import is_placeholder


@dataclass
class _History:
    tokens: list[int] = field(default_factory=list)  # tokens[i] is at offset + i
    offset: int = 0  # absolute position of tokens[0] (older ones were dropped)
    latest: dict[tuple[int, ...], int] = field(default_factory=dict)  # n-gram -> start

    @property
    def end(self) -> int:
        return self.offset + len(self.tokens)

    def at(self, start: int, stop: int) -> list[int]:
        return self.tokens[start - self.offset: stop - self.offset]


class NgramDrafter(PerSequenceDrafter):
    name = "ngram"
    runs_model = False

    def __init__(self, *, min_ngram: int = 2, max_ngram: int = 4, max_history: int = 8192):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.min_ngram, self.max_ngram, self.max_history = min_ngram, max_ngram, max_history
        self._hist: dict[int, _History] = {}

    def begin(self, seq: int, prompt: Sequence[int], sampler: object = None,
              features: Features | None = None) -> None:
        self._hist[seq] = _History()
        self.process(seq, prompt)

    def process(self, seq: int, tokens: Sequence[int],
                features: Features | None = None) -> None:
        h = self._hist.setdefault(seq, _History())
        first_new = h.end
        h.tokens.extend(tokens)
        for n in range(self.min_ngram, self.max_ngram + 1):
            # every n-gram that ends at a new token; later starts overwrite earlier ones
            for start in range(max(first_new - n + 1, h.offset), h.end - n + 1):
                h.latest[tuple(h.at(start, start + n))] = start
        if len(h.tokens) > 2 * self.max_history:
            drop = len(h.tokens) - self.max_history
            del h.tokens[:drop]
            h.offset += drop
            h.latest = {g: s for g, s in h.latest.items() if s >= h.offset}

    def offer(self, seq: int, last: int, pos: int, n_max: int) -> Proposal:
        """What followed the latest earlier occurrence of the context's longest tail."""
        if n_max <= 0:
            return Proposal([])
        h = self._hist.get(seq)
        if h is None:
            return Proposal([])
        # the context is the newest max_history tokens of the history, then `last`
        window = max(h.end - self.max_history, h.offset)
        for n in range(min(self.max_ngram, h.end - window), self.min_ngram - 1, -1):
            tail = (*h.at(h.end - n + 1, h.end), last) if n > 1 else (last,)
            start = h.latest.get(tail)
            if start is None or start < window:
                continue  # no occurrence inside the context (the latest is the last hope)
            follow = h.at(start + n, start + n + n_max)
            if len(follow) < n_max and start + n + len(follow) == h.end:
                follow.append(last)  # the match runs up to the newest token
            # the text only: what followed up to an image (a placeholder is no token)
            cut = next((i for i, t in enumerate(follow) if is_placeholder(t)), len(follow))
            return Proposal(follow[:cut], evidence=DraftEvidence(lookup_match=n)) if cut else (
                Proposal([]))
        return Proposal([])

    def propose_one(self, request: DraftRequest) -> Proposal:
        r = request
        return self.offer(r.seq, r.last, r.pos, r.n_max)

    def end(self, seq: int) -> None:
        self._hist.pop(seq, None)
