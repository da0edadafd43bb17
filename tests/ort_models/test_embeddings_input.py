"""Rows given as embeddings (an image's projected tokens) in the target's prefill: the
graph taking them, beside the text graph over one KV cache, against the numpy reference
(llama.cpp's embeddings batches: rows not scaled, gemma3's not causal within the image)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from specd.ort_models import native_ops
from specd.ort_models.graph_builder import BuildOptions
from specd.ort_models.model_cache import load_or_build
from specd.ort_models.runner import Call, ModelRunner
from specd.ort_models.shared_initializers import external_tensors, same_named

from numpy_reference import ReferenceModel

# gemma3 with sliding windows of 5 keys on every other layer: the image's 6 rows and
# the text after it cross the window's edge
GEMMA3 = {"sliding_window": 5, "swa_pattern": 2, "rope_freq_base_swa": 10000.0,
          "final_softcap": 30.0}
ARCHES = [("llama", {}), ("qwen2", {}), ("gemma3", GEMMA3)]
BEFORE, AFTER = [5, 17, 42], [100, 7, 3, 99]
N_IMAGE = 6

native = pytest.mark.skipif(native_ops.unavailable_reason() is not None,
                            reason=f"specd's kernels: {native_ops.unavailable_reason()}")
ATTENTION = [pytest.param(BuildOptions(accuracy_level=1, hidden_layers=(0,)), id="exact"),
             pytest.param(BuildOptions(accuracy_level=1, hidden_layers=(0,),
                                       attention="native"), id="native", marks=native)]


def _runner(path, options: BuildOptions, causal: bool, n_seq: int = 1) -> ModelRunner:
    target = ModelRunner(load_or_build(path, options), n_ctx=256, n_seq=n_seq)
    emb = load_or_build(path, replace(options, embeddings_input=True, causal=causal))
    target.attach_embeddings(emb, same_named(emb.model_path, target.built.model_path))
    return target


def _image(n_embd: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(0, 1.0, (N_IMAGE, n_embd)).astype(np.float32)


@pytest.mark.parametrize("options", ATTENTION)
@pytest.mark.parametrize(("arch", "kw"), ARCHES, ids=[a for a, _ in ARCHES])
def test_image_rows_match_reference(tiny_model_factory, arch, kw, options) -> None:
    """Text, an image's embeddings, text: every row's logits and the image rows' hidden
    states are the reference's, gemma3's image not causal within itself."""
    path = tiny_model_factory(arch=arch, weight_type="F32", **kw)
    causal = arch != "gemma3"
    r = _runner(path, options, causal)
    image = _image(r.hp.n_embd)
    ref = ReferenceModel(path)
    cache = ref.new_cache()
    want = [ref.step(BEFORE, cache)]
    inputs: dict[int, np.ndarray] = {}
    want.append(ref.step_embeddings(image, cache, causal=causal, layer_inputs=inputs))
    want.append(ref.step(AFTER, cache))

    a = r.forward_batch([Call(0, BEFORE, 0, range(3))])[0]
    b = r.forward_batch([Call(0, [-1] * N_IMAGE, 3, range(N_IMAGE), (0,), embeds=image)])[0]
    c = r.forward_batch([Call(0, AFTER, 3 + N_IMAGE, range(4))])[0]
    for got, exp in zip((a.logits, b.logits, c.logits), want, strict=True):
        rel = np.abs(got - exp).max() / np.abs(exp).max()
        assert rel < 2e-5, rel
    feat = inputs[1]  # the residual stream after layer 0
    assert np.abs(b.features[0] - feat).max() / np.abs(feat).max() < 2e-5


@pytest.mark.parametrize("options", ATTENTION)
def test_gemma3_image_causality_matters(tiny_model_factory, options) -> None:
    """The non-causal image rows differ from causal ones (the reference agrees on which):
    the test above could not pass with the wrong mask."""
    path = tiny_model_factory(arch="gemma3", weight_type="F32", **GEMMA3)
    ref = ReferenceModel(path)
    image = _image(ref.n_embd, 1)
    out = {}
    for causal in (True, False):
        r = _runner(path, options, causal)
        r.forward(0, BEFORE, 0)
        out[causal] = r.forward_batch([Call(0, [-1] * N_IMAGE, 3, range(N_IMAGE),
                                            embeds=image)])[0].logits
        cache = ref.new_cache()
        ref.step(BEFORE, cache)
        exp = ref.step_embeddings(image, cache, causal=causal)
        assert np.abs(out[causal] - exp).max() / np.abs(exp).max() < 2e-5
    assert np.abs(out[True][0] - out[False][0]).max() > 1e-3


@pytest.mark.parametrize("options", ATTENTION)
def test_image_call_beside_text_calls(tiny_model_factory, options) -> None:
    """A batch holding one sequence's image chunk and another's text: each output is its
    call's alone (the image's on the embeddings graph, the text's on the target's)."""
    path = tiny_model_factory(arch="qwen2", weight_type="F32")
    r = _runner(path, options, True, n_seq=2)
    image = _image(r.hp.n_embd, 2)
    r.forward(0, BEFORE, 0)
    both = r.forward_batch([Call(1, AFTER, 0), Call(0, [-1] * N_IMAGE, 3, embeds=image)])
    alone = _runner(path, options, True, n_seq=2)
    alone.forward(0, BEFORE, 0)
    assert np.array_equal(both[0].logits, alone.forward(1, AFTER, 0))
    assert np.array_equal(both[1].logits, alone.forward_batch(
        [Call(0, [-1] * N_IMAGE, 3, embeds=image)])[0].logits)


def test_embeddings_graph_shares_the_targets_weights(tiny_model_factory) -> None:
    """Every weight of the graph taking embeddings is the text graph's (mapped once), and
    its folder is its own: the text graph is not rebuilt or changed."""
    path = tiny_model_factory(arch="gemma3", weight_type="Q8_0", **GEMMA3)
    text = load_or_build(path)
    emb = load_or_build(path, BuildOptions(embeddings_input=True, causal=False))
    assert emb.folder != text.folder and not load_or_build(path).built_now
    shared = same_named(emb.model_path, text.model_path)
    assert set(shared) == set(external_tensors(emb.model_path))


def test_calls_with_embeddings_need_the_graph(tiny_model_factory) -> None:
    path = tiny_model_factory(arch="llama", weight_type="F32")
    r = ModelRunner(load_or_build(path), n_ctx=256)
    with pytest.raises(ValueError, match="takes no embeddings"):
        r.forward_batch([Call(0, [-1] * 2, 0, embeds=np.zeros((2, r.hp.n_embd), np.float32))])
    r = _runner(path, BuildOptions(), True)
    with pytest.raises(ValueError, match="takes embeddings"):
        r.forward_batch([Call(0, [-1] * 2, 0, embeds=np.zeros((3, r.hp.n_embd), np.float32))])


def test_embeddings_options_are_checked() -> None:
    with pytest.raises(ValueError, match="causal=False is for embeddings graphs"):
        BuildOptions(causal=False)
    with pytest.raises(ValueError, match="no sampler"):
        BuildOptions(embeddings_input=True, attention="fused")
