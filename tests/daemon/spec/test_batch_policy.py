"""The plan of a step several sequences share: a draft only where it pays at this
concurrency, priced by the step's measured pass costs."""

from __future__ import annotations

import random
from dataclasses import replace

from specd.daemon.spec.batch_policy import BatchDraftPlanner, Outlook, _Choice

DRAFT = object()  # a draft runner
HEAD = object()


def geometric(a: float, n: int) -> list[float]:
    """E(k) for k = 0..n at acceptance a per position."""
    return [sum(a ** i for i in range(k + 1)) for k in range(n + 1)]


def caps(p: BatchDraftPlanner, outlooks: list[Outlook]) -> list[int] | None:
    """The step's planned draft lengths."""
    plans = p.plans(outlooks)
    return None if plans is None else [x.n for x in plans]


def planner(verify_ms: tuple[float, float], draft_ms: tuple[float, float],
            runner: object = DRAFT) -> BatchDraftPlanner:
    """Costs measured as lines: a target pass of r rows verify_ms[0] + verify_ms[1] * r
    ms, a draft pass of k rows draft_ms[0] + draft_ms[1] * k ms."""
    p = BatchDraftPlanner()
    for rows in (2, 4, 8, 16, 24):
        for _ in range(4):
            p.costs.observe_verify(rows, (verify_ms[0] + verify_ms[1] * rows) / 1e3)
    for k in (1, 2, 4, 8):
        for _ in range(4):
            p.costs.observe_draft(runner, k, (draft_ms[0] + draft_ms[1] * k) / 1e3)
    return p


def test_one_sequence_plans_alone() -> None:
    p = planner((30, 1), (10, 1))
    assert caps(p, [Outlook(geometric(0.9, 8), DRAFT)]) is None


def test_no_plan_before_the_draft_runner_is_timed() -> None:
    p = BatchDraftPlanner()
    p.costs.observe_verify(2, 0.03)
    assert caps(p, [Outlook(geometric(0.9, 8), DRAFT)] * 2) is None


def test_drafts_that_pay_are_kept() -> None:
    p = planner((30, 1), (8, 1))
    planned = caps(p, [Outlook(geometric(0.9, 8), DRAFT)] * 2)
    assert planned is not None and all(n is not None and n >= 3 for n in planned)


def test_drafts_that_do_not_pay_at_this_concurrency_are_dropped() -> None:
    """Rows cost much once the pass is wide, and the draft's passes are dear: at eight
    sequences with middling acceptance, plain steps emit more per second."""
    p = planner((30, 6), (12, 3))
    assert caps(p, [Outlook(geometric(0.5, 8), DRAFT)] * 8) == [0] * 8


def test_the_sequence_whose_draft_pays_drafts_and_the_others_do_not() -> None:
    p = planner((30, 3), (4, 0.5))
    good, poor = Outlook(geometric(0.95, 8), DRAFT), Outlook(geometric(0.2, 8), DRAFT)
    planned = caps(p, [poor, good, poor, poor])
    assert planned is not None and planned[1] and planned[0] == planned[2] == planned[3] == 0


def test_a_free_lookup_is_verified_where_a_model_draft_would_not_pay() -> None:
    p = planner((30, 3), (40, 10))
    lookup = Outlook(geometric(0.3, 8), DRAFT, lookup=geometric(0.95, 6))
    plans = p.plans([lookup, Outlook(geometric(0.3, 8), DRAFT)])
    assert plans is not None and plans[0] is not None and plans[1] is not None
    assert plans[0].take_offer and plans[0].n >= 4 and plans[1].n == 0


def test_a_head_pays_once_for_its_block() -> None:
    """The same costs and acceptance: a head's one pass a block beats a chain of passes."""
    block = planner((30, 2), (5, 0.5), runner=HEAD)
    steps = planner((30, 2), (5, 0.5))
    rate = block.plan([Outlook(geometric(0.7, 8), HEAD, one_pass=True)] * 4)[1]
    assert rate > steps.plan(
        [Outlook(geometric(0.7, 8), DRAFT)] * 4)[1]


def test_plain_steps_still_probe_a_sequence_now_and_then() -> None:
    """While nothing is drafted, a sequence that can draft probes two tokens every
    explore_every steps, each in turn (a plain row, here the first, never)."""
    p = planner((30, 6), (4, 0.5))
    outlooks = [Outlook([1.0], None), *[Outlook(geometric(0.5, 8), DRAFT)] * 2]
    planned = [caps(p, outlooks) for _ in range(2 * p.explore_every)]
    probes = [(i, plan) for i, plan in enumerate(planned) if plan != [0, 0, 0]]
    assert probes == [(p.explore_every - 1, [0, 0, 2]), (2 * p.explore_every - 1, [0, 2, 0])]


def test_a_probe_that_would_reread_a_long_context_waits() -> None:
    """A sequence whose draft model lags by a long context (its prompt, or many plain
    steps) is not probed while that catch-up costs more than a small share of the plain
    steps between probes: the one that lags little is probed in its place, and with none
    such nothing is."""
    p = planner((30, 6), (4, 0.5))
    lagging = Outlook(geometric(0.5, 8), DRAFT, catch_up=200)
    near = Outlook(geometric(0.5, 8), DRAFT, catch_up=3)
    planned = [caps(p, [lagging, near, lagging]) for _ in range(3 * p.explore_every)]
    probes = [plan for plan in planned if plan != [0, 0, 0]]
    assert probes == [[0, 2, 0]] * 3
    alone = [caps(p, [lagging, lagging]) for _ in range(2 * p.explore_every)]
    assert all(plan == [0, 0] for plan in alone)


def test_a_sequence_that_cannot_draft_is_a_plain_row_of_the_step() -> None:
    """A slot whose drafter was dropped (or whose budget is spent) still shares the step:
    its row is priced, and the others' drafts are planned around it."""
    p = planner((30, 1), (8, 1))
    planned = caps(p, [Outlook([1.0], None), Outlook(geometric(0.9, 8), DRAFT)])
    assert planned is not None and planned[0] == 0
    assert planned[1] is not None and planned[1] >= 3


def test_the_quick_no_draft_answer_is_the_full_searchs() -> None:
    """Where no sequence's draft pays at the plain rate the planner answers at once; over
    random steps, that answer (and every other) is the one the full search gives."""
    rng = random.Random(3)
    quick = 0
    for _ in range(1000):
        p = planner((rng.uniform(20, 80), rng.uniform(0.2, 3)),
                    (rng.uniform(5, 60), rng.uniform(0.1, 4)))
        runner = rng.choice([DRAFT, HEAD])
        most = rng.uniform(0, 0.9)  # the step's best acceptance
        outlooks = [Outlook(geometric(rng.uniform(0, most), rng.randint(1, 8)), runner,
                            one_pass=runner is HEAD,
                            lookup=geometric(rng.uniform(0, most), 4) if rng.random() < 0.2
                            else ())
                    for _ in range(rng.randint(2, 8))]
        got = p.plan(outlooks)
        plain = len(outlooks) / p._verify_cost(len(outlooks))
        quick += not any(p._may_pay(o, 1.0, plain) for o in outlooks)
        p._may_pay = lambda o, w, rate: True  # type: ignore[method-assign]
        assert p.plan(outlooks) == got
    assert 100 < quick < 900  # both kinds of step were drawn


def test_a_catch_up_is_priced_in_the_first_pass() -> None:
    """After plain steps the draft model first evaluates the tokens it skipped: a first
    pass of many rows that a draft of one token must pay for in its step."""
    p = planner((30, 1), (8, 2))
    steady = caps(p, [Outlook(geometric(0.7, 8), DRAFT)] * 2)
    assert steady is not None and all(n >= 1 for n in steady)
    assert caps(p, [Outlook(geometric(0.7, 8), DRAFT, catch_up=16)] * 2) == [0, 0]
    forecast = p.forecast_of([Outlook(geometric(0.7, 8), DRAFT, catch_up=16)] * 2,
                             [_Choice(2), _Choice(2)])
    # passes of 2 + 32 rows, then of 2 rows
    assert abs(forecast.draft_s - (8 + 2 * 34 + 8 + 2 * 2) / 1e3) < 1e-9
    # a catch-up buys the drafts of the steps left: spread over many, it is worth paying
    long_ahead = caps(p, [Outlook(geometric(0.7, 8), DRAFT, catch_up=16, remaining=200)] * 2)
    assert long_ahead is not None and all(n >= 1 for n in long_ahead)


def test_a_long_offer_that_holds_back_the_batchs_end_is_not_verified() -> None:
    """Four sequences could verify 32-token offers their history makes near-certain, in a
    pass of many rows; the other four, as far from done, would wait for that pass and
    emit one token in it. Per second the step emits a little more, but the batch ends
    with the four that gained nothing, later: plain steps."""
    p = planner((70, 12), (12, 3))
    sure = Outlook(geometric(0.1, 8), DRAFT, lookup=geometric(0.999, 32), remaining=128)
    fresh = Outlook(geometric(0.1, 8), DRAFT, remaining=128)
    outlooks = [sure] * 4 + [fresh] * 4
    unaware = [replace(o, remaining=None) for o in outlooks]
    assert caps(p, unaware) == [32] * 4 + [0] * 4  # tokens per second alone would take them
    assert caps(p, outlooks) == [0] * 8


def test_a_long_offer_pays_where_the_others_then_decode_faster() -> None:
    """Two streams: one verifies its history's 32 tokens and is soon done, after which
    the other decodes alone at the pace measured alone, much faster than beside it."""
    p = planner((70, 12), (12, 3))
    for _ in range(8):
        p.costs.observe_pace(1, 3, 0.1)  # alone: 3 tokens a 0.1 s step
        p.costs.observe_pace(2, 2, 0.082)  # two: a token each a plain step
    sure = Outlook(geometric(0.1, 8), DRAFT, lookup=geometric(0.999, 32), remaining=40)
    fresh = Outlook(geometric(0.1, 8), DRAFT, remaining=128)
    assert caps(p, [sure, fresh]) == [32, 0]


def test_the_batchs_end_waits_for_the_last_sequences_only() -> None:
    """Per second, one sequence's sure 32-token offer emits the most; but two sequences
    twice as far from done wait for its pass. Their own drafts bring the end nearer."""
    p = planner((60, 8), (6, 1))
    near = Outlook(geometric(0.1, 8), DRAFT, lookup=geometric(0.999, 32), remaining=100)
    far = Outlook(geometric(0.8, 8), DRAFT, remaining=200)
    assert caps(p, [replace(o, remaining=None) for o in (near, far, far)]) == [32, 0, 0]
    planned = caps(p, [near, far, far])
    assert planned is not None and planned[0] == 0 and planned[1] == planned[2] > 0


def test_time_to_go_follows_the_pace_measured_at_each_concurrency() -> None:
    p = BatchDraftPlanner()
    p.costs.observe_verify(2, 0.05)
    for _ in range(4):
        p.costs.observe_pace(1, 2, 0.04)  # 0.02 s a token alone
        p.costs.observe_pace(2, 2, 0.05)  # 0.05 s a token each, two together
    # both decode together for 10 tokens, then the longer one alone for 20
    assert abs(p.costs.time_to_go([10, 30]) - (10 * 0.05 + 20 * 0.02)) < 1e-9
    assert p.costs.time_to_go([]) == 0.0
