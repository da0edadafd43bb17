"""A drafter that raises: the daemon logs it with the drafter's name, counts it (the
request's stats, the response's, /metrics) and finishes the request target-only; the test
suite raises instead, so that a broken drafter fails its test (tiny models)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from specd.daemon.drafters.draft_model import DraftModelDrafter
from specd.daemon.serving.engine import EngineConfig
from specd.daemon.spec.drafter import DraftParams, DraftRequest, PassObserver, Proposal
from specd.daemon.spec.generation import RAISE_DRAFTER_ERRORS, Generation, GenerationParams
from specd.ort_models.model_cache import BuiltModel, load_or_build
from specd.ort_models.runner import ModelRunner

from live_server import live_server
from speculation_checks import decode_all

PROMPT = [348, 20, 31, 42, 53, 64, 75, 86, 97, 108, 119, 130]


class Breaks(DraftModelDrafter):
    """A draft model whose third draft raises."""

    drafts = 0

    def propose(self, requests: Sequence[DraftRequest],
                on_pass: PassObserver | None = None) -> list[Proposal]:
        self.drafts += 1
        if self.drafts == 3:
            raise RuntimeError("the draft broke")
        return super().propose(requests, on_pass)


@pytest.fixture(scope="module")
def models(tiny_model_factory: Callable[..., Path]) -> tuple[BuiltModel, BuiltModel]:
    target = tiny_model_factory(arch="qwen2", weight_type="Q8_0", seed=3, context_length=1024)
    draft = tiny_model_factory(arch="qwen2", weight_type="Q8_0", seed=3, perturb=0.01,
                               context_length=1024)
    return load_or_build(target), load_or_build(draft)


@pytest.fixture
def daemon_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    """Drafter errors handled as the daemon handles them."""
    monkeypatch.delenv(RAISE_DRAFTER_ERRORS)


def _run(target: BuiltModel, drafter: DraftModelDrafter | None) -> tuple[list[int], Generation]:
    gen = Generation(ModelRunner(target, n_ctx=512), 0, PROMPT,
                     GenerationParams(max_tokens=40, ignore_eos=True,
                                      draft=DraftParams(n_max=3)), eog=set(), drafter=drafter)
    return decode_all(gen), gen


def test_the_suite_raises_drafter_errors() -> None:
    import os

    assert os.environ.get(RAISE_DRAFTER_ERRORS) == "1"


def test_a_failing_draft_is_logged_counted_and_the_request_finishes(
        models: tuple[BuiltModel, BuiltModel], daemon_mode: None,
        caplog: pytest.LogCaptureFixture) -> None:
    target, draft = models
    want, _ = _run(target, None)
    with caplog.at_level(logging.ERROR, logger="specd.generation"):
        got, gen = _run(target, Breaks(ModelRunner(draft, n_ctx=512)))
    assert got == want
    assert gen.stats.rounds == 2 and gen.stats.accepted > 0  # it drafted before it broke
    assert gen.stats.drafter_failures == {"draft": 1}
    assert gen.stats.as_dict()["drafter_failures"] == {"draft": 1}
    [record] = caplog.records  # once: the request goes on without the drafter
    assert "drafter draft failed while drafting" in record.getMessage()
    assert record.exc_info is not None and "the draft broke" in str(record.exc_info[1])


def test_with_errors_raised_a_failing_draft_fails_its_request(
        models: tuple[BuiltModel, BuiltModel]) -> None:
    target, draft = models
    with pytest.raises(RuntimeError, match="the draft broke"):
        _run(target, Breaks(ModelRunner(draft, n_ctx=512)))


@pytest.fixture
def server(tiny_model_factory: Callable[..., Path], tmp_path: Path,
           monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    monkeypatch.setenv("SPECD_STATE_DIR", str(tmp_path / "state"))
    target = tiny_model_factory(arch="qwen2", weight_type="Q8_0", seed=3, context_length=1024)
    draft = tiny_model_factory(arch="qwen2", weight_type="Q8_0", seed=3, perturb=0.01,
                               context_length=1024)
    cfg = EngineConfig(target=str(target), draft=str(draft), spec_type="draft", n_ctx=512,
                       slots=1)
    with live_server(cfg, tmp_path) as srv:
        yield srv


def test_a_failing_drafter_is_in_the_response_and_metrics(
        server: Any, daemon_mode: None, monkeypatch: pytest.MonkeyPatch) -> None:
    drafter = server.service.engine.drafter
    assert isinstance(drafter, DraftModelDrafter)
    status, text = server.request("GET", "/metrics")
    assert status == 200 and 'specd_drafter_failures_total{drafter="draft"} 0' in text
    real = drafter.propose
    drafts = []

    def breaks(*args: Any) -> list[Proposal]:
        drafts.append(args)
        if len(drafts) == 3:
            raise RuntimeError("the draft broke")
        return real(*args)

    monkeypatch.setattr(drafter, "propose", breaks)
    body = {"prompt": PROMPT, "max_tokens": 30, "temperature": 0, "ignore_eos": True}
    status, out = server.request("POST", "/v1/completions", body)
    assert status == 200, out
    assert out["usage"]["completion_tokens"] == 30
    spec = out["usage"]["speculative"]
    assert spec["drafter_failures"] == {"draft": 1} and spec["rounds"] == 2
    status, text = server.request("GET", "/metrics")
    assert 'specd_drafter_failures_total{drafter="draft"} 1' in text


class EndBreaks(DraftModelDrafter):
    """A draft model that raises when its request ends."""

    def end(self, seq: int) -> None:
        raise RuntimeError("the end broke")


def test_a_drafter_failing_at_the_end_is_logged_and_counted(
        models: tuple[BuiltModel, BuiltModel], daemon_mode: None,
        caplog: pytest.LogCaptureFixture) -> None:
    target, draft = models
    want, _ = _run(target, None)
    with caplog.at_level(logging.ERROR, logger="specd.generation"):
        got, gen = _run(target, EndBreaks(ModelRunner(draft, n_ctx=512)))
    assert got == want
    assert gen.stats.drafter_failures == {"draft": 1}
    [record] = caplog.records
    assert "drafter draft failed while ending" in record.getMessage()
    assert record.exc_info is not None and "the end broke" in str(record.exc_info[1])


def test_with_errors_raised_a_drafter_failing_at_the_end_fails_its_request(
        models: tuple[BuiltModel, BuiltModel]) -> None:
    target, draft = models
    with pytest.raises(RuntimeError, match="the end broke"):
        _run(target, EndBreaks(ModelRunner(draft, n_ctx=512)))
