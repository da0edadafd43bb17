"""The service as one sender's requests reach it.

Each request submitted through a view carries the sender's identity (a slot's cached
prompt is reused, and cached counts reported, only within one identity), and is tracked
until it finishes, so that shutdown can cancel every generation still running.
"""

from __future__ import annotations

import copy
import threading
from typing import Any, cast

from specd.daemon.serving.scheduler import Request, Scheduler
from specd.daemon.serving.service import Service


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


class _StampingScheduler:
    """The scheduler, stamping the sender's identity on each request it is given."""

    def __init__(self, scheduler: Scheduler, identity: str, live: LiveRequests):
        self._scheduler, self._identity, self._live = scheduler, identity, live

    def submit(self, req: Request) -> Request:
        req.identity = self._identity
        self._live.track(req)
        try:
            return self._scheduler.submit(req)
        except BaseException:
            self._live.forget(req)
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self._scheduler, name)


def service_for(service: Service, identity: str, live: LiveRequests) -> Service:
    """`service` for one sender: the same engine and scheduler, its requests stamped
    with `identity` and tracked in `live`."""
    view = copy.copy(service)
    view.scheduler = cast(Scheduler, _StampingScheduler(service.scheduler, identity, live))
    return view
