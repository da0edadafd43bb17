"""The slots' prefix cache over prompts holding images (a real engine, tiny model, images
given as embeddings): a follow-up about the same image reuses its KV, another image of
the same size does not, and the output is a fresh prefill's."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from specd.daemon.serving.engine import Engine, EngineConfig
from specd.daemon.serving.scheduler import Request, Scheduler
from specd.daemon.spec.generation import GenerationParams
from specd.daemon.spec.media import ImageChunk, assemble

BEFORE = [1, 20, 31, 42]
N_IMAGE = 16


@pytest.fixture(scope="module")
def engine(tiny_model_factory: Any) -> Engine:
    path = tiny_model_factory(arch="qwen2", weight_type="Q8_0", seed=5, context_length=1024)
    return Engine(EngineConfig(target=str(path), spec_type="none", n_ctx=1024, slots=2,
                               images=True))


@pytest.fixture
def scheduler(engine: Engine) -> Iterator[Scheduler]:
    sched = Scheduler(engine)
    yield sched
    sched.stop()


def _image(engine: Engine, seed: int) -> ImageChunk:
    n_embd = engine.target.built.hparams.n_embd
    rows = np.random.default_rng(seed).normal(0, 1.0, (N_IMAGE, n_embd)).astype(np.float32)
    return ImageChunk(rows, f"{seed:064x}")


def _run(scheduler: Scheduler, segments: list[Any], cache_prompt: bool = True) -> Request:
    prompt, images = assemble(segments)
    done = threading.Event()
    req = Request(prompt=prompt, params=GenerationParams(max_tokens=8, ignore_eos=True),
                  on_tokens=lambda toks: None, on_done=lambda r: done.set(),
                  cache_prompt=cache_prompt, images=images)
    scheduler.submit(req)
    assert done.wait(60) and req.error is None, req.error
    return req


def test_a_follow_up_about_the_same_image_reuses_it(engine: Engine,
                                                    scheduler: Scheduler) -> None:
    screenshot = _image(engine, 1)
    first = _run(scheduler, [BEFORE, screenshot, [50, 60, 70]])
    assert first.gen is not None and first.gen.stats.cached_tokens == 0
    follow = _run(scheduler, [BEFORE, screenshot, [80, 90]])
    assert follow.gen is not None and follow.slot == first.slot
    assert follow.gen.stats.cached_tokens == len(BEFORE) + N_IMAGE
    fresh = _run(scheduler, [BEFORE, screenshot, [80, 90]], cache_prompt=False)
    assert fresh.gen is not None and fresh.gen.stats.cached_tokens == 0
    assert follow.gen.tokens == fresh.gen.tokens


def test_another_image_of_the_same_size_is_not_reused(engine: Engine,
                                                      scheduler: Scheduler) -> None:
    _run(scheduler, [BEFORE, _image(engine, 2), [50, 60]])
    other = _run(scheduler, [BEFORE, _image(engine, 3), [50, 60]])
    assert other.gen is not None and other.gen.stats.cached_tokens == len(BEFORE)
    fresh = _run(scheduler, [BEFORE, _image(engine, 3), [50, 60]], cache_prompt=False)
    assert fresh.gen is not None and other.gen.tokens == fresh.gen.tokens
