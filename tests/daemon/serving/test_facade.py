"""ServiceFacade: what ipc reads of the service, and a sender's view stamping its requests."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from specd.daemon.serving.engine import Engine, EngineConfig
from specd.daemon.serving.facade import ServiceFacade
from specd.daemon.serving.scheduler import Request, Scheduler
from specd.daemon.serving.service import Result, Service
from specd.daemon.spec.generation import GenerationParams


@pytest.fixture(scope="module")
def service(tiny_model_factory: Callable[..., Path]) -> Iterator[Service]:
    path = tiny_model_factory(arch="qwen2", weight_type="Q8_0", seed=5, context_length=1024)
    engine = Engine(EngineConfig(target=str(path), spec_type="none", n_ctx=256, slots=2,
                                 aliases=["b-name", "a-name"], tags=["t"]))
    svc = Service(engine, Scheduler(engine))
    yield svc
    svc.scheduler.stop()


def test_the_facade_reads_the_served_model(service: Service) -> None:
    facade = ServiceFacade(service)
    engine = service.engine
    assert facade.model_name == "a-name" == engine.model_name
    assert {"a-name", "b-name", "specd", "default", engine.target.name,
            engine.target.path.name, engine.cfg.target} <= facade.model_names
    assert facade.aliases == ["a-name", "b-name"] and facade.tags == ["t"]
    assert facade.n_ctx == 256 and facade.n_slots == 2
    assert facade.defaults is engine.cfg.defaults
    assert facade.embeddings is None  # no --embeddings
    messages = [{"role": "user", "content": "hi"}]
    assert facade.render_chat(messages) == engine.render_chat(messages)
    assert facade.chat_tokens(messages) == engine.chat_tokens(messages)
    c = facade.counters()
    assert (c.n_slots, c.busy_slots, c.queue_length, c.drafter) == (2, 0, 0, None)


def test_the_facts_model_listings_give(service: Service) -> None:
    facts = ServiceFacade(service).facts()
    gguf = service.engine.target.gguf
    assert facts.arch == "qwen2" and facts.device == "cpu"
    assert facts.quantization == "Q8_0"
    assert facts.parameters == sum(int(np.prod(t.shape)) for t in gguf.tensors.values()) > 0
    assert facts.file_bytes == service.engine.target.path.stat().st_size
    assert facts.resident_bytes > 0 and facts.n_ctx_train == 1024
    assert ServiceFacade(service).digest() == gguf.content_hash()


class _Tracker:
    def __init__(self) -> None:
        self.tracked: list[Request] = []

    def track(self, req: Request) -> None:
        self.tracked.append(req)

    def forget(self, req: Request) -> None:
        self.tracked.remove(req)


def test_a_senders_view_stamps_and_tracks_its_requests(service: Service) -> None:
    tracker = _Tracker()
    view = ServiceFacade(service).for_sender("alice", tracker)

    async def run() -> Result:
        prompt = service.tokenizer.encode("hello")
        result = None
        async for ev in view.generate(prompt, GenerationParams(max_tokens=2)):
            result = ev
        assert isinstance(result, Result)
        return result

    result = asyncio.run(run())
    assert result.completion_tokens == 2
    assert [r.identity for r in tracker.tracked] == ["alice"]
    assert type(service.scheduler) is Scheduler  # the service itself is unchanged
