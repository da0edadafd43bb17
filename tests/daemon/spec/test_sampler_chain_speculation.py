"""A request's sampler chain under speculation (tiny models): the target's distribution is
the whole chain's, so a greedy chain's text with a draft model is the target-only text
byte for byte (prompt lookup: tests/ipc/test_fim_replay.py, on a real model, which copies
from its prompt as a random one does not), a seeded one (coupled drafts) the target-only draws, and
rejection sampling emits the chain's distribution; a chain the graph does not run decides
on the host, a chain it runs in the graph."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from specd.daemon.drafters.draft_model import DraftModelDrafter
from specd.daemon.spec.drafter import Drafter, DraftParams
from specd.daemon.spec.generation import Generation, GenerationParams
from specd.daemon.spec.sampling import SamplerParams, SamplerVocab
from specd.daemon.text.tokenizer import Tokenizer
from specd.ort_models import native_ops
from specd.ort_models.gguf_file import GGUFFile
from specd.ort_models.graph_builder import BuildOptions
from specd.ort_models.model_cache import BuiltModel, load_or_build
from specd.ort_models.runner import ModelRunner

from speculation_checks import assert_speculated, decode_all, second_token_check

HOST = BuildOptions()
GRAPH = BuildOptions(kernels="gguf", attention="native", kv_dtype="f16", sampler=True)
needs_kernels = pytest.mark.skipif(native_ops.library() is None,
                                   reason="specd's kernels are off")
# the random model's distributions are flat: top-k 3 leaves the infill sampler text tokens
# above its thresholds, and it ends the text where an end of generation competes
VIM = ("top_k", "top_p", "infill")
GREEDY_INFILL = SamplerParams(samplers=(*VIM, "temperature"), top_k=3, top_p=0.9,
                              temperature=0.0)
LONG = [348, 20, 31, 42, 53, 64, 75, 86, 97, 108, 119, 130]  # runs to max_tokens
ENDS = [1, *range(80, 120)]  # infill ends it (36 tokens)


class _Models:
    def __init__(self, factory: Callable[..., Path], options: BuildOptions):
        target = factory(arch="qwen2", weight_type="Q8_0", seed=3, context_length=1024,
                         fim=True)
        draft = factory(arch="qwen2", weight_type="Q8_0", seed=3, perturb=0.01,
                        context_length=1024, fim=True)
        self.tok = Tokenizer.from_metadata(GGUFFile(target).metadata)
        self.vocab = SamplerVocab.from_tokenizer(self.tok)
        self.target: BuiltModel = load_or_build(target, options)
        self.draft: BuiltModel = load_or_build(draft, options)

    def run(self, prompt: list[int], sampling: SamplerParams, drafter: Drafter | None = None,
            **kw: object) -> tuple[list[int], Generation]:
        params = GenerationParams(**{"max_tokens": 64, "sampling": sampling,
                                     "draft": DraftParams(n_max=4), **kw})  # type: ignore[arg-type]
        gen = Generation(ModelRunner(self.target, n_ctx=512), 0, prompt, params,
                         eog=set(self.tok.eot_ids), drafter=drafter, vocab=self.vocab)
        return decode_all(gen), gen

    def draft_drafter(self) -> DraftModelDrafter:
        return DraftModelDrafter(ModelRunner(self.draft, n_ctx=512))


@pytest.fixture(scope="module", params=[pytest.param(HOST, id="host"),
                                        pytest.param(GRAPH, id="graph", marks=needs_kernels)])
def models(request: pytest.FixtureRequest, tiny_model_factory: Callable[..., Path]) -> _Models:
    return _Models(tiny_model_factory, request.param)


def test_a_greedy_infill_chain_is_byte_identical_under_speculation(models: _Models) -> None:
    want, alone = models.run(ENDS, GREEDY_INFILL)
    assert not alone.in_graph  # infill: the host's
    assert alone.finish_reason == "stop" and 4 < len(want) < 64
    assert want[-1] in models.tok.eot_ids
    got, gen = models.run(ENDS, GREEDY_INFILL, models.draft_drafter())
    assert got == want
    assert_speculated(gen.stats)
    assert gen.stats.accepted >= 10, gen.stats.as_dict()


def test_a_seeded_infill_chain_emits_the_target_only_draws(models: _Models) -> None:
    """llama.vim's chain as sent (no temperature step: sampled at temperature 1)."""
    sampling = SamplerParams(samplers=VIM, top_k=3, top_p=0.9, seed=7, logit_bias={353: 2.0})
    want, alone = models.run(LONG, sampling)
    assert len(want) > 4
    for n_max in (2, 4):
        got, gen = models.run(LONG, sampling, models.draft_drafter(),
                              draft=DraftParams(n_max=n_max))
        assert gen.coupled and not gen.in_graph
        assert got == want, n_max
        assert_speculated(gen.stats)


def test_a_chain_the_graph_runs_decides_there(models: _Models) -> None:
    """"kpt" (top-k, top-p, temperature) is the graph's order: decided in the graph
    where it samples, with the text the default chain gives."""
    explicit = SamplerParams(samplers=("top_k", "top_p", "temperature"), top_k=3, top_p=0.9,
                             temperature=0.0, min_p=0.3)  # min_p is not in the chain
    default = SamplerParams(top_k=3, top_p=0.9, temperature=0.0)
    got, gen = models.run(LONG, explicit, models.draft_drafter())
    assert gen.in_graph == (models.target.options.sampler is True)
    assert got == models.run(LONG, default)[0]
    assert_speculated(gen.stats)


def test_min_keep_decides_on_the_host_with_the_target_only_draws(models: _Models) -> None:
    """min_keep on top-p: the graph's top-p has none, so the request samples on the host
    (also where the graph samples); seeded, its coupled drafts give the target-only draws,
    which min_keep changes."""
    sampling = SamplerParams(top_p=0.2, min_keep=4, temperature=1.0, seed=5)
    want, alone = models.run(LONG, sampling)
    assert not alone.in_graph
    assert want != models.run(LONG, SamplerParams(top_p=0.2, temperature=1.0, seed=5))[0]
    got, gen = models.run(LONG, sampling, models.draft_drafter())
    assert gen.coupled and not gen.in_graph
    assert got == want
    assert_speculated(gen.stats)


@pytest.mark.parametrize("sampling", [
    pytest.param(dict(samplers=VIM, top_k=5, top_p=0.95), id="llama.vim"),
    pytest.param(dict(samplers=("top_p", "min_p", "temperature"), top_p=0.05, min_p=0.6,
                      min_keep=4), id="min_keep"),
    pytest.param(dict(samplers=("top_n_sigma", "typ_p", "temperature"), top_n_sigma=1.5,
                      typical_p=0.8), id="sigma-typical"),
])
def test_rejection_sampling_emits_the_chains_distribution(
        tiny_model_factory: Callable[..., Path], sampling: dict) -> None:
    """The second token of drafts verified by rejection sampling against the chain's p
    fits the target's own distribution of it (marginal over the first)."""
    m = _Models(tiny_model_factory, HOST)
    p, accepted = second_token_check(ModelRunner(m.target, n_ctx=512), m.draft_drafter(),
                                     LONG, n_runs=1500, vocab=m.vocab, **sampling)
    assert p > 1e-4, p
    assert accepted > 100, accepted  # q is the unfiltered draft: most rows differ
