"""Tests for specd.daemon.sampling (host-side sampling, pure numpy)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from specd.daemon.spec.sampling import (
    NoAllowedToken,
    Sampler,
    SamplerParams,
    TokenLogprob,
    derive_seeds,
    sample_from_probs,
    softmax,
    token_logprob,
    top_probability,
)

from chi_square import FAIL_P, PASS_P, chi2_pvalue


def _logits_for(probs: list[float]) -> np.ndarray:
    """Logits whose softmax is ``probs`` (zeros become -inf)."""
    p = np.asarray(probs, dtype=np.float64)
    with np.errstate(divide="ignore"):
        return np.log(p)


def _reference_probs(logits: np.ndarray, params: SamplerParams, history: list[int]) -> np.ndarray:
    """Straightforward full-sort implementation of the llama.cpp chain, for comparison."""
    x = np.array(logits, dtype=np.float64)  # [vocab]
    n = params.repeat_last_n
    recent = history if n < 0 else history[-n:] if n > 0 else []
    for t in set(recent):
        x[t] = x[t] / params.repeat_penalty if x[t] > 0 else x[t] * params.repeat_penalty
    if params.temperature == 0:
        out = np.zeros_like(x)
        out[int(np.argmax(x))] = 1.0
        return out
    if not params.temperature_last:
        x = x / params.temperature
    order = np.lexsort((np.arange(x.size), -x))  # descending value, ties by lower id
    keep = np.zeros(x.size, dtype=bool)
    kept = order[: params.top_k] if params.top_k > 0 else order
    keep[kept] = True
    if params.top_p < 1.0:
        p = softmax(np.where(keep, x, -np.inf))
        cum = np.cumsum(p[kept])
        n_keep = next((i + 1 for i, c in enumerate(cum) if c >= params.top_p), kept.size)
        keep[:] = False
        keep[kept[:n_keep]] = True
    if params.min_p > 0.0:
        p = softmax(np.where(keep, x, -np.inf))
        keep &= p >= params.min_p * p.max() * (1 - 1e-12)
    if params.temperature_last:
        x = x / params.temperature
    return softmax(np.where(keep, x, -np.inf))


# -- greedy ---------------------------------------------------------------------


def test_greedy_is_argmax_and_one_hot() -> None:
    logits = np.array([0.1, 2.5, -1.0, 2.4, 0.0], dtype=np.float32)
    s = Sampler(SamplerParams(temperature=0.0, seed=1))
    assert s.is_greedy
    assert s.sample(logits) == 1
    np.testing.assert_array_equal(s.probs(logits), [0, 1, 0, 0, 0])


def test_greedy_ties_go_to_lowest_index() -> None:
    logits = np.array([1.0, 3.0, 0.0, 3.0, 3.0])
    s = Sampler(SamplerParams(temperature=0.0))
    assert s.sample(logits) == 1
    assert s.probs(logits)[1] == 1.0


def test_greedy_draws_nothing_from_the_rng() -> None:
    s = Sampler(SamplerParams(temperature=0.0, seed=7))
    ref = np.random.Generator(np.random.PCG64(7))
    for _ in range(5):
        s.sample(np.random.default_rng(0).normal(size=50))
    assert s.uniform() == ref.random()


def test_greedy_applies_repetition_penalty() -> None:
    s = Sampler(SamplerParams(temperature=0.0, repeat_penalty=2.0), history=[0])
    assert s.sample(np.array([3.0, 2.0, 0.0])) == 1  # 3/2 = 1.5 < 2


# -- filters --------------------------------------------------------------------


def test_top_k_keeps_exactly_k() -> None:
    logits = np.random.default_rng(3).normal(size=1000)
    for k in (1, 5, 40, 999):
        p = Sampler(SamplerParams(temperature=1.0, top_k=k)).probs(logits)
        kept = np.flatnonzero(p)
        assert kept.size == k
        assert set(kept) == set(np.argsort(-logits)[:k])
        np.testing.assert_allclose(p[kept], softmax(logits[kept]), rtol=1e-12)


def test_top_k_ties_at_the_cut_keep_exactly_k_lowest_ids() -> None:
    logits = np.array([0.0, 5.0, 1.0, 1.0, 1.0, 1.0, -2.0])
    p = Sampler(SamplerParams(temperature=1.0, top_k=3)).probs(logits)
    assert list(np.flatnonzero(p)) == [1, 2, 3]


def test_top_k_larger_than_vocab_is_off() -> None:
    logits = np.array([0.0, 1.0, 2.0])
    p = Sampler(SamplerParams(temperature=1.0, top_k=10)).probs(logits)
    np.testing.assert_allclose(p, softmax(logits), rtol=1e-12)


@pytest.mark.parametrize(
    ("top_p", "expected"),
    [(0.3, [0]), (0.5, [0]), (0.75, [0, 1]), (0.81, [0, 1, 2]), (0.96, [0, 1, 2, 3])],
)
def test_top_p_keeps_the_minimal_nucleus(top_p: float, expected: list[int]) -> None:
    # shuffled so that the nucleus is not simply a prefix of the ids
    probs = [0.5, 0.3, 0.15, 0.04, 0.01]
    perm = np.array([3, 0, 4, 1, 2])  # token perm[i] gets probs[i]
    shuffled = np.zeros(5)
    shuffled[perm] = probs
    p = Sampler(SamplerParams(temperature=1.0, top_p=top_p)).probs(_logits_for(shuffled))
    assert set(np.flatnonzero(p)) == set(perm[expected])
    kept_mass = sum(probs[i] for i in expected)
    np.testing.assert_allclose(p[perm[expected]], np.array(probs)[expected] / kept_mass)


def test_top_p_windowed_search_matches_full_sort_on_a_large_flat_vocab() -> None:
    # flat-ish logits: the nucleus needs several thousand tokens, forcing the window to grow
    logits = np.random.default_rng(11).normal(scale=0.3, size=152_064)
    params = SamplerParams(temperature=1.0, top_p=0.9)
    p = Sampler(params).probs(logits)
    ref = _reference_probs(logits, params, [])
    assert np.count_nonzero(p) > 4 * 1024
    np.testing.assert_array_equal(p > 0, ref > 0)
    np.testing.assert_allclose(p, ref, rtol=1e-9, atol=0)


def test_min_p_threshold_is_relative_to_the_max() -> None:
    probs = [0.1, 0.4, 0.2, 0.05, 0.25]
    p = Sampler(SamplerParams(temperature=1.0, min_p=0.3)).probs(_logits_for(probs))
    assert list(np.flatnonzero(p)) == [1, 2, 4]  # p >= 0.3 * 0.4 = 0.12
    np.testing.assert_allclose(p[[1, 2, 4]], np.array([0.4, 0.2, 0.25]) / 0.85)


def test_min_p_one_keeps_only_the_max() -> None:
    p = Sampler(SamplerParams(temperature=1.0, min_p=1.0)).probs(np.array([0.0, 2.0, 1.0]))
    np.testing.assert_array_equal(p, [0.0, 1.0, 0.0])


def test_filters_run_in_llama_cpp_order_top_k_then_top_p_then_min_p() -> None:
    # top-p is computed on the renormalised top-k survivors, not the full vocabulary
    probs = [0.3, 0.25, 0.2, 0.15, 0.1]
    params = SamplerParams(temperature=1.0, top_k=2, top_p=0.6)
    p = Sampler(params).probs(_logits_for(probs))
    assert list(np.flatnonzero(p)) == [0, 1]  # 0.3 / 0.55 = 0.545 < 0.6 -> both kept
    # min-p after top-p: threshold relative to the max survivor
    params = SamplerParams(temperature=1.0, top_p=0.7, min_p=0.8)
    p = Sampler(params).probs(_logits_for(probs))
    assert list(np.flatnonzero(p)) == [0, 1]  # nucleus {0,1,2}, then 0.2 < 0.8 * 0.3


# -- temperature and penalty ------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.25, 0.7, 1.0, 1.8])
def test_temperature_scales_logits(temperature: float) -> None:
    logits = np.random.default_rng(5).normal(size=64) * 3
    p = Sampler(SamplerParams(temperature=temperature)).probs(logits)
    np.testing.assert_allclose(p, softmax(logits / temperature), rtol=1e-12)


def test_temperature_is_applied_after_filters_by_default() -> None:
    probs = [0.5, 0.3, 0.15, 0.05]
    logits = _logits_for(probs)
    # llama.cpp order: top-p on the untempered distribution keeps {0, 1}
    last = Sampler(SamplerParams(temperature=3.0, top_p=0.75)).probs(logits)
    assert list(np.flatnonzero(last)) == [0, 1]
    np.testing.assert_allclose(last[:2], softmax(logits[:2] / 3.0))
    # temperature first flattens the distribution, so the nucleus grows
    first = Sampler(SamplerParams(temperature=3.0, top_p=0.75, temperature_last=False))
    assert np.count_nonzero(first.probs(logits)) == 3


def test_repetition_penalty_llama_cpp_semantics() -> None:
    logits = np.array([2.0, -1.0, 0.5, 3.0, -2.0])
    s = Sampler(SamplerParams(temperature=0.0, repeat_penalty=2.0), history=[0, 1, 0, 0])
    x = s.penalised_logits(logits)
    # positive divided, negative multiplied, repeats do not compound
    np.testing.assert_array_equal(x, [1.0, -2.0, 0.5, 3.0, -2.0])
    np.testing.assert_array_equal(logits, [2.0, -1.0, 0.5, 3.0, -2.0])  # input untouched


def test_repetition_penalty_only_looks_at_the_last_n_tokens() -> None:
    logits = np.array([2.0, 2.0, 2.0, 2.0])
    params = SamplerParams(temperature=1.0, repeat_penalty=2.0, repeat_last_n=2)
    s = Sampler(params, history=[0])
    s.accept(1)
    s.accept(2)
    assert s.history == [1, 2]
    np.testing.assert_array_equal(s.penalised_logits(logits), [2.0, 1.0, 1.0, 2.0])
    off = Sampler(SamplerParams(repeat_penalty=2.0, repeat_last_n=0), history=[0, 1])
    np.testing.assert_array_equal(off.penalised_logits(logits), logits)
    whole = Sampler(SamplerParams(repeat_penalty=2.0, repeat_last_n=-1), history=range(100))
    assert len(whole.history) == 100


def test_repetition_penalty_changes_probs_as_expected() -> None:
    logits = np.array([1.0, 1.0, -1.0])
    s = Sampler(SamplerParams(temperature=1.0, repeat_penalty=1.5), history=[0, 2])
    np.testing.assert_allclose(s.probs(logits), softmax(np.array([1 / 1.5, 1.0, -1.5])))


@pytest.mark.parametrize(
    "params",
    [
        SamplerParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=1.1),
        SamplerParams(temperature=1.3, top_p=0.5, repeat_penalty=1.3, repeat_last_n=3),
        SamplerParams(temperature=0.5, top_k=7, min_p=0.2, temperature_last=False),
        SamplerParams(temperature=1.0, top_k=300, top_p=0.8),
        SamplerParams(temperature=0.0, repeat_penalty=1.5),
    ],
)
def test_probs_match_a_full_sort_reference(params: SamplerParams) -> None:
    rng = np.random.default_rng(21)
    logits = rng.normal(scale=2.5, size=2000).astype(np.float32)
    history = list(rng.integers(0, 2000, size=10)) + list(np.argsort(-logits)[:5])
    p = Sampler(params, history=history).probs(logits)
    ref = _reference_probs(logits, params, history)
    np.testing.assert_array_equal(p > 0, ref > 0)
    np.testing.assert_allclose(p, ref, rtol=1e-9, atol=1e-300)
    assert p.dtype == np.float64
    assert math.isclose(p.sum(), 1.0, rel_tol=1e-12)


@pytest.mark.parametrize(
    "params",
    [
        SamplerParams(temperature=1.0, top_k=37),
        SamplerParams(temperature=1.0, top_k=1500, top_p=0.4),
        SamplerParams(temperature=1.0, top_p=0.3),
        SamplerParams(temperature=2.0, top_p=0.97, min_p=0.3),
    ],
)
def test_heavy_ties_and_masked_logits_match_the_reference(params: SamplerParams) -> None:
    rng = np.random.default_rng(13)
    logits = rng.integers(0, 6, size=20_000).astype(np.float64)  # huge tie groups
    logits[rng.choice(20_000, size=3000, replace=False)] = -np.inf  # masked tokens
    p = Sampler(params).probs(logits)
    ref = _reference_probs(logits, params, [])
    np.testing.assert_array_equal(p > 0, ref > 0)
    np.testing.assert_allclose(p, ref, rtol=1e-9, atol=0)


def test_probs_are_deterministic_for_the_same_logits() -> None:
    logits = np.random.default_rng(8).normal(size=5000)
    s = Sampler(SamplerParams(temperature=0.9, top_k=50, top_p=0.9, min_p=0.01))
    a = s.probs(logits)
    b = s.probs(logits.copy())
    np.testing.assert_array_equal(a, b)


# -- drawing and rng ---------------------------------------------------------------


def test_sample_inverts_the_cdf_of_probs_with_one_uniform() -> None:
    logits = np.random.default_rng(2).normal(size=300)
    s = Sampler(SamplerParams(temperature=0.7, top_k=20, seed=99))
    twin = s.copy()
    for _ in range(50):
        token = s.sample(logits)
        assert token == sample_from_probs(twin.probs(logits), twin.uniform())
        assert s.probs(logits)[token] > 0


@pytest.mark.parametrize(
    "params",
    [
        SamplerParams(temperature=1.0, seed=5),
        SamplerParams(temperature=0.5, top_k=1, seed=5),  # effectively greedy, still one draw
        SamplerParams(temperature=1.2, top_p=0.01, min_p=0.5, seed=5),
    ],
)
def test_exactly_one_rng_draw_per_non_greedy_sample(params: SamplerParams) -> None:
    logits = np.random.default_rng(4).normal(size=100)
    s = Sampler(params)
    ref = np.random.Generator(np.random.PCG64(5))
    for _ in range(7):
        s.sample(logits)
        ref.random()
    assert s.uniform() == ref.random()
    _, dense = s.sample_with_probs(logits)
    ref.random()
    assert s.uniform() == ref.random()
    np.testing.assert_array_equal(dense, s.probs(logits))


def test_seeded_samplers_reproduce_and_different_seeds_differ() -> None:
    logits = np.zeros(1000)
    params = SamplerParams(temperature=1.0, seed=1234)
    s1, s2, s3 = Sampler(params), Sampler(params), Sampler(params, seed=4321)
    a = [s1.sample(logits) for _ in range(30)]
    b = [s2.sample(logits) for _ in range(30)]
    c = [s3.sample(logits) for _ in range(30)]
    assert a == b
    assert a != c


def test_copy_copies_rng_state_and_history() -> None:
    logits = np.random.default_rng(6).normal(size=200)
    s = Sampler(SamplerParams(temperature=1.0, repeat_penalty=1.2, seed=42), history=[1, 2])
    for _ in range(3):
        s.accept(s.sample(logits))
    twin = s.copy()
    assert [twin.sample(logits) for _ in range(20)] == [s.sample(logits) for _ in range(20)]
    twin.accept(199)
    assert 199 not in s.history
    assert twin.uniform() == s.uniform()


def test_sample_from_probs_never_returns_a_zero_probability_token() -> None:
    p = np.array([0.0, 0.25, 0.0, 0.75, 0.0])
    assert sample_from_probs(p, 0.0) == 1
    assert sample_from_probs(p, 0.2499) == 1
    assert sample_from_probs(p, 0.25) == 3
    assert sample_from_probs(p, np.nextafter(1.0, 0.0)) == 3
    assert sample_from_probs(np.array([2.0, 6.0]), 0.3) == 1  # unnormalised is fine
    with pytest.raises(ValueError):
        sample_from_probs(np.zeros(3), 0.5)


def test_derive_seeds_gives_reproducible_independent_streams() -> None:
    t1, d1 = derive_seeds(77)
    t2, d2 = derive_seeds(77)
    assert (t1, d1) == (t2, d2)
    assert t1 != d1
    assert derive_seeds(78) != (t1, d1)
    assert derive_seeds(None) != derive_seeds(None)
    target = Sampler(SamplerParams(temperature=1.0), seed=t1)
    draft = Sampler(SamplerParams(temperature=1.0), seed=d1)
    u_t = np.array([target.uniform() for _ in range(2000)])
    u_d = np.array([draft.uniform() for _ in range(2000)])
    assert abs(np.corrcoef(u_t, u_d)[0, 1]) < 0.1  # 0.1 is ~4.5 sigma for n=2000


# -- validation ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("temperature", float("inf")),
        ("top_k", -1),
        ("top_k", 2.5),
        ("top_p", 0.0),
        ("top_p", 1.01),
        ("min_p", -0.01),
        ("min_p", 1.5),
        ("repeat_penalty", 0.0),
        ("repeat_penalty", -1.0),
        ("repeat_last_n", -2),
        ("seed", -5),
        ("seed", 1.5),
        ("top_p", "0.9"),
        ("top_k", True),
        ("presence_penalty", math.nan),
        ("frequency_penalty", "1"),
        ("logit_bias", {-1: 1.0}),
        ("logit_bias", {3: math.nan}),
        ("logit_bias", {3: math.inf}),
        ("logit_bias", {3: True}),
    ],
)
def test_validate_rejects_out_of_range_values(field: str, value: object) -> None:
    params = SamplerParams(**{field: value})
    with pytest.raises(ValueError, match=field):
        params.validate()
    with pytest.raises(ValueError, match=field):
        Sampler(params)


def test_validate_accepts_defaults_and_edges() -> None:
    for params in (
        SamplerParams(),
        SamplerParams(temperature=0, top_k=0, top_p=1.0, min_p=0.0, repeat_last_n=-1),
        SamplerParams(min_p=1.0, seed=0, repeat_penalty=0.5),
    ):
        assert params.validate() is params
    assert SamplerParams(temperature=0.0).is_greedy
    assert not SamplerParams(temperature=0.1).is_greedy


def test_top_probability_is_the_softmax_maximum() -> None:
    rng = np.random.default_rng(3)
    for scale in (0.1, 3.0, 30.0):
        x = (rng.standard_normal(151936) * scale).astype(np.float32)
        x[::7] = -np.inf  # masked tokens
        assert top_probability(x) == pytest.approx(softmax(x).max(),
                                                            rel=1e-5)


@pytest.mark.parametrize("temperature", [5e-324, 1e-300, 1e-12])
def test_a_vanishing_temperature_samples_the_argmax(temperature: float) -> None:
    """However small the temperature, dividing cannot overflow every logit to -inf."""
    logits = np.array([10.0, 12.0, 11.0, -np.inf])
    sampler = Sampler(SamplerParams(temperature=temperature, seed=1))
    assert [sampler.sample(logits) for _ in range(5)] == [1] * 5
    probs = sampler.probs(logits)
    assert probs[1] == 1.0 and probs.sum() == 1.0


def test_blockwise_inverse_cdf_equals_the_running_sum_over_the_vocabulary() -> None:
    """sample_from_probs sums blocks of 1024 ids first: away from rounding ties it picks
    the token a running sum over the whole vocabulary picks, across block boundaries,
    empty blocks and a partial last block included."""
    rng = np.random.default_rng(4)
    for vocab in (1000, 1024, 3000, 151936):
        p = rng.random(vocab)
        p[rng.random(vocab) < 0.3] = 0.0
        p[1024:2048] = 0.0  # a whole empty block
        cdf = np.cumsum(p)
        for u in rng.random(200) * 0.999:
            want = int(np.searchsorted(cdf, u * cdf[-1], side="right"))
            assert sample_from_probs(p, float(u)) == want
        assert p[sample_from_probs(p, np.nextafter(1.0, 0.0))] > 0.0
        assert p[sample_from_probs(p, 0.0)] > 0.0


# -- logit bias, presence and frequency penalties -------------------------------------


def _penalised_reference(logits: np.ndarray, params: SamplerParams, history: list[int]
                         ) -> np.ndarray:
    """llama.cpp's logit-bias then penalties samplers, written out token by token."""
    x = np.array(logits, dtype=np.float64)
    for t, b in params.logit_bias.items():
        x[t] += b
    n = params.repeat_last_n
    recent = history if n < 0 else history[-n:] if n > 0 else []
    for t in set(recent):
        if x[t] > 0:
            x[t] /= params.repeat_penalty
        else:
            x[t] *= params.repeat_penalty
        x[t] -= recent.count(t) * params.frequency_penalty + params.presence_penalty
    return x


PENALISED = SamplerParams(temperature=1.0, repeat_penalty=1.3, presence_penalty=0.4,
                          frequency_penalty=0.3, repeat_last_n=6,
                          logit_bias={0: 1.5, 2: -0.7, 5: -math.inf})
PENALISED_LOGITS = np.array([0.5, 1.2, -0.3, 0.9, 0.1, 2.0, -1.0, 0.4])
PENALISED_HISTORY = [9, 9, 1, 3, 1, 1, 4, 3]  # the last 6 count: 1 x3, 3 x2, 4 x1


def test_logit_bias_then_penalties_as_llama_cpp_applies_them() -> None:
    s = Sampler(PENALISED, history=PENALISED_HISTORY)
    want = _penalised_reference(PENALISED_LOGITS, PENALISED, PENALISED_HISTORY)
    np.testing.assert_allclose(s.penalised_logits(PENALISED_LOGITS), want)
    np.testing.assert_allclose(s.probs(PENALISED_LOGITS), softmax(want))
    assert s.probs(PENALISED_LOGITS)[5] == 0.0  # -inf: banned, though the largest logit
    # greedy: the argmax after the bias (token 5 banned, token 0 raised above 3 and 1)
    greedy = Sampler(SamplerParams(temperature=0.0, logit_bias={5: -math.inf, 0: 1.5}))
    assert greedy.sample(PENALISED_LOGITS) == 0
    # a bias for ids past a row's width (a draft's narrower logits) is left out
    narrow = Sampler(SamplerParams(temperature=1.0, logit_bias={1: 0.5, 20: 3.0}))
    np.testing.assert_allclose(narrow.penalised_logits(PENALISED_LOGITS),
                               PENALISED_LOGITS + np.eye(8)[1] * 0.5)


def test_biased_and_penalised_draws_follow_their_distribution() -> None:
    """Seeded draws (one sampler, fixed seed) against the reference distribution: the
    new pieces change what is drawn, not only what probs() reports."""
    s = Sampler(PENALISED, seed=11, history=PENALISED_HISTORY)
    want = softmax(_penalised_reference(PENALISED_LOGITS, PENALISED, PENALISED_HISTORY))
    counts = np.zeros(8, dtype=np.int64)
    for _ in range(20_000):
        counts[s.sample(PENALISED_LOGITS)] += 1
    assert chi2_pvalue(counts, want) > PASS_P
    # and the test would see the penalties missing
    unpenalised = softmax(PENALISED_LOGITS + np.array([1.5, 0, -0.7, 0, 0, -np.inf, 0, 0]))
    assert chi2_pvalue(counts, unpenalised) < FAIL_P


def test_a_bias_that_leaves_no_token_is_no_allowed_token() -> None:
    ban_all = {t: -math.inf for t in range(8)}
    for temperature in (0.0, 1.0):
        with pytest.raises(NoAllowedToken, match="logit_bias"):
            Sampler(SamplerParams(temperature=temperature, logit_bias=ban_all)).sample(
                PENALISED_LOGITS)


def test_token_logprob_is_log_softmax_and_keeps_the_lower_ids_of_ties_at_the_cut() -> None:
    logits = np.array([0.0, 2.0, 1.0, 2.0, 1.0, 1.0, -np.inf], dtype=np.float32)
    got = token_logprob(logits, 4, 3)
    log_total = math.log(float(np.exp(logits.astype(np.float64)).sum()))
    assert got.token == 4
    assert got.logprob == pytest.approx(1.0 - log_total)
    # 1 and 3 tie at the top, then 2, 4 and 5 tie at the cut: the lowest id is kept
    assert [i for i, _ in got.top] == [1, 3, 2]
    assert [v for _, v in got.top] == pytest.approx([2.0 - log_total, 2.0 - log_total,
                                                     1.0 - log_total])
    assert token_logprob(logits, 6, 0) == TokenLogprob(6, -math.inf, ())
