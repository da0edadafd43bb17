"""The adaptive draft length controller."""

import pytest

from specd.daemon.spec.drafter import DraftEvidence, Proposal
from specd.daemon.spec.policy import (
    LOOKUP_PRIOR,
    AdaptiveDraftLength,
    FixedDraftLength,
    lookup_prior,
)


def _warm(a: AdaptiveDraftLength, t1: float, slope: float, draft: float) -> None:
    for s in (1, 3, 5, 9):
        a.observe_verify(s, t1 + slope * (s - 1))
    for _ in range(2):  # the first drafting call is a warm-up, not used
        a.observe_draft(4 * draft, [draft] * 3)


def test_starts_by_measuring_then_probes() -> None:
    a = AdaptiveDraftLength(n_max=8)
    assert a.choose(8) == 0
    a.observe_verify(1, 0.07)
    assert a.choose(8) == 2


def test_cheap_draft_and_high_acceptance_draft_long() -> None:
    a = AdaptiveDraftLength(n_max=8)
    _warm(a, 0.07, 0.012, 0.002)  # near-free draft (n-gram like)
    for _ in range(50):
        a.observe_acceptance(8, 8)
    assert a.choose(8) == 8


def test_expensive_draft_and_low_acceptance_stop_drafting() -> None:
    a = AdaptiveDraftLength(n_max=8)
    _warm(a, 0.07, 0.012, 0.035)  # draft costs half a target step
    for _ in range(50):
        a.observe_acceptance(4, 0)
    assert a.choose(8) == 0


def _idle(a: AdaptiveDraftLength, rounds: int, t1: float) -> list[int]:
    """Rounds as Generation runs them: a probe drafts 2, none is accepted."""
    choices = []
    for _ in range(rounds):
        n = a.choose(8)
        choices.append(n)
        if n:
            a.observe_acceptance(n, 0)
            a.observe_verify(n + 1, t1)
            a.observe_round(n, 1, 2 * t1, t1)
        else:
            a.observe_verify(1, t1)
            a.observe_round(0, 1, t1, 0.0)
    return choices


def test_probes_recover_from_zero_within_a_budget() -> None:
    a = AdaptiveDraftLength(n_max=8, probe_every=4, probe_budget=0.1)
    _warm(a, 0.07, 0.012, 0.035)
    for _ in range(50):
        a.observe_acceptance(4, 0)
    for _ in range(100):  # ten seconds of drafting rounds so far: 1 s to probe with
        a.observe_verify(3, 0.07)
        a.observe_round(2, 1, 0.1, 0.03)
    choices = _idle(a, 40, 0.07)
    probes = [i for i, n in enumerate(choices) if n]
    assert probes[0] == 3  # probe_every idle rounds first
    assert all(b - a >= 4 for a, b in zip(probes, probes[1:], strict=False))
    assert set(choices) == {0, 2}
    for _ in range(80):  # acceptance recovers: it drafts again
        a.observe_acceptance(4, 4)
    assert a.choose(8) > 0


def test_probing_stops_when_catching_up_costs_more_than_the_budget() -> None:
    """The prose case: each probe first evaluates every skipped token on the draft; once
    that costs more than the budget allows, target-only steps run undisturbed."""
    a = AdaptiveDraftLength(n_max=8, probe_every=4, probe_budget=0.03)
    _warm(a, 0.075, 0.012, 0.02)
    for _ in range(50):
        a.observe_acceptance(4, 0)
    a.observe_round(0, 1, 0.075, 0.0)
    a.observe_round(0, 1, 0.075, 0.0)
    a.observe_round(2, 1, 0.075 + 0.04 + 2 * 0.005, 0.04 + 2 * 0.005)  # caught up 2
    assert abs(a.catch_up_cost() - 0.005) < 1e-9
    choices = _idle(a, 300, 0.075)
    assert sum(1 for n in choices if n) <= 2
    spent = a._probe_overhead  # the accounting under test
    assert spent <= 0.03 * a._elapsed + 0.2


def test_a_draft_that_ran_its_prompt_teaches_no_catch_up_cost() -> None:
    """A draft model's first draft runs the prompt it left pending: that call's time is
    neither a steady draft's (includes_catch_up) nor a skipped token's catch-up, so
    neither estimate moves; the skipped tokens are caught up all the same."""
    a = AdaptiveDraftLength(n_max=8)
    _warm(a, 0.075, 0.012, 0.02)
    a.observe_round(0, 1, 0.075, 0.0)
    a.observe_round(0, 1, 0.075, 0.0)
    first, before = a.draft_cost(2), a._models[0].catch_up
    a.observe_round(2, 1, 0.075 + 0.5, 0.5, prompt_rows=300)  # caught up 2 and the prompt
    assert a._models[0].catch_up == before and a.draft_cost(2) == first
    assert a._models[0].to_catch_up == 0
    a.observe_round(0, 1, 0.075, 0.0)
    a.observe_round(0, 1, 0.075, 0.0)
    a.observe_round(2, 1, 0.075 + 0.04 + 2 * 0.005, 0.04 + 2 * 0.005)  # caught up 2 only
    assert a._models[0].catch_up is not None and a._models[0].catch_up != before


def test_unlucky_first_rounds_do_not_end_probing() -> None:
    """Two rejections right at the start (code at temperature 0.7 can begin so) leave
    thin evidence: probes go on until position 1 has been tried a few times."""
    a = AdaptiveDraftLength(n_max=4, probe_every=4)
    _warm(a, 0.085, 0.012, 0.025)
    a.observe_acceptance(2, 0)
    a.observe_acceptance(2, 0)
    choices = _idle(a, 40, 0.085)  # no time budget has accrued yet
    assert sum(1 for n in choices if n) >= 3


def test_time_outside_draft_and_verify_counts_against_drafting() -> None:
    """Sampling p and q at temperature > 0 costs drafting rounds a few ms more than plain
    ones; a gain of a few percent on paper must survive it."""
    a = AdaptiveDraftLength(n_max=1)
    _warm(a, 0.085, 0.01, 0.025)
    for _ in range(50):
        a.observe_acceptance(1, 1 if _ % 20 < 11 else 0)  # 0.55 at position 1
    for _ in range(20):
        a.observe_verify(1, 0.085)
        a.observe_round(0, 1, 0.0855, 0.0)
    before = a.rate(1) / a.rate(0)
    v2 = a.verify_cost(2)
    for _ in range(20):  # passes as predicted; 6 ms more outside them than plain rounds
        a.observe_verify(2, v2)
        a.observe_round(1, 2, 0.025 + v2 + 0.0065, 0.025)
    assert before > 1.05 and a.rate(1) / a.rate(0) < before - 0.03


def test_respects_limit() -> None:
    a = AdaptiveDraftLength(n_max=8)
    _warm(a, 0.07, 0.001, 0.0001)
    for _ in range(50):
        a.observe_acceptance(8, 8)
    assert a.choose(3) == 3
    assert a.choose(0) == 0


def test_unexplored_positions_extrapolate_from_the_last_observed() -> None:
    """After short probes that were always accepted, longer drafts are worth trying."""
    a = AdaptiveDraftLength(n_max=8)
    _warm(a, 0.07, 0.004, 0.002)
    for _ in range(30):
        a.observe_acceptance(2, 2)
    assert a.choose(8) == 8


def test_one_slow_pass_does_not_flip_the_choice() -> None:
    """Long-memory estimates: a single 3x outlier (another program on the core) leaves a
    well-established choice alone."""
    a = AdaptiveDraftLength(n_max=8)
    for _ in range(30):
        _warm(a, 0.07, 0.01, 0.02)
        a.observe_acceptance(4, 3)
    before = a.choose(8)
    assert before >= 2
    a.observe_verify(before + 1, 3 * (0.07 + 0.01 * before))
    assert a.choose(8) == before


def test_acceptance_estimate_needs_evidence_to_move_far() -> None:
    a = AdaptiveDraftLength(n_max=4, prior_accept=0.7)
    a.observe_acceptance(1, 0)
    assert 0.4 < a.accept[0] < 0.7  # one miss moves it, but not to 0
    for _ in range(60):
        a.observe_acceptance(1, 1)
    assert a.accept[0] > 0.95
    assert a.accept[1] == a.accept[0]  # never drafted: extrapolated from position 1


def test_acceptance_probabilities_count_in_place_of_outcomes() -> None:
    a = AdaptiveDraftLength(n_max=4, prior_accept=0.7)
    b = AdaptiveDraftLength(n_max=4, prior_accept=0.7)
    for _ in range(40):
        a.observe_acceptance(3, 0, probs=(0.6,))  # rejected at 1, accepted with p 0.6
        b.observe_acceptance(3, 3, probs=(0.6, 0.6, 0.6))
    assert a.accept[0] == pytest.approx(b.accept[0])
    assert 0.58 < a.accept[0] < 0.62
    assert b.accept[2] == pytest.approx(0.6, abs=0.01)
    c = AdaptiveDraftLength(n_max=4, prior_accept=0.7)
    for _ in range(40):
        c.observe_acceptance(3, 1, probs=(0.9,))  # fewer probabilities: outcomes fill in
    assert 0.88 < c.accept[0] < 0.92 and c.accept[1] < 0.1


def test_verify_cost_uses_each_well_observed_size() -> None:
    a = AdaptiveDraftLength(n_max=8)
    for _ in range(5):
        for s, t in ((1, 0.070), (2, 0.072), (3, 0.090), (5, 0.110)):
            a.observe_verify(s, t)
    assert abs(a.verify_cost(2) - 0.072) < 1e-9  # its own mean, not the line's 0.08
    assert 0.09 < a.verify_cost(4) < 0.11  # unobserved: the fitted line


def test_a_fixed_cost_per_drafting_call_favours_longer_drafts() -> None:
    """Measured on the Qwen pair at T 0.7: one proposal costs 25 ms per call (the first
    step also feeds the token the draft has not seen), two cost 35 ms. A mean per step
    (~20 ms) made n = 1 look as good as n = 2; first + later steps does not."""
    a = AdaptiveDraftLength(n_max=8)
    for _ in range(10):
        a.observe_verify(1, 0.076)
        a.observe_verify(2, 0.078)
        a.observe_verify(3, 0.098)
        a.observe_verify(4, 0.112)
        a.observe_draft(0.025)
        a.observe_draft(0.035, [0.010])
        a.observe_draft(0.045, [0.010, 0.010])
    for _ in range(50):
        a.observe_acceptance(3, 3)
        a.observe_acceptance(3, 2)
        a.observe_acceptance(3, 1)
        a.observe_acceptance(3, 3)
    assert a.draft_cost(2) is not None and abs(a.draft_cost(2) - 0.035) < 1e-9
    assert a.rate(2) > 1.05 * a.rate(1)
    assert a.choose(3) >= 2


def test_the_first_drafting_call_is_a_warm_up() -> None:
    a = AdaptiveDraftLength(n_max=4)
    a.observe_draft(0.060, [0.030])  # cold: new shapes, cold caches
    assert a.draft_cost(2) is None
    a.observe_draft(0.035, [0.010])
    assert abs(a.draft_cost(2) - 0.035) < 1e-9


def test_explores_one_longer_draft_when_it_is_nearly_as_good() -> None:
    """A stale estimate at a length no longer chosen gets another look: every 8th
    drafting round tries n + 1 while it is predicted within 5%."""
    a = AdaptiveDraftLength(n_max=4)
    for _ in range(10):
        for s in (1, 2, 3):
            a.observe_verify(s, 0.070 + 0.010 * (s - 1))
        a.observe_draft(0.020, [0.018])
    for _ in range(40):
        a.observe_acceptance(2, 2)
        a.observe_acceptance(2, 2)
        a.observe_acceptance(2, 1)
    n = a.choose(4)
    assert n == 1 and a.rate(2) > 0.95 * a.rate(1)
    choices = [a.choose(4) for _ in range(31)]
    assert choices.count(n + 1) == 4 and set(choices) == {n, n + 1}


def test_a_lookup_offer_is_verified_where_lookups_are_accepted() -> None:
    a = AdaptiveDraftLength(n_max=8)
    _warm(a, 0.07, 0.012, 0.035)  # draft costs half a target step
    for _ in range(50):
        a.observe_acceptance(4, 0)  # the model's drafts fail
        a.observe_acceptance(4, 4, lookup=2)  # the lookups hold
    assert a.choose_source(8, 0, 0) == (0, False)
    assert a.choose_source(8, 5, 2) == (5, True)  # all of the offer
    assert a.choose_source(3, 5, 2) == (3, True)  # no more than the limit


def test_a_lookup_offer_loses_to_a_better_model() -> None:
    a = AdaptiveDraftLength(n_max=8)
    _warm(a, 0.07, 0.012, 0.002)  # a near-free draft model that is always right
    for _ in range(50):
        a.observe_acceptance(8, 8)
        a.observe_acceptance(4, 1, lookup=2)
    n, lookup = a.choose_source(8, 4, 2)
    assert n == 8 and not lookup


def test_the_offer_predicted_fastest_is_picked_each_sources_acceptance_apart() -> None:
    """Two free sources offer at once (prompt lookup, history): the policy weighs the one
    predicted faster at its best length, from each source's own acceptance per match."""
    a = AdaptiveDraftLength(n_max=8)
    lookup = Proposal([1, 2, 3, 4], evidence=DraftEvidence(lookup_match=2))
    history = Proposal([5, 6, 7], evidence=DraftEvidence(lookup_match=4,
                                                         lookup_source="history"))
    assert a.pick_offer([lookup, history]) is lookup  # nothing timed yet: the longest
    assert a.pick_offer([]) is None
    _warm(a, 0.07, 0.012, 0.035)
    for _ in range(50):
        a.observe_acceptance(4, 0, lookup=2)  # prompt lookup's offers fail
        a.observe_acceptance(4, 4, lookup=4, free="history")  # history's hold
    assert a.pick_offer([lookup, history]) is history
    assert a.accept_lookup(4, free="history")[0] > 0.9 and a.accept_lookup(4)[0] == 0.5
    # the same match length of prompt lookup keeps its own evidence
    for _ in range(50):
        a.observe_acceptance(4, 4, lookup=2)
        a.observe_acceptance(3, 0, lookup=4, free="history")
    assert a.pick_offer([history, lookup]) is lookup
    assert a.plan(8, lookup, runs_model=False).take_offer


def test_rejected_lookups_are_not_verified() -> None:
    a = AdaptiveDraftLength(n_max=8)
    _warm(a, 0.07, 0.012, 0.035)
    for _ in range(50):
        a.observe_acceptance(4, 0)
        a.observe_acceptance(4, 0, lookup=2)
    assert a.choose_source(8, 4, 2) == (0, False)
    assert a.accept_lookup(2)[0] < 0.05


def test_lookup_acceptance_is_kept_per_match_length() -> None:
    """Offers continuing a 2-token match fail, those continuing 4 tokens hold: each
    match length is judged on its own record, and an unseen one starts from the prior."""
    a = AdaptiveDraftLength(n_max=4)
    _warm(a, 0.07, 0.012, 0.035)
    for _ in range(50):
        a.observe_acceptance(4, 0)
        a.observe_acceptance(3, 0, lookup=2)
        a.observe_acceptance(3, 3, lookup=4)
    assert a.accept_lookup(2)[0] < 0.05 and a.accept_lookup(4)[0] > 0.95
    assert a.choose_source(4, 3, 2) == (0, False)
    assert a.choose_source(4, 3, 4) == (3, True)
    assert a.accept_lookup(3) == pytest.approx([0.5] * 4)  # the prior: not yet tried
    assert a.choose_source(4, 3, 3)[1]  # worth trying at that prior


def test_without_a_model_an_offer_is_verified_only_where_it_pays() -> None:
    """Prompt lookup alone: a round verifies the offer or takes a plain step; it never
    asks for a model draft (nor probes one)."""
    a = AdaptiveDraftLength(n_max=4)
    assert a.choose_source(4, 3, 2, model=False) == (0, False)  # no timing yet
    for _ in range(10):
        for s in (1, 2, 3, 4):
            a.observe_verify(s, 0.070 + 0.012 * (s - 1))
        a.observe_round(0, 1, 0.07, 0.0)
    assert a.choose_source(4, 0, 0, model=False) == (0, False)
    for _ in range(50):
        a.observe_acceptance(3, 0, lookup=2)  # short matches miss
        a.observe_acceptance(2, 2, lookup=3)
    assert a.choose_source(4, 3, 2, model=False) == (0, False)
    assert a.choose_source(4, 2, 3, model=False) == (2, True)
    assert all(a.choose_source(4, 0, 0, model=False) == (0, False) for _ in range(20))


def test_a_lookup_round_postpones_a_probe() -> None:
    a = AdaptiveDraftLength(n_max=8, probe_every=1)
    _warm(a, 0.07, 0.012, 0.035)
    a.observe_acceptance(4, 0)  # little evidence on the model yet: probes are free to run
    for _ in range(20):
        a.observe_acceptance(4, 4, lookup=2)
    assert a.choose_source(8, 4, 2) == (4, True)  # a probe was due, the offer went first
    a.observe_round(4, 5, 0.09, 0.0, lookup=True)
    assert a.choose_source(8, 0, 0) == (2, False)  # the probe, next time nothing is offered


def test_checked_guesses_correct_a_rarely_drafted_position() -> None:
    a = AdaptiveDraftLength(n_max=8)
    _warm(a, 0.07, 0.012, 0.01)
    for _ in range(50):
        a.observe_acceptance(2, 2)
    for _ in range(5):
        a.observe_acceptance(3, 2)  # a few unlucky tries of a third draft
    assert a.accept[2] < 0.3
    assert a.choose(8) == 2
    for _ in range(40):  # the draft's guesses after fully accepted rounds of 2 were right
        a.observe_position(2, True)
    assert a.accept[2] > 0.9
    assert a.choose(8) > 2
    a.observe_position(1, False, lookup=2)
    assert a.accept_lookup(2)[1] < a.accept_lookup(2)[0] and a.accept[1] > 0.9


def test_a_drafters_catch_up_limit_bounds_what_a_probe_is_predicted_to_cost() -> None:
    """A draft model evaluates at most catch_up_limit skipped tokens before a probe: the
    per-token catch-up cost is measured over those, and the prediction counts only them."""
    costs = []
    for limit in (None, 4):
        a = AdaptiveDraftLength(n_max=8, catch_up_limit=limit)
        _warm(a, 0.075, 0.012, 0.02)
        for _ in range(10):
            a.observe_round(0, 1, 0.075, 0.0)
        own = a.draft_cost(2) or 0.0
        a.observe_round(2, 1, 0.075 + own + 0.02, own + 0.02)  # caught up in 20 ms
        assert abs(a.catch_up_cost() - 0.02 / (10 if limit is None else 4)) < 1e-9
        for _ in range(100):
            a.observe_round(0, 1, 0.075, 0.0)
        costs.append(a.probe_cost() - a.catch_up_cost() * (100 if limit is None else 4))
        assert costs[-1] >= 0.0
    assert abs(costs[0] - costs[1]) < 1e-9  # the rest of a probe is the same


def test_probes_go_on_through_a_long_stretch_when_catch_ups_are_bounded() -> None:
    """A catch-up costs ~4 ms a skipped token: with every skipped token evaluated, a probe
    after a long stretch costs more than the budget ever accrues, so a request that turns
    from prose to code never drafts again; a drafter that evaluates only the latest 16
    keeps probes at a fixed cost, within the budget, however long the stretch."""
    t1, per_token = 0.075, 0.004
    late_probes = {}
    for limit in (None, 16):
        a = AdaptiveDraftLength(n_max=8, probe_every=4, probe_budget=0.03,
                                catch_up_limit=limit)
        _warm(a, t1, 0.012, 0.02)
        for _ in range(50):
            a.observe_acceptance(4, 0)
        probes, skipped = [], 0
        for i in range(3000):
            n = a.choose(8)
            if n:
                probes.append(i)
                caught = skipped if limit is None else min(skipped, limit)
                draft = (a.draft_cost(n) or 0.0) + per_token * caught
                a.observe_acceptance(n, 0)
                a.observe_verify(n + 1, t1 + 0.012 * n)
                a.observe_round(n, 1, draft + t1 + 0.012 * n, draft)
                skipped = 0
            else:
                a.observe_verify(1, t1)
                a.observe_round(0, 1, t1, 0.0)
                skipped += 1
        late_probes[limit] = sum(1 for i in probes if i >= 1500)
        assert a._probe_overhead <= 0.03 * a._elapsed + 0.2
    assert late_probes[None] == 0
    assert late_probes[16] >= 10


def test_a_drafter_that_never_catches_up() -> None:
    """catch_up_limit 0: nothing is evaluated before a probe, so nothing is measured."""
    a = AdaptiveDraftLength(n_max=8, catch_up_limit=0)
    _warm(a, 0.075, 0.012, 0.02)
    for _ in range(5):
        a.observe_round(0, 1, 0.075, 0.0)
    a.observe_round(2, 1, 0.12, 0.04)
    assert a.probe_cost() >= 0.0 and a._models[0].catch_up is None


def test_the_fixed_policy_drafts_n_max_and_takes_any_offer() -> None:
    from specd.daemon.spec.drafter import DraftEvidence, Proposal
    from specd.daemon.spec.policy import FixedDraftLength, RoundPlan

    p = FixedDraftLength(n_max=4, n_min=2)
    offer = Proposal([5, 6, 7], evidence=DraftEvidence(lookup_match=2))
    assert p.plan(8, None, runs_model=True) == RoundPlan(4)
    assert p.plan(3, None, runs_model=True) == RoundPlan(3)  # the room left
    assert p.plan(1, None, runs_model=True) == RoundPlan(0)  # shorter than n_min
    assert p.plan(8, offer, runs_model=True) == RoundPlan(4, take_offer=True)
    assert p.plan(8, Proposal([]), runs_model=True) == RoundPlan(4)  # no offer: the model
    assert p.plan(8, Proposal([]), runs_model=False) == RoundPlan(0)  # lookup alone


def test_the_adaptive_policy_learns_from_round_records() -> None:
    """A record feeds the same estimates as the observe_* calls it stands for."""
    from specd.daemon.spec.drafter import DraftEvidence
    from specd.daemon.spec.policy import ModelCall, RoundRecord

    by_record, by_calls = AdaptiveDraftLength(n_max=4), AdaptiveDraftLength(n_max=4)
    for _ in range(3):
        call = ModelCall(3, 3, 0.02, DraftEvidence(step_seconds=(0.01, 0.005, 0.005),
                                                   guess_checks=((0, True),)))
        by_record.observe(RoundRecord(n_drafted=3, n_accepted=2, emitted=[1, 2, 3],
                                      seconds=0.2, verify_seconds=0.1, model_call=call,
                                      accept_probs=(0.9, 0.8, 0.3)))
        by_calls.observe_draft(0.02, (0.005, 0.005))
        by_calls.observe_position(0, True)
        by_calls.observe_verify(4, 0.1)
        by_calls.observe_acceptance(3, 2, 0, (0.9, 0.8, 0.3))
        by_calls.observe_round(3, 3, 0.2, 0.02, False)
    assert by_record.accept == by_calls.accept
    assert by_record.draft_cost(3) == by_calls.draft_cost(3)
    assert by_record.rate(2) == by_calls.rate(2)


def test_a_one_pass_drafters_cost_is_a_line_in_the_block_length() -> None:
    """A head's block costs a + b*n, not a step per token: measured at n = 4 and n = 8,
    n = 6 is priced between them, where per-step pricing would make it flat (the later
    steps cost nothing) or a multiple of the first."""
    a = AdaptiveDraftLength(n_max=8, one_pass=True)
    b = AdaptiveDraftLength(n_max=8)
    for n, seconds in [(4, 0.010)] * 4 + [(8, 0.014)] * 4:
        a.observe_draft(seconds, (), n)
        b.observe_draft(seconds, (), n)
    cost = a.draft_cost(6)
    assert cost is not None and 0.0115 < cost < 0.0125
    assert a.draft_cost(8) > a.draft_cost(4)  # type: ignore[operator]
    assert b.draft_cost(8) == pytest.approx(8 * b.draft_cost(1))  # type: ignore[operator]


# -- several model sources (a head and a draft model) -------------------------------------
def _two_sources() -> AdaptiveDraftLength:
    from specd.daemon.spec.policy import SourceTraits

    return AdaptiveDraftLength(n_max=8, sources=(SourceTraits(one_pass=True, catch_up_limit=0),
                                                 SourceTraits(catch_up_limit=16)))


def _simulate(a: AdaptiveDraftLength, rounds: int, accept: tuple[float, float],
              cost: tuple[float, float], t1: float = 0.03) -> list[tuple[int, int]]:
    """Rounds as Generation runs them: source s accepts each draft position with
    probability accept[s] (as its expected count) and its call costs cost[s] per token
    (a one-pass source: per block); (n, source) per round."""
    chosen = []
    for _ in range(rounds):
        n, s = a.choose_model(8)
        chosen.append((n, s))
        if n == 0:
            a.observe_verify(1, t1)
            a.observe_round(0, 1, t1, 0.0)
            continue
        draft = cost[s] * (1 if s == 0 else n)
        accepted = 0
        run = 1.0
        for _ in range(n):
            run *= accept[s]
            if run < 0.5:
                break
            accepted += 1
        a.observe_draft(draft, () if s == 0 else (cost[s],) * (n - 1), n, s)
        a.observe_verify(n + 1, t1 * (1 + 0.1 * n))
        a.observe_acceptance(n, accepted, source=s)
        a.observe_round(n, accepted + 1, draft + t1 * (1 + 0.1 * n), draft, source=s)
    return chosen


def test_each_source_is_measured_before_either_is_chosen() -> None:
    a = _two_sources()
    assert a.choose_model(8) == (0, 0)  # a plain step first
    a.observe_verify(1, 0.03)
    assert a.choose_model(8) == (2, 0)  # then probes of each source for its costs
    a.observe_draft(0.004, (), 2, 0)
    a.observe_draft(0.004, (), 2, 0)
    assert a.choose_model(8) == (2, 1)


def test_the_source_predicted_faster_drafts_and_acceptance_is_kept_apart() -> None:
    """An accurate but costly draft model against a cheap but weaker head: the model wins
    while its acceptance is high; each source's acceptance is its own."""
    a = _two_sources()
    chosen = _simulate(a, 300, accept=(0.5, 0.95), cost=(0.002, 0.004))
    late = [s for n, s in chosen[-100:] if n]
    assert late.count(1) > 0.9 * len(late)
    assert a.accept_of(1)[1] > 0.9 and a.accept_of(0)[1] < 0.3


def test_a_source_found_slower_is_probed_again_and_taken_when_it_gets_better() -> None:
    a = _two_sources()
    _simulate(a, 300, accept=(0.5, 0.95), cost=(0.002, 0.004))
    # the text changes: the head now accepts as well as the model, at half its cost
    chosen = _simulate(a, 400, accept=(0.95, 0.95), cost=(0.002, 0.004))
    late = [s for n, s in chosen[-100:] if n]
    assert late.count(0) > 0.8 * len(late)


def test_the_unused_source_counts_the_tokens_it_must_catch_up_on() -> None:
    a = _two_sources()
    a.observe_verify(1, 0.03)
    a.observe_round(3, 4, 0.05, 0.004, source=0)  # the head drafted: the model skipped 4
    assert (a._models[0].skipped, a._models[1].skipped) == (0, 4)
    assert a._models[1].to_catch_up == 4 and a._models[0].to_catch_up == 0
    a.observe_round(2, 3, 0.05, 0.01, source=1)
    assert (a._models[0].skipped, a._models[1].skipped) == (3, 0)


def test_a_source_clearly_slower_is_not_probed_on_thin_evidence_alone() -> None:
    """Once measured far slower (a weak head beside an accurate draft model), the source
    is probed within the budget, not every few rounds while its evidence is thin."""
    a = _two_sources()
    chosen = _simulate(a, 40, accept=(0.3, 0.95), cost=(0.002, 0.004))
    head_rounds = sum(1 for n, s in chosen[5:] if n and s == 0)
    assert head_rounds <= 2, chosen  # every 4 rounds until 8 trials: 7


# -- estimates carried from one request to the next -----------------------------------------
def test_a_carried_policy_drafts_from_the_faster_source_at_its_first_round() -> None:
    """A fresh request measures a plain step and probes each source before choosing; one
    started from an earlier request's estimates drafts from the source found faster at
    once, with the earlier costs."""
    earlier = _two_sources()
    _simulate(earlier, 300, accept=(0.5, 0.95), cost=(0.002, 0.004))
    fresh, carried = _two_sources(), _two_sources()
    assert fresh.choose_model(8) == (0, 0)
    assert carried.carry_from(earlier)
    n, s = carried.choose_model(8)
    assert n >= 2 and s == 1
    assert carried.draft_cost(3, 1) == pytest.approx(earlier.draft_cost(3, 1))
    assert carried.verify_cost(4) == pytest.approx(earlier.verify_cost(4))


def test_carried_acceptance_counts_as_a_few_observations() -> None:
    from specd.daemon.spec.policy import CARRIED_WEIGHT

    earlier = _two_sources()
    _simulate(earlier, 300, accept=(0.5, 0.95), cost=(0.002, 0.004))
    carried = _two_sources()
    carried.carry_from(earlier)
    # the earlier hit rate, nearer the prior for the fewer observations
    acc = carried._models[1].acceptance
    assert acc.hits[0] / acc.trials[0] == pytest.approx(
        earlier._models[1].acceptance.hits[0] / earlier._models[1].acceptance.trials[0])
    assert acc.trials[0] == pytest.approx(CARRIED_WEIGHT)
    assert 0.85 < carried.accept_of(1)[0] < earlier.accept_of(1)[0]
    for _ in range(8):  # this request's text: the model's drafts are all rejected
        carried.observe_acceptance(4, 0, source=1)
    assert carried.accept_of(1)[0] < 0.4 < 0.9 < earlier.accept_of(1)[0]


def test_nothing_is_carried_from_a_policy_of_other_sources() -> None:
    from specd.daemon.spec.policy import FixedDraftLength

    earlier = AdaptiveDraftLength(n_max=8)  # one source
    _warm(earlier, 0.07, 0.012, 0.002)
    two = _two_sources()
    assert not two.carry_from(earlier)
    assert not two.carry_from(FixedDraftLength(8))
    assert two.choose_model(8) == (0, 0) and two.verify_cost(1) is None
    assert not FixedDraftLength(8).carry_from(earlier)


def test_policy_memory_starts_each_request_from_the_last_one_kept() -> None:
    from specd.daemon.spec.policy import PolicyMemory

    memory = PolicyMemory()
    first = _two_sources()
    assert not memory.start("head+draft", first)  # nothing kept yet
    _simulate(first, 300, accept=(0.5, 0.95), cost=(0.002, 0.004))
    memory.keep("head+draft", first)
    second, other = _two_sources(), _two_sources()
    assert memory.start("head+draft", second)
    assert not memory.start("draft", other)  # another drafter's estimates are its own
    assert second.choose_model(8)[1] == 1 and other.choose_model(8) == (0, 0)


def test_carried_costs_keep_each_pass_size_own_mean() -> None:
    """Verify costs step with the pass size (2 rows cost about 1, 3 much more): a carried
    line keeps each size's mean, not only the fitted line through them."""
    a = AdaptiveDraftLength(n_max=8)
    for _ in range(20):
        for size, seconds in ((1, 0.030), (2, 0.031), (3, 0.045), (5, 0.050)):
            a.observe_verify(size, seconds)
    b = AdaptiveDraftLength(n_max=8)
    assert b.carry_from(a)
    for size in (1, 2, 3, 5):
        assert b.verify_cost(size) == pytest.approx(a.verify_cost(size))
    b.observe_verify(2, 0.040)  # the new request's own passes soon count
    assert b.verify_cost(2) > 0.032  # type: ignore[operator]


def test_a_free_offer_may_verify_more_than_n_max() -> None:
    """Offers cost nothing to make: the adaptive policy weighs them up to free_max (the
    model drafts at most n_max), so a long history match that holds is verified whole;
    a fixed policy drafts n_max from either."""
    a = AdaptiveDraftLength(n_max=8, free_max=32)
    assert a.offer_limit == 32 and FixedDraftLength(8).offer_limit == 8
    assert AdaptiveDraftLength(n_max=8).offer_limit == 8  # no free_max: n_max
    _warm(a, 0.07, 0.002, 0.035)
    for _ in range(40):
        a.observe_acceptance(32, 32, lookup=32, free="history")
    n, take = a.choose_source(64, 32, 32, free="history")
    assert take and n > 8, n
    assert len(a.accept_lookup(32, free="history")) == 32


def test_a_source_thin_on_evidence_is_tried_where_its_offer_is_the_longest() -> None:
    """History's offer, never verified at its match length, is picked over prompt
    lookup's learned one of the same length (else its acceptance is never learned);
    a shorter one is weighed by its predicted rate."""
    a = AdaptiveDraftLength(n_max=8, free_max=16)
    _warm(a, 0.07, 0.012, 0.035)
    for _ in range(30):
        a.observe_acceptance(8, 8, lookup=3)  # prompt lookup's offers hold
    lookup = Proposal(list(range(8)), evidence=DraftEvidence(lookup_match=3))
    history = Proposal(list(range(8)), evidence=DraftEvidence(lookup_match=16,
                                                              lookup_source="history"))
    short = Proposal(list(range(4)), evidence=DraftEvidence(lookup_match=16,
                                                            lookup_source="history"))
    assert a.pick_offer([lookup, history]) is history
    assert a.pick_offer([lookup, short]) is lookup
    for _ in range(30):
        a.observe_acceptance(8, 0, lookup=16, free="history")  # learned: it fails
    assert a.pick_offer([lookup, history]) is lookup


def test_a_longer_match_is_assumed_likelier_to_go_on() -> None:
    """Before any offer was verified, prompt lookup's matches (up to 4 tokens) start at
    LOOKUP_PRIOR; a longer match (history's) starts higher."""
    a = AdaptiveDraftLength(n_max=8)
    assert a.accept_lookup(2)[0] == a.accept_lookup(4)[0] == LOOKUP_PRIOR
    assert a.accept_lookup(8, free="history")[0] == pytest.approx(0.75)
    assert a.accept_lookup(32, free="history")[0] == pytest.approx(0.9375)
    assert lookup_prior(16) > lookup_prior(8) > lookup_prior(4)
