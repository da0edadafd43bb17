"""`qwen3moe` targets: the hyper-parameters, logits against the float64 reference and
llama.cpp, a verified row equal to a single step, and lossless speculation with a dense
qwen3 draft and with prompt lookup. The experts run on specd's kernels (GgufExperts,
MoeRouter); without them the tests skip, and a build says why it cannot run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from specd.daemon.drafters.draft_model import DraftModelDrafter
from specd.daemon.drafters.ngram import NgramDrafter
from specd.daemon.models.building import build_options
from specd.ort_models import native_ops
from specd.ort_models.arch import read_hparams
from specd.ort_models.gguf_file import GGUFError, GGUFFile
from specd.ort_models.graph_builder import BuildOptions
from specd.ort_models.model_cache import load_or_build
from specd.ort_models.runner import ModelRunner

import llama_cpp_oracle
import tiny_hf_moe
from logprob_agreement import NATIVE_F32, assert_agrees, assert_continuation_agrees
from speculation_checks import assert_block_rows_equal_single_steps, greedy_decode
from tiny_moe import ReferenceMoeModel, file_factory, write_dense_twin, write_tiny_qwen3moe

pytestmark = pytest.mark.skipif(native_ops.library() is None,
                                reason=f"no specd kernels: {native_ops.unavailable_reason()}")

PROMPT = [5, 17, 42, 100, 7, 3, 99, 12, 250, 31, 64, 128]
K_DIMS = {"n_embd": 256, "n_ff_exp": 256}
# float32 KV cache: the reference comparisons see only the products' rounding


@pytest.fixture(scope="module")
def moe_file(tmp_path_factory: pytest.TempPathFactory):
    return file_factory(write_tiny_qwen3moe, tmp_path_factory.mktemp("qwen3moe"))


def test_the_experts_hyper_parameters_are_read(moe_file) -> None:
    hp = read_hparams(GGUFFile(moe_file(n_expert=8, n_used=3, n_ff_exp=32)))
    assert hp.arch == "qwen3moe" and hp.qk_norm
    assert hp.moe is not None
    assert (hp.moe.n_expert, hp.moe.n_used, hp.moe.n_ff, hp.moe.gating, hp.moe.norm) == (
        8, 3, 32, "softmax", True)


def test_more_experts_used_than_there_are_is_refused(moe_file) -> None:
    with pytest.raises(GGUFError, match="expert_used_count 9 exceeds expert_count 8"):
        read_hparams(GGUFFile(moe_file(n_expert=8, n_used=9)))


def test_without_specds_kernels_the_build_says_why(moe_file) -> None:
    with pytest.raises(GGUFError, match="qwen3moe's experts run on specd's own CPU kernels"):
        load_or_build(moe_file(seed=4), BuildOptions())


def _router_gaps(ref: ReferenceMoeModel) -> list[float]:
    """Wrap the reference's router to record, per token and layer, the gap between the
    last chosen and the first unchosen expert's probability."""
    gaps: list[float] = []
    route = ref.route

    def recording(layer: int, h: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        logits = h @ ref.weights[f"blk.{layer}.ffn_gate_inp.weight"].T
        for row in logits:
            top = np.sort(row)[::-1]
            gaps.append(float(top[ref.n_used - 1] - top[ref.n_used]))
        return route(layer, h)

    ref.route = recording  # type: ignore[method-assign]
    return gaps


# seeds whose routers choose clearly at every token (int8 activations move a router's
# probabilities by ~0.01: a gap of 0.05 cannot flip; float32 products by ~1e-6). Float
# experts check the semantics tightly; quantized ones that each type is wired in (their
# bits: test_moe_kernels.py), within int8 activations' rounding, which the tiny models'
# sharp attention amplifies to ~0.2 of the largest logit over 15 tokens
@pytest.mark.parametrize("expert_type, down_type, kw, seed, tol", [
    ("F32", None, {}, 1, 2e-4), ("F16", None, {}, 1, 2e-4), ("Q8_0", None, {}, 4, 0.3),
    ("Q4_0", None, {}, 1, 0.3), ("MXFP4", None, {}, 4, 0.3),
    ("Q4_K", "Q6_K", K_DIMS, 3, 0.3)])
def test_logits_match_the_reference(moe_file, expert_type: str, down_type: str | None,
                                    kw: dict[str, Any], seed: int, tol: float) -> None:
    """A prompt, then a block after it: the logits the float64 reference computes, within
    the products' rounding (float32 for float experts, int8 activations for quantized
    ones), where the reference's routers choose clearly (a near tie between two experts
    may go either way)."""
    path = moe_file(expert_type=expert_type, down_type=down_type, seed=seed, **kw)
    ref = ReferenceMoeModel(path)
    gaps = _router_gaps(ref)
    want = ref.forward(PROMPT + [77, 78, 79])  # [T, vocab]
    assert min(gaps) > (1e-3 if expert_type in ("F32", "F16") else 0.05), min(gaps)
    r = ModelRunner(load_or_build(path, NATIVE_F32), n_ctx=256)
    got = np.concatenate([r.forward(0, PROMPT, 0, list(range(len(PROMPT)))),
                          r.forward(0, [77, 78, 79], len(PROMPT), [0, 1, 2])])
    err = np.abs(got - want).max()
    assert err / np.abs(want).max() < tol
    two = np.sort(want, axis=-1)[:, -2:]
    clear = two[:, 1] - two[:, 0] > 2 * err  # picks the rounding cannot swap
    assert clear.sum() >= (2 if expert_type in ("F32", "F16") else 0)
    np.testing.assert_array_equal(got.argmax(-1)[clear], want.argmax(-1)[clear])


@pytest.mark.parametrize("expert_type, kw", [("Q8_0", {}), ("Q4_K", K_DIMS)])
def test_a_verified_row_equals_a_single_step(moe_file, expert_type: str, kw: dict[str, Any]
                                             ) -> None:
    """The target's CPU graph (f16 KV cache, SampleTokens): every row of a block whose
    tokens wake different experts equals the single step at its position, bit for bit."""
    built = load_or_build(moe_file(expert_type=expert_type, seed=2, **kw),
                          build_options("target"))
    assert_block_rows_equal_single_steps(built, PROMPT)


SPREAD = 0.1  # the target's experts: a shared part the dense draft has, and their own


def test_a_dense_qwen3_draft_is_lossless(moe_file, tmp_path: Path) -> None:
    """A dense qwen3 draft sharing the target's vocabulary (as Qwen3-0.6B beside
    Qwen3-30B-A3B): greedy output byte-identical to target-only decoding, with rounds
    drafted, some drafts accepted and some rejected."""
    target = load_or_build(moe_file(seed=3, spread=SPREAD), build_options("target"))
    draft = load_or_build(write_dense_twin(tmp_path / "draft.gguf", spread=SPREAD, seed=3),
                          build_options("draft"))
    want, _ = greedy_decode(target, PROMPT, None, max_tokens=60)
    got, gen = greedy_decode(target, PROMPT, DraftModelDrafter(
        ModelRunner(draft, n_ctx=256, row_block=1, min_rows=1)), max_tokens=60)
    assert got == want
    assert gen.stats.rounds > 0 and 0 < gen.stats.accepted < gen.stats.drafted, \
        gen.stats.as_dict()


def test_prompt_lookup_is_lossless(moe_file) -> None:
    """Prompt lookup on the target's own repetitions: byte-identical, drafts accepted."""
    target = load_or_build(moe_file(seed=3, spread=SPREAD), build_options("target"))
    want, _ = greedy_decode(target, PROMPT, None, max_tokens=160)
    got, gen = greedy_decode(target, PROMPT, NgramDrafter(), max_tokens=160)
    assert got == want
    assert gen.stats.drafted > 0 and gen.stats.accepted > 0, gen.stats.as_dict()


@pytest.mark.llama_cpp_oracle
def test_logits_along_llama_cpps_greedy_path(moe_file) -> None:
    """llama-server (float32 KV cache) decodes a tiny qwen3moe file of specd's writer:
    specd's log probabilities of llama.cpp's likely tokens agree within llama.cpp's
    rounding (F32 experts: llama.cpp's products are float32 too), and where specd's
    target graph's top two are clearly apart it picks llama.cpp's token."""
    if reason := llama_cpp_oracle.missing("llama-server"):
        pytest.skip(reason)
    for expert_type, tol in (("F32", 0.05), ("Q8_0", 1.0)):
        path = moe_file(expert_type=expert_type, seed=2)
        theirs = llama_cpp_oracle.greedy_with_logprobs(path, PROMPT, 16)
        assert_agrees(path, PROMPT, theirs, tol)


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Hugging Face Qwen3-MoE checkpoint, converted by llama.cpp's own
    convert_hf_to_gguf.py (float32)."""
    if reason := tiny_hf_moe.skip_reason():
        pytest.skip(reason)
    root = tmp_path_factory.mktemp("hf_qwen3moe")
    return tiny_hf_moe.convert(tiny_hf_moe.write_checkpoint(root / "hf"), root / "m.gguf")


@pytest.mark.needs_torch
@pytest.mark.needs_transformers
def test_a_converted_checkpoint_matches_the_reference(converted: Path) -> None:
    """llama.cpp's converter's file (its key names, 3-D expert layout and types) reads as
    the reference reads it: logits within float32 rounding."""
    hp = read_hparams(GGUFFile(converted))
    assert hp.arch == "qwen3moe" and hp.moe is not None and hp.moe.n_expert == 8
    ref = ReferenceMoeModel(converted)
    want = ref.forward(PROMPT)
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
    # float32 experts and matrices (an f16 KV cache): a near tie is one within 0.05
    assert_continuation_agrees(converted, PROMPT, 24, near=0.05)
