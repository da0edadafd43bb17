"""The scheduler on a real engine (tiny model): queue places, slot choice, and requests
their consumer ends in the round that produced what it needed."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from specd.daemon.serving.engine import Engine, EngineConfig
from specd.daemon.serving.scheduler import QueueFull, Request, Scheduler
from specd.daemon.spec.generation import GenerationParams


@pytest.fixture(scope="module")
def engine(tiny_model_factory: Any) -> Engine:
    path = tiny_model_factory(arch="qwen2", weight_type="Q8_0", seed=5, context_length=1024)
    return Engine(EngineConfig(target=str(path), spec_type="none", n_ctx=1024, slots=2))


@pytest.fixture
def scheduler(engine: Engine) -> Iterator[Scheduler]:
    sched = Scheduler(engine, max_queue=2)
    yield sched
    sched.stop()


def _request(prompt: list[int], n: int = 8,
             on_tokens: Callable[[list[int]], bool | None] = lambda toks: None
             ) -> tuple[Request, threading.Event]:
    done = threading.Event()
    req = Request(prompt=prompt, params=GenerationParams(max_tokens=n, ignore_eos=True),
                  on_tokens=on_tokens, on_done=lambda r: done.set())
    return req, done


def _wait(cond: Callable[[], bool], timeout: float = 30) -> None:
    deadline = time.time() + timeout
    while not cond() and time.time() < deadline:
        time.sleep(0.01)
    assert cond()


def test_cancelled_requests_give_up_their_queue_places(scheduler: Scheduler,
                                                       monkeypatch: pytest.MonkeyPatch
                                                       ) -> None:
    """Clients that left while their requests waited must not fill the queue: a live
    request still gets in (it got 'the queue is full' until a slot freed)."""
    runner = scheduler.engine.target.runner
    real, gate = runner.forward_batch, threading.Event()

    def held(*args: Any, **kw: Any) -> Any:  # both slots' requests wait here
        gate.wait(60)
        return real(*args, **kw)

    monkeypatch.setattr(runner, "forward_batch", held)
    try:
        running = [_request([1, 2, 3 + i])[0] for i in range(2)]
        for r in running:
            scheduler.submit(r)
        _wait(lambda: all(s.request is not None for s in scheduler.slots))
        waiting = [_request([5, 6, i]) for i in range(2)]
        for r, _ in waiting:
            scheduler.submit(r)
        assert scheduler.queue_length == 2
        with pytest.raises(QueueFull):
            scheduler.submit(_request([7])[0])
        for r, _ in waiting:
            r.cancel()  # their clients left
        assert scheduler.queue_length == 0
        live, live_done = _request([9, 9, 9], n=2)
        scheduler.submit(live)  # no QueueFull: the cancelled hold no places
        assert all(done.wait(10) for _, done in waiting)  # finished, not left hanging
    finally:
        gate.set()
    assert live_done.wait(60) and live.error is None and len(live.gen.tokens) == 2


def test_a_new_conversation_takes_an_empty_slot_not_anothers_cache(scheduler: Scheduler
                                                                   ) -> None:
    """With no prefix to share, a request goes to an empty slot (else the one used
    longest ago), so the conversation cached in the other slot keeps its prefix."""
    a = [1, *range(20, 60)]
    b = [1, *range(100, 130)]  # shares only the first token (a BOS) with a
    for prompt in (a, b):
        req, done = _request(prompt)
        scheduler.submit(req)
        assert done.wait(60) and req.error is None
    slots = {tuple(s.cached[:len(a)]): s.index for s in scheduler.slots}
    assert tuple(a) in slots and tuple(b) in {tuple(s.cached[:len(b)]) for s in scheduler.slots}
    follow_up, done = _request(a + [7, 8, 9])
    scheduler.submit(follow_up)
    assert done.wait(60)
    assert follow_up.slot == slots[tuple(a)]
    assert follow_up.gen.stats.cached_tokens == len(a)


def test_a_cached_prefix_is_reused_only_by_its_own_identity(scheduler: Scheduler) -> None:
    """Another identity's request with the same prompt reuses nothing (its cached count
    would tell it how much of the other's prompt it guessed); the owner's reuses it."""
    secret = [1, *range(200, 240)]
    owner, done = _request(secret)
    owner.identity = "uid:1000"
    scheduler.submit(owner)
    assert done.wait(60) and owner.error is None
    for identity, cached in (("uid:1001", 0), ("uid:1000", len(secret))):
        probe, done = _request(secret + [5])
        probe.identity = identity
        scheduler.submit(probe)
        assert done.wait(60) and probe.error is None
        assert probe.gen.stats.cached_tokens == cached, identity


def test_a_consumer_that_has_enough_ends_the_request_in_that_round(scheduler: Scheduler
                                                                   ) -> None:
    """on_tokens returning True (a stop string met) ends the generation in the round
    that produced it, instead of whenever the consumer's thread next looks."""
    calls: list[list[int]] = []

    def enough(tokens: list[int]) -> bool:
        calls.append(tokens)
        return len(calls) == 3

    req, done = _request([1, 2, 3], n=64, on_tokens=enough)
    scheduler.submit(req)
    assert done.wait(60) and req.error is None
    assert len(calls) == 3 and len(req.gen.tokens) == 3  # one token per round here
    assert req.gen.finish_reason == "stop"


def test_a_request_that_cannot_start_still_finishes(scheduler: Scheduler,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever goes wrong while a request starts, its client gets an error, not a wait
    without end (it is already off the queue)."""
    def broken(*args: Any, **kw: Any) -> Any:
        raise RuntimeError("no memory for the KV cache")

    monkeypatch.setattr(scheduler.engine, "start", broken)
    req, done = _request([1, 2, 3])
    scheduler.submit(req)
    assert done.wait(30) and req.error == "internal error: no memory for the KV cache"
