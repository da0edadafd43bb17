"""A DFlash head's graphs on ONNX Runtime against the numpy reference: the injected K/V
rows, the block's logits, and rounds that overwrite rejected rows."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from specd.ort_models.head_runner import HeadRunner, load_or_build_head

from numpy_reference import ReferenceDFlash, ReferenceEagle3, ReferenceModel
from tiny_heads import gemma_features, write_tiny_head

PROMPT = [348, 20, 31, 42, 53, 64, 75, 86, 97, 108, 119, 130]
TOL = dict(rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def target_path(tiny_model_factory: Callable[..., Path]) -> Path:
    return tiny_model_factory(arch="qwen3", weight_type="Q8_0", seed=3, context_length=512)


def _pair(target_path: Path, tmp_path: Path, kind: str = "dflash", **head: Any
          ) -> tuple[HeadRunner, ReferenceDFlash, ReferenceModel]:
    path = write_tiny_head(tmp_path / "head.gguf", kind=kind, seed=5, **head)
    ref_target = ReferenceModel(target_path)
    # ONNX Runtime's products in float32 (accuracy level 1), as the reference computes
    runner = HeadRunner(load_or_build_head(path, target_path, accuracy_level=1, kernels="ort"),
                        n_ctx=512)
    return runner, ReferenceDFlash(path, ref_target, n_ctx=runner.n_ctx), ref_target


def _injected(runner: HeadRunner, ref: ReferenceDFlash, ref_target: ReferenceModel
              ) -> tuple[HeadRunner, ReferenceDFlash, list[int], int]:
    """The prompt's features injected into both; the block [last, MASK x 3] to run at the
    position after it."""
    features = _features(ref, ref_target, PROMPT)
    n = len(PROMPT)
    runner.inject(0, features.astype(np.float32), 0)
    ref.inject(features, np.arange(n))
    mask = runner.built.head.mask_token_id
    assert mask is not None
    return runner, ref, [PROMPT[-1], mask, mask, mask], n


def _features(ref_head: ReferenceDFlash, ref_target: ReferenceModel, tokens: list[int]
              ) -> np.ndarray:
    inputs: dict[int, np.ndarray] = {}
    ref_target.step(tokens, ref_target.new_cache(), inputs)
    return ref_head.features(inputs)  # [T, L*E]


@pytest.mark.parametrize("head", [
    {}, {"causal": True}, {"causal": False}, {"own_embeddings": True, "own_output": True},
    {"draft_vocab": 100}], ids=["default", "causal", "not-causal", "own-tensors", "d2t"])
def test_injection_and_block_match_the_reference(target_path: Path, tmp_path: Path,
                                                 head: dict[str, Any]) -> None:
    runner, ref, ref_target = _pair(target_path, tmp_path, **head)
    features = _features(ref, ref_target, PROMPT)
    n = len(PROMPT)
    runner.inject(0, features.astype(np.float32), 0)
    ref.inject(features, np.arange(n))
    for layer, (k, v) in enumerate(runner.kv.layers(0)):
        np.testing.assert_allclose(k[0, :, :n], ref.keys[layer][:, :n], **TOL)
        np.testing.assert_allclose(v[0, :, :n], ref.values[layer][:, :n], **TOL)
    mask = runner.built.head.mask_token_id
    assert mask is not None
    block = [PROMPT[-1], mask, mask, mask]
    got = runner.block(0, block, n, [0, 1, 2, 3]).logits  # [4, vocab]
    want = ref.block(block, n)
    assert got.shape == want.shape == (4, ref_target.vocab_size)
    finite = np.isfinite(want)
    assert np.array_equal(np.isfinite(got), finite)  # d2t: the same ids left at -inf
    np.testing.assert_allclose(got[finite], want[finite], **TOL)
    if head.get("causal"):  # row 0 sees nothing after it: the block's other rows don't count
        np.testing.assert_allclose(runner.block(0, block[:1], n, [0]).logits, want[:1],
                                   **TOL)


@pytest.mark.parametrize("head", [
    {}, {"confidence_head": False}, {"sample_from_anchor": False}, {"draft_vocab": 100},
    {"draft_vocab": 100, "markov_rank": 8, "confidence_head": False},
    {"weight_type": "Q8_0"}],
    ids=["default", "no-confidence", "bonus-anchor", "d2t", "d2t-rank8-no-confidence", "q8_0"])
def test_dspark_markov_chain_and_confidence_match_the_reference(
        target_path: Path, tmp_path: Path, head: dict[str, Any]) -> None:
    """DSpark's block: each read row biased by W2 · W1[prev], prev chained from the anchor
    through each row's argmax (in the draft vocabulary, mapped through d2t), and the
    confidence head over [normed row ; W1[prev]]; for any run of rows, as the drafter reads
    them in either layout."""
    runner, ref, block, n = _injected(*_pair(target_path, tmp_path, kind="dspark", **head))
    for rows in ([0, 1, 2, 3], [1, 2, 3], [0]):
        got = runner.block(0, block, n, rows)
        want, conf = ref.markov_block(block, n, rows)
        finite = np.isfinite(want)
        assert np.array_equal(np.isfinite(got.logits), finite)
        np.testing.assert_allclose(got.logits[finite], want[finite], **TOL)
        if conf is None:
            assert got.confidence is None
        else:
            assert got.confidence is not None
            np.testing.assert_allclose(got.confidence, conf, **TOL)
    # the chain conditions on the previous row's argmax: not the unbiased logits
    plain = ref.block(block, n)
    assert not np.allclose(runner.block(0, block, n, [0, 1]).logits[1], plain[1][None])


def test_rounds_overwrite_rejected_rows(target_path: Path, tmp_path: Path) -> None:
    """A block writes its rows after the context; the next round injects the verified
    tokens over them: the cache then holds what one injection of the whole sequence
    writes, and the next block's logits are those of a fresh run."""
    runner, ref, ref_target = _pair(target_path, tmp_path)
    seq = PROMPT + [7, 8, 9, 10, 11]
    features = _features(ref, ref_target, seq).astype(np.float32)
    n = len(PROMPT)
    mask = runner.built.head.mask_token_id
    runner.inject(0, features[:n], 0)
    runner.block(0, [seq[n], mask, mask, mask], n, [1, 2, 3])  # rows n..n+3 written
    runner.inject(0, features[n:n + 2], n)  # two verified: n, n + 1; rows n+2, n+3 stale
    fresh = HeadRunner(runner.built, n_ctx=512)
    fresh.inject(0, features[:n + 2], 0)
    block = [seq[n + 2], mask, mask]
    np.testing.assert_array_equal(runner.block(0, block, n + 2, [0, 1, 2]).logits,
                                  fresh.block(0, block, n + 2, [0, 1, 2]).logits)
    for (k, v), (k2, v2) in zip(runner.kv.layers(0), fresh.kv.layers(0), strict=True):
        np.testing.assert_array_equal(k[0, :, :n + 5], k2[0, :, :n + 5])
        np.testing.assert_array_equal(v[0, :, :n + 5], v2[0, :, :n + 5])


def test_non_finite_features_are_clamped(target_path: Path, tmp_path: Path) -> None:
    runner, ref, ref_target = _pair(target_path, tmp_path)
    features = _features(ref, ref_target, PROMPT[:4])
    features[0, 0], features[1, 3], features[2, 5] = np.nan, np.inf, -1e9
    runner.inject(0, features.astype(np.float32), 0)
    ref.inject(features, np.arange(4))
    k = runner.kv.layers(0)[0][0][0, :, :4]
    assert np.isfinite(k).all()
    np.testing.assert_allclose(k, ref.keys[0][:, :4], **TOL)


# what llama.cpp's dflash layers read for heads of Gemma targets (a window of 5 keys: the
# block's rows at 12..15 see part of the 12-token context)
GEMMA = {
    "embedding-scale": gemma_features(),
    "sliding-window": gemma_features(sliding_window=5),
    "sliding-window-all": gemma_features(sliding_window=5, pattern=[True, True]),
    "gelu": gemma_features(gelu=True),
    "attention-scales": gemma_features(attention_scale=0.3, value_scale=0.7),
    "post-norms-output-scale": gemma_features(post_norms=True, output_scale=0.9),
    "gemma3-like": gemma_features(sliding_window=5, gelu=True, post_norms=True),
    "shared-kv": gemma_features(shared_kv=True),
    "attention-sinks": gemma_features(sinks=True),
    "gemma4-like": gemma_features(sliding_window=5, shared_kv=True, sinks=True,
                                  post_norms=True, output_scale=0.9),
    "rope-linear": gemma_features(rope_linear=8.0),
    "rope-freqs": gemma_features(rope_freqs=True),
}


@pytest.mark.parametrize("kind", ["dflash", "dspark", "dflash2"])
@pytest.mark.parametrize("name", list(GEMMA))
def test_heads_of_gemma_targets_match_the_reference(target_path: Path, tmp_path: Path,
                                                    name: str, kind: str) -> None:
    """A head with an embedding scale, sliding-window layers, GELU, attention and value
    scales, post-norms and an output scale: its block as the reference computes it (a
    DFlash2 head's layers take the first four; the others it refuses, naming them)."""
    features = GEMMA[name]
    if kind == "dflash2" and ("value_scale" in str(features) or any(
            "post_" in name or "output_scale" in name for name in features["tensors"])):
        path = write_tiny_head(tmp_path / "head.gguf", kind=kind, seed=5, **features)
        with pytest.raises(ValueError, match="DFlash2|post_attention_norm|output_scale"):
            load_or_build_head(path, target_path, accuracy_level=1, kernels="ort")
        return
    runner, ref, block, n = _injected(*_pair(target_path, tmp_path, kind=kind, **features))
    rows = [1, 2, 3]
    got = runner.block(0, block, n, rows)
    if kind == "dflash2":
        cand, scores = ref.lattice(block, n, rows)
        assert got.candidates is not None and got.scores is not None
        np.testing.assert_array_equal(got.candidates, cand)
        np.testing.assert_allclose(got.scores, scores, **TOL)
        return
    want = (ref.block(block, n)[rows] if kind == "dflash"
            else ref.markov_block(block, n, rows)[0])
    np.testing.assert_allclose(got.logits, want, **TOL)
    # the features change the logits: not the plain head's
    plain = ReferenceDFlash(write_tiny_head(tmp_path / "plain.gguf", kind=kind, seed=5),
                            ReferenceModel(target_path), n_ctx=runner.n_ctx)
    plain.inject(_features(plain, ReferenceModel(target_path), PROMPT), np.arange(n))
    assert not np.allclose(plain.block(block, n)[rows], ref.block(block, n)[rows], atol=1e-3)


@pytest.mark.parametrize("name", ["embedding-scale", "attention-scales",
                                  "post-norms-output-scale", "sliding-window", "shared-kv",
                                  "attention-sinks"])
def test_specd_kernels_run_heads_of_gemma_targets(tiny_model_factory: Callable[..., Path],
                                                  tmp_path: Path, name: str) -> None:
    """Where specd's kernels run, a head with those features packs its blocks on specd's
    attention (not one with a sliding window, shared K/V or sinks: written out), and its
    logits stay the reference's within the error of 8-bit activations."""
    from specd.ort_models import native_ops
    from specd.ort_models.graph_builder.dflash import packs_sequences

    if native_ops.library() is None:
        pytest.skip(f"specd's kernels are off: {native_ops.unavailable_reason()}")
    target = tiny_model_factory(arch="qwen3", weight_type="Q4_0", seed=3, context_length=512)
    path = write_tiny_head(tmp_path / "head.gguf", seed=5, weight_type="Q4_0", **GEMMA[name])
    built = load_or_build_head(path, target, kernels="gguf", requant="")
    written_out = ("sliding-window", "shared-kv", "attention-sinks")
    assert packs_sequences(built.head, "gguf") == (name not in written_out)
    runner = HeadRunner(built, n_ctx=512)
    ref_target = ReferenceModel(target)
    ref = ReferenceDFlash(path, ref_target, n_ctx=runner.n_ctx)
    features = _features(ref, ref_target, PROMPT)
    runner.inject(0, features.astype(np.float32), 0)
    ref.inject(features, np.arange(len(PROMPT)))
    mask = runner.built.head.mask_token_id
    block = [PROMPT[-1], mask, mask]
    got = runner.block(0, block, len(PROMPT), [0, 1, 2]).logits
    want = ref.block(block, len(PROMPT))
    assert np.abs(got - want).mean() < 0.05 * want.std()
    assert np.corrcoef(got.ravel(), want.ravel())[0, 1] > 0.999


def test_specd_kernels_run_the_heads_products(tiny_model_factory: Callable[..., Path],
                                              tmp_path: Path) -> None:
    """Where specd's kernels run, a head's Q4_0 matrices (and the target's shared LM head)
    go through GgufMatMul; its logits stay those of the reference within the error of 8-bit
    activations (the ONNX Runtime path is checked exactly above)."""
    import onnx

    from specd.ort_models import native_ops

    if native_ops.library() is None:
        pytest.skip(f"specd's kernels are off: {native_ops.unavailable_reason()}")
    target_path = tiny_model_factory(arch="qwen3", weight_type="Q4_0", seed=3,
                                     context_length=512)
    path = write_tiny_head(tmp_path / "head.gguf", seed=5, weight_type="Q4_0")
    built = load_or_build_head(path, target_path, kernels="gguf", requant="")  # Q4_0 as is
    ops = {n.op_type for name in ("inject", "block")
           for n in onnx.load(str(built.model_path(name)), load_external_data=False).graph.node}
    assert "GgufMatMul" in ops and built.uses_native
    runner = HeadRunner(built, n_ctx=512)
    ref_target = ReferenceModel(target_path)
    ref = ReferenceDFlash(path, ref_target, n_ctx=runner.n_ctx)
    features = _features(ref, ref_target, PROMPT)
    runner.inject(0, features.astype(np.float32), 0)
    ref.inject(features, np.arange(len(PROMPT)))
    mask = runner.built.head.mask_token_id
    block = [PROMPT[-1], mask, mask]
    got = runner.block(0, block, len(PROMPT), [0, 1, 2]).logits
    want = ref.block(block, len(PROMPT))
    # 8-bit activations in every product: close, not equal (2% of the logits' spread)
    assert np.abs(got - want).mean() < 0.05 * want.std()
    assert np.corrcoef(got.ravel(), want.ravel())[0, 1] > 0.999


@pytest.mark.parametrize("kind", ["dflash", "dspark", "dspark-vanilla", "dflash2"])
def test_heads_converted_by_llama_cpp_match_the_reference(target_path: Path, kind: str
                                                          ) -> None:
    """The heads llama.cpp's own converter wrote (tests/fixtures/heads: z-lab DFlash;
    DSpark with a reduced vocabulary and a confidence head, and one with neither in the
    bonus-anchor layout; DFlash2 in Q8_0) run as the reference reads them."""
    path = Path(__file__).resolve().parents[1] / "fixtures" / "heads" / f"{kind}.gguf"
    ref_target = ReferenceModel(target_path)
    runner = HeadRunner(load_or_build_head(path, target_path, accuracy_level=1, kernels="ort"),
                        n_ctx=512)
    runner, ref, block, n = _injected(runner, ReferenceDFlash(path, ref_target,
                                                             n_ctx=runner.n_ctx), ref_target)
    if kind == "dflash2":
        got = runner.block(0, block, n, [1, 2, 3])
        cand, scores = ref.lattice(block, n, [1, 2, 3])
        np.testing.assert_array_equal(got.candidates, cand)
        np.testing.assert_allclose(got.scores, scores, **TOL)
        return
    got = runner.block(0, block, n, [0, 1, 2, 3])
    want, conf = (ref.markov_block(block, n, [0, 1, 2, 3]) if kind.startswith("dspark")
                  else (ref.block(block, n), None))
    finite = np.isfinite(want)
    assert np.array_equal(np.isfinite(got.logits), finite)
    np.testing.assert_allclose(got.logits[finite], want[finite], **TOL)
    if conf is not None:
        assert got.confidence is not None
        np.testing.assert_allclose(got.confidence, conf, **TOL)


@pytest.mark.parametrize("head", [
    {}, {"norm_before_residual": True}, {"draft_vocab": 100},
    {"own_embeddings": True, "own_output": True}],
    ids=["default", "norm-before-residual", "d2t", "own-tensors"])
def test_eagle3_encoder_and_steps_match_the_reference(target_path: Path, tmp_path: Path,
                                                      head: dict[str, Any]) -> None:
    """EAGLE-3: g from the three target layers' features; a run of (token, g) pairs
    written at their positions, then single steps fed the previous step's pre-norm hidden
    state, each against the reference."""
    _check_eagle3(write_tiny_head(tmp_path / "eagle3.gguf", kind="eagle3", seed=5, **head),
                  target_path)


@pytest.mark.parametrize("name", ["eagle3", "eagle3-llama3"])
def test_the_eagle3_heads_converted_by_llama_cpp_match_the_reference(target_path: Path,
                                                                     name: str) -> None:
    """eagle3-llama3: Llama 3.1's rope scaling, as the converter writes it
    (rope_freqs.weight), and norm_before_residual."""
    _check_eagle3(Path(__file__).resolve().parents[1] / "fixtures" / "heads" / f"{name}.gguf",
                  target_path)


def _check_eagle3(path: Path, target_path: Path) -> None:
    ref_target = ReferenceModel(target_path)
    runner = HeadRunner(load_or_build_head(path, target_path, accuracy_level=1, kernels="ort"),
                        n_ctx=512)
    ref = ReferenceEagle3(path, ref_target, n_ctx=runner.n_ctx)
    inputs: dict[int, np.ndarray] = {}
    ref_target.step(PROMPT, ref_target.new_cache(), inputs)
    features = ref.features(inputs)  # [T, 3*E]
    g = runner.encode(features.astype(np.float32))
    np.testing.assert_allclose(g, ref.encode(features), **TOL)
    n = len(PROMPT)
    ids = PROMPT[1:] + [7]  # position P pairs the token at P + 1 with g[P]
    got = runner.step(0, ids, g, 0, [n - 1])
    want_logits, want_hidden = ref.step(ids, ref.encode(features), np.arange(n))
    np.testing.assert_allclose(got.hidden, want_hidden[-1:], **TOL)
    finite = np.isfinite(want_logits[-1:])
    np.testing.assert_allclose(got.logits[finite], want_logits[-1:][finite], **TOL)
    hidden, ref_hidden, tok = got.hidden, want_hidden[-1:], 9
    for pos in range(n, n + 3):  # drafting: each step fed the last one's hidden state
        got = runner.step(0, [tok], hidden, pos, [0])
        want_logits, ref_hidden = ref.step([tok], ref_hidden, np.array([pos]))
        np.testing.assert_allclose(got.hidden, ref_hidden, **TOL)
        finite = np.isfinite(want_logits)
        assert np.array_equal(np.isfinite(got.logits), finite)
        np.testing.assert_allclose(got.logits[finite], want_logits[finite], **TOL)
        hidden, tok = got.hidden, int(np.argmax(got.logits[0]))
    k, v = runner.kv.layers(0)[0]
    np.testing.assert_allclose(k[0, :, :n + 3], ref.keys[:, :n + 3], **TOL)
    np.testing.assert_allclose(v[0, :, :n + 3], ref.values[:, :n + 3], **TOL)


@pytest.mark.parametrize("head", [
    {}, {"draft_vocab": 100}, {"conv_kernel_size": 3, "selector_top_k": 3},
    {"meta": {"dflash.logit_scale": 0.5, "dflash.final_logit_softcapping": 3.0}}],
    ids=["default", "d2t", "kernel3-top3", "logit-transforms"])
def test_dflash2_convolutions_and_lattice_match_the_reference(
        target_path: Path, tmp_path: Path, head: dict[str, Any]) -> None:
    """DFlash2's block: grouped convolutions in its layers and the selector's candidates
    and pair scores over the rows read, for runs of rows in the drafter's layout."""
    runner, ref, block, n = _injected(*_pair(target_path, tmp_path, kind="dflash2", **head))
    for rows in ([1, 2, 3], [1]):
        got = runner.block(0, block, n, rows)
        cand, scores = ref.lattice(block, n, rows)
        assert got.candidates is not None and got.scores is not None
        np.testing.assert_array_equal(got.candidates, cand)
        np.testing.assert_allclose(got.scores, scores, **TOL)
