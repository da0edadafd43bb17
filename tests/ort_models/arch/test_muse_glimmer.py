"""muse-glimmer (Onyx): its hyper-parameters as llama.cpp reads them, tiny models against
the float64 numpy reference in every attention kind (a prompt across the sliding window,
global layers without RoPE, the attention gate, the embedding and post norms, the logit
multiplier), a verified row equal to a single step, speculation lossless with a draft
model and with prompt lookup, and llama.cpp's own logits and greedy continuations where
it is built. Checkpoints converted by llama.cpp's converter: test_muse_glimmer_hf.py."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from specd.daemon.drafters.draft_model import DraftModelDrafter
from specd.daemon.drafters.ngram import NgramDrafter
from specd.daemon.spec.drafter import Drafter
from specd.daemon.spec.generation import Generation
from specd.ort_models import native_ops
from specd.ort_models.arch import read_hparams
from specd.ort_models.gguf_file import GGUFError, GGUFFile
from specd.ort_models.graph_builder import BuildOptions
from specd.ort_models.model_cache import load_or_build
from specd.ort_models.runner import ModelRunner

import llama_cpp_oracle
from numpy_muse_glimmer import MuseGlimmerReference
from speculation_checks import (
    assert_block_rows_equal_single_steps,
    assert_speculated,
    greedy_decode,
)
from tiny_muse_glimmer import write_tiny_muse_glimmer

PROMPT = [5, 17, 42, 100, 7, 3, 99, 12, 250, 31, 64, 128, 9, 33]  # longer than the window
NATIVE = BuildOptions(kernels="gguf", attention="native", kv_dtype="f16")


@pytest.fixture(scope="session")
def muse_factory(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """`factory(**write_tiny_muse_glimmer kwargs) -> Path`, one file per kwargs."""
    root = tmp_path_factory.mktemp("tiny_muse")
    made: dict[str, Path] = {}

    def make(**kw: Any) -> Path:
        key = json.dumps(kw, sort_keys=True)
        if key not in made:
            made[key] = write_tiny_muse_glimmer(root / f"muse-{len(made)}.gguf", **kw)
        return made[key]

    return make


@pytest.mark.parametrize("pattern, want", [
    (None, (True, True, True, False)), (2, (True, False, True, False)),
    ([False, True, True, True], (False, True, True, True))])
def test_hyper_parameters_as_llama_cpp_reads_them(muse_factory: Callable[..., Path],
                                                  pattern: Any, want: tuple[bool, ...]
                                                  ) -> None:
    """The converter's per-layer array, or a period: sliding layers rotate, global ones
    (every 4th counted back from the last, by default) do not."""
    hp = read_hparams(GGUFFile(muse_factory(swa_pattern=pattern)))
    assert hp.swa_layers == want and hp.sliding_window == 5
    assert [hp.uses_rope(i) for i in range(4)] == list(want)
    assert hp.rope_interleaved and hp.qk_norm and hp.post_norms and hp.attn_gate
    assert hp.embedding_norm and hp.post_norm_eps == 1e-8 and hp.logit_scale == 0.75
    assert hp.final_softcap == 30.0 and hp.rope_base_swa == hp.rope_base == 10000.0
    assert not hp.tied_embeddings and hp.attn_scale == 1 / np.sqrt(32)


def test_softcapping_defaults_to_llama_cpps_30(muse_factory: Callable[..., Path]) -> None:
    hp = read_hparams(GGUFFile(muse_factory(final_softcap=None)))
    assert hp.final_softcap == 30.0
    assert read_hparams(GGUFFile(muse_factory(final_softcap=0.0))).final_softcap is None


def test_a_file_without_a_gate_is_refused(muse_factory: Callable[..., Path],
                                          tmp_path: Path) -> None:
    """A layer's attention gate is required: its absence is named before any build."""
    from specd.ort_models.model_cache import validate_gguf

    _without(muse_factory(), tmp_path / "nogate.gguf", "blk.2.attn_gate.weight")
    with pytest.raises(GGUFError, match="missing tensor 'blk.2.attn_gate.weight'"):
        validate_gguf(GGUFFile(tmp_path / "nogate.gguf"))


def _without(src: Path, dst: Path, tensor: str) -> None:
    """`src` rewritten without `tensor` (gguf-py)."""
    from gguf import GGUFReader, GGUFWriter

    r = GGUFReader(str(src))
    w = GGUFWriter(str(dst), "muse-glimmer")
    for name, field in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        w.add_key_value(name, field.contents(), field.types[0],
                        field.types[-1] if len(field.types) > 1 else None)
    for t in r.tensors:
        if t.name != tensor:
            w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


_KINDS = {"exact": BuildOptions(accuracy_level=1),
          "fused": BuildOptions(accuracy_level=1, attention="fused")}
if native_ops.library() is not None:
    _KINDS["native"] = BuildOptions(accuracy_level=1, kernels="gguf", attention="native")


@pytest.mark.parametrize("kind", list(_KINDS))
def test_logits_match_the_reference(muse_factory: Callable[..., Path], kind: str) -> None:
    """float32 products: every row of a prompt that crosses the sliding window, then a
    block after it, as the float64 reference computes them."""
    path = muse_factory(seed=1)
    want = MuseGlimmerReference(path).forward(PROMPT + [77, 78, 79])  # [T, vocab]
    r = ModelRunner(load_or_build(path, _KINDS[kind]), n_ctx=256)
    got = r.forward(0, PROMPT, 0, list(range(len(PROMPT))))
    block = r.forward(0, [77, 78, 79], len(PROMPT), [0, 1, 2])
    got = np.concatenate([got, block])
    assert np.abs(got - want).max() / np.abs(want).max() < 2e-5


def test_each_mechanism_moves_the_logits(muse_factory: Callable[..., Path]) -> None:
    """The reference is not blind to what it checks: a file whose gates, window or logit
    multiplier differ gives other logits (so agreeing with it pins each of them)."""
    base = MuseGlimmerReference(muse_factory(seed=1)).forward(PROMPT)
    for kw in ({"logit_scale": 0.5}, {"sliding_window": 50}, {"swa_pattern": 0}):
        other = MuseGlimmerReference(muse_factory(seed=1, **kw)).forward(PROMPT)
        assert np.abs(other - base).max() > 1e-2, kw


@pytest.mark.skipif(native_ops.library() is None, reason="specd's kernels are off")
@pytest.mark.parametrize("split", [3, 9])
def test_a_verified_row_equals_a_single_step(muse_factory: Callable[..., Path],
                                             split: int) -> None:
    """The target's CPU graph (GgufMatMul, CachedAttention with the window and without
    RoPE on the global layers, f16 cache): rows of a block equal single steps bit for
    bit, before and past the window's edge."""
    built = load_or_build(muse_factory(weight_type="Q8_0", seed=1), NATIVE)
    assert_block_rows_equal_single_steps(built, PROMPT, split)


def _target(factory: Callable[..., Path]) -> Any:
    return load_or_build(factory(weight_type="Q8_0", seed=1),
                         NATIVE if native_ops.library() is not None else BuildOptions())


def _decode(target: Any, prompt: list[int], drafter: Drafter | None,
            n_max: int = 4) -> tuple[list[int], Generation]:
    return greedy_decode(target, prompt, drafter, max_tokens=48, n_max=n_max)


def test_greedy_with_a_draft_model_is_target_only(muse_factory: Callable[..., Path]
                                                   ) -> None:
    """A tiny muse-glimmer draft (the target perturbed) across the window's edge: the
    output is target-only decoding's, drafts accepted and rejected on the way."""
    target = _target(muse_factory)
    draft = load_or_build(muse_factory(weight_type="Q8_0", seed=1, perturb=0.05))
    want, _ = _decode(target, PROMPT, None)
    got, gen = _decode(target, PROMPT, DraftModelDrafter(
        ModelRunner(draft, n_ctx=256, row_block=1, min_rows=1)))
    assert_speculated(gen.stats)
    assert gen.stats.accepted < gen.stats.drafted
    assert got == want


def test_greedy_with_prompt_lookup_is_target_only(muse_factory: Callable[..., Path]) -> None:
    """Prompt lookup over a prompt that repeats the target's own continuation: its
    offer is verified and partly accepted, and the output is target-only decoding's."""
    target = _target(muse_factory)
    own, _ = _decode(target, PROMPT, None)
    prompt = PROMPT + own + PROMPT + own[:8]  # what may follow is in the prompt already
    want, _ = _decode(target, prompt, None)
    got, gen = _decode(target, prompt, NgramDrafter(), n_max=8)
    assert_speculated(gen.stats)
    assert got == want


@pytest.mark.llama_cpp_oracle
def test_logits_along_llama_cpps_greedy_path(muse_factory: Callable[..., Path]) -> None:
    """llama-server (float32 KV cache) decoding the test writer's file greedily: specd's
    float32 log probabilities of llama.cpp's likely tokens agree within its rounding, and
    specd's continuation equals llama.cpp's and the reference's up to the first near tie."""
    if reason := llama_cpp_oracle.missing("llama-server"):
        pytest.skip(reason)
    path = muse_factory(seed=3, logit_scale=1.5)
    theirs = llama_cpp_oracle.greedy_with_logprobs(path, PROMPT, 16)
    tokens = [t for t, _ in theirs]
    r = ModelRunner(load_or_build(path, BuildOptions(accuracy_level=1)), n_ctx=256)
    exact = r.forward(0, PROMPT + tokens[:-1], 0,
                      list(range(len(PROMPT) - 1, len(PROMPT) - 1 + len(tokens))))
    logp = exact - exact.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))  # log softmax [rows, vocab]
    compared = 0
    for i, (_, top) in enumerate(theirs):
        for tid, lp in top.items():
            if lp > -5:
                assert abs(logp[i, tid] - lp) < 0.05, (i, tid, logp[i, tid], lp)
                compared += 1
    assert compared >= len(tokens)
    want, margins = MuseGlimmerReference(path).greedy_with_margins(PROMPT, 16)
    ours, _ = llama_cpp_oracle.greedy_with_margins(
        ModelRunner(load_or_build(path, BuildOptions(accuracy_level=1)), n_ctx=256),
        PROMPT, 16)
    clear = llama_cpp_oracle.agreed_until_near_tie(want, margins, tokens, near=0.05)
    assert clear >= 8 and ours[:clear] == want[:clear]
