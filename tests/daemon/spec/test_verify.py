"""Tests for specd.daemon.verify: greedy verification and exact rejection sampling.

The statistical tests draw many independent verification rounds with fixed seeds
and compare the empirical distribution of emitted tokens with the target
distribution by a chi-square goodness-of-fit test.  Each correct-rule test must
pass at p-value > 1e-4 and each deliberately broken rule (monkeypatched into the
real code path) must fail it at p-value < 1e-12, so the tests demonstrably have
the power to see the bias they guard against.
"""

from __future__ import annotations

import numpy as np
import pytest

from specd.daemon.spec import verify
from specd.daemon.spec.sampling import Sampler, SamplerParams, softmax
from specd.daemon.spec.verify import (
    SparseDraftProbs,
    VerifyResult,
    residual_distribution,
    verify_greedy,
    verify_rejection,
)

from chi_square import FAIL_P, PASS_P, chi2_pvalue, chi2_sf

# -- helpers -------------------------------------------------------------------


def _rows(logits: np.ndarray, n_draft: int) -> np.ndarray:
    return np.tile(logits, (n_draft + 1, 1))  # [n_draft+1, vocab]


def _one_hot_rows(argmaxes: list[int], vocab: int) -> np.ndarray:
    rows = np.zeros((len(argmaxes), vocab), dtype=np.float32)  # [n_draft+1, vocab]
    rows[np.arange(len(argmaxes)), argmaxes] = 5.0
    return rows


def _first_token_counts(
    logits: np.ndarray,
    q: np.ndarray,
    params: SamplerParams,
    n_trials: int,
    seed: int,
    n_draft: int = 2,
) -> np.ndarray:
    """Histogram of the first emitted token over independent verification rounds.

    Target logits and draft distribution q are the same at every position; the
    penalty is off, so one sampler can serve all rounds.
    """
    vocab = q.shape[0]
    sampler = Sampler(params, seed=seed)
    drafts = np.random.default_rng(seed + 1).choice(vocab, size=(n_trials, n_draft), p=q)
    rows = _rows(logits, n_draft)  # [n_draft+1, vocab]
    qs = np.tile(q, (n_draft, 1))  # [n_draft, vocab]
    counts = np.zeros(vocab, dtype=np.int64)
    for trial in range(n_trials):
        result = verify_rejection(rows, drafts[trial], qs, sampler)
        counts[result.tokens[0]] += 1
    return counts


P_BASE = np.array([0.30, 0.20, 0.15, 0.10, 0.10, 0.08, 0.05, 0.02])
Q_BASE = np.array([0.05, 0.10, 0.30, 0.25, 0.05, 0.10, 0.10, 0.05])


def _pairs() -> dict[str, tuple[np.ndarray, np.ndarray, SamplerParams]]:
    """name -> (target logits [8], draft q [8], target sampler params)."""
    plain = SamplerParams(temperature=1.0)
    with np.errstate(divide="ignore"):
        p_gap = np.log(np.array([0.3, 0.25, 0.2, 0.15, 0.1, 0.0, 0.0, 0.0]))
    filtered_logits = np.array([2.0, 1.6, 1.4, 1.0, 0.3, -0.5, 0.9, -2.0])
    return {
        "overlapping": (np.log(P_BASE), Q_BASE, plain),
        "q_mass_where_p_is_zero": (p_gap, np.array([1, 1, 1, 1, 1, 2, 2, 1]) / 10, plain),
        "p_mass_where_q_is_zero": (np.log(P_BASE), np.array([0, 0, 4, 3, 1, 1, 1, 0]) / 10, plain),
        "filtered_target": (
            filtered_logits,
            softmax(np.array([0.0, 1.0, 2.0, 0.0, 1.5, 1.0, 2.0, 0.5])),
            SamplerParams(temperature=0.7, top_k=6, top_p=0.9, min_p=0.1),
        ),
        "one_hot_draft": (np.log(P_BASE), np.eye(8)[3], plain),
    }


# -- greedy verification ---------------------------------------------------------


def test_greedy_all_accepted_emits_bonus() -> None:
    sampler = Sampler(SamplerParams(temperature=0.0))
    rows = _one_hot_rows([4, 1, 7, 2], vocab=10)
    result = verify_greedy(rows, [4, 1, 7], sampler)
    assert result == VerifyResult(n_accepted=3, tokens=[4, 1, 7, 2], n_drafted=3)
    assert result.all_accepted
    assert sampler.history == [4, 1, 7, 2]


def test_greedy_first_mismatch_emits_the_target_token_and_stops() -> None:
    sampler = Sampler(SamplerParams(temperature=0.0))
    rows = _one_hot_rows([4, 6, 7, 2], vocab=10)
    result = verify_greedy(rows, [4, 1, 7], sampler)
    assert result == VerifyResult(n_accepted=1, tokens=[4, 6], n_drafted=3)
    assert not result.all_accepted
    assert sampler.history == [4, 6]


def test_greedy_mismatch_at_first_position() -> None:
    result = verify_greedy(_one_hot_rows([0, 1], 3), [2], Sampler(SamplerParams(temperature=0)))
    assert result == VerifyResult(n_accepted=0, tokens=[0], n_drafted=1)


def test_greedy_with_no_draft_emits_one_token() -> None:
    sampler = Sampler(SamplerParams(temperature=0.0))
    result = verify_greedy(_one_hot_rows([5], vocab=8), [], sampler)
    assert result == VerifyResult(n_accepted=0, tokens=[5], n_drafted=0)
    assert result.all_accepted


def test_greedy_penalty_history_advances_between_rows() -> None:
    # row 1 prefers token 0 only until the penalty for the accepted token 0 kicks in
    rows = np.array([[3.0, 0.0, 0.0], [3.0, 2.0, 0.0]])
    sampler = Sampler(SamplerParams(temperature=0.0, repeat_penalty=2.0))
    assert verify_greedy(rows, [0], sampler).tokens == [0, 1]


def test_rows_shape_is_checked() -> None:
    sampler = Sampler(SamplerParams(temperature=0.0))
    with pytest.raises(ValueError, match="n_draft"):
        verify_greedy(np.zeros((2, 5)), [1, 2], sampler)
    with pytest.raises(ValueError, match="rows"):
        verify_rejection(np.zeros((3, 5)), [1, 2], np.full((3, 5), 0.2), sampler)


def test_greedy_verification_with_a_stochastic_sampler_samples_the_target() -> None:
    logits = np.log(P_BASE)
    sampler = Sampler(SamplerParams(temperature=1.0), seed=3)
    counts = np.zeros(8, dtype=np.int64)
    for _ in range(10_000):
        counts[verify_greedy(_rows(logits, 1), [0], sampler).tokens[0]] += 1
    assert chi2_pvalue(counts, P_BASE) > PASS_P


# -- rejection sampling: mechanics -------------------------------------------------


def test_rejection_with_greedy_target_emits_the_argmax() -> None:
    sampler = Sampler(SamplerParams(temperature=0.0), seed=0)
    rows = _one_hot_rows([2, 5, 1], vocab=6)
    q = np.full((2, 6), 1 / 6)
    assert verify_rejection(rows, [2, 5], q, sampler).tokens == [2, 5, 1]
    result = verify_rejection(rows, [2, 4], q, sampler)
    assert result == VerifyResult(n_accepted=1, tokens=[2, 5], n_drafted=2)


def test_rejection_with_identical_p_and_q_always_accepts() -> None:
    logits = np.log(P_BASE)
    sampler = Sampler(SamplerParams(temperature=1.0), seed=1)
    q = np.tile(P_BASE, (4, 1))
    for draft in np.random.default_rng(2).choice(8, size=(200, 4), p=P_BASE):
        assert verify_rejection(_rows(logits, 4), draft, q, sampler).n_accepted == 4


def test_rejection_never_accepts_a_token_the_target_excludes() -> None:
    sampler = Sampler(SamplerParams(temperature=1.0, top_k=2), seed=4)
    logits = np.array([3.0, 2.0, 0.0, -1.0])
    for _ in range(200):
        result = verify_rejection(_rows(logits, 1), [3], np.array([[0.0, 0.0, 0.0, 1.0]]), sampler)
        assert result.n_accepted == 0
        assert result.tokens[0] in (0, 1)


def test_rejection_uses_one_uniform_per_accept_test_plus_one_per_draw() -> None:
    logits = np.log(P_BASE)
    sampler = Sampler(SamplerParams(temperature=1.0), seed=9)
    twin = sampler.copy()
    result = verify_rejection(_rows(logits, 3), [0, 1, 2], np.tile(P_BASE, (3, 1)), sampler)
    assert result.n_accepted == 3  # p == q: three accept tests + one bonus draw
    for _ in range(4):
        twin.uniform()
    assert sampler.uniform() == twin.uniform()


def test_rejection_empty_draft_samples_the_bonus() -> None:
    sampler = Sampler(SamplerParams(temperature=1.0), seed=5)
    twin = sampler.copy()
    logits = np.log(P_BASE)
    result = verify_rejection(_rows(logits, 0), [], np.zeros((0, 8)), sampler)
    assert result == VerifyResult(n_accepted=0, tokens=[twin.sample(logits)], n_drafted=0)


def test_sparse_draft_probs_give_the_same_result_as_dense() -> None:
    rng = np.random.default_rng(12)
    logits = rng.normal(size=(4, 50))  # [n_draft+1, vocab]
    ids = np.stack([rng.choice(50, size=5, replace=False) for _ in range(3)])  # [3, 5]
    vals = rng.dirichlet(np.ones(5), size=3)  # [3, 5]
    dense = np.zeros((3, 50))
    np.put_along_axis(dense, ids, vals, axis=1)
    params = SamplerParams(temperature=1.0)
    for trial in range(100):
        draft = [int(row[rng.choice(5, p=v)]) for row, v in zip(ids, vals, strict=True)]
        sparse = SparseDraftProbs(ids, vals)
        a = verify_rejection(logits, draft, dense, Sampler(params, seed=trial))
        b = verify_rejection(logits, draft, sparse, Sampler(params, seed=trial))
        assert a == b


def test_draft_vocab_wider_or_narrower_than_target_is_padded_or_cut() -> None:
    logits = np.log(P_BASE)
    sampler = Sampler(SamplerParams(temperature=1.0), seed=6)
    wide = np.concatenate([P_BASE * 0.9, [0.1]])[None, :]  # [1, 9]: extra padding id 8
    assert verify_rejection(_rows(logits, 1), [8], wide, sampler).n_accepted == 0
    narrow = (P_BASE[:6] / P_BASE[:6].sum())[None, :]  # [1, 6]
    result = verify_rejection(_rows(logits, 1), [0], narrow, sampler)
    assert 0 <= result.tokens[0] < 8


def test_residual_distribution() -> None:
    p = np.array([0.5, 0.3, 0.2, 0.0])
    q = np.array([0.2, 0.4, 0.2, 0.2])
    np.testing.assert_allclose(residual_distribution(p, q), [1.0, 0.0, 0.0, 0.0])
    np.testing.assert_array_equal(residual_distribution(p, p), p)  # all-zero residual -> p


# -- acceptance probabilities ---------------------------------------------------------


def test_accept_probs_cover_the_positions_decided() -> None:
    greedy = Sampler(SamplerParams(temperature=0.0))
    rows = _one_hot_rows([4, 1, 7, 2], vocab=10)
    assert verify_greedy(rows, [4, 1, 7], greedy).accept_probs == (1.0, 1.0, 1.0)
    assert verify_greedy(rows, [4, 3, 7], greedy).accept_probs == (1.0, 0.0)
    q = np.full((3, 10), 0.1)  # [n_draft, vocab]
    r = verify_rejection(rows, [4, 3, 7], q, Sampler(SamplerParams(temperature=0.0), seed=0))
    assert r.accept_probs == pytest.approx((0.1, 0.1))  # min(p, q) sums to q at the argmax


def test_accept_probs_are_the_target_probability_where_the_target_draws() -> None:
    rng = np.random.default_rng(21)
    logits = rng.normal(size=(3, 30))  # [n_draft+1, vocab]
    params = SamplerParams(temperature=0.7, top_k=12)
    r = verify_greedy(logits, [5, 9], Sampler(params, seed=2))
    ref = Sampler(params)
    expected = [ref.probs(logits[i])[d] for i, d in enumerate([5, 9])]
    assert r.accept_probs == pytest.approx(expected[: len(r.accept_probs)])


def test_accept_probs_are_sum_min_p_q_under_rejection_sampling() -> None:
    logits, q, params = _pairs()["filtered_target"]
    p = Sampler(params).probs(logits)
    for seed in range(20):
        r = verify_rejection(_rows(logits, 3), [1, 1, 1], np.tile(q, (3, 1)),
                             Sampler(params, seed=seed))
        assert len(r.accept_probs) == min(3, r.n_accepted + 1)
        assert r.accept_probs == pytest.approx([np.minimum(p, q).sum()] * len(r.accept_probs))


def test_accept_probs_estimate_the_acceptance_rate() -> None:
    """The mean of the probabilities matches the rate of the outcomes drawn from them
    (3 sigma of 20k Bernoulli trials), for each kind of target/draft pair."""
    for name, (logits, q, params) in _pairs().items():
        sampler = Sampler(params, seed=31)
        drafts = np.random.default_rng(32).choice(q.shape[0], size=20_000, p=q)
        hits, alphas = 0, 0.0
        for d in drafts:
            r = verify_rejection(_rows(logits, 1), [int(d)], q[None, :], sampler)
            hits += r.n_accepted
            alphas += r.accept_probs[0]
        n = drafts.shape[0]
        a = alphas / n
        assert abs(hits / n - a) <= 3 * np.sqrt(a * (1 - a) / n), name


# -- rejection sampling: distribution exactness --------------------------------------


@pytest.mark.parametrize("name", list(_pairs()))
def test_rejection_first_token_follows_the_target(name: str) -> None:
    logits, q, params = _pairs()[name]
    p = Sampler(params).probs(logits)
    if name == "filtered_target":
        assert 2 <= np.count_nonzero(p) < 6  # the filters really cut something
    counts = _first_token_counts(logits, q, params, n_trials=20_000, seed=100)
    assert chi2_pvalue(counts, p) > PASS_P


def test_resampling_from_p_instead_of_the_residual_is_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(verify, "residual_distribution", lambda p, q: p)
    logits, q, params = _pairs()["overlapping"]
    counts = _first_token_counts(logits, q, params, n_trials=20_000, seed=100)
    assert chi2_pvalue(counts, P_BASE) < FAIL_P


def test_accepting_with_probability_p_instead_of_p_over_q_is_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(verify, "accepts_draft", lambda u, p_d, q_d: u < p_d)
    logits, q, params = _pairs()["overlapping"]
    counts = _first_token_counts(logits, q, params, n_trials=20_000, seed=100)
    assert chi2_pvalue(counts, P_BASE) < FAIL_P


# -- joint of the first two emitted tokens --------------------------------------------

JOINT_LOGITS = np.array([1.2, 0.8, 0.0, -0.6, 0.4])
JOINT_Q = np.array([[0.1, 0.4, 0.1, 0.3, 0.1], [0.3, 0.1, 0.3, 0.1, 0.2]])  # [2, vocab]


def _first_two_tokens(params: SamplerParams, n_trials: int, seed: int) -> np.ndarray:
    """Joint histogram [vocab, vocab] of the first two tokens of a generation.

    Each trial starts a fresh request: a 2-token block is drafted from JOINT_Q and
    verified; if the block yields only one token a second round is drafted and
    verified, as the engine would.
    """
    vocab = JOINT_LOGITS.shape[0]
    rows = _rows(JOINT_LOGITS, 2)  # [3, vocab]
    draft_rng = np.random.default_rng(seed)
    counts = np.zeros((vocab, vocab), dtype=np.int64)
    for trial in range(n_trials):
        sampler = Sampler(params, seed=seed * 1_000_003 + trial)
        tokens: list[int] = []
        while len(tokens) < 2:
            draft = [int(draft_rng.choice(vocab, p=JOINT_Q[i])) for i in range(2)]
            tokens += verify_rejection(rows, draft, JOINT_Q, sampler).tokens
        counts[tokens[0], tokens[1]] += 1
    return counts


def _expected_joint(params: SamplerParams) -> np.ndarray:
    """P(t0 = a, t1 = b) = p(a | prompt) * p(b | a), p after the request's sampler."""
    p0 = Sampler(params).probs(JOINT_LOGITS)  # [vocab]
    p1 = np.stack([Sampler(params, history=[a]).probs(JOINT_LOGITS) for a in range(5)])
    return p0[:, None] * p1  # [vocab, vocab]


def test_joint_of_first_two_tokens_without_prefix_dependence() -> None:
    params = SamplerParams(temperature=1.0)
    expected = _expected_joint(params)
    np.testing.assert_allclose(expected, np.outer(expected.sum(1), expected.sum(1)))
    counts = _first_two_tokens(params, n_trials=12_000, seed=7)
    assert chi2_pvalue(counts, expected) > PASS_P


def test_joint_of_first_two_tokens_with_repetition_penalty() -> None:
    # the penalty makes p(. | a) depend on a, so the history must advance per token
    params = SamplerParams(temperature=1.0, repeat_penalty=3.0)
    expected = _expected_joint(params)
    counts = _first_two_tokens(params, n_trials=12_000, seed=8)
    assert chi2_pvalue(counts, expected) > PASS_P


def test_joint_of_first_two_tokens_with_logit_bias_and_openai_penalties() -> None:
    # presence and frequency penalties make p(. | a) depend on a; the bias moves p itself
    params = SamplerParams(temperature=1.0, presence_penalty=0.6, frequency_penalty=0.5,
                           logit_bias={1: 0.6, 3: 0.8})
    expected = _expected_joint(params)
    counts = _first_two_tokens(params, n_trials=12_000, seed=9)
    assert chi2_pvalue(counts, expected) > PASS_P
    unbiased = SamplerParams(temperature=1.0, presence_penalty=0.6, frequency_penalty=0.5)
    assert chi2_pvalue(counts, _expected_joint(unbiased)) < FAIL_P


@pytest.mark.parametrize("penalty", ["presence_penalty", "frequency_penalty"])
def test_joint_test_catches_a_penalty_history_that_does_not_advance(
    monkeypatch: pytest.MonkeyPatch, penalty: str
) -> None:
    monkeypatch.setattr(Sampler, "accept", lambda self, token: None)
    params = SamplerParams(temperature=1.0, **{penalty: 1.5})
    counts = _first_two_tokens(params, n_trials=12_000, seed=9)
    assert chi2_pvalue(counts, _expected_joint(params)) < FAIL_P


def test_joint_test_catches_a_history_that_does_not_advance(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(Sampler, "accept", lambda self, token: None)
    params = SamplerParams(temperature=1.0, repeat_penalty=3.0)
    counts = _first_two_tokens(params, n_trials=12_000, seed=8)
    assert chi2_pvalue(counts, _expected_joint(params)) < FAIL_P


@pytest.mark.parametrize(
    ("x", "df", "sf"),
    [
        (3.841459, 1, 0.05),
        (5.991465, 2, 0.05),
        (7.814728, 3, 0.05),
        (11.0705, 5, 0.05),
        (18.30704, 10, 0.05),
        (23.20925, 10, 0.01),
        (42.55697, 29, 0.05),
        (0.0, 4, 1.0),
    ],
)
def test_chi2_sf_matches_tabulated_critical_values(x: float, df: int, sf: float) -> None:
    assert chi2_sf(x, df) == pytest.approx(sf, rel=1e-4)
