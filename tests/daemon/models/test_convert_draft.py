"""specd's head converter against llama.cpp's: the synthetic checkpoints of tiny_hf_heads,
which tests/fixtures/make_head_fixtures.py converted with llama.cpp's convert_hf_to_gguf.py
(build 11434) into tests/fixtures/heads/, converted again here for the same tiny target
(write_tiny_gguf's default qwen3, as a GGUF where llama.cpp read its HF folder)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from specd.daemon.models.convert_draft import ConvertError, convert_draft
from specd.daemon.models.convert_draft.common import tensor_type
from specd.daemon.models.convert_draft.safetensors import read_checkpoint_tensors
from specd.ort_models.gguf_file import GGUFFile
from specd.ort_models.heads import read_head

import tiny_hf_heads as hf
from gguf_layout import gguf_layout
from tiny_gguf import write_tiny_gguf

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "heads"
KINDS = {"dflash": "dflash", "dspark": "dspark", "eagle3": "eagle3", "dflash2": "dflash2",
         "dspark-vanilla": "dspark", "eagle3-llama3": "eagle3",
         "dflash-interleaved": "dflash"}


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("target") / "target.gguf", arch="qwen3")


def _convert(tmp_path: Path, name: str, target: Path, **kw: Any) -> Path:
    make, outtype = hf.FIXTURES[name]
    out = tmp_path / f"{name}.gguf"
    convert_draft(make(tmp_path / "checkpoints"), target, out, kw.get("outtype", outtype))
    return out


@pytest.mark.parametrize("name", list(hf.FIXTURES))
def test_conversion_is_llama_cpps(tmp_path: Path, target: Path, name: str) -> None:
    """Every key with its GGUF type and value, every tensor's name, type, shape, offset and
    bytes, in llama.cpp's order: the same file. No key is left out: the general.* keys
    derive from the checkpoint folder's name (the same here as in the fixture script), its
    config and the parameter count. The only difference is the order of the tokenizer
    keys, which follows the target GGUF's (this one, written by write_tiny_gguf, lists BOS
    before EOS; llama.cpp's converter writes EOS, padding, BOS, as a target it converted
    does)."""
    ours = gguf_layout(_convert(tmp_path, name, target))
    theirs = gguf_layout(FIXTURES / f"{name}.gguf")
    assert ours["keys"] == theirs["keys"]
    assert ([k for k in ours["order"] if not k.startswith("tokenizer.ggml.")]
            == [k for k in theirs["order"] if not k.startswith("tokenizer.ggml.")])
    assert ours["tensors"] == theirs["tensors"]
    assert ours["data"] == theirs["data"]
    assert ours["size"] == theirs["size"]


@pytest.mark.parametrize("name", list(hf.FIXTURES))
def test_conversion_reads_as_its_kind(tmp_path: Path, target: Path, name: str) -> None:
    head = read_head(GGUFFile(_convert(tmp_path, name, target)))
    assert head.kind == KINDS[name]
    assert head.target_layers == ((1, 2, 2) if head.kind == "eagle3" else (1, 2))


@pytest.mark.parametrize("name", ["dspark", "eagle3"])
def test_d2t_offsets_become_absolute_ids(tmp_path: Path, target: Path, name: str) -> None:
    """HF d2t[i] = target id - i; the GGUF's d2t[i] is the target id, as I64."""
    out = _convert(tmp_path, name, target)
    ck = read_checkpoint_tensors(tmp_path / "checkpoints" / name)
    offsets = ck["d2t"].read()
    t = GGUFFile(out).tensor("d2t")
    assert t.type_name == "I64"
    ids = t.data.view("<i8")
    np.testing.assert_array_equal(ids, offsets + np.arange(offsets.size))
    assert np.unique(offsets).size < offsets.size and np.unique(ids).size == ids.size
    assert "t2d" not in GGUFFile(out).tensors


def test_interleaved_rope_becomes_neox(tmp_path: Path, target: Path) -> None:
    """`rope_is_neox_style: false`: Q, K and their norms, stored as interleaved-rope pairs,
    are written in rotate_half (NeoX) order, the dflash architecture's: the very tensors
    of the NeoX checkpoint they were interleaved from; the rest as stored."""
    f = GGUFFile(_convert(tmp_path, "dflash-interleaved", target))
    neox = hf.dflash_tensors()
    stored = read_checkpoint_tensors(tmp_path / "checkpoints" / "dflash-interleaved")
    for i in range(2):
        for hf_name, name in (("q_proj", "attn_q"), ("k_proj", "attn_k"),
                              ("q_norm", "attn_q_norm"), ("k_norm", "attn_k_norm"),
                              ("v_proj", "attn_v")):
            t = f.tensor(f"blk.{i}.{name}.weight")
            got = t.data.view("<f4").reshape(t.shape)
            want = neox[f"layers.{i}.self_attn.{hf_name}.weight"]
            np.testing.assert_array_equal(got, want)
            if hf_name != "v_proj":  # the path was taken: the stored order differs
                assert not np.array_equal(
                    got, stored[f"layers.{i}.self_attn.{hf_name}.weight"].read())


def test_dspark_variants(tmp_path: Path, target: Path) -> None:
    """sample_from_anchor and the confidence head as the checkpoints have them; a
    full-vocabulary DSpark's own lm_head is dropped (it drafts through the target's)."""
    full = read_head(GGUFFile(_convert(tmp_path, "dspark", target)))
    assert (full.sample_from_anchor, full.has_confidence_head, full.has_output) == (
        True, True, True)
    vanilla = read_head(GGUFFile(_convert(tmp_path, "dspark-vanilla", target)))
    assert (vanilla.sample_from_anchor, vanilla.has_confidence_head, vanilla.has_output,
            vanilla.draft_vocab) == (False, False, False, None)


@pytest.mark.parametrize(("outtype", "matrix"), [("f32", "F32"), ("f16", "F16"),
                                                 ("bf16", "BF16"), ("q8_0", "Q8_0")])
def test_outtype_types(tmp_path: Path, target: Path, outtype: str, matrix: str) -> None:
    """Matrices take the outtype; norms, biases and vectors stay F32, d2t I64; Q8_0 of a
    row shorter than a block falls back to F16 (DFlash2's rank-8 selector codebooks)."""
    f = GGUFFile(_convert(tmp_path, "dspark", target, outtype=outtype))
    types = {n: t.type_name for n, t in f.tensors.items()}
    assert types["fc.weight"] == types["blk.0.attn_q.weight"] == types["markov_w1.weight"]
    assert types["fc.weight"] == matrix
    assert types["blk.0.attn_norm.weight"] == types["conf_proj.bias"] == "F32"
    assert types["d2t"] == "I64"
    f2 = GGUFFile(_convert(tmp_path / "2", "dflash2", target, outtype=outtype))
    types = {n: t.type_name for n, t in f2.tensors.items()}
    assert types["blk.0.attn_conv_base"] == "F32"  # not named .weight
    assert types["selector_predecessor.weight"] == ("F16" if matrix == "Q8_0" else matrix)


def test_tensor_type_rules() -> None:
    from gguf import GGMLQuantizationType as Q

    assert tensor_type("blk.0.attn_q.weight", 2, Q.Q8_0) == Q.Q8_0
    assert tensor_type("output_norm.weight", 1, Q.F16) == Q.F32
    assert tensor_type("blk.3.attn_k_norm.weight", 2, Q.F16) == Q.F32
    assert tensor_type("conf_proj.bias", 1, Q.BF16) == Q.F32
    assert tensor_type("blk.0.ffn_conv_base", 3, Q.F16) == Q.F32


def test_sharded_checkpoint_converts_the_same(tmp_path: Path, target: Path) -> None:
    one = hf.write_checkpoint(tmp_path / "a", "dflash", hf.dflash_config(), hf.dflash_tensors())
    three = hf.write_checkpoint(tmp_path / "b", "dflash", hf.dflash_config(),
                                hf.dflash_tensors(), shards=3)
    assert len(list(three.glob("model-*.safetensors"))) == 3
    convert_draft(one, target, tmp_path / "one.gguf")
    convert_draft(three, target, tmp_path / "three.gguf")
    assert (tmp_path / "one.gguf").read_bytes() == (tmp_path / "three.gguf").read_bytes()


def test_bf16_reads_exactly(tmp_path: Path) -> None:
    """A BF16 tensor reads as the float32 whose high half it is; F16 stays float16."""
    x = np.array([[1.0, -2.5, 3.140625, 1e-3]], np.float32)
    hf.write_safetensors(tmp_path / "model.safetensors", {"w": x}, float_dtype="BF16")
    got = read_checkpoint_tensors(tmp_path)["w"].read()
    bits = x.view(np.uint32)
    rounded = ((bits.astype(np.uint64) + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint32)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got.view(np.uint32), rounded << 16)
    hf.write_safetensors(tmp_path / "model.safetensors", {"w": x}, float_dtype="F16")
    assert read_checkpoint_tensors(tmp_path)["w"].read().dtype == np.float16


# --------------------------------------------------------------------------- errors


def _edit_config(ck: Path, **changes: Any) -> None:
    config = json.loads((ck / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (ck / "config.json").write_text(json.dumps(config))


def test_unknown_architecture(tmp_path: Path, target: Path) -> None:
    ck = hf.dflash(tmp_path)
    _edit_config(ck, architectures=["MedusaModel"])
    with pytest.raises(ConvertError, match=r"architecture 'MedusaModel' is not a drafter head "
                       r"this converts \(one of DFlashDraftModel, "):
        convert_draft(ck, target, tmp_path / "out.gguf")
    assert not list(tmp_path.glob("out.gguf*"))


@pytest.mark.parametrize(("make", "key", "message"), [
    (hf.dflash, "intermediate_size", "config.json has no prefix_dense_intermediate_size / "
     "dense_intermediate_size / intermediate_size / n_inner / hidden_dim"),
    (hf.dflash, "dflash_config", "config.json has no dflash_config.target_layer_ids"),
    (hf.dflash, "max_position_embeddings", "config.json has no max_position_embeddings"),
    (hf.dspark, "vocab_size", r"config.json has no vocab_size \(the target vocabulary\)"),
    (hf.eagle3, "rms_norm_eps", "config.json has no rms_norm_eps / norm_eps"),
    (hf.eagle3, "draft_vocab_size", "an EAGLE-3 config has draft_vocab_size and "
     "num_hidden_layers 1"),
    (hf.eagle3, "architectures", "config.json has no architectures list"),
])
def test_missing_config_key(tmp_path: Path, target: Path, make: Any, key: str,
                            message: str) -> None:
    ck = make(tmp_path)
    _edit_config(ck, **{key: None})
    with pytest.raises(ConvertError, match=message) as info:
        convert_draft(ck, target, tmp_path / "out.gguf")
    assert str(info.value).startswith(str(ck))
    assert not list(tmp_path.glob("out.gguf*"))


@pytest.mark.parametrize("name", ["dflash", "dspark", "eagle3"])
def test_hidden_size_that_does_not_fit_the_target(tmp_path: Path, name: str) -> None:
    wide = write_tiny_gguf(tmp_path / "wide.gguf", arch="qwen3", n_embd=128, n_ff=256)
    make, _ = hf.FIXTURES[name]
    message = (r"fc.weight reads 192 features, not 3 target layers x the target "
               r"wide.gguf's embedding_length 128: the head was made for a target of another "
               r"width" if name == "eagle3" else
               r"hidden_size 64 does not fit the target wide.gguf: a DFlash head reads "
               r"target hidden states of its own width, and the target's embedding_length "
               r"is 128")
    with pytest.raises(ConvertError, match=message):
        convert_draft(make(tmp_path), wide, tmp_path / "out.gguf")
    if name == "eagle3":  # the width the config states
        ck = tmp_path / "eagle3"
        _edit_config(ck, target_hidden_size=64)
        with pytest.raises(ConvertError, match="target_hidden_size 64 does not fit the "
                           "target wide.gguf, whose embedding_length is 128"):
            convert_draft(ck, wide, tmp_path / "out.gguf")


def test_other_misfits(tmp_path: Path, target: Path) -> None:
    ck = hf.dflash(tmp_path)
    _edit_config(ck, dflash_config={"mask_token_id": 350, "target_layer_ids": [0, 2]})
    with pytest.raises(ConvertError, match=r"target layer id 2 \(GGUF 3\) is outside the "
                       "target target.gguf, which has 2 layers"):
        convert_draft(ck, target, tmp_path / "out.gguf")
    big = write_tiny_gguf(tmp_path / "big.gguf", arch="qwen3", vocab_size=384)
    with pytest.raises(ConvertError, match="vocab_size 352 does not fit the target "
                       "big.gguf, whose tokenizer has 384 tokens"):
        convert_draft(hf.dspark(tmp_path), big, tmp_path / "out.gguf")


def test_bad_d2t(tmp_path: Path, target: Path) -> None:
    """d2t already holding absolute ids (not offsets) maps past the vocabulary; a reduced
    vocabulary without d2t cannot be drafted."""
    ck = hf.eagle3(tmp_path)
    tensors = {k: t.read() for k, t in read_checkpoint_tensors(ck).items()}
    tensors["d2t"] = tensors["d2t"] + np.arange(hf.DRAFT_VOCAB)
    hf.write_safetensors(ck / "model.safetensors", tensors)
    with pytest.raises(ConvertError, match=r"tensor 'd2t' maps draft row \d+ to target id "
                       r"\d+, outside the vocabulary of 352"):
        convert_draft(ck, target, tmp_path / "out.gguf")
    ck = hf.dspark(tmp_path / "2")
    tensors = {k: t.read() for k, t in read_checkpoint_tensors(ck).items() if k != "d2t"}
    hf.write_safetensors(ck / "model.safetensors", tensors)
    with pytest.raises(ConvertError, match="draft_vocab_size 100 < vocab_size 352 but the "
                       "checkpoint has no d2t"):
        convert_draft(ck, target, tmp_path / "out.gguf")


def test_unknown_tensor(tmp_path: Path, target: Path) -> None:
    ck = hf.dflash(tmp_path)
    tensors = {k: t.read() for k, t in read_checkpoint_tensors(ck).items()}
    tensors["layers.0.mlp.experts.0.up_proj.weight"] = np.zeros((4, 4), np.float32)
    hf.write_safetensors(ck / "model.safetensors", tensors)
    with pytest.raises(ConvertError, match=r"tensor 'model.layers.0.mlp.experts.0.up_proj"
                       r".weight' has no place in a DFlashDraftModel head GGUF"):
        convert_draft(ck, target, tmp_path / "out.gguf")


def test_not_a_checkpoint(tmp_path: Path, target: Path) -> None:
    with pytest.raises(ConvertError, match="not a directory"):
        convert_draft(tmp_path / "nothing", target, tmp_path / "out.gguf")
    ck = hf.dflash(tmp_path)
    (ck / "model.safetensors").write_bytes(b"\xff" * 16)
    with pytest.raises(ConvertError, match="not a safetensors file"):
        convert_draft(ck, target, tmp_path / "out.gguf")
    (ck / "model.safetensors").unlink()
    with pytest.raises(ConvertError, match="no model\\*.safetensors files"):
        convert_draft(ck, target, tmp_path / "out.gguf")
    shutil.rmtree(ck)


def test_a_head_converted_for_a_gemma3_target_runs_as_the_reference(tmp_path: Path) -> None:
    """convert-draft gives a head for a Gemma target the target's embedding scale
    (sqrt(n_embd): the head shares the target's embeddings, which Gemma scales in its
    forward pass); specd builds such a head, and its block is the reference's."""
    from specd.ort_models.head_runner import HeadRunner, load_or_build_head

    from numpy_reference import ReferenceDFlash, ReferenceModel

    gemma = write_tiny_gguf(tmp_path / "gemma3.gguf", arch="gemma3", weight_type="F32",
                            seed=3, sliding_window=6, swa_pattern=2, context_length=512)
    out = tmp_path / "head.gguf"
    convert_draft(hf.dflash(tmp_path / "checkpoints"), gemma, out, "f32")
    assert read_head(GGUFFile(out)).embedding_scale == 8.0
    runner = HeadRunner(load_or_build_head(out, gemma, accuracy_level=1, kernels="ort"),
                        n_ctx=64)
    ref_target = ReferenceModel(gemma)
    ref = ReferenceDFlash(out, ref_target, n_ctx=64)
    prompt = [2, 20, 31, 42, 53, 64, 75, 86]
    inputs: dict[int, np.ndarray] = {}
    ref_target.step(prompt, ref_target.new_cache(), inputs)
    features = ref.features(inputs)  # [T, 2E]
    runner.inject(0, features.astype(np.float32), 0)
    ref.inject(features, np.arange(len(prompt)))
    block = [prompt[-1]] + [hf.MASK_TOKEN] * 3
    got = runner.block(0, block, len(prompt), [1, 2, 3]).logits
    np.testing.assert_allclose(got, ref.block(block, len(prompt))[1:], rtol=1e-4, atol=1e-4)
