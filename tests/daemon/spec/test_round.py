"""The batch round (spec/round.py): every drafter kind, in batches of 1–4 sequences, each
sequence's output equal to its solo run; a batch's drafts proposed together, one pass of
the draft source per step; a failure kept to the sequence it belongs to."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from specd.daemon.serving.engine import Engine, EngineConfig
from specd.daemon.spec.batch_policy import BatchDraftPlanner
from specd.daemon.spec.drafter import DraftParams, DraftRequest, PassObserver, Proposal
from specd.daemon.spec.generation import RAISE_DRAFTER_ERRORS, Generation, GenerationParams
from specd.daemon.spec.round import BatchRound
from specd.daemon.spec.sampling import SamplerParams
from specd.ort_models import native_ops

from speculation_checks import assert_drafted, assert_speculated, decode_all
from tiny_heads import write_tiny_head

pytestmark = pytest.mark.skipif(native_ops.library() is None, reason="specd's kernels are off")

KINDS = ["draft", "ngram", "draft+ngram", "draft-dflash", "draft-dspark", "draft-dflash2",
         "draft-eagle3", "head+draft"]
REPEATED = [*range(20, 36), *range(20, 36)]  # a context prompt lookup finds matches in


@pytest.fixture(scope="module", params=KINDS)
def engine(request: pytest.FixtureRequest, tiny_model_factory: Callable[..., Path],
           tmp_path_factory: pytest.TempPathFactory) -> Engine:
    kind = request.param
    target = tiny_model_factory(arch="qwen3", weight_type="Q8_0", seed=3, context_length=512)
    cfg: dict[str, Any] = {"target": str(target), "n_ctx": 512, "slots": 4, "fetch": False,
                           "device": "cpu", "spec_type": kind}
    model = tiny_model_factory(arch="qwen3", weight_type="Q8_0", seed=3, perturb=0.01,
                               context_length=512)
    heads = tmp_path_factory.mktemp("heads")
    if kind in ("draft", "draft+ngram"):
        cfg["draft"] = str(model)
    elif kind.startswith("draft-"):
        head_kind = kind.removeprefix("draft-")
        cfg["draft"] = str(write_tiny_head(heads / f"{head_kind}.gguf", kind=head_kind,
                                           seed=5))
    elif kind == "head+draft":
        cfg["draft"] = str(write_tiny_head(heads / "dflash.gguf", seed=5))
        cfg["also_draft"] = str(model)
    return Engine(EngineConfig(**cfg))


def _params(**kw: Any) -> GenerationParams:
    return GenerationParams(**{"max_tokens": 48, "ignore_eos": True, "adaptive": False,
                               "draft": DraftParams(n_max=3), **kw})


# greedy; seeded sampling, coupled and by rejection sampling; greedy again, each with its
# own prompt
STREAMS = [
    ([348, *REPEATED], _params()),
    ([348, *range(80, 100), *range(80, 90)],
     _params(sampling=SamplerParams(temperature=0.8, seed=7))),
    ([348, 5, *REPEATED[3:]],
     _params(sampling=SamplerParams(temperature=0.8, seed=11), coupled=False)),
    ([348, 7, 9, 11, *range(40, 60)], _params()),
]


def _gens(engine: Engine, streams: Sequence[tuple[list[int], GenerationParams]]
          ) -> list[Generation]:
    return [engine.start(i, prompt, params) for i, (prompt, params) in enumerate(streams)]


def _step_all(engine: Engine, gens: list[Generation], planner: BatchDraftPlanner | None = None
              ) -> list[list[int]]:
    """Every generation to its end, all of them in each step; their outputs."""
    one_round = BatchRound(engine.target.runner, planner)
    out: list[list[int]] = [[] for _ in gens]
    while not all(g.done for g in gens):
        under_way = [i for i, g in enumerate(gens) if not g.done]
        report = one_round.step([gens[i] for i in under_way])
        for i, result in zip(under_way, report.results, strict=True):
            assert not isinstance(result, Exception), result
            out[i] += result
    for g in gens:
        g.close()
    return out


def _source_passes(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The sizes of the model sources' passes, as they run."""
    sizes: list[int] = []
    assert engine.drafter is not None
    for source in engine.drafter.model_sources:
        runner = getattr(source, "runner", None)
        if runner is None:
            continue
        real = runner.forward_batch

        def spy(calls: Any, real: Any = real) -> Any:
            sizes.append(len(calls))
            return real(calls)

        monkeypatch.setattr(runner, "forward_batch", spy)
    return sizes


def _check_drafting(engine: Engine, gens: Sequence[Generation]) -> None:
    """Each sequence drafted, and a draft model's drafts were accepted (a random head's
    rarely are); prompt lookup alone drafts where the context repeats, in some of them."""
    assert engine.drafter is not None
    if not engine.drafter.runs_model:
        assert sum(g.stats.drafted for g in gens) > 0
        return
    for g in gens:
        if engine.spec_type in ("draft", "draft+ngram"):
            assert_speculated(g.stats)
        else:
            assert_drafted(g.stats)


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_a_batch_equals_its_sequences_solo_runs(engine: Engine, k: int,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    streams = STREAMS[:k]
    want = [decode_all(engine.start(0, prompt, params)) for prompt, params in streams]
    sizes = _source_passes(engine, monkeypatch)
    gens = _gens(engine, streams)
    assert _step_all(engine, gens) == want
    _check_drafting(engine, gens)
    assert engine.drafter is not None
    if engine.drafter.runs_model:
        # the batch's drafts in the source's passes together (a draft model's steps, a
        # head's blocks), not a pass per sequence
        assert sizes and max(sizes) == k


def test_the_step_planner_keeps_greedy_and_seeded_output(engine: Engine) -> None:
    """Under the step's planner (its own draft lengths, its probes) every greedy and
    seeded stream still emits its solo run's tokens."""
    streams = [s for s in STREAMS if s[1].coupled is not False]
    want = [decode_all(engine.start(0, prompt, params)) for prompt, params in streams]
    assert _step_all(engine, _gens(engine, streams), BatchDraftPlanner(explore_every=2)) == want


@pytest.fixture
def drafter_errors_logged(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv(RAISE_DRAFTER_ERRORS, raising=False)
    yield


def _breaks_for(engine: Engine, monkeypatch: pytest.MonkeyPatch, seq: int) -> None:
    """The first model source raises whenever a batch holds sequence `seq`."""
    assert engine.drafter is not None
    source = engine.drafter.model_sources[0]
    real = source.propose

    def propose(requests: Sequence[DraftRequest],
                on_pass: PassObserver | None = None) -> list[Proposal]:
        if any(r.seq == seq for r in requests):
            raise RuntimeError("the draft broke")
        return real(requests, on_pass)

    monkeypatch.setattr(source, "propose", propose)


def test_a_failing_draft_drops_only_its_sequences_drafter(
        engine: Engine, drafter_errors_logged: None, monkeypatch: pytest.MonkeyPatch) -> None:
    assert engine.drafter is not None
    if not engine.drafter.runs_model:
        pytest.skip("prompt lookup proposes no model draft")
    streams = STREAMS[:3]
    want = [decode_all(engine.start(0, prompt, params)) for prompt, params in streams]
    _breaks_for(engine, monkeypatch, seq=1)
    gens = _gens(engine, streams)
    assert _step_all(engine, gens) == want  # all finish, each with its own output
    assert gens[1].drafter is None and sum(gens[1].stats.drafter_failures.values()) == 1
    for g in (gens[0], gens[2]):
        assert g.drafter is not None and not g.stats.drafter_failures
    _check_drafting(engine, [gens[0], gens[2]])


def test_with_raising_on_a_failing_draft_fails_only_its_sequence(
        engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    assert engine.drafter is not None
    if not engine.drafter.runs_model:
        pytest.skip("prompt lookup proposes no model draft")
    _breaks_for(engine, monkeypatch, seq=1)
    gens = _gens(engine, STREAMS[:3])
    one_round = BatchRound(engine.target.runner)
    failed: list[Exception] = []
    while not all(g.done for g in gens):
        under_way = [g for g in gens if not g.done]
        for g, result in zip(under_way, one_round.step(under_way).results, strict=True):
            if isinstance(result, Exception):
                failed.append(result)
                g.finish("error")
    assert [str(e) for e in failed] == ["the draft broke"]
    assert [g.finish_reason for g in gens] == ["length", "error", "length"]
    for g in gens:
        g.close()


def test_a_failing_target_call_fails_only_its_sequence(
        engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """The step's target pass fails for one sequence's round: each call runs alone, that
    sequence gets the error, the others go on as they would have."""
    streams = STREAMS[:3]
    want = [decode_all(engine.start(0, prompt, params)) for prompt, params in streams[1:]]
    runner = engine.target.runner
    real = runner.forward_batch

    def forward(calls: Any) -> Any:
        if any(c.seq == 0 and c.rows is not None for c in calls):
            raise RuntimeError("the pass broke")
        return real(calls)

    monkeypatch.setattr(runner, "forward_batch", forward)
    gens = _gens(engine, streams)
    one_round = BatchRound(runner)
    out: list[list[int]] = [[] for _ in gens]
    errors: list[tuple[int, str]] = []
    while not all(g.done for g in gens):
        under_way = [i for i, g in enumerate(gens) if not g.done]
        report = one_round.step([gens[i] for i in under_way])
        for i, result in zip(under_way, report.results, strict=True):
            if isinstance(result, Exception):
                errors.append((i, str(result)))
                gens[i].finish("error")
            else:
                out[i] += result
    for g in gens:
        g.close()
    assert errors == [(0, "the pass broke")]
    assert out[1:] == want


def test_the_batchs_pace_leaves_out_steps_that_verify_free_offers(
        engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """A free offer's accepted tokens come once: a step that verifies one does not teach
    the planner the pace the batch keeps; every other decoding step does."""
    if engine.spec_type != "ngram":
        pytest.skip("prompt lookup's offers alone")
    planner = BatchDraftPlanner()
    paced: list[int] = []
    real = planner.costs.observe_pace
    monkeypatch.setattr(planner.costs, "observe_pace",
                        lambda active, tokens, seconds: paced.append(tokens)
                        or real(active, tokens, seconds))
    offered: list[bool] = []
    real_forward = engine.target.runner.forward_batch
    gens = _gens(engine, [STREAMS[0], STREAMS[3]])

    def spy(calls: Any) -> Any:
        if all(c.rows is not None for c in calls) and len(calls) == len(
                [g for g in gens if not g.done]):
            offered.append(any(g.verifies_offer for g in gens if not g.done))
        return real_forward(calls)

    monkeypatch.setattr(engine.target.runner, "forward_batch", spy)
    _step_all(engine, gens, planner)
    assert any(offered) and not all(offered)  # both kinds of step ran
    assert len(paced) == offered.count(False)
