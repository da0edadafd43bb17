"""The stop-string automaton: the same text out, and the same stop found, as searching
for each string in turn, however the text is cut into pieces."""

from __future__ import annotations

import random

import pytest

from specd.daemon.text.stop_strings import StopMatcher, StopStrings


class _OneByOne:
    """The reference: every stop string searched for in turn in the held text."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self._held = ""
        self.hit: str | None = None

    def feed(self, text: str) -> str:
        if self.hit is not None:
            return ""
        buf = self._held + text
        best = None
        for s in self.stops:
            i = buf.find(s)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is not None:
            self.hit, self._held = best[1], ""
            return buf[:best[0]]
        keep = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(buf)), 0, -1):
                if buf.endswith(s[:n]):
                    keep = max(keep, n)
                    break
        self._held = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep]

    def flush(self) -> str:
        out, self._held = ("" if self.hit else self._held), ""
        return out


def _run(matcher: StopMatcher | _OneByOne, pieces: list[str]) -> tuple[list[str], str | None]:
    out = [matcher.feed(p) for p in pieces]
    out.append(matcher.flush())
    return out, matcher.hit


@pytest.mark.parametrize("seed", range(300))
def test_the_automaton_agrees_with_searching_each_string(seed: int) -> None:
    rng = random.Random(seed)
    alphabet = "abc" if seed % 2 else "ab\n"
    stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 5)))
             for _ in range(rng.randint(0, 6))]
    text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
    cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 8))))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    assert _run(StopMatcher(stops), pieces) == _run(_OneByOne(stops), pieces)


def test_the_earliest_start_wins_then_the_first_given() -> None:
    m = StopMatcher(["bcd", "abcdef", "abc"])
    assert m.feed("xxabcdefg") == "xx" and m.hit == "abcdef"
    m = StopMatcher(["abc", "ab"])
    assert m.feed("zabc") == "z" and m.hit == "abc"
    m = StopMatcher(["ab", "abc"])
    assert m.feed("zabc") == "z" and m.hit == "ab"
    m = StopMatcher(["</s>", "User:"])
    assert m.feed("hello </") == "hello "  # "</" may begin a stop: held back
    assert m.feed("p> and User") == "</p> and "
    assert m.feed(": more") == "" and m.hit == "User:"
    assert m.feed("later") == "" and m.flush() == ""


def test_a_compiled_list_is_shared_and_empty_strings_are_ignored() -> None:
    compiled = StopStrings(["", "END", "END"])
    assert compiled.stops == ["END", "END"]
    a, b = StopMatcher(compiled), StopMatcher(compiled)
    assert a.feed("oneEN") == "one" and b.feed("two") == "two"
    assert a.flush() == "EN" and a.hit is None
    assert StopMatcher([]).feed("anything") == "anything"


def test_many_long_stop_strings_cost_one_pass_per_piece() -> None:
    """Thousands of strings sharing prefixes: the automaton's size is their total length,
    and a piece of text is scanned once (an exhaustive search here would take minutes)."""
    stops = [f"stop-{i:05d}-" + "x" * 200 for i in range(2000)]
    m = StopMatcher(stops)
    out = [m.feed("token ") for _ in range(20000)]
    assert "".join(out) == "token " * 20000 and m.hit is None
    assert m.feed("stop-01999-" + "x" * 200 + " tail") == "" and m.hit == stops[1999]
