"""The requests every sender has in flight, so that shutdown can cancel them all.

Each sender reaches the service through `ServiceFacade.for_sender`, which stamps its
identity on its requests and tells them to LiveRequests until they finish.
"""

from __future__ import annotations

import threading

from specd.daemon.serving.scheduler import Request


class LiveRequests:
    """The requests submitted and not finished yet (any thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._requests: dict[int, Request] = {}
        self.draining = False  # shutting down: every request is cancelled

    def __len__(self) -> int:
        with self._lock:
            return len(self._requests)

    def track(self, req: Request) -> None:
        done = req.on_done

        def finished(r: Request) -> object:
            self.forget(r)
            return done(r)

        req.on_done = finished
        with self._lock:
            self._requests[id(req)] = req
            if self.draining:
                req.cancel()

    def forget(self, req: Request) -> None:
        with self._lock:
            self._requests.pop(id(req), None)

    def cancel_all(self) -> None:
        """Cancel every request in flight, and any submitted from now on."""
        with self._lock:
            self.draining = True
            for req in self._requests.values():
                req.cancel()
