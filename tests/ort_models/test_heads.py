"""Drafter head GGUFs (DFlash, DFlash2, DSpark, EAGLE-3) as llama.cpp writes them: every
kind reads back with its parameters, is told apart from a draft model, and a malformed
file is refused naming the key or tensor."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from specd.ort_models.gguf_file import GGUFError, GGUFFile
from specd.ort_models.graph_builder import BuildOptions
from specd.ort_models.heads import HeadFormatError, HeadParams, head_kind, hidden_index, read_head
from specd.ort_models.model_cache import load_or_build
from specd.ort_models.runner import ModelRunner

from numpy_reference import rms_norm
from tiny_heads import draft_ids, write_tiny_head

# write_tiny_head's defaults read back (a DFlash head over the default tiny qwen3 target)
DFLASH = HeadParams(
    kind="dflash", arch="dflash", n_layer=2, n_embd=64, n_head=4, n_head_kv=2, head_dim=16,
    n_ff=128, n_ctx_train=512, rms_eps=float(np.float32(1e-6)), rope_base=1e6, rope_dim=16,
    rope_interleaved=False, rope_sections=(), rope_scaling=None, rope_scaling_factor=None,
    rope_freq_factors=(),
    hidden_act="silu", causal=False, shared_kv=False, sliding_window=0,
    sliding_window_pattern=(), embedding_scale=None, attention_scale=None,
    attention_value_scale=None, logit_scale=None, final_logit_softcapping=None,
    target_layers=(1, 2), hidden_layers=(0, 1), target_hidden_size=64, n_vocab=352,
    draft_vocab=None, d2t_max_id=None, has_token_embd=False, has_output=False,
    mask_token_id=350, block_size=4, sample_from_anchor=False, has_confidence_head=False,
    markov_rank=None, conv_kernel_size=0, conv_group_size=0, selector_rank=0,
    selector_top_k=0, norm_before_residual=False, norm_before_fc=False, extra_tensors=())
DSPARK = dataclasses.replace(DFLASH, kind="dspark", sample_from_anchor=True,
                             has_confidence_head=True, markov_rank=32,
                             extra_tensors=("conf_proj.bias",))
EAGLE3 = dataclasses.replace(
    DFLASH, kind="eagle3", arch="eagle3", n_layer=1, rms_eps=float(np.float32(1e-5)),
    rope_base=1e4, rope_interleaved=True, causal=True, target_layers=(1, 2, 2),
    hidden_layers=(0, 1, 1), mask_token_id=None, block_size=None)
# the 100 target ids a reduced vocabulary of write_tiny_head(draft_vocab=100) keeps
D2T_MAX = int(draft_ids(0, 352, 100).max())

READ_CASES: list[tuple[dict[str, Any], HeadParams]] = [
    ({}, DFLASH),
    ({"causal": True}, dataclasses.replace(DFLASH, causal=True)),
    ({"causal": False}, DFLASH),
    ({"own_embeddings": True},  # its token_embd doubles as its LM head
     dataclasses.replace(DFLASH, has_token_embd=True, has_output=True)),
    ({"own_output": True}, dataclasses.replace(DFLASH, has_output=True)),
    ({"draft_vocab": 100}, dataclasses.replace(DFLASH, draft_vocab=100, d2t_max_id=D2T_MAX,
                                               has_output=True)),
    ({"drop": ("blk.0.attn_v.weight", "blk.1.attn_v.weight")},
     dataclasses.replace(DFLASH, shared_kv=True)),
    ({"block_size": 16, "target_layers": (2,), "mask_token_id": 0},
     dataclasses.replace(DFLASH, block_size=16, target_layers=(2,), hidden_layers=(1,),
                         mask_token_id=0)),
    ({"meta": {"dflash.block_size": None}},  # llama.cpp drafts 16-token blocks then
     dataclasses.replace(DFLASH, block_size=16)),
    ({"meta": {"dflash.logit_scale": 0.5, "dflash.final_logit_softcapping": 30.0,
               "dflash.hidden_activation": "gelu_pytorch_tanh",
               "dflash.rope.dimension_sections": [8, 0, 0, 0]}},
     dataclasses.replace(DFLASH, logit_scale=0.5, final_logit_softcapping=30.0,
                         hidden_act="gelu", rope_sections=(8, 0, 0, 0))),
    ({"kind": "dflash2"},
     dataclasses.replace(DFLASH, kind="dflash2", conv_kernel_size=2, conv_group_size=16,
                         selector_rank=32, selector_top_k=4)),
    ({"kind": "dspark"}, DSPARK),
    ({"kind": "dspark", "confidence_head": False, "sample_from_anchor": False},
     dataclasses.replace(DSPARK, has_confidence_head=False, sample_from_anchor=False,
                         extra_tensors=())),
    ({"kind": "dspark", "draft_vocab": 100},
     dataclasses.replace(DSPARK, draft_vocab=100, d2t_max_id=D2T_MAX, has_output=True)),
    ({"kind": "eagle3"}, EAGLE3),
    ({"kind": "eagle3", "draft_vocab": 100, "norm_before_residual": True},
     dataclasses.replace(EAGLE3, draft_vocab=100, d2t_max_id=D2T_MAX, has_output=True,
                         norm_before_residual=True)),
    ({"kind": "eagle3", "own_embeddings": True},  # EAGLE-3 never uses it as its LM head
     dataclasses.replace(EAGLE3, has_token_embd=True)),
    ({"kind": "eagle3", "n_embd": 128, "n_ff": 256, "draft_vocab": 100},  # head wider
     dataclasses.replace(EAGLE3, n_embd=128, n_ff=256, head_dim=32, rope_dim=32,
                         draft_vocab=100, d2t_max_id=D2T_MAX, has_output=True)),
]


def _head(tmp_path: Path, **kw: Any) -> GGUFFile:
    return GGUFFile(write_tiny_head(tmp_path / "head.gguf", **kw))


@pytest.mark.parametrize(("kw", "want"), READ_CASES)
def test_every_kind_reads_back(tmp_path: Path, kw: dict[str, Any], want: HeadParams) -> None:
    assert read_head(_head(tmp_path, **kw)) == want


@pytest.mark.parametrize("kind", ["dflash", "dflash2", "dspark", "eagle3"])
def test_written_with_llama_cpp_names(tmp_path: Path, kind: str) -> None:
    """The writer's keys and tensor names are llama.cpp's (llama-arch.cpp, constants.py)."""
    f = _head(tmp_path, kind=kind, draft_vocab=100)
    arch = "eagle3" if kind == "eagle3" else "dflash"
    layer = {"attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight",
             "attn_output.weight", "ffn_norm.weight", "ffn_gate.weight", "ffn_up.weight",
             "ffn_down.weight"}
    if kind == "eagle3":
        layer.add("attn_norm_2.weight")
    else:
        layer |= {"attn_q_norm.weight", "attn_k_norm.weight"}
    if kind == "dflash2":
        layer |= {"attn_conv_base", "attn_conv_proj.weight", "ffn_conv_base",
                  "ffn_conv_proj.weight"}
    top = {"fc.weight", "output_norm.weight", "output.weight", "d2t"}
    top |= set() if kind == "eagle3" else {"enc.output_norm.weight"}
    top |= {"dflash": set(), "eagle3": set(),
            "dflash2": {"selector_predecessor.weight", "selector_successor.weight",
                        "selector_hidden.weight"},
            "dspark": {"markov_w1.weight", "markov_w2.weight", "conf_proj.weight",
                       "conf_proj.bias"}}[kind]
    n = 1 if kind == "eagle3" else 2
    assert set(f.tensors) == top | {f"blk.{i}.{t}" for i in range(n) for t in layer}
    assert f.tensors["d2t"].type_name == "I64"
    keys = {"target_layers": [1, 2, 2] if kind == "eagle3" else [1, 2]}
    keys |= {"dflash": {"block_size": 4}, "eagle3": {"target_hidden_size": 64},
             "dflash2": {"block_size": 4, "conv_kernel_size": 2, "conv_group_size": 16,
                         "selector_rank": 32, "selector_top_k": 4},
             "dspark": {"block_size": 4, "sample_from_anchor": True,
                        "has_confidence_head": True}}[kind]
    assert {k: f.arch_key(k) for k in keys} == keys and f.arch == arch
    assert f.get("tokenizer.ggml.mask_token_id") == (None if kind == "eagle3" else 350)


def test_writer_is_deterministic(tmp_path: Path) -> None:
    def blob(name: str, seed: int) -> bytes:
        return write_tiny_head(tmp_path / name, kind="dspark", draft_vocab=50,
                               seed=seed).read_bytes()
    assert blob("a.gguf", 3) == blob("b.gguf", 3) != blob("c.gguf", 4)


@pytest.mark.parametrize(("kw", "kind"), [
    ({}, "dflash"), ({"causal": True}, "dflash"), ({"kind": "dflash2"}, "dflash2"),
    ({"kind": "dspark"}, "dspark"), ({"kind": "dspark", "confidence_head": False}, "dspark"),
    ({"kind": "eagle3"}, "eagle3"), ({"kind": "eagle3", "draft_vocab": 100}, "eagle3"),
])
def test_kind_detection(tmp_path: Path, kw: dict[str, Any], kind: str) -> None:
    f = _head(tmp_path, **kw)
    assert head_kind(f.metadata, f.tensors) == kind


def test_detection_rules(tiny_model_factory) -> None:
    """llama.cpp's order: the Markov head makes DSpark before a selector makes DFlash2."""
    dflash = {"general.architecture": "dflash"}
    assert head_kind(dflash, ["fc.weight"]) == "dflash"
    assert head_kind(dflash | {"dflash.selector_top_k": 0}, []) == "dflash"
    assert head_kind(dflash | {"dflash.selector_top_k": 4}, []) == "dflash2"
    assert head_kind(dflash | {"dflash.selector_top_k": 4}, ["markov_w1.weight"]) == "dspark"
    assert head_kind({"general.architecture": "eagle3"}, []) == "eagle3"
    target = GGUFFile(tiny_model_factory(arch="qwen3"))
    assert head_kind(target.metadata, target.tensors) is None
    with pytest.raises(HeadFormatError, match="not a drafter head: architecture 'qwen3'"):
        read_head(target)


def test_hidden_index() -> None:
    """Layer id L (the stream entering target layer L) is specd's hidden_{L-1}."""
    assert [hidden_index(layer) for layer in (1, 2, 28)] == [0, 1, 27]
    with pytest.raises(ValueError, match="target layer 0 is the token embedding"):
        hidden_index(0)


def test_hidden_index_against_the_target_graph(tiny_model_factory) -> None:
    """hidden_{L-1} is the stream entering layer L: for L == n_layer (2) the state before
    the final norm (norm + LM head give the target's logits), for L == 1 the output of
    layer 0 (a 1-layer model of the same weights ends there)."""
    path2 = tiny_model_factory(arch="llama", weight_type="F32")
    path1 = tiny_model_factory(arch="llama", weight_type="F32", n_layer=1)
    tokens = [5, 77, 140, 9, 200]
    layers = (1, 2)
    r2 = ModelRunner(load_or_build(path2, BuildOptions(
        hidden_layers=tuple(hidden_index(layer) for layer in layers))), n_ctx=64)
    logits2, hidden = r2.forward_with_features(0, tokens, 0, list(range(len(tokens))))
    logits1 = ModelRunner(load_or_build(path1), n_ctx=64).forward(
        0, tokens, 0, list(range(len(tokens))))
    f = GGUFFile(path2)
    embd = f.tensor("token_embd.weight").data.view(np.float32).reshape(352, 64)
    norm = f.tensor("output_norm.weight").data.view(np.float32)
    eps = f.arch_key("attention.layer_norm_rms_epsilon")
    for layer, logits in zip(layers, (logits1, logits2), strict=True):
        h = hidden[hidden_index(layer)].astype(np.float64)
        np.testing.assert_allclose(rms_norm(h, norm, eps) @ embd.T, logits, atol=2e-4)


IDS = draft_ids(0, 352, 100)
MALFORMED: list[tuple[dict[str, Any], str]] = [
    ({"drop": ("fc.weight",)}, "missing tensor 'fc.weight'"),
    ({"kind": "eagle3", "meta": {"eagle3.target_hidden_size": 32}},
     r"tensor 'fc.weight' is \[64, 192\], expected \[64, 96\] \(3 target layers x target "
     "hidden size 32"),
    ({"meta": {"dflash.target_hidden_size": 32}},
     "dflash.target_hidden_size is 32 but embedding_length is 64"),
    ({"kind": "eagle3", "target_layers": (1, 2)},
     r"eagle3.target_layers \[1, 2\] lists 2 layers; EAGLE-3 reads exactly 3"),
    ({"kind": "eagle3", "n_layer": 2}, "eagle3.block_count is 2; an EAGLE-3 head has one"),
    ({"kind": "eagle3", "meta": {"eagle3.target_hidden_size": None}},
     "missing metadata key 'eagle3.target_hidden_size'"),
    ({"meta": {"dflash.target_layers": None}}, "missing metadata key 'dflash.target_layers'"),
    ({"target_layers": (0, 2)},
     r"dflash.target_layers \[0, 2\]: target layer 0 is the token embedding"),
    ({"meta": {"dflash.target_layers": [-1, 2]}},
     r"dflash.target_layers \[-1, 2\] has a negative layer id"),
    ({"draft_vocab": 100, "tensors": {"d2t": IDS.astype(np.int32)}},
     "tensor 'd2t' is I32; llama.cpp stores the draft -> target map as I64"),
    ({"draft_vocab": 100, "tensors": {"d2t": IDS[:99]}},
     r"tensor 'output.weight' is \[100, 64\], expected \[99, 64\]"),
    ({"kind": "eagle3", "draft_vocab": 100, "tensors": {"d2t": IDS - np.arange(100)}},
     "tensor 'd2t' maps two draft rows to target id"),
    ({"draft_vocab": 100, "tensors": {"d2t": np.append(IDS[:99], 352)}},
     "tensor 'd2t' maps a draft row to target id 352, past the head's vocabulary of 352"),
    ({"draft_vocab": 100, "tensors": {"d2t": np.append(IDS[:99], -3)}},
     "tensor 'd2t' has a negative target id -3"),
    ({"draft_vocab": 100, "own_output": False},
     "tensor 'd2t' maps 100 draft rows, but the head has no output.weight"),
    ({"meta": {"tokenizer.ggml.mask_token_id": None}},
     "missing metadata key 'tokenizer.ggml.mask_token_id'"),
    ({"mask_token_id": 352}, "tokenizer.ggml.mask_token_id 352 is past the vocabulary of 352"),
    ({"kind": "dspark", "meta": {"dflash.block_size": None}},
     "missing metadata key 'dflash.block_size'"),
    ({"meta": {"dflash.block_size": "16"}},
     "dflash.block_size must be an integer >= 1, got '16'"),
    ({"kind": "dspark", "meta": {"dflash.sample_from_anchor": 1}},
     "dflash.sample_from_anchor must be a boolean, got 1"),
    ({"kind": "dspark", "confidence_head": False,
      "meta": {"dflash.has_confidence_head": True}},
     "dflash.has_confidence_head is True but the file has no conf_proj.weight"),
    ({"kind": "dspark", "drop": ("markov_w2.weight",)}, "missing tensor 'markov_w2.weight'"),
    ({"kind": "dspark", "markov_rank": 48, "tensors": {
        "conf_proj.weight": np.zeros((1, 64 + 32), np.float32)}},
     r"tensor 'conf_proj.weight' is \[1, 96\], expected \[1, 112\]"),
    ({"kind": "dflash2", "meta": {"dflash.conv_group_size": None}},
     "missing metadata key 'dflash.conv_group_size' \\(DFlash2 needs it\\)"),
    ({"kind": "dflash2", "meta": {"dflash.conv_group_size": 24}},
     "embedding_length 64 is not a multiple of dflash.conv_group_size 24"),
    ({"kind": "dflash2", "meta": {"dflash.selector_top_k": 8}},
     "embedding_length 64 is too small for the selector lattice of dflash.selector_top_k 8"),
    ({"kind": "dflash2", "drop": ("blk.1.ffn_conv_base",)},
     "missing tensor 'blk.1.ffn_conv_base'"),
    ({"kind": "dflash2", "meta": {"dflash.selector_top_k": None}},
     "tensor 'selector_hidden.weight' \\(DFlash2's selector\\) but dflash.selector_top_k "
     "is 0"),
    ({"tensors": {"blk.0.attn_q.bias": np.zeros(64, np.float32)}},
     "unexpected tensor 'blk.0.attn_q.bias': a dflash head has no such tensor"),
    ({"meta": {"dflash.feed_forward_length": 256}},
     r"tensor 'blk.0.ffn_gate.weight' is \[128, 64\], expected \[256, 64\]"),
    ({"drop": ("blk.1.attn_v.weight",)}, "1 of 2 layers have no attn_v.weight"),
    ({"drop": ("blk.0.attn_q_norm.weight",)}, "missing tensor 'blk.0.attn_q_norm.weight'"),
    ({"kind": "eagle3", "drop": ("blk.0.attn_norm_2.weight",)},
     "missing tensor 'blk.0.attn_norm_2.weight'"),
    ({"kind": "eagle3", "meta": {"eagle3.norm_before_fc": True}},
     "missing tensor 'enc.output_norm.weight' \\(eagle3.norm_before_fc"),
    ({"own_embeddings": True, "tensors": {"token_embd.weight": np.zeros((320, 64),
                                                                         np.float16)}},
     "vocabulary sizes disagree: tokenizer.ggml.tokens 352, token_embd.weight rows 320"),
    ({"meta": {"dflash.hyper_connection.count": 4}}, "DeepSeek-V4 DSpark heads"),
    ({"meta": {"dflash.attention.sliding_window": 128}},
     "missing metadata key 'dflash.attention.sliding_window_pattern'"),
    ({"meta": {"dflash.rope.dimension_count": 18}},
     "dflash.rope.dimension_count is 18; it must be even and at most the head dimension 16"),
]


@pytest.mark.parametrize(("kw", "message"), MALFORMED)
def test_malformed_heads_are_refused(tmp_path: Path, kw: dict[str, Any], message: str) -> None:
    f = _head(tmp_path, **kw)
    with pytest.raises(HeadFormatError, match=message) as info:
        read_head(f)
    assert str(info.value).startswith(f"{f.path}: ")
    assert isinstance(info.value, GGUFError) and isinstance(info.value, ValueError)


# heads converted by llama.cpp's convert_hf_to_gguf.py (tests/fixtures/make_head_fixtures.py)
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "heads"
CONVERTED: list[tuple[str, dict[str, Any], HeadParams]] = [
    ("dflash", {}, DFLASH),
    ("dspark", {"kind": "dspark", "draft_vocab": 100},
     dataclasses.replace(DSPARK, draft_vocab=100, d2t_max_id=351, has_output=True)),
    ("eagle3", {"kind": "eagle3", "draft_vocab": 100},
     dataclasses.replace(EAGLE3, draft_vocab=100, d2t_max_id=347, has_output=True)),
]


@pytest.mark.parametrize(("name", "kw", "want"), CONVERTED)
def test_heads_llama_cpp_converted(name: str, kw: dict[str, Any], want: HeadParams) -> None:
    """The converter writes HF target_layer_ids + 1 for DFlash and DSpark ([0, 1] became
    [1, 2]) and EAGLE-3's aux layer ids as they are ([1, 2, 2])."""
    assert read_head(GGUFFile(FIXTURES / f"{name}.gguf")) == want


@pytest.mark.parametrize(("name", "kw", "want"), CONVERTED)
def test_writer_lays_heads_out_as_the_converter(tmp_path: Path, name: str, kw: dict[str, Any],
                                                want: HeadParams) -> None:
    """write_tiny_head's tensors (names, types, shapes) are the converter's, and so is
    every key it writes but general.* (the converter adds EAGLE-3's key_length, as the
    checkpoint's config has head_dim)."""
    converted = GGUFFile(FIXTURES / f"{name}.gguf")
    ours = _head(tmp_path, **kw)
    assert ({n: (t.type_name, t.shape) for n, t in ours.tensors.items()}
            == {n: (t.type_name, t.shape) for n, t in converted.tensors.items()})
    keys = [k for k in ours.metadata if not k.startswith("general.")]
    assert {k: converted.get(k) for k in keys} == {k: ours.metadata[k] for k in keys}


@pytest.mark.parametrize("name", ["dspark", "eagle3"])
def test_converted_d2t_holds_absolute_ids(name: str) -> None:
    """The HF checkpoints stored d2t as offsets (target id - row), which repeat; the
    converter wrote absolute ids: distinct, ascending like the target ids they name."""
    ids = GGUFFile(FIXTURES / f"{name}.gguf").tensor("d2t").data.view("<i8")
    assert ids.size == 100 and np.all(np.diff(ids) > 0) and 0 <= ids[0] and ids[-1] < 352
    offsets = ids - np.arange(ids.size)
    assert np.unique(offsets).size < ids.size
