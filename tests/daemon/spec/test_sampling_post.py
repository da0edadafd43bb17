"""post_sampling_logprob: the distribution a sampler draws from, as llama.cpp reports it."""

from __future__ import annotations

import math

import numpy as np
import pytest

from specd.daemon.spec.sampling import Sampler, SamplerParams, post_sampling_logprob


def _logits(seed: int = 0, vocab: int = 300) -> np.ndarray:
    return np.random.default_rng(seed).normal(0.0, 3.0, vocab)


@pytest.mark.parametrize("params", [
    SamplerParams(temperature=1.0),
    SamplerParams(temperature=0.7, top_k=40, top_p=0.9, min_p=0.05),
    SamplerParams(temperature=1.3, top_p=0.5, repeat_penalty=1.3, presence_penalty=0.5,
                  frequency_penalty=0.2, logit_bias={3: 2.0, 7: -math.inf}),
])
def test_it_is_the_samplers_own_distribution(params: SamplerParams) -> None:
    x = _logits()
    history = [5, 5, 9, 200]
    s = Sampler(params, seed=1, history=history)
    p = s.probs(x)  # [vocab]
    token = int(np.argmax(p))
    got = post_sampling_logprob(Sampler(params, seed=2), x, token, 10, history=history)
    assert math.exp(got.logprob) == pytest.approx(p[token], rel=1e-12)
    ids = [i for i, _ in got.top]
    want = sorted(np.flatnonzero(p > 0), key=lambda i: (-p[i], i))[:10]
    assert ids == [int(i) for i in want]
    for i, lp in got.top:
        assert math.exp(lp) == pytest.approx(p[i], rel=1e-12)
    assert 7 not in ids  # banned: probability 0 is never listed


def test_history_is_the_given_one_and_the_sampler_is_unchanged() -> None:
    params = SamplerParams(temperature=1.0, repeat_penalty=2.0, repeat_last_n=2)
    x = np.ones(8)
    s = Sampler(params, seed=3, history=[1, 1, 1])
    before = s.history
    got = post_sampling_logprob(s, x, 0, 8, history=[4, 5, 6])  # only 5 and 6 count
    probs = {i: math.exp(lp) for i, lp in got.top}
    assert probs[5] == pytest.approx(probs[6]) and probs[5] < probs[4] == probs[1]
    assert s.history == before


def test_filters_leave_fewer_than_k_summing_to_one() -> None:
    x = np.array([5.0, 4.9, 0.0, -1.0, -2.0])
    got = post_sampling_logprob(Sampler(SamplerParams(temperature=1.0, top_k=2)), x, 1, 4,
                                history=[])
    assert [i for i, _ in got.top] == [0, 1]
    assert sum(math.exp(lp) for _, lp in got.top) == pytest.approx(1.0)


def test_greedy_is_certain_and_a_mask_applies() -> None:
    x = np.array([1.0, 3.0, 2.0, 0.5])
    mask = np.array([True, False, True, True])
    got = post_sampling_logprob(Sampler(SamplerParams(temperature=0.0)), x, 2, 5,
                                history=[], mask=mask)
    assert got.logprob == 0.0 and got.top == ((2, 0.0),)
    off = post_sampling_logprob(Sampler(SamplerParams(temperature=1.0)), x, 1, 5,
                                history=[], mask=mask)
    assert off.logprob == -math.inf and 1 not in [i for i, _ in off.top]
