"""Stop strings found in streamed text by one Aho-Corasick automaton.

A request's stop list is compiled once (`StopStrings`); each new piece of text is then
scanned character by character, whatever the number of stop strings, instead of
searching for every string in turn. The match reported is the one a plain search of the
text would pick: the earliest start, and at one start the string given first.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence


class StopStrings:
    """The compiled automaton of a stop list (read-only: shared by a request's choices)."""

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self.longest = max((len(s) for s in self.stops), default=0)
        self._goto: list[dict[str, int]] = [{}]
        self._depth = [0]
        self._word = [-1]  # the stop (its first index) that ends at a node, else -1
        for index, stop in enumerate(self.stops):
            self._insert(stop, index)
        self._fail = [0] * len(self._goto)
        self._out = [0] * len(self._goto)  # the nearest proper suffix node ending a stop
        self._link()

    def _insert(self, stop: str, index: int) -> None:
        node = 0
        for ch in stop:
            nxt = self._goto[node].get(ch)
            if nxt is None:
                nxt = len(self._goto)
                self._goto[node][ch] = nxt
                self._goto.append({})
                self._depth.append(self._depth[node] + 1)
                self._word.append(-1)
            node = nxt
        if self._word[node] < 0:
            self._word[node] = index

    def _link(self) -> None:
        """Failure and output links, breadth first."""
        queue = deque(self._goto[0].values())
        while queue:
            node = queue.popleft()
            for ch, child in self._goto[node].items():
                fail = self._fail[node]
                while fail and ch not in self._goto[fail]:
                    fail = self._fail[fail]
                target = self._goto[fail].get(ch, 0)
                self._fail[child] = target if target != child else 0
                f = self._fail[child]
                self._out[child] = f if self._word[f] >= 0 else self._out[f]
                queue.append(child)

    def depth(self, state: int) -> int:
        """How many characters of text the state stands for (the tail that may begin a
        stop string)."""
        return self._depth[state]

    def scan(self, state: int, text: str, offset: int) -> tuple[int, tuple[int, int] | None]:
        """Scan `text` from `state`: (the state after it, (start, stop index) of the match
        a plain search would pick, or None). Positions count from `offset` characters
        before `text`."""
        goto, fail, word, out = self._goto, self._fail, self._word, self._out
        best: tuple[int, int] | None = None
        for i, ch in enumerate(text):
            pos = offset + i
            if best is not None and pos - self.longest + 1 > best[0]:
                break  # no match ending here or later can start earlier
            while state and ch not in goto[state]:
                state = fail[state]
            state = goto[state].get(ch, 0)
            node = state if word[state] >= 0 else out[state]
            while node:
                index = word[node]
                found = (pos - len(self.stops[index]) + 1, index)
                if best is None or found < best:
                    best = found
                node = out[node]
        return state, best


class StopMatcher:
    """Finds stop strings in streamed text, holding back a tail that may start one."""

    def __init__(self, stops: Sequence[str] | StopStrings):
        self._ac = stops if isinstance(stops, StopStrings) else StopStrings(stops)
        self.stops = self._ac.stops
        self._held = ""
        self._state = 0
        self.hit: str | None = None

    def feed(self, text: str) -> str:
        """New text -> the part safe to emit now (everything before any stop string)."""
        if self.hit is not None:
            return ""
        buf = self._held + text
        state, found = self._ac.scan(self._state, text, len(self._held))
        if found is not None:
            start, index = found
            self.hit = self.stops[index]
            self._held, self._state = "", 0
            return buf[:start]
        keep = self._ac.depth(state)
        self._state = state
        self._held = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep]

    def flush(self) -> str:
        out = "" if self.hit else self._held
        self._held, self._state = "", 0
        return out
