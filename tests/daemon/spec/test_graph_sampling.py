"""Tokens decided in the graphs (graph_sampling, SampleTokens) inside the real decode loop:
greedy gives the host path's very tokens, with and without a draft, under penalties, bias
and grammars; seeded sampling is reproducible and independent of how tokens fall into
rounds; only token ids leave the session (tiny models, specd's kernels)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from specd.daemon.drafters.draft_model import DraftModelDrafter
from specd.daemon.spec.drafter import DraftParams
from specd.daemon.spec.generation import Generation, GenerationParams
from specd.daemon.spec.graph_sampling import block_result, grammar_masks, sparse_q, to_sparse
from specd.daemon.spec.sampling import Sampler, SamplerParams
from specd.daemon.spec.verify import SparseDraftProbs
from specd.daemon.text.grammar import compile_constraint
from specd.daemon.text.tokenizer import Tokenizer
from specd.ort_models import native_ops
from specd.ort_models.gguf_file import GGUFFile
from specd.ort_models.graph_builder import BuildOptions
from specd.ort_models.model_cache import BuiltModel, load_or_build
from specd.ort_models.runner import Call, CallOutput, ModelRunner
from specd.ort_models.sampling_op import OK, SampledBlock, SampleSpec

from chi_square import FAIL_P, PASS_P, chi2_pvalue

pytestmark = pytest.mark.skipif(native_ops.library() is None, reason="specd's kernels are off")

TARGET = BuildOptions(kernels="gguf", attention="native", kv_dtype="f16", sampler=True)
DRAFT = BuildOptions(requant="q4k", kernels="gguf", attention="native", kv_dtype="f16",
                     sampler=True)
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                 "maximum": 999}},
          "required": ["n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def models(tiny_model_factory: Callable[..., Path]) -> tuple[BuiltModel, BuiltModel, Tokenizer]:
    tp = tiny_model_factory(arch="qwen2", weight_type="Q8_0", seed=8, context_length=1024)
    dp = tiny_model_factory(arch="qwen2", weight_type="Q8_0", seed=8, perturb=0.01,
                            context_length=1024)
    return (load_or_build(tp, TARGET), load_or_build(dp, DRAFT),
            Tokenizer.from_metadata(GGUFFile(tp).metadata))


class Spy:
    """Counts the target's calls decided in the graph and the logits rows that left it."""

    def __init__(self, runner: ModelRunner, monkeypatch: pytest.MonkeyPatch):
        self.in_graph = self.logits_rows = 0
        real = runner.forward_batch

        def spy(calls: list[Call]) -> list[CallOutput]:
            outs = real(calls)
            for out in outs:
                self.in_graph += out.sampled is not None
                self.logits_rows += out.logits.shape[0] if out.logits.shape[1] else 0
            return outs

        monkeypatch.setattr(runner, "forward_batch", spy)


def _generate(models: tuple[BuiltModel, BuiltModel, Tokenizer], *, with_draft: bool = False,
              prompt: list[int] | None = None, schema: dict[str, Any] | None = None,
              monkeypatch: pytest.MonkeyPatch | None = None,
              **kw: Any) -> tuple[list[int], Generation, Spy | None]:
    target_built, draft_built, tok = models
    target = ModelRunner(target_built, n_ctx=512)
    spy = Spy(target, monkeypatch) if monkeypatch is not None else None
    drafter = DraftModelDrafter(ModelRunner(draft_built, n_ctx=512)) if with_draft else None
    grammar = None if schema is None else compile_constraint("json_schema", schema,
                                                             tok).start()
    params = GenerationParams(**{"max_tokens": 40, "ignore_eos": schema is None,
                                 "draft": DraftParams(n_max=4), **kw})
    gen = Generation(target, 0, prompt or [1, *range(20, 40)], params,
                     eog=set(tok.eot_ids), drafter=drafter, grammar=grammar)
    out = gen.prefill()
    while not gen.done:
        out += gen.step()
    return out, gen, spy


GREEDY_CASES = {
    "plain": {},
    "penalties": {"sampling": SamplerParams(temperature=0.0, repeat_penalty=1.3,
                                            presence_penalty=0.4, frequency_penalty=0.2,
                                            repeat_last_n=16)},
    "bias": {"sampling": SamplerParams(temperature=0.0, logit_bias={5: -np.inf, 7: 3.0,
                                                                    300: 1.5})},
}


@pytest.mark.parametrize("draft", [False, True], ids=["target-only", "draft"])
@pytest.mark.parametrize("case", list(GREEDY_CASES))
def test_greedy_in_the_graph_is_the_host_path_token_for_token(
        models: Any, draft: bool, case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    kw = GREEDY_CASES[case]
    host, _, _ = _generate(models, with_draft=draft, backend_sampling=False, **kw)
    graph, gen, spy = _generate(models, with_draft=draft, monkeypatch=monkeypatch, **kw)
    assert graph == host
    assert spy is not None and spy.in_graph > 0
    assert spy.logits_rows == 0  # no logits row left the session
    if draft:
        assert gen.stats.drafted > 0


@pytest.mark.parametrize("draft", [False, True], ids=["target-only", "draft"])
def test_greedy_under_a_grammar_in_the_graph_is_the_host_path(
        models: Any, draft: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    tok = models[2]
    prompt = tok.encode("give json:")
    host, _, _ = _generate(models, with_draft=draft, prompt=prompt, schema=SCHEMA,
                           backend_sampling=False)
    graph, gen, spy = _generate(models, with_draft=draft, prompt=prompt, schema=SCHEMA,
                                monkeypatch=monkeypatch)
    assert graph == host
    assert gen.finish_reason == "stop"
    assert spy is not None and spy.in_graph > 0


SAMPLED = SamplerParams(temperature=0.9, top_k=40, top_p=0.95, min_p=0.02, seed=11)


@pytest.mark.parametrize("draft", [False, True], ids=["target-only", "draft"])
def test_a_seeded_request_in_the_graph_repeats_itself(models: Any, draft: bool) -> None:
    first, gen, _ = _generate(models, with_draft=draft, sampling=SAMPLED)
    again, _, _ = _generate(models, with_draft=draft, sampling=SAMPLED)
    assert first == again
    other, _, _ = _generate(models, with_draft=draft,
                            sampling=SamplerParams(**{**SAMPLED.__dict__, "seed": 12}))
    assert other != first
    if draft:
        assert gen.stats.drafted > 0


def test_greedy_verification_of_seeded_sampling_is_independent_of_the_draft_length(
        models: Any) -> None:
    """Each position draws its own uniform, so with the target's own choice per row (no
    rejection sampling) the output is target-only decoding's, whatever was drafted."""
    alone, _, _ = _generate(models, sampling=SAMPLED)
    for n_max in (1, 3, 6):
        spec, gen, _ = _generate(models, with_draft=True, sampling=SAMPLED,
                                 draft=DraftParams(n_max=n_max, probabilistic=False))
        assert spec == alone, n_max
        assert gen.stats.drafted > 0


def test_the_draft_chooses_in_its_graph_and_sends_q_as_pairs(
        models: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    _, draft_built, _ = models
    runner = ModelRunner(draft_built, n_ctx=512)
    drafter = DraftModelDrafter(runner)
    sampler = Sampler(SamplerParams(temperature=0.8, top_k=10), seed=3)
    drafter.begin(0, [1, *range(20, 40)], sampler)
    proposal = drafter.draft(0, 50, 21, 4, DraftParams(n_max=4))
    assert len(proposal.tokens) == 4
    q = proposal.q_rows
    assert isinstance(q, SparseDraftProbs) and q.token_ids.shape == (4, 10)
    # each pair row is the draft's top-10 at its temperature, the drafted token among them
    np.testing.assert_allclose(q.probs.sum(axis=1), 1.0, rtol=1e-5)
    for i, t in enumerate(proposal.tokens):
        assert t in q.token_ids[i]


def test_a_spec_must_decide_the_rows_its_call_returns(models: Any) -> None:
    runner = ModelRunner(models[0], n_ctx=512)
    spec = SampleSpec(key=1, position=3, temperature=0.0, drafts=[5])
    with pytest.raises(ValueError, match="decides 2 rows"):
        runner.forward_batch([Call(0, [1, 2, 3], 0, None, (), spec)])


def test_calls_with_and_without_specs_share_a_pass(models: Any) -> None:
    """One call decided in the graph beside one decided on the host, on the same tokens:
    the graph's greedy token is the argmax of the logits the other call returns."""
    runner = ModelRunner(models[0], n_ctx=512, n_seq=2)
    a = Call(0, [1, 2, 3], 0, None, (), SampleSpec(key=1, position=3, temperature=0.0))
    b = Call(1, [1, 2, 3], 0)
    out_a, out_b = runner.forward_batch([a, b])
    assert out_a.sampled is not None and out_b.sampled is None
    assert out_a.logits.shape == (1, 0)
    assert out_b.logits.shape == (1, runner.logits_width)
    assert out_a.sampled.tokens == [int(np.argmax(out_b.logits[0]))]
    alone = runner.forward_batch([Call(0, [1, 2, 3], 0)])[0]
    np.testing.assert_array_equal(out_b.logits, alone.logits)


def test_masks_follow_the_drafts_and_stop_where_the_grammar_completes(models: Any) -> None:
    tok = models[2]
    grammar = compile_constraint("json_schema", SCHEMA, tok).start()
    text = tok.encode('{"n":7}', add_bos=False)
    masks, stop = grammar_masks(grammar, text, tok.vocab_size)
    assert stop == len(text) - 1
    probe = grammar.fork()
    for i, t in enumerate(text):
        np.testing.assert_array_equal(masks[i], probe.allowed(tok.vocab_size))
        probe.consume(t)


def test_dense_q_rows_become_pairs_and_wide_ones_stay_on_the_host() -> None:
    q = np.zeros((2, 50))
    q[0, [3, 9]] = (0.25, 0.75)
    q[1, 4] = 1.0
    sparse = sparse_q(q)
    assert sparse is not None
    np.testing.assert_array_equal(sparse.token_ids, [[3, 9], [4, -1]])
    np.testing.assert_allclose(sparse.dense_row(0, 50), q[0])
    assert sparse_q(np.full((1, 100), 0.01)) is None
    mixed = to_sparse([q[0], (np.array([7]), np.array([1.0]))])
    np.testing.assert_array_equal(mixed.token_ids, [[3, 9], [7, -1]])


def test_rejection_sampling_in_the_graph_follows_the_target_distribution(models: Any) -> None:
    """The second token of a sampled request with a one-token draft is decided by the
    graph's rejection sampling (accept the draft, else the residual): over seeds it follows
    the target's own marginal, sum over t1 of p(t1) p(t2 | t1), computed on the host."""
    target_built, draft_built, tok = models
    params = SamplerParams(temperature=1.0, top_k=6)
    prompt = [1, *range(20, 40)]
    host = ModelRunner(target_built, n_ctx=512)
    p1 = Sampler(params, seed=0).probs(host.prefill(0, prompt))  # [vocab]
    marginal = np.zeros_like(p1)
    for t1 in np.flatnonzero(p1):
        row = host.forward(0, [int(t1)], len(prompt))[0]
        marginal += p1[t1] * Sampler(params, seed=0).probs(row)
    target = ModelRunner(target_built, n_ctx=512)
    drafter = DraftModelDrafter(ModelRunner(draft_built, n_ctx=512))
    counts = np.zeros_like(marginal)
    accepted = drafted = 0
    runs = 1500
    for seed in range(runs):
        gen = Generation(target, 0, prompt, GenerationParams(
            max_tokens=3, ignore_eos=True, draft=DraftParams(n_max=1),
            sampling=SamplerParams(temperature=1.0, top_k=6, seed=seed)),
            eog=set(), drafter=drafter)
        out = gen.prefill()
        while not gen.done:
            out += gen.step()
        assert gen.in_graph
        counts[out[1]] += 1
        accepted, drafted = accepted + gen.stats.accepted, drafted + gen.stats.drafted
        gen.close()
    assert drafted == runs and 0.1 * runs < accepted < 0.95 * runs  # both paths ran
    # tokens expected fewer than 5 times are pooled into one bin
    big = marginal * runs >= 5
    pooled_counts = np.append(counts[big], counts[~big].sum())
    pooled_p = np.append(marginal[big], marginal[~big].sum())
    assert chi2_pvalue(pooled_counts, pooled_p) > PASS_P
    # and not the second token's distribution after the likeliest first token alone
    t1 = int(np.argmax(p1))
    alone = Sampler(params, seed=0).probs(host.forward(0, [t1], len(prompt))[0])
    assert chi2_pvalue(pooled_counts, np.append(alone[big], alone[~big].sum())) < FAIL_P


@pytest.mark.parametrize("post", [False, True], ids=["logprobs", "post-sampling"])
def test_logprobs_of_tokens_decided_in_the_graph_are_the_host_paths(
        models: Any, post: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A request asking for logprobs has its tokens decided in the graph, and its logprobs
    under the raw logits too (no logits row leaves the session), equal to the host path's
    but for the float32 exps of the graph's sum; post-sampling ones are computed on the
    host from the rows' logits, exactly as the host path computes them."""
    kw = {"logprobs": 3, "post_sampling_probs": post,
          "sampling": SamplerParams(temperature=0.0, repeat_penalty=1.2)}
    host, host_gen, _ = _generate(models, with_draft=True, backend_sampling=False, **kw)
    graph, gen, spy = _generate(models, with_draft=True, monkeypatch=monkeypatch, **kw)
    assert graph == host
    assert spy is not None and spy.in_graph > 0
    if post:
        assert gen.token_logprobs == host_gen.token_logprobs
        assert spy.logits_rows > 0
        return
    assert spy.logits_rows == 0
    assert len(gen.token_logprobs) == len(host_gen.token_logprobs) == len(graph)
    for got, want in zip(gen.token_logprobs, host_gen.token_logprobs, strict=True):
        assert got.token == want.token
        assert got.logprob == pytest.approx(want.logprob, abs=1e-6)
        assert [i for i, _ in got.top] == [i for i, _ in want.top]
        np.testing.assert_allclose([v for _, v in got.top], [v for _, v in want.top],
                                   atol=1e-6)


def test_a_fully_accepted_block_gives_the_policy_its_bonus_distribution() -> None:
    """After full acceptance at T > 0 the bonus row's candidates become the distribution the
    draft-length policy weighs the draft's guess against (where asked for)."""
    block = SampledBlock([4, 9], 1, OK, (0.8,),
                         np.array([[4, 2, -1], [9, 3, -1]]),
                         np.array([[0.9, 0.1, 0.0], [0.75, 0.25, 0.0]], dtype=np.float32))
    sampler = Sampler(SamplerParams(temperature=0.7, seed=1))
    result = block_result(block, 1, sampler, None, 12, bonus=True)
    assert result.tokens == [4, 9] and result.n_accepted == 1 and sampler.history == [4, 9]
    assert result.bonus_probs is not None
    np.testing.assert_allclose(result.bonus_probs[[9, 3]], [0.75, 0.25])
    assert result.bonus_probs.sum() == pytest.approx(1.0)
    assert block_result(block, 1, sampler, None, 12).bonus_probs is None
    greedy = Sampler(SamplerParams(temperature=0.0))
    assert block_result(block, 1, greedy, None, 12, bonus=True).bonus_probs is None


@pytest.mark.parametrize("seed", range(4))
def test_sampled_drafts_under_a_grammar_in_the_graph_stay_valid(models: Any, seed: int) -> None:
    """Rejection sampling of drafts under a JSON schema in the graph (masks along the
    drafts, the block ended where the grammar completes): the output parses and validates,
    and the seed repeats it."""
    import json

    import jsonschema

    tok = models[2]
    kw = {"prompt": tok.encode("give json:"), "schema": SCHEMA, "max_tokens": 60,
          "sampling": SamplerParams(temperature=1.2, seed=seed)}
    out, gen, _ = _generate(models, with_draft=True, **kw)
    again, _, _ = _generate(models, with_draft=True, **kw)
    assert out == again and gen.finish_reason == "stop" and gen.stats.drafted > 0
    jsonschema.validate(json.loads(tok.decode(out)), SCHEMA)
