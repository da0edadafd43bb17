"""The adaptive policy prices a mixture-of-experts target's verify pass by the experts its
rows wake, counted per pass by the target (tiny qwen3moe files on specd's kernels).

The experts each pass wakes are the real router's choices; the seconds each pass is
charged are a fixed price per woken expert (BASE + PER_EXPERT * experts), so that what the
policy does with the count is checked without asserting on this machine's timings."""

from __future__ import annotations

from pathlib import Path

import pytest

from specd.daemon.drafters.ngram import NgramDrafter
from specd.daemon.models.building import build_options
from specd.daemon.spec.batch_policy import StepCosts
from specd.daemon.spec.drafter import DraftParams
from specd.daemon.spec.generation import Generation, GenerationParams
from specd.daemon.spec.policy import AdaptiveDraftLength
from specd.ort_models import native_ops
from specd.ort_models.graph_builder import BuildOptions
from specd.ort_models.model_cache import load_or_build
from specd.ort_models.runner import Call, ModelRunner

from tiny_moe import write_tiny_qwen3moe

pytestmark = pytest.mark.skipif(native_ops.library() is None,
                                reason=f"no specd kernels: {native_ops.unavailable_reason()}")

PROMPT = [5, 17, 42, 100, 7, 3, 99, 12, 250, 31, 64, 128]
# three passes of each size 1..9 (a size's own mean is used from three observations)
BLOCKS = [[77, 78, 79, 80, 81, 82, 83, 84, 85], [9, 140, 33, 201, 56, 11, 2, 180, 70],
          [240, 6, 61, 130, 19, 222, 88, 45, 170]]
N_LAYER, TOP_K = 3, 2
BASE, PER_EXPERT = 0.02, 0.004  # seconds a pass is charged: fixed, and per woken expert


def _target(tmp_path: Path, n_expert: int) -> ModelRunner:
    """A tiny qwen3moe target of `n_expert` experts, top 2 (n_expert 2: every row wakes
    both, the rows always agree)."""
    path = write_tiny_qwen3moe(tmp_path / f"e{n_expert}.gguf", expert_type="F32", seed=1,
                               n_layer=N_LAYER, n_expert=n_expert, n_used=TOP_K)
    return ModelRunner(load_or_build(path, BuildOptions(kernels="gguf", attention="native")),
                       n_ctx=256)


def _measured_policy(runner: ModelRunner) -> AdaptiveDraftLength:
    """A policy that saw the target's passes of 1..9 rows after a prompt, each charged by
    the experts it woke, drafts from a cheap model accepted 80% a position."""
    a = AdaptiveDraftLength(n_max=8)
    runner.prefill(0, PROMPT)
    for block in BLOCKS:
        for s in range(1, len(block) + 1):
            out = runner.forward_batch([Call(0, block[:s], len(PROMPT))])[0]
            a.observe_verify(s, BASE + PER_EXPERT * out.experts_woken, out.experts_woken)
    for _ in range(2):  # the first drafting call is a warm-up, not used
        a.observe_draft(0.004, [0.001] * 3)
    for _ in range(60):
        for i in range(1, 9):
            a.observe_position(i, 0.8)
    return a


def test_the_predicted_verify_cost_grows_with_the_experts_the_rows_wake(tmp_path: Path
                                                                         ) -> None:
    diverse = _measured_policy(_target(tmp_path, 16))
    agreeing = _measured_policy(_target(tmp_path, 2))
    woken = [diverse.experts_woken(s) or 0.0 for s in range(1, 10)]
    assert all(b > a for a, b in zip(woken, woken[1:], strict=False)), woken
    costs = [diverse.verify_cost(s) or 0.0 for s in range(1, 10)]
    assert all(b > a for a, b in zip(costs, costs[1:], strict=False)), costs
    # each size is priced at the experts it is predicted to wake
    for s, (w, c) in enumerate(zip(woken, costs, strict=True), start=1):
        assert c == pytest.approx(BASE + PER_EXPERT * round(w), rel=1e-6), s
    # two experts, both always woken: every pass costs one step's
    assert agreeing.experts_woken(9) == pytest.approx(N_LAYER * TOP_K)
    assert agreeing.verify_cost(9) == pytest.approx(agreeing.verify_cost(1) or 0.0)
    assert (diverse.verify_cost(9) or 0.0) > (agreeing.verify_cost(9) or 0.0)


def test_rows_that_wake_many_experts_draft_shorter(tmp_path: Path) -> None:
    diverse = _measured_policy(_target(tmp_path, 16)).choose(8)
    agreeing = _measured_policy(_target(tmp_path, 2)).choose(8)
    assert 0 < diverse < agreeing, (diverse, agreeing)


def test_a_moe_target_reports_its_experts_to_the_policy_and_stays_lossless(
        tmp_path: Path) -> None:
    """Prompt lookup on a tiny MoE target, the policy fed each pass's experts: greedy
    output byte-identical to the target alone, with drafts verified and accepted."""
    path = write_tiny_qwen3moe(tmp_path / "t.gguf", seed=3, spread=0.1)
    target = load_or_build(path, build_options("target"))

    def decode(drafter: NgramDrafter | None, adaptive: bool = False
               ) -> tuple[list[int], Generation]:
        gen = Generation(ModelRunner(target, n_ctx=256), 0, PROMPT, GenerationParams(
            max_tokens=120, ignore_eos=True, adaptive=adaptive,
            draft=DraftParams(n_max=4, probabilistic=False)), eog=set(), drafter=drafter)
        out = gen.prefill()
        while not gen.done:
            out += gen.step()
        return out, gen

    want, _ = decode(None)
    got, gen = decode(NgramDrafter())  # every round drafts what the lookup offers
    assert got == want
    assert gen.stats.drafted > 0 and gen.stats.accepted > 0, gen.stats.as_dict()
    got, gen = decode(NgramDrafter(), adaptive=True)  # drafts as the measured costs say
    assert got == want
    assert isinstance(gen.policy, AdaptiveDraftLength)
    # a single step wakes top_k experts in each of the file's 2 layers
    assert gen.policy.experts_woken(1) == pytest.approx(2 * 2)


def test_the_step_planner_prices_a_packed_pass_by_the_experts_it_wakes(tmp_path: Path
                                                                        ) -> None:
    """Two sequences' calls packed in one pass, each pass charged by the experts it woke
    (the calls' shares summed): the step planner's price of a pass follows the experts
    its rows are predicted to wake, which grow more slowly than the rows (the sequences'
    rows choose some of the same experts)."""
    path = write_tiny_qwen3moe(tmp_path / "p.gguf", expert_type="F32", seed=1,
                               n_layer=N_LAYER, n_expert=16, n_used=TOP_K)
    runner = ModelRunner(load_or_build(path, BuildOptions(kernels="gguf", attention="native")),
                         n_ctx=256, n_seq=2)
    runner.prefill(0, PROMPT)
    runner.prefill(1, PROMPT[::-1])
    costs = StepCosts()
    woken: dict[int, list[float]] = {}
    for block in BLOCKS:
        for s in range(1, 5):
            outs = runner.forward_batch([Call(0, block[:s], len(PROMPT)),
                                         Call(1, block[-s:], len(PROMPT))])
            experts = sum(o.pass_experts_share for o in outs)
            woken.setdefault(2 * s, []).append(experts)
            costs.observe_verify(2 * s, BASE + PER_EXPERT * experts, experts)
    assert costs.experts.verify_cost(2) is not None
    for rows in (2, 4, 6, 8):
        predicted = costs.experts.experts(rows)
        assert predicted is not None
        assert costs.verify_pass(rows) == pytest.approx(BASE + PER_EXPERT * round(predicted))
        # the prediction follows what those passes woke (a line through their means)
        assert min(woken[rows]) - 2 <= predicted <= max(woken[rows]) + 2
    # the rows' experts grow more slowly than the rows
    assert (costs.experts.experts(8) or 0.0) < 4 * (costs.experts.experts(2) or 0.0)
