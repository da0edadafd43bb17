"""Wake-ups of the readers of a request's output, held by the scheduler's worker while it
plans its next step.

After a step the worker hands each request its tokens, and each hand-off wakes the event
loop that streams them. Woken at once, the loop's Python (a chunk per stream: JSON, the
socket) runs against the worker's next plan, which is Python too, and the two take turns
on the GIL. Held until the plan is made and sent as the step's passes start, the loop's
work runs while the worker is in ONNX Runtime, which releases the GIL. A reader waits
for its tokens no longer than the next plan takes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable


class Outbox:
    """Callbacks the worker thread posts, run in order when it flushes; posted from any
    other thread, a callback runs at once."""

    def __init__(self) -> None:
        self.worker: threading.Thread | None = None
        self._held: list[Callable[[], object]] = []

    def post(self, callback: Callable[[], object]) -> None:
        if threading.current_thread() is self.worker:
            self._held.append(callback)
        else:
            callback()

    def flush(self) -> None:
        """Run what the worker posted, in the order it did (on the worker thread)."""
        held, self._held = self._held, []
        for callback in held:
            callback()
