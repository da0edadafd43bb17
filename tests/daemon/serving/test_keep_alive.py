"""Keep-alive: the scheduler unloads an idle engine (its memory back to the system) and
reloads it for the next request, never while a request runs."""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from conftest import fetched_model

from specd.daemon.serving.engine import Engine, EngineConfig
from specd.daemon.serving.loaded_model import ModelUnloaded
from specd.daemon.serving.scheduler import NEVER, Request, Scheduler
from specd.daemon.spec.generation import GenerationParams
from specd.memory_fit.rss import rss_bytes, trim_heap

MB = 1e6


def _wait(cond: Callable[[], bool], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert cond()


def _generate(sched: Scheduler, prompt: list[int], n: int = 24, *,
              keep_alive: float | None = None,
              on_tokens: Callable[[list[int]], None] = lambda t: None) -> list[int]:
    """A greedy request through the scheduler, to its end: its tokens."""
    out: list[int] = []
    done = threading.Event()

    def got(tokens: list[int]) -> None:
        out.extend(tokens)
        on_tokens(tokens)

    req = Request(prompt=prompt, params=GenerationParams(max_tokens=n, ignore_eos=True),
                  on_tokens=got, on_done=lambda r: done.set(), keep_alive=keep_alive)
    sched.submit(req)
    assert done.wait(120) and req.error is None, req.error
    return out


@pytest.fixture(scope="module")
def tiny(tiny_model_factory: Any) -> Engine:
    path = tiny_model_factory(arch="qwen2", weight_type="Q8_0", seed=5, context_length=1024)
    return Engine(EngineConfig(target=str(path), spec_type="ngram", n_ctx=1024, slots=2))


@pytest.mark.real
def test_an_idle_unload_returns_the_memory_and_the_reload_answers_the_same() -> None:
    """SmolLM2-135M with a draft model (itself): RSS falls by most of what its sessions
    took when the idle engine unloads, and the reloaded engine's greedy output is the
    same as before."""
    path = str(fetched_model("smollm2-135m-instruct"))
    engine = Engine(EngineConfig(target=path, draft=path, n_ctx=2048, slots=2))
    sched = Scheduler(engine, keep_alive=NEVER)
    try:
        prompt = engine.encode_prompt("Name three rivers of Europe.", chat=True)
        before = _generate(sched, prompt)
        gc.collect()
        trim_heap()
        loaded_rss = rss_bytes()
        sessions = engine.target.resident_bytes + engine.draft.resident_bytes
        sched.set_keep_alive(0)  # idle now: unloads at once
        _wait(lambda: not engine.loaded)
        gc.collect()
        unloaded_rss = rss_bytes()
        freed = loaded_rss - unloaded_rss
        figures = (f"RSS loaded {loaded_rss / MB:.0f} MB, unloaded {unloaded_rss / MB:.0f} "
                   f"MB: {freed / MB:.0f} MB freed of the {sessions / MB:.0f} MB the "
                   "sessions took")
        print(figures)
        assert freed > 0.6 * sessions, figures
        with pytest.raises(ModelUnloaded):
            engine.target.runner  # noqa: B018
        assert engine.drafter is None and all(not s.cached for s in sched.slots)
        sched.set_keep_alive(NEVER)
        after = _generate(sched, prompt)
        assert engine.loaded and after == before
        assert sched.requests_failed == 0
    finally:
        sched.stop()


def test_the_engine_reloads_the_same_configuration(tiny: Engine) -> None:
    """unload / load: the runners' settings, the drafter's kind and the output are the
    same, and an unloaded engine's descriptions still answer."""
    runner = tiny.target.runner
    settings = (runner.n_ctx, runner.min_rows, runner.row_block, runner.n_seq)
    drafter = type(tiny.drafter)
    sched = Scheduler(tiny)
    try:
        prompt = [1, 2, 3, 4, 5, 1, 2, 3]
        want = _generate(sched, prompt)
        tiny.unload()
        assert not tiny.loaded and tiny.describe()["loaded"] is False
        assert tiny.n_ctx == settings[0] and tiny.drafter_name is not None
        tiny.load()
        runner = tiny.target.runner
        assert (runner.n_ctx, runner.min_rows, runner.row_block, runner.n_seq) == settings
        assert type(tiny.drafter) is drafter
    finally:
        sched.stop()
    sched = Scheduler(tiny)  # its round over the new runner
    try:
        assert _generate(sched, prompt) == want
    finally:
        sched.stop()


def test_a_running_stream_is_never_cut(tiny: Engine) -> None:
    """keep-alive 0: the engine stays loaded through every round of a running stream,
    and unloads once it ended; its output is that of a scheduler that never unloads."""
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    sched = Scheduler(tiny, keep_alive=NEVER)
    try:
        want = _generate(sched, prompt, n=48)
    finally:
        sched.stop()
    sched = Scheduler(tiny, keep_alive=0)
    try:
        seen: list[bool] = []

        def slow(tokens: list[int]) -> None:  # the stream outlasts the keep-alive
            seen.append(tiny.loaded)
            time.sleep(0.005)

        got = _generate(sched, prompt, n=48, on_tokens=slow)
        assert got == want and len(seen) > 1 and all(seen)
        _wait(lambda: not tiny.loaded)
        assert _generate(sched, prompt, n=48) == want  # reloaded for it
        _wait(lambda: not tiny.loaded)
    finally:
        sched.stop()
        tiny.load()


def test_a_request_keep_alive_sets_how_long_the_model_stays(tiny: Engine) -> None:
    sched = Scheduler(tiny, keep_alive=NEVER)
    try:
        assert sched.residency().expires_at == float("inf")
        _generate(sched, [1, 2, 3], n=4, keep_alive=0.3)  # Ollama's keep_alive
        r = sched.residency()
        assert r.loaded and r.expires_at is not None and r.expires_at < time.time() + 1
        _wait(lambda: not tiny.loaded, timeout=10)
        assert not sched.residency().loaded
        with sched.hold(NEVER):  # a load request: loaded for the block, and kept
            assert tiny.loaded
        time.sleep(0.4)
        assert tiny.loaded and sched.residency().expires_at == float("inf")
    finally:
        sched.stop()
        tiny.load()
