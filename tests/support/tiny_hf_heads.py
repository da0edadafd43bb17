"""Tiny synthetic Hugging Face checkpoints of drafter heads (numpy only), in their trainers'
layouts, for write_tiny_gguf's default qwen3 target: DFlash (z-lab `DFlashDraftModel`),
DFlash2, DSpark (`DSparkDraftModel`, a reduced vocabulary with `d2t` offsets, and a
full-vocabulary "vanilla" export), EAGLE-3 (`LlamaForCausalLMEagle3`, `midlayer.*`).
Random weights, fixed seeds.

tests/fixtures/make_head_fixtures.py converts them with llama.cpp's own converter into
tests/fixtures/heads/<name>.gguf (`FIXTURES` says which checkpoint and --outtype each
file comes from); specd's converter is tested against those files.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

# write_tiny_gguf's default qwen3 target
TARGET = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128,
          "vocab_size": 352, "max_position_embeddings": 512, "rms_norm_eps": 1e-6,
          "rope_theta": 1000000.0}
MASK_TOKEN = 350  # the first padding row
DRAFT_VOCAB = 100
MARKOV_RANK = 32

_FLOAT_DTYPES = ("F32", "F16", "BF16")


def _bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits, rounded to nearest even (as torch rounds)."""
    bits = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def _encode(a: np.ndarray, float_dtype: str) -> tuple[str, bytes]:
    """(safetensors dtype, little-endian bytes) of one tensor; floats as `float_dtype`."""
    if a.dtype.kind == "f":
        if float_dtype == "BF16":
            return "BF16", _bf16_bits(a).astype("<u2").tobytes()
        return float_dtype, a.astype("<f4" if float_dtype == "F32" else "<f2").tobytes()
    kinds = {np.dtype(np.int64): ("I64", "<i8"), np.dtype(np.int32): ("I32", "<i4"),
             np.dtype(np.bool_): ("BOOL", "?")}
    dtype, fmt = kinds[a.dtype]
    return dtype, a.astype(fmt).tobytes()


def write_safetensors(path: Path, tensors: dict[str, np.ndarray],
                      float_dtype: str = "F32") -> None:
    """One safetensors file: an 8-byte little-endian header length, the JSON header
    (tensors sorted by name, padded with spaces to 8 bytes), the data in that order.
    Float tensors are stored as `float_dtype` (F32, F16 or BF16)."""
    if float_dtype not in _FLOAT_DTYPES:
        raise ValueError(f"float_dtype must be one of {_FLOAT_DTYPES}, got {float_dtype!r}")
    header: dict[str, Any] = {}
    blobs = []
    offset = 0
    for name in sorted(tensors):
        dtype, blob = _encode(np.asarray(tensors[name]), float_dtype)
        header[name] = {"dtype": dtype, "shape": list(tensors[name].shape),
                        "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def write_checkpoint(root: Path, name: str, config: dict[str, Any],
                     tensors: dict[str, np.ndarray], float_dtype: str = "F32",
                     shards: int = 1) -> Path:
    """root/name/: config.json and the tensors, in one model.safetensors or in `shards`
    files with model.safetensors.index.json (tensors split in name order)."""
    d = root / name
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps(config))
    if shards == 1:
        write_safetensors(d / "model.safetensors", tensors, float_dtype)
        return d
    names = sorted(tensors)
    weight_map = {}
    for i, part in enumerate(np.array_split(np.array(names), shards)):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        write_safetensors(d / file, {n: tensors[n] for n in part}, float_dtype)
        weight_map |= {str(n): file for n in part}
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": weight_map}))
    return d


def _rng_tensor(rng: np.random.Generator, shape: tuple[int, ...], norm: bool = False
                ) -> np.ndarray:
    if norm:
        return (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
    return (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)


def _layer(rng: np.random.Generator, p: str, n_in: int, qk_norm: bool) -> dict[str, Any]:
    """One Qwen3 (qk_norm) or Llama decoder layer; q/k/v read `n_in` inputs."""
    e, hd, nh, nkv, ff = (TARGET["hidden_size"], TARGET["head_dim"],
                          TARGET["num_attention_heads"], TARGET["num_key_value_heads"],
                          TARGET["intermediate_size"])
    out = {
        p + "input_layernorm.weight": _rng_tensor(rng, (e,), norm=True),
        p + "self_attn.q_proj.weight": _rng_tensor(rng, (nh * hd, n_in)),
        p + "self_attn.k_proj.weight": _rng_tensor(rng, (nkv * hd, n_in)),
        p + "self_attn.v_proj.weight": _rng_tensor(rng, (nkv * hd, n_in)),
        p + "self_attn.o_proj.weight": _rng_tensor(rng, (e, nh * hd)),
        p + "post_attention_layernorm.weight": _rng_tensor(rng, (e,), norm=True),
        p + "mlp.gate_proj.weight": _rng_tensor(rng, (ff, e)),
        p + "mlp.up_proj.weight": _rng_tensor(rng, (ff, e)),
        p + "mlp.down_proj.weight": _rng_tensor(rng, (e, ff)),
    }
    if qk_norm:
        out[p + "self_attn.q_norm.weight"] = _rng_tensor(rng, (hd,), norm=True)
        out[p + "self_attn.k_norm.weight"] = _rng_tensor(rng, (hd,), norm=True)
    return out


def _d2t_offsets(rng: np.random.Generator) -> np.ndarray:
    """HF d2t: target id of draft row i, minus i (ascending target ids, as EAGLE-3's
    most-frequent-token tables)."""
    ids = np.sort(rng.choice(TARGET["vocab_size"], size=DRAFT_VOCAB, replace=False))
    return (ids - np.arange(DRAFT_VOCAB)).astype(np.int64)


def dflash_config() -> dict[str, Any]:
    return {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", **TARGET,
            "block_size": 4, "tie_word_embeddings": False,
            "dflash_config": {"mask_token_id": MASK_TOKEN, "target_layer_ids": [0, 1]}}


def dflash_tensors() -> dict[str, np.ndarray]:
    """z-lab DFlash: fc, hidden_norm, Qwen3 layers, norm; no embeddings, no LM head."""
    rng = np.random.default_rng(11)
    e = TARGET["hidden_size"]
    tensors = {"fc.weight": _rng_tensor(rng, (e, 2 * e)),
               "hidden_norm.weight": _rng_tensor(rng, (e,), norm=True),
               "norm.weight": _rng_tensor(rng, (e,), norm=True)}
    for i in range(2):
        tensors |= _layer(rng, f"layers.{i}.", e, qk_norm=True)
    return tensors


def dflash(root: Path) -> Path:
    """z-lab DFlash over the target's layers 0 and 1 (GGUF target_layers [1, 2])."""
    return write_checkpoint(root, "dflash", dflash_config(), dflash_tensors())


ROPE_PERMUTED = ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                 "self_attn.q_norm.weight", "self_attn.k_norm.weight")


def interleave_rope(a: np.ndarray, head_dim: int) -> np.ndarray:
    """Rows of rotate_half (NeoX) heads, per head the first half then the second, laid
    out as interleaved-rope pairs (dim i beside dim i + head_dim / 2)."""
    return np.swapaxes(a.reshape(-1, 2, head_dim // 2, *a.shape[1:]), 1, 2).reshape(a.shape)


def dflash_interleaved(root: Path) -> Path:
    """DFlash trained with interleaved rope (`rope_is_neox_style: false`): dflash's
    tensors with Q/K and their norms interleaved, which the converter turns back."""
    tensors = {n: interleave_rope(t, TARGET["head_dim"]) if n.endswith(ROPE_PERMUTED) else t
               for n, t in dflash_tensors().items()}
    return write_checkpoint(root, "dflash-interleaved",
                            {**dflash_config(), "rope_is_neox_style": False}, tensors)


def dspark(root: Path) -> Path:
    """DSpark (DFlash + Markov and confidence heads) over a reduced vocabulary with d2t."""
    rng = np.random.default_rng(12)
    e, v = TARGET["hidden_size"], TARGET["vocab_size"]
    tensors = {"fc.weight": _rng_tensor(rng, (e, 2 * e)),
               "hidden_norm.weight": _rng_tensor(rng, (e,), norm=True),
               "norm.weight": _rng_tensor(rng, (e,), norm=True),
               "lm_head.weight": _rng_tensor(rng, (DRAFT_VOCAB, e)),
               "markov_head.markov_w1.weight": _rng_tensor(rng, (v, MARKOV_RANK)),
               "markov_head.markov_w2.weight": _rng_tensor(rng, (DRAFT_VOCAB, MARKOV_RANK)),
               "confidence_head.proj.weight": _rng_tensor(rng, (1, e + MARKOV_RANK)),
               "confidence_head.proj.bias": np.zeros(1, np.float32),
               "d2t": _d2t_offsets(rng),
               "t2d": np.zeros(v, np.bool_)}
    for i in range(2):
        tensors |= _layer(rng, f"layers.{i}.", e, qk_norm=True)
    config = {"architectures": ["DSparkDraftModel"], "model_type": "qwen3", **TARGET,
              "block_size": 4, "tie_word_embeddings": False, "draft_vocab_size": DRAFT_VOCAB,
              "target_layer_ids": [0, 1], "mask_token_id": MASK_TOKEN}
    return write_checkpoint(root, "dspark", config, tensors)


def dspark_vanilla(root: Path) -> Path:
    """A "vanilla" DSpark export: the full vocabulary (its lm_head, which llama.cpp's
    converter drops: the target's LM head serves), no confidence head, the 1 + N block
    layout (sample_from_anchor false); stored as float16."""
    rng = np.random.default_rng(14)
    e, v = TARGET["hidden_size"], TARGET["vocab_size"]
    tensors = {"fc.weight": _rng_tensor(rng, (e, 2 * e)),
               "hidden_norm.weight": _rng_tensor(rng, (e,), norm=True),
               "norm.weight": _rng_tensor(rng, (e,), norm=True),
               "lm_head.weight": _rng_tensor(rng, (v, e)),
               "markov_head.markov_w1.weight": _rng_tensor(rng, (v, MARKOV_RANK)),
               "markov_head.markov_w2.weight": _rng_tensor(rng, (v, MARKOV_RANK))}
    for i in range(2):
        tensors |= _layer(rng, f"layers.{i}.", e, qk_norm=True)
    config = {"architectures": ["DSparkDraftModel"], "model_type": "qwen3", **TARGET,
              "block_size": 4, "tie_word_embeddings": False, "target_layer_ids": [0, 1],
              "mask_token_id": MASK_TOKEN, "sample_from_anchor": False,
              "markov_head_type": "vanilla"}
    return write_checkpoint(root, "dspark-vanilla", config, tensors, float_dtype="F16")


DFLASH2 = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 8,
           "selector_top_k": 4}


def dflash2(root: Path) -> Path:
    """DFlash2: DFlash plus two-tap grouped convolutions around attention and FFN
    (`attention_conv` / `mlp_conv`: a base kernel [2, k, hidden] and a kernel projection
    [2 k hidden/group, hidden]) and the candidate selector (codebooks [vocab, rank], a
    hidden projection [rank, hidden]); stored as bfloat16."""
    rng = np.random.default_rng(15)
    e, v = TARGET["hidden_size"], TARGET["vocab_size"]
    k, rank = DFLASH2["conv_kernel_size"], DFLASH2["selector_rank"]
    proj = 2 * k * (e // DFLASH2["conv_group_size"])
    tensors = {"fc.weight": _rng_tensor(rng, (e, 2 * e)),
               "hidden_norm.weight": _rng_tensor(rng, (e,), norm=True),
               "norm.weight": _rng_tensor(rng, (e,), norm=True),
               "candidate_selector.predecessor_codebook": _rng_tensor(rng, (v, rank)),
               "candidate_selector.successor_codebook": _rng_tensor(rng, (v, rank)),
               "candidate_selector.hidden_projection.weight": _rng_tensor(rng, (rank, e))}
    for i in range(2):
        tensors |= _layer(rng, f"layers.{i}.", e, qk_norm=True)
        for part in ("attention_conv", "mlp_conv"):
            tensors[f"layers.{i}.{part}.base_kernel"] = _rng_tensor(rng, (2, k, e))
            tensors[f"layers.{i}.{part}.kernel_projection.weight"] = _rng_tensor(
                rng, (proj, e))
    config = {"architectures": ["DFlash2DraftModel"], "model_type": "qwen3", **TARGET,
              "tie_word_embeddings": False,
              "dflash_config": {"mask_token_id": MASK_TOKEN, "target_layer_ids": [0, 1],
                                "block_size": 4, **DFLASH2}}
    return write_checkpoint(root, "dflash2", config, tensors, float_dtype="BF16")


def eagle3_tensors(seed: int) -> dict[str, np.ndarray]:
    """EAGLE-3: fc over three target layers, one `midlayer` whose q/k/v read
    [embedding ; features], its own LM head over a reduced vocabulary, d2t offsets."""
    rng = np.random.default_rng(seed)
    e = TARGET["hidden_size"]
    tensors = {"fc.weight": _rng_tensor(rng, (e, 3 * e)),
               "norm.weight": _rng_tensor(rng, (e,), norm=True),
               "lm_head.weight": _rng_tensor(rng, (DRAFT_VOCAB, e)),
               "midlayer.hidden_norm.weight": _rng_tensor(rng, (e,), norm=True),
               "d2t": _d2t_offsets(rng),
               "t2d": np.zeros(TARGET["vocab_size"], np.bool_)}
    tensors |= _layer(rng, "midlayer.", 2 * e, qk_norm=False)
    return tensors


def eagle3_config() -> dict[str, Any]:
    return {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
            **TARGET, "num_hidden_layers": 1, "draft_vocab_size": DRAFT_VOCAB,
            "rope_theta": 10000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
            "eagle_aux_hidden_state_layer_ids": [1, 2, 2]}


def eagle3(root: Path) -> Path:
    """SpecForge EAGLE-3 reading target layers [1, 2, 2] (written as they are)."""
    return write_checkpoint(root, "eagle3", eagle3_config(), eagle3_tensors(13))


def eagle3_llama3(root: Path) -> Path:
    """EAGLE-3 with Llama 3.1's rope scaling (the converter adds rope_freqs.weight),
    norm_before_residual and an explicit target_hidden_size."""
    config = eagle3_config() | {
        "rope_theta": 10000.0, "target_hidden_size": TARGET["hidden_size"],
        "norm_before_residual": True,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}
    return write_checkpoint(root, "eagle3-llama3", config, eagle3_tensors(16))


# tests/fixtures/heads/<name>.gguf: the checkpoint it was converted from, and --outtype
FIXTURES: dict[str, tuple[Callable[[Path], Path], str]] = {
    "dflash": (dflash, "f16"),
    "dspark": (dspark, "f16"),
    "eagle3": (eagle3, "f16"),
    "dflash2": (dflash2, "q8_0"),
    "dspark-vanilla": (dspark_vanilla, "bf16"),
    "eagle3-llama3": (eagle3_llama3, "f32"),
    "dflash-interleaved": (dflash_interleaved, "f32"),
}
