"""Slots drafting with a head: the scheduler runs every slot's DFlash block (or EAGLE-3
step) in one pass of the head, as it runs the draft model's steps, and each stream's output
is its solo run's (tiny models, specd's kernels)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from specd.daemon.serving.engine import Engine, EngineConfig
from specd.daemon.serving.scheduler import Scheduler
from specd.daemon.spec.drafter import DraftParams
from specd.daemon.spec.generation import GenerationParams
from specd.daemon.spec.sampling import SamplerParams
from specd.daemon.spec.stats import SpecStats
from specd.daemon.text.grammar import compile_constraint
from specd.ort_models import native_ops
from specd.ort_models.head_runner import HeadRunner

from scheduler_streams import Stream, solo
from speculation_checks import assert_drafted
from tiny_heads import write_tiny_head

pytestmark = pytest.mark.skipif(native_ops.library() is None, reason="specd's kernels are off")

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                 "maximum": 999}},
          "required": ["n"], "additionalProperties": False}


@pytest.fixture(scope="module", params=["dflash", "dspark", "eagle3", "dflash2"])
def engine(request: pytest.FixtureRequest, tiny_model_factory: Callable[..., Path],
           tmp_path_factory: pytest.TempPathFactory) -> Engine:
    kind = request.param
    target = tiny_model_factory(arch="qwen3", weight_type="Q8_0", seed=3, context_length=512)
    head = write_tiny_head(tmp_path_factory.mktemp("heads") / f"{kind}.gguf", kind=kind,
                           seed=5)
    return Engine(EngineConfig(target=str(target), draft=str(head), spec_type=f"draft-{kind}",
                               n_ctx=512, slots=3, fetch=False, device="cpu"))


@pytest.fixture
def scheduler(engine: Engine) -> Iterator[Scheduler]:
    sched = Scheduler(engine)
    yield sched
    sched.stop()


def _streams(engine: Engine) -> list[Callable[[], Stream]]:
    """Greedy, seeded sampling, and greedy under a JSON schema; drafting every round."""
    grammar = compile_constraint("json_schema", SCHEMA, engine.tokenizer)

    def params(**kw: Any) -> GenerationParams:
        return GenerationParams(**{"max_tokens": 40, "ignore_eos": True, "adaptive": False,
                                   "draft": DraftParams(n_max=3), **kw})

    return [
        lambda: Stream([348, *range(20, 50)], params()),
        lambda: Stream([348, *range(80, 120)],
                       params(sampling=SamplerParams(temperature=0.8, seed=7))),
        lambda: Stream(engine.tokenizer.encode("give json:"), params(ignore_eos=False),
                       grammar),
    ]


def test_streams_share_head_passes_and_equal_their_solo_runs(
        scheduler: Scheduler, engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    head = engine.head
    assert isinstance(head, HeadRunner)
    kind = head.built.head.kind
    eagle3 = kind == "eagle3"
    assert head.packs_steps if eagle3 else head.packs_blocks
    assert engine.drafter is not None
    assert getattr(engine.drafter.model_sources[0], "runner", None) is head

    def head_passes() -> int:
        return head.step_passes if eagle3 else head.block_passes

    makers = _streams(engine)
    want = [solo(scheduler, make) for make in makers]
    real, sizes = head.forward_batch, []

    def spy(calls: list[Any]) -> list[Any]:
        sizes.append(len(calls))
        return real(calls)

    monkeypatch.setattr(head, "forward_batch", spy)
    passes, injections, inject_passes = head_passes(), head.injections, head.inject_passes
    streams = [make() for make in makers]
    for s in streams:
        scheduler.submit(s.req)
    assert [s.result() for s in streams] == want
    drafted = [s.req.gen.stats.drafted for s in streams if s.req.gen is not None]
    assert all(n > 0 for n in drafted)
    assert max(sizes) == 3  # all three streams' blocks (steps) in one pass
    assert head_passes() - passes == len(sizes) < sum(sizes)  # a session run per pass
    # the verified tokens' injections (EAGLE-3: pairs) of the slots completed together
    assert head.inject_passes - inject_passes < head.injections - injections


def test_slots_drafting_with_a_head_and_a_draft_model_equal_target_only(
        tiny_model_factory: Callable[..., Path], tmp_path: Path) -> None:
    """head+draft in three slots, the adaptive policy choosing a source per round and
    slot: each slot's draft calls run on its round's source (the head's blocks and the
    model's steps in passes of their own), and greedy output is target-only's."""
    target = tiny_model_factory(arch="qwen3", weight_type="Q8_0", seed=3, context_length=512)
    model = tiny_model_factory(arch="qwen3", weight_type="Q8_0", seed=4, context_length=512)
    head = write_tiny_head(tmp_path / "dflash.gguf", seed=5)
    both = Engine(EngineConfig(target=str(target), draft=str(head), also_draft=str(model),
                               n_ctx=512, slots=3, fetch=False, device="cpu"))
    alone = Engine(EngineConfig(target=str(target), spec_type="none", n_ctx=512, fetch=False,
                                device="cpu"))
    assert both.spec_type == "head+draft"

    def makers(adaptive: bool) -> list[Callable[[], Stream]]:
        params = GenerationParams(max_tokens=60, ignore_eos=True, adaptive=adaptive,
                                  draft=DraftParams(n_max=4))
        return [lambda p=p: Stream(p, params)
                for p in ([348, *range(20, 50)], [348, *range(80, 120)], [348, 7, 9, 11])]

    plain = Scheduler(alone)
    try:
        want = [solo(plain, make) for make in makers(False)]
    finally:
        plain.stop()
    sched = Scheduler(both)
    # each slot's own policy plans its rounds (the step's planner, which drafts nothing
    # where drafting does not pay, as on these tiny models, is tested on its own)
    sched.planner.plans = lambda outlooks: None  # type: ignore[method-assign]
    try:
        streams = [make() for make in makers(True)]
        for s in streams:
            sched.submit(s.req)
        assert [s.result() for s in streams] == want
    finally:
        sched.stop()
    used = {name for s in streams if s.req.gen is not None
            for name in s.req.gen.stats.source_calls}
    assert used == {"dflash", "draft"}
    total = SpecStats()
    for s in streams:
        assert s.req.gen is not None
        total.merge(s.req.gen.stats)
    assert_drafted(total)  # a random head's and another seed's drafts: rarely accepted
