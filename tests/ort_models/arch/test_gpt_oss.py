"""`gpt-oss` targets: the hyper-parameters (sinks, sliding windows, YaRN, the biased router
and experts), logits against the float64 reference and llama.cpp (specd's writer's file
and a Hugging Face checkpoint converted by llama.cpp's converter), a verified row equal
to a single step, and lossless speculation with a draft model and with prompt lookup.
The experts run on specd's kernels (GgufExperts, MoeRouter); without them the tests
skip."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from specd.daemon.drafters.draft_model import DraftModelDrafter
from specd.daemon.drafters.ngram import NgramDrafter
from specd.daemon.models.building import build_options
from specd.ort_models import native_ops
from specd.ort_models.arch import read_hparams
from specd.ort_models.arch.rope_scaling import rope_cos_sin
from specd.ort_models.gguf_file import GGUFError, GGUFFile
from specd.ort_models.graph_builder import BuildOptions
from specd.ort_models.model_cache import load_or_build
from specd.ort_models.runner import ModelRunner

import llama_cpp_oracle
import tiny_hf_moe
from logprob_agreement import NATIVE_F32, assert_agrees, assert_continuation_agrees
from speculation_checks import assert_block_rows_equal_single_steps, greedy_decode
from tiny_moe import ReferenceGptOssModel, file_factory, write_tiny_gpt_oss, yarn_cos_sin

pytestmark = pytest.mark.skipif(native_ops.library() is None,
                                reason=f"no specd kernels: {native_ops.unavailable_reason()}")

PROMPT = [5, 17, 42, 100, 7, 3, 99, 12, 250, 31, 64, 128]  # longer than the window (8)
EXACT = BuildOptions(kernels="gguf", attention="exact")
FUSED = BuildOptions(kernels="gguf", attention="fused")


@pytest.fixture(scope="module")
def oss_file(tmp_path_factory: pytest.TempPathFactory):
    return file_factory(write_tiny_gpt_oss, tmp_path_factory.mktemp("gpt_oss"))


def test_the_hyper_parameters_are_read(oss_file) -> None:
    hp = read_hparams(GGUFFile(oss_file(n_layer=4, n_used=3)))
    assert hp.arch == "gpt-oss" and hp.attn_sinks and hp.qkv_bias and hp.attn_out_bias
    assert hp.swa_layers == (True, False, True, False) and hp.sliding_window == 8
    assert hp.ffn_norm == "post_attention_norm" and not hp.tied_embeddings
    assert hp.rope_scaling is not None and hp.rope_scaling.kind == "yarn"
    assert (hp.rope_scaling.freq_scale, hp.rope_scaling.n_ctx_orig) == (1 / 32, 256)
    assert hp.moe is not None
    assert (hp.moe.n_used, hp.moe.gating, hp.moe.act, hp.moe.biases, hp.moe.norm) == (
        3, "softmax_weight", "swiglu_oai", True, False)


def test_a_file_without_its_sinks_is_refused(oss_file) -> None:
    from specd.ort_models.tensor_checks import check_model

    f = GGUFFile(oss_file(drop=("blk.1.attn_sinks.weight",)))
    with pytest.raises(GGUFError, match="blk.1.attn_sinks.weight"):
        check_model(f, read_hparams(f))


def test_yarn_tables_follow_llama_cpp() -> None:
    """The rotary tables of a YaRN file against the float64 formula of ggml's rope_yarn
    (the ramp between the kept and the interpolated pairs, the magnitude 1 + 0.1 ln 32)."""
    from specd.ort_models.arch.rope_scaling import RopeScaling

    scaling = RopeScaling(kind="yarn", freq_scale=1 / 32, n_ctx_orig=4096)
    for rope_dim, base in ((64, 150000.0), (16, 150000.0), (128, 10000.0)):
        cos, sin = rope_cos_sin(scaling, 5000, rope_dim, base)
        want_cos, want_sin = yarn_cos_sin(np.arange(5000), rope_dim, base, 32.0, 4096)
        np.testing.assert_allclose(cos, want_cos, atol=3e-6)
        np.testing.assert_allclose(sin, want_sin, atol=3e-6)
    plain_cos, _ = rope_cos_sin(None, 50, 16, 150000.0)
    assert abs(plain_cos[1, -1] - cos[1, -1]) > 0.1  # scaled: not the plain angles


def _router_gaps(ref: ReferenceGptOssModel) -> list[float]:
    """Record, per token and layer, the gap between the last chosen and the first
    unchosen expert's biased logit."""
    gaps: list[float] = []
    route = ref.route

    def recording(layer: int, h: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        p = f"blk.{layer}."
        logits = h @ ref.weights[p + "ffn_gate_inp.weight"].T + ref.weights[
            p + "ffn_gate_inp.bias"]
        for row in logits:
            top = np.sort(row)[::-1]
            gaps.append(float(top[ref.n_used - 1] - top[ref.n_used]))
        return route(layer, h)

    ref.route = recording  # type: ignore[method-assign]
    return gaps


def _specd_logits(path: Path, options: BuildOptions) -> np.ndarray:
    """A prompt, then a block after it (past the window), as specd computes them."""
    r = ModelRunner(load_or_build(path, options), n_ctx=256)
    return np.concatenate([r.forward(0, PROMPT, 0, list(range(len(PROMPT)))),
                           r.forward(0, [77, 78, 79], len(PROMPT), [0, 1, 2])])


@pytest.mark.parametrize("options", [NATIVE_F32, EXACT, FUSED],
                         ids=["native", "exact", "fused"])
def test_logits_match_the_reference(oss_file, options: BuildOptions) -> None:
    """Float32 experts and matrices: the logits the float64 reference computes (sinks,
    sliding windows, YaRN, biases, the router and the clamped SwiGLU) within float32
    rounding, on specd's attention kernel, on the attention written out and on
    GroupQueryAttention (its head_sink); the same
    reference without its sinks, or without YaRN, is far off (each is in the graph)."""
    path = oss_file(expert_type="F32", weight_type="F32", seed=1)
    ref = ReferenceGptOssModel(path)
    gaps = _router_gaps(ref)
    want = ref.forward(PROMPT + [77, 78, 79])  # [T, vocab]
    assert min(gaps) > 1e-3, min(gaps)
    got = _specd_logits(path, options)
    scale = np.abs(want).max()
    assert np.abs(got - want).max() / scale < 2e-4
    np.testing.assert_array_equal(got.argmax(-1), want.argmax(-1))
    for name in ("attn_sinks", "yarn"):
        other = ReferenceGptOssModel(path)
        if name == "yarn":
            other.yarn = None
        else:
            for i in range(other.n_layer):
                del other.weights[f"blk.{i}.attn_sinks.weight"]
        assert np.abs(other.forward(PROMPT + [77, 78, 79]) - want).max() / scale > 1e-2, name


def test_mxfp4_experts_match_the_reference(oss_file) -> None:
    """MXFP4 experts (as gpt-oss ships them), read as stored: within the int8 activations'
    rounding of the experts' products, where the routers choose clearly."""
    path = oss_file(expert_type="MXFP4", weight_type="F32", seed=0)
    ref = ReferenceGptOssModel(path)
    gaps = _router_gaps(ref)
    want = ref.forward(PROMPT + [77, 78, 79])
    assert min(gaps) > 0.05, min(gaps)
    got = _specd_logits(path, NATIVE_F32)
    err = np.abs(got - want).max()
    assert err / np.abs(want).max() < 0.1
    two = np.sort(want, axis=-1)[:, -2:]
    clear = two[:, 1] - two[:, 0] > 2 * err
    np.testing.assert_array_equal(got.argmax(-1)[clear], want.argmax(-1)[clear])


def test_a_verified_row_equals_a_single_step(oss_file) -> None:
    """The target's CPU graph (f16 KV cache, SampleTokens): every row of a block, past the
    sliding window, equals the single step at its position bit for bit."""
    built = load_or_build(oss_file(seed=2), build_options("target"))
    assert_block_rows_equal_single_steps(built, PROMPT)


def test_a_draft_model_is_lossless(oss_file) -> None:
    """A draft of the same vocabulary (the target's weights with Q4_0 experts, close but
    not equal): greedy output byte-identical to target-only decoding, with rounds
    drafted, some drafts accepted and some rejected."""
    target = load_or_build(oss_file(seed=3), build_options("target"))
    draft = load_or_build(oss_file(seed=3, expert_type="Q4_0"), build_options("draft"))
    want, _ = greedy_decode(target, PROMPT, None, max_tokens=60)
    got, gen = greedy_decode(target, PROMPT, DraftModelDrafter(
        ModelRunner(draft, n_ctx=256, row_block=1, min_rows=1)), max_tokens=60)
    assert got == want
    assert gen.stats.rounds > 0 and 0 < gen.stats.accepted < gen.stats.drafted, \
        gen.stats.as_dict()


def test_prompt_lookup_is_lossless(oss_file) -> None:
    """Prompt lookup on the target's own repetitions (few: a random model with sliding
    windows and sinks seldom loops): byte-identical, drafts accepted."""
    target = load_or_build(oss_file(seed=2), build_options("target"))
    want, _ = greedy_decode(target, PROMPT, None, max_tokens=160)
    got, gen = greedy_decode(target, PROMPT, NgramDrafter(), max_tokens=160)
    assert got == want
    assert gen.stats.drafted > 0 and gen.stats.accepted > 0, gen.stats.as_dict()


@pytest.mark.llama_cpp_oracle
@pytest.mark.parametrize("expert_type, weight_type, tol", [
    ("F32", "F32", 0.05), ("MXFP4", "Q8_0", 1.0)])
def test_logits_along_llama_cpps_greedy_path(oss_file, expert_type: str, weight_type: str,
                                             tol: float) -> None:
    """llama-server (float32 KV cache) decodes a tiny gpt-oss file of specd's writer, 20
    tokens past the sliding window: specd's log probabilities agree within llama.cpp's
    rounding, and (float32 experts) greedy continuations agree up to specd's first near
    tie."""
    if reason := llama_cpp_oracle.missing("llama-server"):
        pytest.skip(reason)
    path = oss_file(expert_type=expert_type, weight_type=weight_type, seed=2)
    theirs = llama_cpp_oracle.greedy_with_logprobs(path, PROMPT, 20)
    assert_agrees(path, PROMPT, theirs, tol)
    if expert_type != "F32":  # int8 activations (both sides, rounded apart) on a model
        return  # this flat: near ties from the first tokens
    ours, margins = llama_cpp_oracle.greedy_with_margins(
        ModelRunner(load_or_build(path, build_options("target")), n_ctx=256), PROMPT, 20)
    assert llama_cpp_oracle.agreed_until_near_tie(ours, margins, [t for t, _ in theirs],
                                                  near=0.05) >= 4


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Hugging Face GptOssForCausalLM (YaRN, sinks, sliding windows),
    converted by llama.cpp's own convert_hf_to_gguf.py (float32)."""
    if reason := tiny_hf_moe.skip_reason():
        pytest.skip(reason)
    root = tmp_path_factory.mktemp("hf_gpt_oss")
    return tiny_hf_moe.convert(tiny_hf_moe.write_gpt_oss_checkpoint(root / "hf"),
                               root / "m.gguf")


@pytest.mark.needs_torch
@pytest.mark.needs_transformers
def test_a_converted_checkpoint_matches_the_reference(converted: Path) -> None:
    """llama.cpp's converter's file (its key names, gate/up split, sinks, YaRN keys) reads
    as the reference reads it: logits within float32 rounding."""
    hp = read_hparams(GGUFFile(converted))
    assert hp.arch == "gpt-oss" and hp.moe is not None and hp.rope_scaling is not None
    assert any(hp.swa_layers) and hp.attn_sinks
    want = ReferenceGptOssModel(converted).forward(PROMPT)
    got = ModelRunner(load_or_build(converted, NATIVE_F32), n_ctx=256).forward(
        0, PROMPT, 0, list(range(len(PROMPT))))
    assert np.abs(got - want).max() / np.abs(want).max() < 2e-4


@pytest.mark.llama_cpp_oracle
@pytest.mark.needs_torch
@pytest.mark.needs_transformers
def test_a_converted_checkpoint_decodes_as_llama_cpp_does(converted: Path) -> None:
    """llama-server on the converter's file: specd's log probabilities agree within its
    rounding, and greedy continuations agree up to specd's first near tie."""
    if reason := llama_cpp_oracle.missing("llama-server"):
        pytest.skip(reason)
    theirs = llama_cpp_oracle.greedy_with_logprobs(converted, PROMPT, 16)
    assert_agrees(converted, PROMPT, theirs, 0.05)
    # float32 throughout (an f16 KV cache): a near tie is one within 0.01
    assert_continuation_agrees(converted, PROMPT, 24, near=0.01)
