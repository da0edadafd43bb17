"""What every head kind shares: the checkpoint and its config, the GGUF under way with
llama.cpp's choice of tensor type per `--outtype`, the text-model keys every head
writes, and the general.* keys.

The rules are those of llama.cpp's convert_hf_to_gguf.py (build 11434, `ModelBase` and
`TextModel` in conversion/base.py); where it reads a value transformers' `AutoConfig`
would default, this module asks config.json for it and names the key when it is missing.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import gguf
import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, LlamaFileType, QuantError

from .errors import ConvertError
from .safetensors import SafeTensor, read_checkpoint_tensors

Q = GGMLQuantizationType
# --outtype -> (general.file_type, the type of every tensor llama.cpp does not keep F32)
OUTTYPES: dict[str, tuple[LlamaFileType, GGMLQuantizationType]] = {
    "f32": (LlamaFileType.ALL_F32, Q.F32),
    "f16": (LlamaFileType.MOSTLY_F16, Q.F16),
    "bf16": (LlamaFileType.MOSTLY_BF16, Q.BF16),
    "q8_0": (LlamaFileType.MOSTLY_Q8_0, Q.Q8_0),
}
DEFAULT_ROPE_THETA = 10000.0  # transformers' default for the llama and qwen3 configs


@dataclass
class Checkpoint:
    """A Hugging Face checkpoint: config.json and its safetensors tensors."""

    path: Path
    config: dict[str, Any]  # config.json as written
    hp: dict[str, Any]  # the same, with transformer_layer_config and text_config merged in
    arch: str  # architectures[0]
    tensors: dict[str, SafeTensor]  # in the order llama.cpp's converter visits them

    def fail(self, msg: str) -> NoReturn:
        raise ConvertError(f"{self.path}: {msg}")

    def find(self, keys: Sequence[str]) -> Any:
        """The first of `keys` config.json has (None: none of them)."""
        return next((self.hp[k] for k in keys if k in self.hp), None)

    def need(self, keys: Sequence[str], why: str) -> Any:
        value = self.find(keys)
        if value is None:
            self.fail(f"config.json has no {' / '.join(keys)} ({why})")
        return value

    def need_int(self, keys: Sequence[str], why: str, lo: int = 1) -> int:
        value = self.need(keys, why)
        if isinstance(value, bool) or not isinstance(value, int) or value < lo:
            self.fail(f"config.json {keys[0]} must be an integer >= {lo}, got {value!r}")
        return value

    def n_embd(self) -> int:
        return self.need_int(["hidden_size", "n_embd", "dim"], "the head's width")

    def n_head(self) -> int:
        return self.need_int(["num_attention_heads", "n_head", "n_heads"], "attention heads")

    def head_dim(self) -> int:
        """head_dim where written, else hidden_size / num_attention_heads."""
        hd = self.hp.get("head_dim")
        if hd is None:
            return self.n_embd() // self.n_head()
        if isinstance(hd, bool) or not isinstance(hd, int) or hd < 1:
            self.fail(f"config.json head_dim must be a positive integer, got {hd!r}")
        return hd


def load_checkpoint(path: Path) -> Checkpoint:
    """The checkpoint in directory `path` (ConvertError where it is not one)."""
    if not path.is_dir():
        raise ConvertError(f"{path}: not a directory (a checkpoint is a folder with "
                           "config.json and model*.safetensors)")
    config_path = path / "config.json"
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConvertError(f"{path}: no config.json") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConvertError(f"{config_path}: not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ConvertError(f"{config_path}: not a JSON object")
    arches = config.get("architectures")
    if not isinstance(arches, list) or not arches or not isinstance(arches[0], str):
        raise ConvertError(f"{path}: config.json has no architectures list (which kind of "
                           "head this is)")
    hp = dict(config)
    for nested in ("transformer_layer_config", "text_config"):  # the converter's order
        if isinstance(hp.get(nested), dict):
            hp = {**hp, **hp[nested]}
    return Checkpoint(path, config, hp, arches[0], read_checkpoint_tensors(path))


def block_id(name: str) -> int | None:
    """The first all-digit part of a tensor name: its layer (llama.cpp's rule)."""
    return next((int(p) for p in name.split(".") if p.isdecimal()), None)


def tensor_type(name: str, n_dims: int, qtype: GGMLQuantizationType) -> GGMLQuantizationType:
    """The type llama.cpp's converter gives GGUF tensor `name`: F32 for vectors, norms and
    anything not named `.weight` (biases, DFlash2's conv bases), else the --outtype's."""
    if n_dims <= 1 or name.endswith("_norm.weight") or not name.endswith(".weight"):
        return Q.F32
    return qtype


def as_float(data: np.ndarray) -> np.ndarray:
    """What the converter computes with: float16 and float32 as they are, any other
    dtype (BF16 already read as float32, integers, bools) as float32."""
    return data if data.dtype in (np.float16, np.float32) else data.astype(np.float32)


class HeadWriter:
    """The head GGUF under way: keys under its architecture, tensors in the order added
    with the types llama.cpp's converter gives them."""

    def __init__(self, arch: str, outtype: str) -> None:
        if outtype not in OUTTYPES:
            raise ConvertError(f"unknown --outtype {outtype!r} (one of {', '.join(OUTTYPES)})")
        self.arch = arch
        self.ftype, self.qtype = OUTTYPES[outtype]
        self.w = GGUFWriter(path=None, arch=arch)

    def key(self, name: str) -> str:
        return f"{self.arch}.{name}"

    def add_tensor(self, name: str, data: np.ndarray) -> None:
        """A float tensor: numpy shape (rows, cols) = GGUF (cols, rows). Q8_0 of a row
        length that is not a multiple of 32 falls back to F16, as in llama.cpp."""
        data = as_float(data)
        qtype = tensor_type(name, data.ndim, self.qtype)
        try:
            encoded = gguf.quants.quantize(data, qtype)
        except QuantError:
            qtype = Q.F16
            encoded = gguf.quants.quantize(data, qtype)
        self.w.add_tensor(name, encoded, raw_dtype=qtype)

    def add_ids(self, name: str, ids: np.ndarray) -> None:
        """An I64 tensor (d2t), stored as it is."""
        self.w.add_tensor(name, np.ascontiguousarray(ids, dtype=np.int64), raw_dtype=Q.I64)

    def add_general(self, checkpoint_dir: Path) -> None:
        """general.type and what llama.cpp derives from the checkpoint folder (its model
        card, config.json, generation_config.json, its name) and the parameter count:
        general.name, size_label, ..."""
        total, shared, expert, expert_count = self.w.get_total_parameter_count()
        meta = gguf.Metadata.load(None, checkpoint_dir, None, total)
        gen = gguf.Metadata.load_generation_config(checkpoint_dir)
        if "penalty_repeat" not in gen and "repetition_penalty" in gen:
            meta.sampling_penalty_repeat = gen["repetition_penalty"]
        if meta.name is None:
            meta.name = checkpoint_dir.name
        if meta.size_label is None and total > 0:
            meta.size_label = gguf.size_label(total, shared, expert, expert_count)
        self.w.add_type(gguf.GGUFType.MODEL)
        meta.set_gguf_meta_model(self.w)

    def add_text_params(self, ck: Checkpoint, n_layer: int, rope: dict[str, Any]) -> None:
        """TextModel.set_gguf_parameters: the decoder's shape, rope and norms, the file
        type. `rope` is `rope_parameters(ck)`."""
        w = self.w
        w.add_block_count(n_layer)
        w.add_context_length(ck.need_int(
            ["max_position_embeddings", "n_ctx", "n_positions", "max_length",
             "max_sequence_length", "model_max_length"], "the trained context length"))
        w.add_embedding_length(ck.n_embd())
        w.add_feed_forward_length(ck.need_int(
            ["prefix_dense_intermediate_size", "dense_intermediate_size", "intermediate_size",
             "n_inner", "hidden_dim"], "the feed-forward width"))
        n_head = ck.n_head()
        w.add_head_count(n_head)
        w.add_head_count_kv(ck.find(["num_key_value_heads", "n_kv_heads"]) or n_head)
        if ck.hp.get("is_causal") is False:
            w.add_causal_attention(False)
        params = rope.get("full_attention", rope)
        rope_type, factor = params.get("rope_type"), params.get("factor")
        if rope_type == "linear" and factor is not None:
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(factor)
        elif rope_type == "yarn" and factor is not None:
            w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            w.add_rope_scaling_factor(factor)
            if "original_max_position_embeddings" not in params:
                ck.fail("config.json yarn rope scaling has no original_max_position_embeddings")
            w.add_rope_scaling_orig_ctx_len(params["original_max_position_embeddings"])
            if (ext := params.get("extrapolation_factor")) is not None:
                w.add_rope_scaling_yarn_ext_factor(ext)
            if (attn := params.get("attention_factor", params.get("attn_factor"))) is not None:
                w.add_rope_scaling_yarn_attn_factor(attn)
            if (fast := params.get("beta_fast")) is not None:
                w.add_rope_scaling_yarn_beta_fast(fast)
            if (slow := params.get("beta_slow")) is not None:
                w.add_rope_scaling_yarn_beta_slow(slow)
        elif rope_type in ("su", "longrope"):
            w.add_rope_scaling_type(gguf.RopeScalingType.LONGROPE)
        if "mrope_section" in rope:
            sections = list(rope["mrope_section"])[:4]
            w.add_rope_dimension_sections(sections + [0] * (4 - len(sections)))
        if (theta := params.get("rope_theta")) is not None:
            w.add_rope_freq_base(theta)
        if (swa_theta := rope.get("sliding_attention", {}).get("rope_theta")) is not None:
            w.add_rope_freq_base_swa(swa_theta)
        w.add_layer_norm_rms_eps(ck.need(["rms_norm_eps", "norm_eps"], "the RMSNorm epsilon"))
        if (eps := ck.find(["layer_norm_eps", "layer_norm_epsilon", "norm_epsilon"])) is not None:
            w.add_layer_norm_eps(eps)
        if (n := ck.find(["num_local_experts", "num_experts", "n_routed_experts"])) is not None:
            w.add_expert_count(n)
        if (n := ck.find(["num_experts_per_tok", "num_experts_per_token", "top_k_experts"])
                ) is not None:
            w.add_expert_used_count(n)
        if (n := ck.hp.get("n_group")) is not None:
            w.add_expert_group_count(n)
        if (n := ck.hp.get("topk_group")) is not None:
            w.add_expert_group_used_count(n)
        # llama.cpp writes these where the config has head_dim, which transformers' configs
        # of both layouts always have (written or defaulted)
        w.add_key_length(ck.head_dim())
        w.add_value_length(ck.head_dim())
        w.add_file_type(self.ftype)

    def add_tokenizer(self, tokenizer: Iterable[tuple[str, Any]]) -> None:
        """The target's tokenizer keys, typed as the target stores them."""
        for key, v in tokenizer:
            self.w.add_key_value(key, v.value, v.type, v.sub_type)

    def add_quantization_version(self) -> None:
        self.w.add_quantization_version(gguf.GGML_QUANT_VERSION)

    def write(self, path: Path) -> None:
        self.w.write_header_to_file(path=path)
        self.w.write_kv_data_to_file()
        self.w.write_tensors_to_file()
        self.w.close()


def rope_parameters(ck: Checkpoint) -> dict[str, Any]:
    """The config's rope parameters with the top-level rope keys mirrored in, as
    llama.cpp's TextModel gathers them (rope_theta defaulting as transformers does)."""
    hp = ck.hp
    rope = dict((hp["rope_parameters"] if "rope_parameters" in hp else hp.get("rope_scaling"))
                or {})
    if "full_attention" not in rope and "sliding_attention" not in rope:
        local = ck.find(["local_rope_theta", "rope_local_theta", "rope_theta_local",
                         "swa_rope_theta", "rope_local_base_freq"])
        if local is not None:
            rope["sliding_attention"] = {"rope_theta": local}
        theta = ck.find(["global_rope_theta", "rope_global_theta", "rope_theta_global",
                         "rope_theta", "rotary_emb_base"])
        rope.setdefault("rope_theta", DEFAULT_ROPE_THETA if theta is None else theta)
        if "rope_type" not in rope and (kind := rope.get("type")) is not None:
            rope["rope_type"] = kind
        partial = ck.find(["partial_rotary_factor", "rope_pct", "rope_percent"])
        if "partial_rotary_factor" not in rope and partial is not None:
            rope["partial_rotary_factor"] = partial
        orig = ck.find(["original_max_position_embeddings"])
        if "original_max_position_embeddings" not in rope and orig is not None:
            rope["original_max_position_embeddings"] = orig
    return rope


def absolute_d2t(ck: Checkpoint, t: SafeTensor, n_vocab: int, rows: int | None) -> np.ndarray:
    """HF `d2t` stores, per draft row i, target id - i; the GGUF stores the target ids.
    They must be distinct and inside the vocabulary of `n_vocab`; `rows`: the draft
    vocabulary size it must cover (None: any)."""
    offsets = t.read().reshape(-1)  # [draft_vocab] offsets
    if offsets.dtype.kind == "f":
        if not np.all(np.isfinite(offsets)) or np.any(offsets != np.round(offsets)):
            ck.fail(f"tensor {t.name!r} holds non-integer offsets")
    offsets = offsets.astype(np.int64)
    if rows is not None and offsets.size != rows:
        ck.fail(f"tensor {t.name!r} has {offsets.size} rows but draft_vocab_size is {rows}")
    ids = offsets + np.arange(offsets.size, dtype=np.int64)  # [draft_vocab] target ids
    bad = np.flatnonzero((ids < 0) | (ids >= n_vocab))
    if bad.size:
        ck.fail(f"tensor {t.name!r} maps draft row {int(bad[0])} to target id "
                f"{int(ids[bad[0]])}, outside the vocabulary of {n_vocab}")
    if np.unique(ids).size != ids.size:
        ck.fail(f"tensor {t.name!r} maps two draft rows to one target id (as absolute ids: "
                "the offsets + row index must be distinct)")
    return ids


# a llama-style decoder layer's Hugging Face names (after `model.layers.N.`) -> llama.cpp's
# (after `blk.N.`), the names every head kind shares
LLAMA_LAYER = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
# tensors llama.cpp's converter drops unread
SKIPPED_SUFFIXES = (".attention.masked_bias", ".attention.bias", ".rotary_emb.inv_freq")
