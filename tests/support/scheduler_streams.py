"""A request submitted to a Scheduler and what it emitted, for tests of slots that run
beside each other (each stream's output against its solo run)."""

from __future__ import annotations

import threading
from collections.abc import Callable

from specd.daemon.serving.scheduler import Request, Scheduler
from specd.daemon.spec.generation import GenerationParams
from specd.daemon.text.grammar import Grammar


class Stream:
    """A request and what it emitted."""

    def __init__(self, prompt: list[int], params: GenerationParams,
                 grammar: Grammar | None = None):
        self.tokens: list[int] = []
        self.done = threading.Event()
        self.on_tokens: Callable[[], None] = lambda: None  # after each round's tokens
        self.req = Request(prompt=prompt, params=params, on_tokens=self._got,
                           on_done=lambda r: self.done.set(), grammar=grammar)

    def _got(self, tokens: list[int]) -> None:
        self.tokens += tokens
        self.on_tokens()

    def result(self) -> list[int]:
        assert self.done.wait(120) and self.req.error is None, self.req.error
        return self.tokens


def solo(scheduler: Scheduler, make: Callable[[], Stream]) -> list[int]:
    """The output of the stream `make` gives, run alone."""
    s = make()
    scheduler.submit(s.req)
    return s.result()
