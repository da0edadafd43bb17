"""The scheduler's outbox: the worker's wake-ups wait for its flush, in order; anyone
else's go at once."""

from __future__ import annotations

import threading

from specd.daemon.serving.outbox import Outbox


def test_the_workers_posts_wait_for_its_flush_and_keep_their_order() -> None:
    box, seen = Outbox(), []

    def work() -> None:
        for i in range(3):
            box.post(lambda i=i: seen.append(i))
        seen.append("before flush")
        box.flush()
        box.flush()  # nothing is run twice

    box.worker = threading.Thread(target=work)
    box.worker.start()
    box.worker.join()
    assert seen == ["before flush", 0, 1, 2]


def test_a_post_from_another_thread_runs_at_once() -> None:
    box, seen = Outbox(), []
    box.worker = threading.Thread(target=lambda: None)
    box.post(lambda: seen.append("now"))
    assert seen == ["now"]
