"""Tiny random drafter heads for tests, laid out as llama.cpp's converter writes them.

`write_tiny_head` writes a DFlash, DFlash2, DSpark or EAGLE-3 head GGUF (architecture
`dflash` or `eagle3`) with the key and tensor names and shapes of llama.cpp build 11434
(conversion/qwen.py DFlashModel / DSparkModel, conversion/llama.py EAGLE-3,
src/models/dflash.cpp and eagle3.cpp), shaped to sit next to `write_tiny_gguf`'s default
target (2 layers, n_embd 64, its tokenizer): the head carries the target's tokenizer, as
the converter copies it from --target-model-dir. Tensors are random (seeded per name as in
tiny_gguf, so a seed gives the same file); `d2t` holds absolute target ids.

`drop`, `meta` and `tensors` make malformed variants: tensors left out, metadata keys
replaced (None: left out) and tensors replaced by given arrays.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFWriter, TokenType

from tiny_gguf import (
    _FILE_TYPES,
    FLOAT_QUANT_TYPES,
    _check_type,
    _name_seed,
    _tensor_data,
    _tensor_specs,
    _TensorSpec,
    add_tokenizer,
    build_vocab,
)

KINDS = ("dflash", "dflash2", "dspark", "eagle3")


def default_target_layers(kind: str) -> tuple[int, ...]:
    """Layer ids as the converter writes them (HF ids + 1) for a 2-layer target: the
    stream entering layer 1 and the one after the last layer. EAGLE-3 reads exactly three,
    so over two layers one repeats."""
    return (1, 2, 2) if kind == "eagle3" else (1, 2)


def write_tiny_head(
    path: str | Path,
    *,
    kind: str = "dflash",
    seed: int = 0,
    target_arch: str = "qwen3",
    vocab_size: int | None = None,
    n_layer: int | None = None,
    n_embd: int = 64,
    n_head: int = 4,
    n_head_kv: int = 2,
    head_dim: int | None = None,
    n_ff: int = 128,
    target_layers: Sequence[int] | None = None,
    target_hidden_size: int = 64,
    block_size: int = 4,
    mask_token_id: int | None = None,
    causal: bool | None = None,
    sample_from_anchor: bool = True,
    confidence_head: bool = True,
    draft_vocab: int | None = None,
    own_embeddings: bool = False,
    own_output: bool | None = None,
    markov_rank: int = 32,
    conv_kernel_size: int = 2,
    conv_group_size: int = 16,
    selector_rank: int = 32,
    selector_top_k: int = 4,
    norm_before_residual: bool = False,
    weight_type: str = "F16",
    drop: Sequence[str] = (),
    meta: Mapping[str, Any] | None = None,
    tensors: Mapping[str, np.ndarray] | None = None,
) -> Path:
    """Write a tiny head and return its path.

    kind: "dflash" | "dflash2" (conv + selector) | "dspark" (Markov head; confidence_head,
    sample_from_anchor) | "eagle3". n_layer defaults to 2 (EAGLE-3: 1, all it has);
    target_layers to `default_target_layers(kind)`; target_hidden_size (EAGLE-3's key; a
    dflash head's features are its own n_embd wide) to the tiny target's 64.
    mask_token_id defaults to the first unused (padding) token of the vocabulary, like
    Qwen's 151669. causal: dflash.attention.causal (None: not written). draft_vocab: a
    reduced vocabulary of that many target tokens, with `d2t` and the head's own output.
    own_embeddings / own_output: the head's own token_embd / output (else the target's are
    shared); own_output defaults to True with draft_vocab. weight_type: the 2-D matrices'
    (norms, biases and the DFlash2 conv bases are F32, as the converter writes 1-D ones).
    """
    _check_type(kind, "kind", KINDS)
    _check_type(weight_type, "weight_type", FLOAT_QUANT_TYPES)
    eagle = kind == "eagle3"
    arch = "eagle3" if eagle else "dflash"
    n_layer = n_layer if n_layer is not None else (1 if eagle else 2)
    head_dim = head_dim or n_embd // n_head
    layers = tuple(target_layers if target_layers is not None else default_target_layers(kind))
    voc = build_vocab(target_arch, vocab_size)
    n_vocab = len(voc.tokens)
    own_output = draft_vocab is not None if own_output is None else own_output
    if mask_token_id is None:
        unused = [i for i, t in enumerate(voc.token_types) if t == TokenType.UNUSED]
        mask_token_id = unused[0] if unused else n_vocab - 1
    out_rows = draft_vocab or n_vocab
    feature_width = target_hidden_size if eagle else n_embd

    kv: dict[str, Any] = {
        f"{arch}.context_length": 512,
        f"{arch}.embedding_length": n_embd,
        f"{arch}.block_count": n_layer,
        f"{arch}.feed_forward_length": n_ff,
        f"{arch}.attention.head_count": n_head,
        f"{arch}.attention.head_count_kv": n_head_kv,
        f"{arch}.rope.freq_base": 10000.0 if eagle else 1000000.0,
        f"{arch}.attention.layer_norm_rms_epsilon": 1e-5 if eagle else 1e-6,
        "general.file_type": int(_FILE_TYPES[weight_type]),
        f"{arch}.target_layers": list(layers),
    }
    if eagle:  # LlamaModel + the EAGLE-3 branch of conversion/llama.py
        kv |= {f"{arch}.vocab_size": n_vocab, f"{arch}.rope.dimension_count": head_dim,
               f"{arch}.target_hidden_size": target_hidden_size,
               f"{arch}.norm_before_residual": norm_before_residual,
               f"{arch}.norm_before_fc": False}
    else:  # Qwen3Model + DFlashModel (+ DSparkModel) of conversion/qwen.py
        kv |= {f"{arch}.attention.key_length": head_dim,
               f"{arch}.attention.value_length": head_dim,
               f"{arch}.block_size": block_size,
               "tokenizer.ggml.mask_token_id": mask_token_id}
        if kind == "dflash2":
            kv |= {f"{arch}.conv_kernel_size": conv_kernel_size,
                   f"{arch}.conv_group_size": conv_group_size,
                   f"{arch}.selector_rank": selector_rank,
                   f"{arch}.selector_top_k": selector_top_k}
        if causal is not None:
            kv[f"{arch}.attention.causal"] = causal
        if kind == "dspark":
            kv |= {f"{arch}.sample_from_anchor": sample_from_anchor,
                   f"{arch}.has_confidence_head": confidence_head}
    for key, value in (meta or {}).items():
        if value is None:
            kv.pop(key, None)
        else:
            kv[key] = value

    # the decoder layers: qwen3's (q/k norms) for the dflash family, llama's for EAGLE-3,
    # whose q/k/v read [embedding ; features]
    specs = [s for s in _tensor_specs(
        "llama" if eagle else "qwen3", n_layer, n_embd, n_head, n_head_kv, head_dim, n_ff,
        n_vocab, True, weight_type, weight_type, weight_type, "F32",
        attn_in=2 * n_embd if eagle else None) if s.name != "token_embd.weight"]
    specs += _head_specs(kind, n_layer, n_embd, n_vocab, len(layers) * feature_width,
                         weight_type, conv_kernel_size, conv_group_size, selector_rank,
                         markov_rank, confidence_head)
    if own_embeddings:
        specs.append(_TensorSpec("token_embd.weight", (n_vocab, n_embd), "embed", weight_type))
    if own_output:
        specs.append(_TensorSpec("output.weight", (out_rows, n_embd), "output", weight_type))
    if kind == "dspark":
        specs.append(_TensorSpec("markov_w2.weight", (out_rows, markov_rank), "matmul",
                                 weight_type))

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    w = GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{kind}")
    for key, value in kv.items():
        _put(w, key, value)
    add_tokenizer(w, voc)
    replaced = dict(tensors or {})
    for spec in specs:
        if spec.name in drop:
            continue
        if spec.name in replaced:
            w.add_tensor(spec.name, replaced.pop(spec.name))
            continue
        data, raw_dtype = _tensor_data(spec, seed, n_embd, None)
        w.add_tensor(spec.name, data, raw_dtype=raw_dtype)
    if draft_vocab is not None and "d2t" not in drop and "d2t" not in replaced:
        w.add_tensor("d2t", draft_ids(seed, n_vocab, draft_vocab))
    for name, array in replaced.items():  # d2t, or tensors the head has not otherwise
        w.add_tensor(name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def draft_ids(seed: int, n_vocab: int, draft_vocab: int) -> np.ndarray:
    """The d2t a reduced-vocabulary head of `write_tiny_head` carries: `draft_vocab`
    distinct target ids, ascending (as EAGLE-3's most-frequent-token tables are), int64."""
    rng = _name_seed(seed, "d2t", 0)
    return np.sort(rng.choice(n_vocab, size=draft_vocab, replace=False)).astype(np.int64)


def _head_specs(
    kind: str, n_layer: int, n_embd: int, n_vocab: int, n_features: int, weight_type: str,
    conv_kernel_size: int, conv_group_size: int, selector_rank: int, markov_rank: int,
    confidence_head: bool,
) -> list[_TensorSpec]:
    """The tensors a head adds to its decoder layers (numpy order, (out, in))."""
    specs = [_TensorSpec("fc.weight", (n_embd, n_features), "matmul", weight_type)]
    if kind == "eagle3":
        return specs + [_TensorSpec("blk.0.attn_norm_2.weight", (n_embd,), "norm", "F32")]
    specs.append(_TensorSpec("enc.output_norm.weight", (n_embd,), "norm", "F32"))
    if kind == "dspark":
        specs.append(_TensorSpec("markov_w1.weight", (n_vocab, markov_rank), "embed",
                                 weight_type))
        if confidence_head:
            specs += [
                _TensorSpec("conf_proj.weight", (1, n_embd + markov_rank), "matmul",
                            weight_type),
                _TensorSpec("conf_proj.bias", (1,), "bias", "F32"),
            ]
    if kind == "dflash2":
        projected = 2 * conv_kernel_size * (n_embd // conv_group_size)
        for i in range(n_layer):
            for part in ("attn", "ffn"):
                specs += [
                    _TensorSpec(f"blk.{i}.{part}_conv_base", (2, conv_kernel_size, n_embd),
                                "bias", "F32"),
                    _TensorSpec(f"blk.{i}.{part}_conv_proj.weight", (projected, n_embd),
                                "matmul", weight_type),
                ]
        specs += [
            _TensorSpec("selector_predecessor.weight", (n_vocab, selector_rank), "embed",
                        weight_type),
            _TensorSpec("selector_successor.weight", (n_vocab, selector_rank), "embed",
                        weight_type),
            _TensorSpec("selector_hidden.weight", (selector_rank, n_embd), "matmul",
                        weight_type),
        ]
    return specs


def _put(w: GGUFWriter, key: str, value: Any) -> None:
    """A metadata value in the type llama.cpp's converter gives it: booleans, uint32
    counts (int32 where negative), float32 reals, strings, arrays."""
    if isinstance(value, bool):
        w.add_bool(key, value)
    elif isinstance(value, int):
        (w.add_uint32 if value >= 0 else w.add_int32)(key, value)
    elif isinstance(value, float):
        w.add_float32(key, value)
    elif isinstance(value, str):
        w.add_string(key, value)
    else:
        w.add_array(key, list(value))


def gemma_features(*, seed: int = 0, n_layer: int = 2, n_embd: int = 64,
                   embedding_scale: float | None = 8.0, sliding_window: int = 0,
                   pattern: Sequence[bool] | None = None, gelu: bool = False,
                   attention_scale: float | None = None, value_scale: float | None = None,
                   post_norms: bool = False, output_scale: float | None = None,
                   shared_kv: bool = False, sinks: bool = False,
                   rope_linear: float | None = None, rope_freqs: bool = False,
                   head_dim: int = 16) -> dict[str, Any]:
    """`write_tiny_head`'s meta and tensors for what llama.cpp's dflash layers read for
    heads of Gemma targets (keys as conversion/qwen.py and specd's convert-draft write
    them): an embedding scale (Gemma's sqrt(n_embd), by default 8 = sqrt(64)), a sliding
    window over the layers `pattern` marks (default: every other one, the first), GELU,
    an attention scale and value scale, post-attention and post-FFN norms, a layer output
    scale, layers without attn_v (K shared as V), attention sinks (4 heads), linear rope
    scaling by `rope_linear`, rope frequency factors (rope_freqs.weight, head_dim / 2).
    Pass as write_tiny_head(..., **gemma_features(...))."""
    meta: dict[str, Any] = {}
    if embedding_scale is not None:
        meta["dflash.embedding_scale"] = embedding_scale
    if sliding_window:
        meta["dflash.attention.sliding_window"] = sliding_window
        meta["dflash.attention.sliding_window_pattern"] = list(
            pattern if pattern is not None else [i % 2 == 0 for i in range(n_layer)])
    if gelu:
        meta["dflash.hidden_activation"] = "gelu_pytorch_tanh"
    if attention_scale is not None:
        meta["dflash.attention.scale"] = attention_scale
    if value_scale is not None:
        meta["dflash.attention.value_scale"] = value_scale
    if rope_linear is not None:
        meta["dflash.rope.scaling.type"] = "linear"
        meta["dflash.rope.scaling.factor"] = rope_linear
    tensors: dict[str, np.ndarray] = {}
    rng = _name_seed(seed, "gemma_features", 0)
    if rope_freqs:
        tensors["rope_freqs.weight"] = np.linspace(1.0, 8.0, head_dim // 2, dtype=np.float32)
    for i in range(n_layer):
        if post_norms:
            for name in ("post_attention_norm", "post_ffw_norm"):
                tensors[f"blk.{i}.{name}.weight"] = (
                    1.0 + 0.1 * rng.standard_normal(n_embd)).astype(np.float32)
        if output_scale is not None:
            tensors[f"blk.{i}.layer_output_scale.weight"] = np.array([output_scale],
                                                                     np.float32)
        if sinks:
            tensors[f"blk.{i}.attn_sinks.weight"] = rng.standard_normal(4).astype(np.float32)
    drop = [f"blk.{i}.attn_v.weight" for i in range(n_layer)] if shared_kv else []
    return {"meta": meta, "tensors": tensors, "drop": drop}
