"""A stand-in for a request's text stream, its events given up front: tests of the
streaming core and of the dialects' writers without a model."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

from specd.daemon.serving.service import Piece, ProgressEvent, Result


class ScriptedStream:
    """Yields its events in order; remembers whether it was cancelled."""

    def __init__(self, events: Sequence[Piece | ProgressEvent | Result]):
        self.events, self.cancelled = list(events), False

    async def _run(self) -> AsyncIterator[Piece | ProgressEvent | Result]:
        for ev in self.events:
            yield ev

    def __aiter__(self) -> AsyncIterator[Piece | ProgressEvent | Result]:
        return self._run()

    def cancel(self) -> None:
        self.cancelled = True

    async def started(self) -> None:
        """Ready at once (a forwarded stream waits for its upstream's answer here)."""
