"""The adaptive draft length controller."""

from specd.daemon.adaptive import AdaptiveDraftLength


def _warm(a: AdaptiveDraftLength, t1: float, slope: float, draft: float) -> None:
    for s in (1, 3, 5, 9):
        a.observe_verify(s, t1 + slope * (s - 1))
    a.observe_draft(4, 4 * draft)


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


def test_probe_recovers_from_zero() -> None:
    a = AdaptiveDraftLength(n_max=8, probe_every=4)
    _warm(a, 0.07, 0.012, 0.035)
    for _ in range(50):
        a.observe_acceptance(4, 0)
    choices = [a.choose(8) for _ in range(4 + 8 + 16)]
    probes = [i for i, n in enumerate(choices) if n]
    assert probes == [3, 3 + 8, 3 + 8 + 16]  # gaps double while probes do not pay
    assert set(choices) == {0, 2}
    for _ in range(80):  # acceptance recovers: it drafts again, and probing resets
        a.observe_acceptance(4, 4)
    assert a.choose(8) > 0


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


def test_verify_cost_uses_each_well_observed_size() -> None:
    a = AdaptiveDraftLength(n_max=8)
    for _ in range(5):
        for s, t in ((1, 0.070), (2, 0.072), (3, 0.090), (5, 0.110)):
            a.observe_verify(s, t)
    assert abs(a.verify_cost(2) - 0.072) < 1e-9  # its own mean, not the line's 0.08
    assert 0.09 < a.verify_cost(4) < 0.11  # unobserved: the fitted line
