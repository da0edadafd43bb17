"""Every active slot's rows in one target pass a step: each stream's output is its solo
run's, whatever runs beside it, joins or leaves (tiny models, specd's kernels)."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from specd.daemon.serving.engine import Engine, EngineConfig
from specd.daemon.serving.scheduler import Scheduler
from specd.daemon.spec import batch_policy
from specd.daemon.spec.drafter import DraftParams
from specd.daemon.spec.generation import Generation, GenerationParams
from specd.daemon.spec.policy import RoundPlan
from specd.daemon.spec.sampling import SamplerParams
from specd.daemon.spec.stats import SpecStats
from specd.daemon.text.grammar import compile_constraint
from specd.ort_models import native_ops
from specd.ort_models.runner import Call, CallOutput, ModelRunner

from scheduler_streams import Stream, solo
from speculation_checks import assert_drafted, assert_speculated

pytestmark = pytest.mark.skipif(native_ops.library() is None, reason="specd's kernels are off")

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                 "maximum": 999}},
          "required": ["n"], "additionalProperties": False}


@pytest.fixture(scope="module", params=["none", "draft"])
def engine(request: pytest.FixtureRequest, tiny_model_factory: Callable[..., Path]) -> Engine:
    target = tiny_model_factory(arch="qwen2", weight_type="Q8_0", seed=8, context_length=1024)
    draft = tiny_model_factory(arch="qwen2", weight_type="Q8_0", seed=8, perturb=0.01,
                               context_length=1024)
    spec = request.param
    return Engine(EngineConfig(target=str(target), draft=None if spec == "none" else str(draft),
                               spec_type=spec, n_ctx=1024, slots=4))


@pytest.fixture
def scheduler(engine: Engine) -> Iterator[Scheduler]:
    sched = Scheduler(engine)
    yield sched
    sched.stop()


def _streams(engine: Engine) -> list[Callable[[], Stream]]:
    """Four kinds of request: greedy, greedy with a longer draft, seeded sampling, and
    greedy under a JSON schema."""
    tok = engine.tokenizer
    grammar = compile_constraint("json_schema", SCHEMA, tok)

    def params(**kw: Any) -> GenerationParams:
        return GenerationParams(**{"max_tokens": 40, "ignore_eos": True,
                                   "draft": DraftParams(n_max=3), **kw})

    return [
        lambda: Stream([1, *range(20, 50)], params()),
        lambda: Stream([1, *range(60, 70)], params(draft=DraftParams(n_max=6), max_tokens=80)),
        lambda: Stream([1, *range(80, 120)],
                       params(sampling=SamplerParams(temperature=0.8, seed=7))),
        lambda: Stream(tok.encode("give json:"), params(ignore_eos=False), grammar),
    ]


def _count_passes(monkeypatch: pytest.MonkeyPatch, runner: ModelRunner) -> list[int]:
    """The number of calls in each of the runner's passes from now on."""
    real, sizes = runner.forward_batch, []

    def spy(calls: list[Call]) -> list[CallOutput]:
        sizes.append(len(calls))
        return real(calls)

    monkeypatch.setattr(runner, "forward_batch", spy)
    return sizes


def test_streams_in_one_pass_equal_their_solo_runs(scheduler: Scheduler, engine: Engine,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    makers = _streams(engine)
    want = [solo(scheduler, make) for make in makers]
    sizes = _count_passes(monkeypatch, engine.target.runner)
    draft = (None if engine.drafter is None
             else getattr(engine.drafter.model_sources[0], "runner", None))
    draft_sizes = _count_passes(monkeypatch, draft) if draft is not None else []
    streams = [make() for make in makers]
    for s in streams:
        scheduler.submit(s.req)
    assert [s.result() for s in streams] == want
    assert max(sizes) == 4  # all four streams shared passes
    total = SpecStats()
    for s in streams:
        assert s.req.gen is not None
        total.merge(s.req.gen.stats)
    if engine.drafter is None:  # "none": every round a plain step, no draft pass
        assert total.rounds == 0 and total.drafted == 0, total.as_dict()
        assert total.draft_lengths == {0: total.decoded_tokens}, total.as_dict()
    else:
        assert draft is not None and max(draft_sizes) >= 2  # their drafts shared passes
        assert_speculated(total)


def test_joining_and_cancelled_streams_leave_the_others_unchanged(
        scheduler: Scheduler, engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stream joins once two run (from the worker, after a running one's fifth token),
    and one of the two is cancelled once all three shared a pass: the others' outputs
    are their solo runs', the cancelled one's a prefix of its own."""
    a, b, c, _ = _streams(engine)
    want_a, want_b, want_c = (solo(scheduler, make) for make in (a, b, c))
    sizes = _count_passes(monkeypatch, engine.target.runner)
    first, leaving, joining = a(), b(), c()

    def join() -> None:
        if len(first.tokens) >= 5 and joining.req.id == 0:
            scheduler.submit(joining.req)

    def leave() -> None:
        if len(joining.tokens) >= 2:  # after a pass of all three
            leaving.req.cancel()

    first.on_tokens, joining.on_tokens = join, leave
    for s in (first, leaving):
        scheduler.submit(s.req)
    assert first.result() == want_a and joining.result() == want_c
    assert leaving.done.wait(60) and leaving.req.gen is not None
    assert leaving.req.gen.finish_reason == "cancelled"
    assert 5 <= len(leaving.tokens) < len(want_b)
    assert leaving.tokens == want_b[:len(leaving.tokens)]
    assert max(sizes) == 3


def _as(identity: str, stream: Stream) -> Stream:
    stream.req.identity = identity
    return stream


def test_a_prompt_asked_twice_at_once_is_evaluated_once(scheduler: Scheduler) -> None:
    """Two requests with one long prompt (n choices): the second waits for the first's
    prefill and copies its KV (cached_tokens), and both give the solo output (measured
    under another identity, whose cache they cannot reuse)."""
    prompt = [1, *range(150, 250)]

    def make(identity: str) -> Stream:
        return _as(identity, Stream(prompt, GenerationParams(max_tokens=12, ignore_eos=True)))

    want = solo(scheduler, lambda: make("solo"))
    pair = [make("choices"), make("choices")]
    for s in pair:
        scheduler.submit(s.req)
    assert [s.result() for s in pair] == [want, want]
    cached = sorted(s.req.gen.stats.cached_tokens for s in pair if s.req.gen is not None)
    assert cached == [0, len(prompt) - 1]


def test_a_request_reuses_the_prefix_another_slot_is_generating(scheduler: Scheduler) -> None:
    """A request continuing a conversation that still generates in another slot copies
    the prompt and the tokens generated so far from it."""
    prompt = [1, *range(250, 310)]
    running = _as("me", Stream(prompt, GenerationParams(max_tokens=40, ignore_eos=True)))
    follow: list[Stream] = []

    def submit_follow_up() -> None:
        if len(running.tokens) >= 4 and not follow:
            follow.append(_as("me", Stream(prompt + running.tokens[:3] + [7],
                                           GenerationParams(max_tokens=8, ignore_eos=True))))
            scheduler.submit(follow[0].req)

    running.on_tokens = submit_follow_up
    scheduler.submit(running.req)
    running.result()
    got = follow[0].result()
    solo = _as("other", Stream(follow[0].req.prompt,
                               GenerationParams(max_tokens=8, ignore_eos=True)))
    scheduler.submit(solo.req)
    assert got == solo.result()
    assert follow[0].req.gen is not None
    assert follow[0].req.gen.stats.cached_tokens == len(prompt) + 3



def test_adaptive_streams_planned_as_a_step_equal_their_solo_runs(
        scheduler: Scheduler, engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """Four adaptive streams (greedy, and seeded sampling): once the passes are timed the
    planner caps each step's drafts as a whole, and each output is its solo run's."""
    if engine.drafter is None:
        pytest.skip("no drafter to plan")

    def make(i: int) -> Callable[[], Stream]:
        sampling = SamplerParams(temperature=0.8 if i % 2 else 0.0, seed=i)
        return lambda: Stream([1, *range(20 + 13 * i, 45 + 13 * i)], GenerationParams(
            max_tokens=60, ignore_eos=True, draft=DraftParams(n_max=6), adaptive=True,
            sampling=sampling))

    makers = [make(i) for i in range(4)]
    want = [solo(scheduler, m) for m in makers]
    planned: list[list[Any]] = []
    real = scheduler.planner.plans

    def plans(outlooks: Any) -> list[Any] | None:
        out = real(outlooks)
        if out is not None:
            planned.append(out)
        return out

    monkeypatch.setattr(scheduler.planner, "plans", plans)
    # on tiny models the plan is plain steps but for its probes, which draft: let them,
    # whatever their catch-ups cost against these cheap passes
    monkeypatch.setattr(batch_policy, "PROBE_SHARE", 1.0)
    streams = [m() for m in makers]
    for s in streams:
        scheduler.submit(s.req)
    assert [s.result() for s in streams] == want
    assert max(len(c) for c in planned) == 4  # steps of four were planned
    total = SpecStats()
    for s in streams:
        assert s.req.gen is not None
        total.merge(s.req.gen.stats)
    assert_drafted(total)


def test_streams_drafting_to_any_step_plan_equal_their_solo_runs(
        scheduler: Scheduler, engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each step's plan drawn at random (0: a plain step; a slot left out: its own policy
    plans): every stream drafts as planned, up to its n_max, and its output is its solo
    run's."""
    if engine.drafter is None:
        pytest.skip("no drafter to plan for")
    makers = _streams(engine)
    want = [solo(scheduler, make) for make in makers]
    rng = random.Random(5)

    def plans(gens: Sequence[Generation]) -> dict[int, RoundPlan]:
        drawn = {i: rng.choice([None, RoundPlan(0), RoundPlan(1), RoundPlan(2),
                                RoundPlan(5)]) for i in range(len(gens))}
        return {i: plan for i, plan in drawn.items() if plan is not None}

    monkeypatch.setattr(scheduler.round, "_step_plans", plans)
    streams = [make() for make in makers]
    for s in streams:
        scheduler.submit(s.req)
    assert [s.result() for s in streams] == want
    stats = [s.req.gen.stats for s in streams if s.req.gen is not None]
    assert sum(st.rounds for st in stats) > 0 and sum(st.accepted for st in stats) > 0
    assert max(n for st in stats for n in st.draft_lengths) <= 6  # n_max
    assert any(st.draft_lengths.get(5) for st in stats)  # drafted as the plan said
