"""Speculative decoding on tiny random models: exactness, rollback, limits, seeds."""

from __future__ import annotations

import time

import numpy as np
import pytest

from specd.daemon.drafters.composite import CompositeDrafter
from specd.daemon.drafters.draft_model import DraftModelDrafter
from specd.daemon.drafters.ngram import NgramDrafter
from specd.daemon.drafters.synthetic import SyntheticDrafter
from specd.daemon.models.building import DRAFT_VOCAB_ROWS, build_options, target_kernels
from specd.daemon.spec.drafter import DraftEvidence, DraftParams, Proposal
from specd.daemon.spec.generation import Generation, GenerationParams, RequestError
from specd.daemon.spec.sampling import Sampler, SamplerParams, softmax
from specd.ort_models.graph_builder import BuildOptions
from specd.ort_models.model_cache import load_or_build
from specd.ort_models.runner import ModelRunner

from speculation_checks import assert_speculated, second_token_check

EOG = {349}
PROMPT = [348, 20, 31, 42, 53, 64, 75, 86, 97, 108, 119, 130]


@pytest.fixture(scope="module")
def models(tiny_model_factory):
    target = load_or_build(tiny_model_factory(arch="qwen2", weight_type="Q8_0", seed=3,
                                              context_length=1024))
    draft = load_or_build(tiny_model_factory(arch="qwen2", weight_type="Q8_0", seed=3,
                                             perturb=0.01, context_length=1024))
    return target, draft


def run(target, drafter=None, *, n_ctx=512, prompt=PROMPT, row_block=None, **kw):
    runner = ModelRunner(target, n_ctx=n_ctx, row_block=row_block)
    params = GenerationParams(**kw)
    gen = Generation(runner, 0, prompt, params, eog=EOG, drafter=drafter)
    out = gen.prefill()
    while not gen.done:
        out += gen.step()
    gen.close()
    return out, gen


def steady_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """time.perf_counter advancing 1 ms a call: the adaptive controller's choices, which
    follow measured times, are then the same on every run whatever the machine's load (a
    busy host once made it verify no lookup at all)."""
    ticks = iter(range(10**9))
    monkeypatch.setattr(time, "perf_counter", lambda: next(ticks) * 1e-3)


def draft_drafter(draft, n_ctx=512):
    return DraftModelDrafter(ModelRunner(draft, n_ctx=n_ctx))


def sampled_twice(target, draft, *, temperature: float, seed: int):
    """Two seeded rejection-sampled runs (draft n_max=4): (tokens, tokens, first run)."""
    sp = SamplerParams(temperature=temperature, seed=seed)
    dp = DraftParams(n_max=4, probabilistic=True)
    a, ga = run(target, draft_drafter(draft), max_tokens=48, ignore_eos=True, sampling=sp,
                draft=dp)
    b, _ = run(target, draft_drafter(draft), max_tokens=48, ignore_eos=True, sampling=sp,
               draft=dp)
    return a, b, ga


@pytest.mark.parametrize("n_max", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("p_min", [0.0, 0.5])
def test_greedy_speculation_is_byte_identical(models, n_max, p_min) -> None:
    target, draft = models
    want, _ = run(target, max_tokens=64, ignore_eos=True)
    got, gen = run(target, draft_drafter(draft), max_tokens=64, ignore_eos=True,
                   draft=DraftParams(n_max=n_max, p_min=p_min))
    assert got == want
    assert_speculated(gen.stats, min_first=0.5 if p_min == 0.0 else 0.0)  # a perturbed copy


@pytest.mark.parametrize("n_max", [3, 8])
def test_speculation_with_a_fixed_row_block(models, n_max) -> None:
    """The target runner's fixed call shape (CUDA's) on the CPU, where rows do not depend
    on it: verify blocks are capped at the row block, and the output is the target's.
    (That the fixed shape makes rows exact on CUDA is tests/ort_models/test_cuda.py's to show.)"""
    target, draft = models
    want, _ = run(target, max_tokens=48, ignore_eos=True)
    got, gen = run(target, draft_drafter(draft), max_tokens=48, ignore_eos=True,
                   row_block=4, draft=DraftParams(n_max=n_max))
    assert got == want
    assert gen.stats.rounds > 0 and max(gen.stats.draft_lengths) <= 3  # row block 4


def test_requantized_draft_is_byte_identical(tiny_model_factory, models) -> None:
    """A draft built as the engine builds drafts (re-quantized to 4 bits, fused attention,
    neither batch-invariant nor exact) changes acceptance only."""
    target, _ = models
    draft = load_or_build(tiny_model_factory(arch="qwen2", weight_type="Q8_0", seed=3,
                                             perturb=0.01, context_length=1024),
                          build_options("draft"))
    native = target_kernels() == "gguf"
    assert (draft.options.requant, draft.options.attention) == (
        ("q4k", "native") if native else ("q4", "fused"))
    # exact weights (GGUF blocks in specd's kernel where it compiled), exact attention, and
    # there tokens decided in the graph
    assert build_options("target") == (
        BuildOptions(kernels="gguf", attention="native", kv_dtype="f16", sampler=True)
        if target_kernels() == "gguf" else BuildOptions())
    assert build_options("draft").sampler == native
    assert build_options("target", device="cuda:0") == BuildOptions()
    assert build_options("draft", device="cuda:0").attention == "exact"  # fp32 GQA: CPU only
    assert build_options("draft").vocab_rows == DRAFT_VOCAB_ROWS  # the default cut
    assert build_options("draft", draft_vocab=0).vocab_rows == 0  # --draft-vocab 0: all
    assert build_options("draft", draft_vocab=5000).vocab_rows == 5000
    assert build_options("target", draft_vocab=5000).vocab_rows == 0  # targets: never cut
    want, _ = run(target, max_tokens=64, ignore_eos=True)
    got, gen = run(target, draft_drafter(draft), max_tokens=64, ignore_eos=True,
                   draft=DraftParams(n_max=4))
    assert got == want
    assert gen.stats.accepted > 0


@pytest.mark.skipif(target_kernels() != "gguf", reason="specd's kernels did not compile")
@pytest.mark.parametrize("n_max", [3, 8])
@pytest.mark.parametrize("weights, n_embd, n_ff", [
    ("Q4_K", 256, 512),  # the target on GgufMatMul too
    ("F16", 320, 448),  # K = 320 and 448: the draft's Q4_K rows end inside a superblock
])
def test_gguf_kernel_target_with_q4k_draft_is_byte_identical(
        tiny_model_factory, n_max: int, weights: str, n_embd: int,
        n_ff: int) -> None:
    """A target and a Q4_K-requantized draft of a perturbed copy of it (specd's kernels):
    the output is the target's, and the draft proposes far better than chance (a kernel
    that misread the requantized rows would propose noise: about 1 in the vocabulary's
    size; the random tiny models' logits are flat enough that 4 bits flip many argmaxes:
    the first draft position is accepted 35-60% of the time.)"""
    dims = {"n_embd": n_embd, "n_ff": n_ff, "context_length": 1024, "arch": "qwen2",
            "weight_type": weights, "seed": 5}
    target = load_or_build(tiny_model_factory(**dims), build_options("target"))
    draft = load_or_build(tiny_model_factory(**dims, perturb=0.01),
                          build_options("draft", "q4k"))
    assert draft.options.kernels == "gguf"
    want, _ = run(target, max_tokens=64, ignore_eos=True)
    got, gen = run(target, draft_drafter(draft), max_tokens=64, ignore_eos=True,
                   draft=DraftParams(n_max=n_max))
    assert got == want
    assert gen.stats.rounds > 0
    first = gen.stats.per_position_acceptance()[0]  # chance: 1 / 350
    assert first > 0.1, gen.stats.per_position_acceptance()


def test_draft_equal_to_target_accepts_everything(models) -> None:
    target, _ = models
    want, _ = run(target, max_tokens=40, ignore_eos=True)
    got, gen = run(target, draft_drafter(target), max_tokens=40, ignore_eos=True,
                   draft=DraftParams(n_max=4))
    assert got == want
    assert gen.stats.accepted == gen.stats.drafted


@pytest.mark.parametrize("adaptive", [False, True])
def test_ngram_speculation_is_byte_identical(models, adaptive, monkeypatch) -> None:
    """Prompt lookup alone; under the adaptive controller each round verifies the offer
    or takes a plain step (there is no model to draft)."""
    target, _ = models
    if adaptive:
        steady_clock(monkeypatch)
    prompt = PROMPT + PROMPT[1:] + PROMPT[1:]  # repetition for lookup to find
    want, _ = run(target, prompt=prompt, max_tokens=64, ignore_eos=True)
    got, gen = run(target, NgramDrafter(), prompt=prompt, max_tokens=64, ignore_eos=True,
                   draft=DraftParams(n_max=6), adaptive=adaptive)
    assert got == want
    assert gen.stats.rounds > 0 and gen.stats.rounds == gen.stats.lookup_rounds


def test_a_sampled_lookups_next_token_counts_its_target_probability(models, monkeypatch) -> None:
    """After a fully accepted lookup offer, the offer's next token is weighed against the
    target's distribution of the bonus: at temperature > 0 a probability, not a hit."""
    target, _ = models
    steady_clock(monkeypatch)
    sp = SamplerParams(temperature=0.9, seed=11)
    want, _ = run(target, max_tokens=40, ignore_eos=True, sampling=sp)

    class Foresight(NgramDrafter):
        """Offers what the target will draw (verified greedily, one uniform per emitted
        token: the target-only tokens), one more than asked."""

        def offer(self, seq, last, pos, n_max):
            j = pos - len(PROMPT)  # want[j] is `last`
            return Proposal(want[j + 1:j + 2 + n_max], evidence=DraftEvidence(lookup_match=4))

    runner = ModelRunner(target, n_ctx=512)
    gen = Generation(runner, 0, PROMPT, GenerationParams(
        max_tokens=40, ignore_eos=True, sampling=sp, draft=DraftParams(n_max=3),
        adaptive=True), eog=EOG, drafter=Foresight())
    a = gen.policy
    assert a is not None
    seen: list[float] = []
    pos = a.observe_position
    a.observe_position = lambda i, hit, lookup=0, **kw: (  # type: ignore[method-assign]
        seen.append(float(hit)) if lookup else None, pos(i, hit, lookup, **kw))
    out = gen.prefill()
    while not gen.done:
        out += gen.step()
    assert out == want and gen.stats.lookup_rounds > 0
    assert seen and all(0.0 <= x <= 1.0 + 1e-9 for x in seen)
    assert any(0.0 < x < 1.0 for x in seen)  # probabilities, not hits


@pytest.mark.parametrize("adaptive", [False, True])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_draft_and_lookup_speculation_is_byte_identical(models, adaptive, temperature,
                                                       monkeypatch) -> None:
    """Rounds drafted by the lookup and rounds drafted by the model, verified greedily,
    give the target-only output (sampled too: one uniform per emitted token either way)."""
    target, draft = models
    if adaptive:
        steady_clock(monkeypatch)
    prompt = PROMPT + PROMPT[1:] + PROMPT[1:]  # repetition for lookup to find
    sp = SamplerParams(temperature=temperature, top_k=40, seed=11)
    want, _ = run(target, prompt=prompt, max_tokens=64, ignore_eos=True, sampling=sp)
    drafter = CompositeDrafter("draft+ngram", [draft_drafter(draft)],
                               NgramDrafter(min_ngram=1))  # many matches
    got, gen = run(target, drafter, prompt=prompt, max_tokens=64, ignore_eos=True,
                   sampling=sp, draft=DraftParams(n_max=6, probabilistic=False),
                   adaptive=adaptive)
    assert got == want
    s = gen.stats
    assert s.lookup_rounds > 0
    if not adaptive:  # lookup first, the model where the lookup has nothing
        assert s.rounds > s.lookup_rounds


def test_adaptive_is_byte_identical(models) -> None:
    target, draft = models
    want, _ = run(target, max_tokens=64, ignore_eos=True)
    got, gen = run(target, draft_drafter(draft), max_tokens=64, ignore_eos=True,
                   draft=DraftParams(n_max=8), adaptive=True)
    assert got == want
    assert_speculated(gen.stats)


def test_sampled_with_greedy_verification_equals_target_only(models) -> None:
    """Greedy verification of a sampled target draws one uniform per token either way."""
    target, draft = models
    sp = SamplerParams(temperature=0.9, top_k=40, seed=11)
    want, _ = run(target, max_tokens=48, ignore_eos=True, sampling=sp)
    got, gen = run(target, draft_drafter(draft), max_tokens=48, ignore_eos=True,
                   sampling=sp, draft=DraftParams(n_max=4, probabilistic=False))
    assert got == want
    assert_speculated(gen.stats)


def test_rejection_sampling_seeded_runs_repeat(models) -> None:
    target, draft = models
    a, b, ga = sampled_twice(target, draft, temperature=0.8, seed=5)
    assert a == b
    assert ga.stats.accepted > 0
    dp = DraftParams(n_max=4, probabilistic=True)
    c, _ = run(target, draft_drafter(draft), max_tokens=48, ignore_eos=True,
               sampling=SamplerParams(temperature=0.8, seed=6), draft=dp)
    assert c != a


def test_a_draft_cut_to_its_first_ids_keeps_the_output_the_targets(
        tiny_model_factory) -> None:
    """A draft whose logits cover only ids below 128 (as drafts are built, past 98,304)
    never proposes the others; greedy output stays the target's, and rejection sampling
    still emits them: their draft probability is 0, so the residual carries them."""
    path = tiny_model_factory(arch="qwen2", weight_type="Q8_0", seed=3, perturb=0.01,
                              context_length=1024)
    target = load_or_build(tiny_model_factory(arch="qwen2", weight_type="Q8_0", seed=3,
                                              context_length=1024))
    draft = load_or_build(path, BuildOptions(vocab_rows=128))
    want, _ = run(target, max_tokens=64, ignore_eos=True)
    assert any(t >= 128 for t in want)
    got, gen = run(target, draft_drafter(draft), max_tokens=64, ignore_eos=True,
                   draft=DraftParams(n_max=4))
    assert got == want and gen.stats.accepted > 0
    a, b, ga = sampled_twice(target, draft, temperature=1.5, seed=5)
    assert a == b and any(t >= 128 for t in a) and ga.stats.drafted > 0


def test_logit_bias_and_penalties_keep_sampled_speculation_exact(models) -> None:
    """The request's logit bias and penalties shape p, and q too (the draft samples under
    them, its penalty history following the emitted tokens): the second token, drawn
    through rejection sampling, is distributed as the biased, penalised target's."""
    target, draft = models
    runner = ModelRunner(target, n_ctx=512)
    first = softmax(runner.prefill(0, PROMPT))  # [vocab]
    top = [int(t) for t in np.argsort(first)[::-1][:3]]
    sampling = {"logit_bias": {top[0]: -float("inf"), top[1]: 1.0, top[2]: -1.0},
                "presence_penalty": 0.7, "frequency_penalty": 0.4}
    p, accepted = second_token_check(runner, draft_drafter(draft), PROMPT, n_runs=2000,
                                     temperature=1.0, **sampling)
    assert p > 1e-3 and 100 < accepted < 1900
    out, gen = run(target, draft_drafter(draft), max_tokens=24, ignore_eos=True,
                   sampling=SamplerParams(temperature=1.0, seed=3, **sampling),
                   draft=DraftParams(n_max=4))
    assert top[0] not in out
    assert gen.draft_sampler is not None
    assert gen.draft_sampler.history == gen.sampler.history  # q's penalties see p's tokens
    assert gen.draft_sampler.params.logit_bias == sampling["logit_bias"]


def test_the_penalties_see_the_prompt_as_llama_servers_do(models) -> None:
    """llama-server's samplers accept every prompt token before the reply, so a presence
    penalty weighs the prompt's tokens too: greedily, a penalty large enough keeps every
    prompt token out of the reply, while without it the reply repeats one of them."""
    target, draft = models
    plain, _ = run(target, max_tokens=16, ignore_eos=True)
    assert set(plain) & set(PROMPT)  # the unpenalised reply reuses the prompt's tokens
    penalised = SamplerParams(temperature=0.0, presence_penalty=1e4, repeat_last_n=-1)
    out, gen = run(target, max_tokens=16, ignore_eos=True, sampling=penalised)
    assert not set(out) & set(PROMPT), out
    assert gen.sampler.history[:len(PROMPT)] == PROMPT
    # drafted, the reply is the same and q's penalties see the prompt as well
    drafted, gd = run(target, draft_drafter(draft), max_tokens=16, ignore_eos=True,
                      sampling=penalised, draft=DraftParams(n_max=4))
    assert drafted == out and gd.stats.rounds > 0


def test_logprobs_are_the_targets_with_or_without_a_draft(models) -> None:
    """Each emitted token's logprob and top tokens come from the target's row it was
    decided on: the same whether it came from a prefill, a plain step or a verified
    block (rows equal single steps bit for bit)."""
    target, draft = models
    alone, ga = run(target, max_tokens=20, ignore_eos=True, logprobs=3)
    drafted, gd = run(target, draft_drafter(draft), max_tokens=20, ignore_eos=True,
                      logprobs=3, draft=DraftParams(n_max=4))
    assert drafted == alone and gd.stats.accepted > 0
    assert gd.token_logprobs == ga.token_logprobs
    assert [t.token for t in ga.token_logprobs] == alone
    runner = ModelRunner(target, n_ctx=512)
    for i in (0, 7):  # the first token (prefill) and a later one, from a fresh prefill
        row = runner.prefill(0, PROMPT + alone[:i]).astype(np.float64)  # [vocab]
        log_total = np.log(np.exp(row - row.max()).sum()) + row.max()
        got = ga.token_logprobs[i]
        assert got.logprob == pytest.approx(row[alone[i]] - log_total, abs=1e-9)
        assert [t for t, _ in got.top] == list(np.argsort(-row, kind="stable")[:3])
        assert got.top[0][0] == alone[i]  # greedy: the most likely
    assert run(target, max_tokens=4)[1].token_logprobs == []  # not asked for


def test_target_rng_unchanged_by_the_draft_when_nothing_is_drafted(models) -> None:
    """Separate streams: a drafter that never proposes leaves the target's draws alone."""
    target, draft = models
    sp = SamplerParams(temperature=1.0, seed=21)
    want, _ = run(target, max_tokens=32, ignore_eos=True, sampling=sp)
    got, gen = run(target, draft_drafter(draft), max_tokens=32, ignore_eos=True, sampling=sp,
                   draft=DraftParams(n_max=4, p_min=1.0, probabilistic=True))
    assert gen.stats.drafted == 0
    assert got == want


def test_synthetic_rates_zero_equal_target_only(models) -> None:
    target, _ = models
    want, _ = run(target, max_tokens=40, ignore_eos=True)
    got, gen = run(target, SyntheticDrafter([0.0] * 4), max_tokens=40, ignore_eos=True,
                   draft=DraftParams(n_max=4))
    assert got == want
    assert gen.stats.accepted == 0 and gen.stats.rounds > 0
    assert not gen.stats.valid


def test_synthetic_rates_one_accept_every_draft(models) -> None:
    target, _ = models
    _, gen = run(target, SyntheticDrafter([1.0] * 4), max_tokens=41, ignore_eos=True,
                 draft=DraftParams(n_max=4))
    assert gen.stats.accepted == gen.stats.drafted > 0


def test_synthetic_rounds_leave_only_the_prompt_cached(models) -> None:
    """Synthetically accepted drafts have no real KV: a later request on the slot must
    not reuse them (the scheduler caches `evaluated_tokens`)."""
    target, _ = models
    out, gen = run(target, SyntheticDrafter([1.0] * 4), max_tokens=30, ignore_eos=True,
                   draft=DraftParams(n_max=4))
    assert not gen.stats.valid and len(out) == 30
    assert gen.evaluated_tokens == PROMPT


def test_a_draft_with_fewer_ids_keeps_drafting_past_them(tiny_model_factory,
                                                         models) -> None:
    """compat lets vocabulary sizes differ a little; an id the draft lacks reaches it as
    id 0 instead of failing the draft (which would end speculation for the request)."""
    _, draft = models
    target = load_or_build(tiny_model_factory(arch="qwen2", weight_type="Q8_0", seed=3,
                                              context_length=1024, vocab_size=384))
    assert draft.hparams.n_vocab <= 370 < target.hparams.n_vocab
    prompt = PROMPT[:6] + [370] + PROMPT[6:]
    want, _ = run(target, prompt=prompt, max_tokens=32, ignore_eos=True)
    drafter = DraftModelDrafter(ModelRunner(draft, n_ctx=512),
                                vocab_limit=target.hparams.n_vocab)
    got, gen = run(target, drafter, prompt=prompt, max_tokens=32, ignore_eos=True,
                   draft=DraftParams(n_max=4))
    assert got == want
    assert gen.drafter is not None and gen.stats.drafted > 0


def test_budgeted_prefill_stops_on_bucket_boundaries(models) -> None:
    """After a reused prefix of 100 tokens, 256-token budgets cut on bucket boundaries,
    where an unbudgeted prefill of the same suffix cuts too; a smaller budget cuts at the
    budget, and a pass never crosses a boundary."""
    target, _ = models
    runner = ModelRunner(target, n_ctx=1024)
    real, calls = runner.forward_batch, []

    def forward_batch(batch):
        calls.extend((c.pos, len(c.tokens)) for c in batch)
        return real(batch)

    runner.forward_batch = forward_batch  # type: ignore[method-assign]
    prompt = [20 + i % 300 for i in range(700)]
    for budget in (256, None):
        calls.clear()
        gen = Generation(runner, 0, prompt, GenerationParams(max_tokens=1), eog=EOG,
                         reuse=100)
        while not gen.prefilled:
            gen.prefill(budget)
        assert calls == [(100, 156), (256, 256), (512, 188)]
    calls.clear()
    gen = Generation(runner, 0, prompt[:300], GenerationParams(max_tokens=1), eog=EOG)
    while not gen.prefilled:
        gen.prefill(100)  # no boundary in reach: the budget
    assert calls == [(0, 100), (100, 100), (200, 56), (256, 44)]


def test_the_first_token_is_prompt_processing_in_the_stats(models) -> None:
    target, draft = models
    _, gen = run(target, draft_drafter(draft), max_tokens=20, ignore_eos=True,
                 draft=DraftParams(n_max=3))
    s = gen.stats
    assert (s.generated_tokens, s.decoded_tokens) == (20, 19) and s.prefill_s > 0
    assert s.decode_tps == pytest.approx(19 / s.decode_s)


def test_synthetic_mean_length_is_close(models) -> None:
    target, _ = models
    _, gen = run(target, SyntheticDrafter(mean_length=3.0, n_max=4, seed=1), max_tokens=300,
                 ignore_eos=True, draft=DraftParams(n_max=4), n_ctx=1024)
    assert 2.5 < gen.stats.mean_acceptance_length < 3.5


@pytest.mark.parametrize("rates", [[1.2], [-0.1], [0.2, 0.5], []])
def test_synthetic_bad_rates_are_clear_errors(rates) -> None:
    with pytest.raises(ValueError, match="rate"):
        SyntheticDrafter(rates)


def test_prompt_filling_the_context_completes(models) -> None:
    target, draft = models
    rng = np.random.default_rng(0)
    prompt = rng.integers(3, 340, size=256 - 3).tolist()
    want, g0 = run(target, n_ctx=256, prompt=prompt, max_tokens=50, ignore_eos=True)
    got, g1 = run(target, draft_drafter(draft, 256), n_ctx=256, prompt=prompt, max_tokens=50,
                  ignore_eos=True, draft=DraftParams(n_max=8))
    assert got == want
    assert g0.finish_reason == g1.finish_reason == "length"
    assert len(got) == 4  # positions 253, 254, 255 evaluated + the token after


def test_speculation_across_a_bucket_boundary_is_exact(models) -> None:
    target, draft = models
    rng = np.random.default_rng(4)
    prompt = rng.integers(3, 340, size=240).tolist()
    want, _ = run(target, prompt=prompt, max_tokens=40, ignore_eos=True)
    got, gen = run(target, draft_drafter(draft), prompt=prompt, max_tokens=40,
                   ignore_eos=True, draft=DraftParams(n_max=16))
    assert got == want
    assert_speculated(gen.stats)


def test_oversize_prompt_is_a_request_error(models) -> None:
    target, _ = models
    with pytest.raises(RequestError, match="300 tokens long .* at most 255"):
        run(target, n_ctx=256, prompt=[5] * 300)


def test_n_min_skips_short_drafts(models) -> None:
    target, draft = models
    want, _ = run(target, max_tokens=32, ignore_eos=True)
    got, gen = run(target, draft_drafter(draft), max_tokens=32, ignore_eos=True,
                   draft=DraftParams(n_max=4, n_min=3, p_min=0.6))
    assert got == want
    assert all(n == 0 or n >= 3 for n in gen.stats.draft_lengths)
    # the drafter proposed, and without n_min some of its proposals are short ones
    assert gen.stats.source_calls.get("draft", 0) > 0, gen.stats.as_dict()
    _, loose = run(target, draft_drafter(draft), max_tokens=32, ignore_eos=True,
                   draft=DraftParams(n_max=4, n_min=0, p_min=0.6))
    assert any(0 < n < 3 for n in loose.stats.draft_lengths), loose.stats.as_dict()


def test_draft_model_reuses_its_cached_prefix(models) -> None:
    target, draft = models
    drafter = draft_drafter(draft)
    first, _ = run(target, drafter, max_tokens=24, ignore_eos=True, draft=DraftParams(n_max=4))
    calls: list[tuple[int, int]] = []  # (tokens, pos) of each draft call
    forward = drafter.runner.forward_batch

    def spy(batch):
        calls.extend((len(c.tokens), c.pos) for c in batch)
        return forward(batch)

    drafter.runner.forward_batch = spy  # type: ignore[method-assign]
    longer = PROMPT + first[:8]
    want, _ = run(target, prompt=longer, max_tokens=24, ignore_eos=True)
    got, gen = run(target, drafter, prompt=longer, max_tokens=24, ignore_eos=True,
                   draft=DraftParams(n_max=4))
    assert got == want
    # the prompt was cached whole: the first draft evaluates only the first token
    assert calls[0] == (1, len(longer))
    assert_speculated(gen.stats)


def test_target_only_rounds_keep_the_drafts_cache(models) -> None:
    """Rounds at n = 0 report accept(0) with no draft: the draft's cache must keep the
    prompt, or the next draft re-evaluates all of it (seconds for a long prompt)."""
    target, _ = models
    drafter = draft_drafter(target)
    want, _ = run(target, max_tokens=40, ignore_eos=True)
    drafter.begin(0, PROMPT)
    for tok in want[:3]:  # three target-only rounds, as Generation reports them
        drafter.accept(0, 0)
        drafter.process(0, [tok])
    d = drafter.draft(0, want[3], len(PROMPT) + 3, 2, DraftParams(n_max=2))
    assert len(d.evidence.guess_checks) == 3  # caught up on 3 tokens, not the prompt
    drafter.accept(0, 2)
    drafter.process(0, [want[3], *d.tokens])
    drafter.accept(0, 0)  # a target-only round after a full acceptance
    drafter.process(0, [want[6]])
    d2 = drafter.draft(0, want[7], len(PROMPT) + 7, 2, DraftParams(n_max=2))
    # pending: the draft's last proposal (never evaluated), the target's token, last; the
    # first guess is the one after two accepted drafts (position 2), the next position 0
    assert d2.evidence.guess_checks == ((2, True), (0, True))
    assert d2.tokens == want[8:10]


def test_a_fully_accepted_round_checks_the_drafts_next_guess(models) -> None:
    """After n accepted drafts, the draft's guess for the target's bonus token is a free
    sample of draft position n (0-based) given the n before it accepted."""
    target, _ = models
    want, _ = run(target, max_tokens=40, ignore_eos=True)
    for bonus, right in ((want[4], True), ((want[4] + 1) % 300, False)):
        drafter = draft_drafter(target)  # the target as its own draft: it guesses want
        drafter.begin(0, PROMPT)
        d = drafter.draft(0, want[0], len(PROMPT), 3, DraftParams(n_max=3))
        assert d.tokens == want[1:4]
        drafter.accept(0, 3)
        drafter.process(0, want[0:4])
        d2 = drafter.draft(0, bonus, len(PROMPT) + 4, 2, DraftParams(n_max=2))
        assert d2.evidence.guess_checks == ((3, right),)
    drafter.accept(0, 1)  # one of two accepted: the next round has nothing to check
    drafter.process(0, [bonus, d2.tokens[0]])
    d3 = drafter.draft(0, 7, len(PROMPT) + 6, 2, DraftParams(n_max=2))
    assert d3.evidence.guess_checks == ()


def test_a_sampling_drafts_distribution_for_the_bonus_token_is_reported(models) -> None:
    """The sampled counterpart of the checked guess: after n accepted drafts, the draft's
    distribution where the bonus token was drawn (position n), which the generation weighs
    against the target's there."""
    target, _ = models
    dsp = SamplerParams(temperature=0.7, top_k=10, seed=5)
    drafter = draft_drafter(target)
    drafter.begin(0, PROMPT, Sampler(dsp, seed=5))
    d = drafter.draft(0, 40, len(PROMPT), 3, DraftParams(n_max=3))
    assert d.evidence.bonus_q is None and d.evidence.guess_checks == ()
    drafter.accept(0, 3)
    drafter.process(0, [40, *d.tokens])
    d2 = drafter.draft(0, 41, len(PROMPT) + 4, 2, DraftParams(n_max=2))
    assert d2.evidence.bonus_q is not None and d2.evidence.guess_checks == ()
    i, q = d2.evidence.bonus_q
    row = ModelRunner(target, n_ctx=512).prefill(0, [*PROMPT, 40, *d.tokens])  # [vocab]
    assert i == 3
    np.testing.assert_allclose(q, Sampler(dsp).probs(row), atol=1e-6)
    drafter.accept(0, 1)  # one of two accepted: nothing to weigh next round
    drafter.process(0, [41, d2.tokens[0]])
    assert drafter.draft(0, 7, len(PROMPT) + 6, 2, DraftParams(n_max=2)).evidence.bonus_q is None


def test_sampled_rounds_feed_the_controller_acceptance_probabilities(models, monkeypatch) -> None:
    """At temperature > 0 the adaptive controller counts sum(min(p, q)) per position
    decided and at the bonus position, not only the outcomes."""
    target, draft = models
    steady_clock(monkeypatch)
    seen: list[tuple[str, int, float]] = []
    sp = SamplerParams(temperature=0.8, seed=11)
    runner = ModelRunner(target, n_ctx=512)
    gen = Generation(runner, 0, PROMPT, GenerationParams(
        max_tokens=40, ignore_eos=True, sampling=sp, draft=DraftParams(n_max=3),
        adaptive=True), eog=EOG, drafter=draft_drafter(draft))
    a = gen.policy
    assert a is not None
    acc, pos = a.observe_acceptance, a.observe_position
    a.observe_acceptance = lambda n, k, lookup=0, probs=(), source=0, **kw: (  # type: ignore[method-assign]
        seen.extend(("round", i, x) for i, x in enumerate(probs)),
        acc(n, k, lookup, probs, source, **kw))
    a.observe_position = lambda i, hit, lookup=0, source=0, **kw: (  # type: ignore[method-assign]
        seen.append(("bonus", i, float(hit))), pos(i, hit, lookup, source, **kw))
    gen.prefill()
    while not gen.done:
        gen.step()
    rounds = [x for kind, _, x in seen if kind == "round"]
    bonus = [(i, x) for kind, i, x in seen if kind == "bonus"]
    assert rounds and bonus  # the tiny pair agrees often: full acceptances happen
    assert all(0.0 <= x <= 1.0 + 1e-9 for x in rounds)
    assert any(0.0 < x < 1.0 for x in rounds)  # probabilities, not outcomes
    assert all(i >= 1 and 0.0 <= x <= 1.0 + 1e-9 for i, x in bonus)


def test_adaptive_never_re_evaluates_the_prompt_on_the_draft(models) -> None:
    target, draft = models
    drafter = draft_drafter(draft)
    starts: list[int] = []
    forward = drafter.runner.forward_batch

    def spy(calls):
        starts.extend(c.pos for c in calls)
        return forward(calls)

    drafter.runner.forward_batch = spy  # type: ignore[method-assign]
    run(target, drafter, max_tokens=48, ignore_eos=True, draft=DraftParams(n_max=4),
        adaptive=True)
    # the first draft evaluates the prompt, once: no later call reaches back into it
    assert starts[0] == 0 and min(starts[1:]) >= len(PROMPT)


def test_catch_up_checks_the_drafters_guesses_against_emitted_tokens(models) -> None:
    """After target-only rounds the draft evaluates the skipped tokens and reports, per
    row, whether its greedy guess was the token that followed (teacher forcing)."""
    target, _ = models
    drafter = draft_drafter(target)  # the target as its own draft: every guess is right
    want, _ = run(target, max_tokens=40, ignore_eos=True)
    drafter.begin(0, PROMPT)
    drafter.process(0, want[:10])  # 10 target-only tokens, then a drafting round
    d = drafter.draft(0, want[10], len(PROMPT) + 10, 2, DraftParams(n_max=2))
    assert d.evidence.guess_checks == ((0, True),) * 10  # all teacher-forced position 0
    assert d.tokens == want[11:13]
    d2 = drafter.draft(0, want[10], len(PROMPT) + 10, 2, DraftParams(n_max=2))
    assert d2.evidence.guess_checks == ()  # nothing skipped this time


class _CountingDrafter(DraftModelDrafter):
    """The draft model, recording the length asked of each draft call."""

    def __init__(self, runner: ModelRunner) -> None:
        super().__init__(runner)
        self.asked: list[int] = []

    def propose(self, requests, on_pass=None):
        self.asked.extend(r.n_max for r in requests)
        return super().propose(requests, on_pass)


def test_drafts_end_at_an_end_of_generation(models) -> None:
    """Drafts past an end-of-generation token would never be emitted: they are not
    verified, nor counted as accepted."""
    target, _ = models
    free, _ = run(target, max_tokens=40, ignore_eos=True)
    eog = {free[3]}  # the 4th token the target generates ends the request
    runner = ModelRunner(target, n_ctx=512)
    gen = Generation(runner, 0, PROMPT, GenerationParams(max_tokens=40,
                                                         draft=DraftParams(n_max=8)),
                     eog=eog, drafter=draft_drafter(target))  # the target as its own draft
    out = gen.prefill()
    while not gen.done:
        out += gen.step()
    assert out == free[:4] and gen.finish_reason == "stop"
    assert gen.stats.drafted == gen.stats.accepted == 3  # the drafts up to the end


def test_adaptive_never_drafts_shorter_than_n_min(models) -> None:
    """Drafts shorter than n_min are thrown away unverified, so the adaptive controller
    must neither choose nor probe such lengths (each would be a draft call for nothing)."""
    target, draft = models
    want, _ = run(target, max_tokens=64, ignore_eos=True)
    for drafter_model in (target, draft):  # every draft accepted / a perturbed copy
        drafter = _CountingDrafter(ModelRunner(drafter_model, n_ctx=512))
        got, gen = run(target, drafter, max_tokens=64, ignore_eos=True, adaptive=True,
                       draft=DraftParams(n_max=8, n_min=3))
        assert got == want
        assert drafter.asked and min(drafter.asked) >= 3, drafter.asked
        assert min(n for n in gen.stats.draft_lengths if n) >= 3  # 0: plain rounds


def test_adaptive_stops_drafting_when_every_draft_comes_back_empty(models) -> None:
    """p_min = 1 stops every draft before its first token: the controller must learn
    that drafting yields nothing and fall back to plain steps (probing now and then)."""
    target, draft = models
    want, _ = run(target, max_tokens=96, ignore_eos=True)
    drafter = _CountingDrafter(ModelRunner(draft, n_ctx=512))
    got, gen = run(target, drafter, max_tokens=96, ignore_eos=True, adaptive=True,
                   draft=DraftParams(n_max=8, p_min=1.0))
    assert got == want and gen.stats.drafted == 0
    assert len(drafter.asked) <= 95 // 3, drafter.asked  # about every round before


def test_p_min_does_not_turn_short_lookups_into_misses(models, monkeypatch) -> None:
    """Only a draft the model cut for want of confidence counts as a miss where it
    stopped; a prompt lookup that found fewer tokens (p_min does not apply to it) must
    teach the controller nothing of the sort."""
    from specd.daemon.spec.policy import AdaptiveDraftLength

    target, _ = models
    seen: list[tuple[int, bool]] = []
    real = AdaptiveDraftLength.observe_position

    def spy(self, i, hit, lookup=0):
        if not lookup:  # the model's positions (there is no model here)
            seen.append((i, hit))
        return real(self, i, hit, lookup)

    monkeypatch.setattr(AdaptiveDraftLength, "observe_position", spy)
    prompt = [348, *([20, 31, 42, 53] * 6)]  # repeats: the lookup finds short continuations
    run(target, NgramDrafter(), prompt=prompt, max_tokens=48, ignore_eos=True,
        adaptive=True, draft=DraftParams(n_max=8, p_min=0.5))
    assert seen == []


def test_a_long_catch_up_evaluates_only_the_latest_skipped_tokens(models) -> None:
    """After many target-only rounds the draft evaluates only the latest `catch_up`
    tokens it skipped, placed right after what its cache holds (a gap it never fills);
    a later request reuses only the cache's prefix before the gap."""
    target, _ = models
    want, _ = run(target, max_tokens=40, ignore_eos=True)
    drafter = DraftModelDrafter(ModelRunner(target, n_ctx=512), catch_up=4)
    calls: list[tuple[int, int]] = []
    forward, prefill = drafter.runner.forward_batch, drafter.runner.prefill

    def spy(batch):
        calls.extend((len(c.tokens), c.pos) for c in batch)
        return forward(batch)

    def spy_prefill(seq, tokens, pos=0, chunk=256, rope_positions=None):
        calls.append((len(tokens), pos))
        return prefill(seq, tokens, pos, chunk, rope_positions)

    n = len(PROMPT)
    drafter.begin(0, PROMPT)
    drafter.runner.forward_batch = spy  # type: ignore[method-assign]
    drafter.runner.prefill = spy_prefill  # type: ignore[method-assign]
    drafter.process(0, want[:10])  # ten target-only rounds
    d = drafter.draft(0, want[10], n + 10, 2, DraftParams(n_max=2))
    # the prompt (left to the first draft), want[6:10] and the last in one call
    assert calls == [(n + 5, 0), (1, n + 5)]
    # the four evaluated rows' guesses, checked (wrong or right: the context has a gap)
    assert [i for i, _ in d.evidence.guess_checks] == [0] * 4
    drafter.accept(0, 0)
    drafter.process(0, [want[10]])
    drafter.draft(0, want[11], n + 11, 1, DraftParams(n_max=1))
    assert calls[2] == (1, n + 5)  # the next token right after the last, 6 left out
    calls.clear()
    drafter.end(0)
    drafter.begin(0, PROMPT + want[:12])
    assert calls == []  # begin evaluates nothing
    d = drafter.draft(0, want[12], n + 12, 3, DraftParams(n_max=3))
    assert calls[0] == (13, n)  # the prompt was reused, nothing after the gap
    assert d.tokens == want[13:16]  # the target as its own draft, its context whole again


def test_speculation_with_catch_up_gaps_is_byte_identical(models, tiny_model_factory) -> None:
    """An unrelated draft: the adaptive controller mostly decodes target-only and probes,
    each probe after a gap in the draft's context. The output is the target's."""
    target, _ = models
    other = load_or_build(tiny_model_factory(arch="qwen2", weight_type="Q8_0", seed=11,
                                             context_length=1024))
    want, _ = run(target, max_tokens=96, ignore_eos=True)
    drafter = DraftModelDrafter(ModelRunner(other, n_ctx=512), catch_up=2)
    got, gen = run(target, drafter, max_tokens=96, ignore_eos=True,
                   draft=DraftParams(n_max=4), adaptive=True)
    assert got == want
    assert drafter._seqs[0].offset > 0  # gaps were left
    assert gen.stats.drafted > 0


def test_a_request_starts_from_the_last_finished_requests_estimates(models, monkeypatch):
    """With a PolicyMemory, a request's adaptive policy starts from the previous one's
    estimates (a fresh one knows no cost before its first round); greedy output stays the
    target's."""
    from specd.daemon.spec.policy import AdaptiveDraftLength, PolicyMemory

    steady_clock(monkeypatch)
    target, draft = models
    want, _ = run(target, max_tokens=40, ignore_eos=True)
    runner = ModelRunner(target, n_ctx=512)
    drafter = draft_drafter(draft)
    memory = PolicyMemory()
    params = GenerationParams(max_tokens=40, ignore_eos=True, adaptive=True,
                              draft=DraftParams(n_max=4))
    rates: list[list[float | None]] = []
    for _ in range(2):
        gen = Generation(runner, 0, PROMPT, params, eog=EOG, drafter=drafter, memory=memory)
        a = gen.policy
        assert isinstance(a, AdaptiveDraftLength)
        rates.append([a.rate(n) for n in range(4)])  # before any round
        out = gen.prefill()
        while not gen.done:
            out += gen.step()
        gen.close()
        assert out == want
        kept = [a.rate(n) for n in range(4)]
    assert rates[0] == [None] * 4
    assert rates[1] == pytest.approx(kept, rel=0.2)
