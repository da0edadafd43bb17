"""Checks of a drafter's rounds that hold for every kind of drafter."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from specd.daemon.spec.drafter import Drafter, DraftParams
from specd.daemon.spec.generation import Generation, GenerationParams
from specd.daemon.spec.sampling import Sampler, SamplerParams, SamplerVocab
from specd.daemon.spec.stats import SpecStats
from specd.ort_models.runner import ModelRunner

from chi_square import chi2_pvalue


def second_token_check(runner: ModelRunner, drafter: Drafter, prompt: Sequence[int],
                       n_runs: int = 3000, temperature: float = 1.5,
                       vocab: SamplerVocab | None = None, **sampling: Any
                       ) -> tuple[float, int]:
    """Sampled proposals of one token verified by rejection sampling, over seeds 0..n_runs-1:
    the chi-square p-value of the second generated token (the round's: an accepted draft
    or the residual's draw) against the target's own distribution of it, marginal over the
    first (categories expected fewer than 5 times pooled), and how many drafts were
    accepted. `sampling`: more SamplerParams fields (logit_bias, penalties, samplers...);
    `vocab`: the model's, for a chain with infill or DRY."""
    sp = SamplerParams(temperature=temperature, seed=0, **sampling)
    seconds: list[int] = []
    accepted = 0
    for seed in range(n_runs):
        gen = Generation(runner, 0, list(prompt), GenerationParams(
            max_tokens=3, ignore_eos=True,
            sampling=SamplerParams(temperature=temperature, seed=seed, **sampling),
            draft=DraftParams(n_max=1), draft_top_k=0, coupled=False), eog=set(),
            drafter=drafter, vocab=vocab)
        out = gen.prefill()
        out += gen.step()
        gen.close()
        accepted += gen.stats.accepted
        seconds.append(out[1])
    # the sampler's penalties see the prompt, then the first token
    first = Sampler(sp, history=prompt, vocab=vocab).probs(
        runner.prefill(0, list(prompt)))  # [vocab]
    want = np.zeros_like(first)
    for t1 in np.flatnonzero(first):
        want += first[t1] * Sampler(sp, history=[*prompt, int(t1)], vocab=vocab).probs(
            runner.prefill(0, [*prompt, int(t1)]))
    counts = np.bincount(seconds, minlength=want.shape[0])
    rare = want * n_runs < 5
    pooled_counts = np.append(counts[~rare], counts[rare].sum())
    pooled_want = np.append(want[~rare], want[rare].sum())
    return chi2_pvalue(pooled_counts, pooled_want), accepted


def assert_drafted(stats: SpecStats) -> None:
    """The request drafted: rounds verified drafts (what a random-weight head drafts is
    never the target's choice, so its tests can ask no more; the shipped head's acceptance
    is tested in tests/daemon/serving/test_real_models.py)."""
    assert stats.rounds > 0 and stats.drafted > 0, f"nothing was drafted: {stats.as_dict()}"


def assert_speculated(stats: SpecStats, *, min_first: float = 0.0) -> None:
    """The request drafted (rounds > 0) and the target accepted some of it: at least one
    draft, and at least `min_first` of the first draft positions (a speculation test that
    compares output with target-only alone passes as well with a drafter that never
    drafts)."""
    assert stats.rounds > 0, f"nothing was drafted: {stats.as_dict()}"
    assert stats.accepted > 0, f"no draft was accepted: {stats.as_dict()}"
    first = stats.per_position_acceptance()[0]
    assert first >= min_first, (
        f"first-position acceptance {first:.2f} is below {min_first}: {stats.as_dict()}")


def decode_all(gen: Generation) -> list[int]:
    """Prefill, every round to the end, close: the tokens the request emitted."""
    out = gen.prefill()
    while not gen.done:
        out += gen.step()
    gen.close()
    return out


def greedy_decode(target: Any, prompt: list[int], drafter: Drafter | None, *,
                  max_tokens: int, n_max: int = 4, adaptive: bool = False
                  ) -> tuple[list[int], Generation]:
    """Greedy decoding of `prompt` on the built `target` (a fresh runner, 256 positions),
    with `drafter` proposing `n_max` tokens a round, or as the adaptive policy picks
    (None: target-only): the tokens and the finished Generation (its stats)."""
    gen = Generation(ModelRunner(target, n_ctx=256), 0, prompt, GenerationParams(
        max_tokens=max_tokens, ignore_eos=True, adaptive=adaptive,
        draft=DraftParams(n_max=n_max, probabilistic=False)), eog=set(), drafter=drafter)
    return decode_all(gen), gen


def assert_block_rows_equal_single_steps(built: Any, prompt: list[int], split: int = 3
                                         ) -> None:
    """Every row of a block verified after `prompt[:split]` equals the single step at its
    position, bit for bit (the exactness speculation relies on)."""
    singles_r = ModelRunner(built, n_ctx=256)
    singles = np.stack([singles_r.forward(0, [t], i)[0] for i, t in enumerate(prompt)])
    block_r = ModelRunner(built, n_ctx=256)
    block_r.forward(0, prompt[:split], 0)
    block = block_r.forward(0, prompt[split:], split, list(range(len(prompt) - split)))
    np.testing.assert_array_equal(block, singles[split:])
