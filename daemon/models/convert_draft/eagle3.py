"""EAGLE-3 checkpoints (SpecForge `LlamaForCausalLMEagle3`, speculators `Eagle3Speculator`,
...) -> a GGUF of architecture `eagle3`, as llama.cpp's `LlamaModel` writes one when it
detects an EAGLE-3 draft (conversion/llama.py).

The checkpoint: `fc` over three target layers, one decoder layer `midlayer.*` (or
`layers.0.*`) whose q/k/v read [embedding ; features] (2 x hidden wide) and whose
`hidden_norm` becomes `blk.0.attn_norm_2`, `norm`, its own `lm_head` over a reduced
vocabulary, and `d2t`: per draft row, target id - row index (the GGUF stores the target
ids). q and k are permuted to llama.cpp's rope layout, as for any Llama model.
"""

from __future__ import annotations

import math
import re
from typing import Any

import numpy as np

from .common import (
    LLAMA_LAYER,
    SKIPPED_SUFFIXES,
    Checkpoint,
    HeadWriter,
    absolute_d2t,
    block_id,
    rope_parameters,
)
from .target import TargetInfo

EAGLE3_ARCHS = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM", "Eagle3Speculator",
                "Eagle3DraftModel")
N_TARGET_LAYERS = 3

_GLOBAL = {
    "embed_tokens": "token_embd", "model.embed_tokens": "token_embd",
    "lm_head": "output", "model.lm_head": "output",
    "norm": "output_norm", "model.norm": "output_norm",
}
_LAYER_RE = re.compile(r"model\.layers\.0\.(.+)")


def _gguf_name(ck: Checkpoint, name: str) -> str:
    for stem, suffix in ((name, ""), *((name[:-len(s)], s) for s in (".weight", ".bias")
                                       if name.endswith(s))):
        if stem in _GLOBAL:
            return _GLOBAL[stem] + suffix
        m = _LAYER_RE.fullmatch(stem)
        if m and m.group(1) in LLAMA_LAYER:
            return f"blk.0.{LLAMA_LAYER[m.group(1)]}{suffix}"
    ck.fail(f"tensor {name!r} has no place in an EAGLE-3 head GGUF (llama.cpp's converter "
            "cannot map it either)")


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Rows of q or k ([n_head * head_dim, n_in] or a bias), per head from HF's
    half-split rope layout to llama.cpp's interleaved one."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def llama3_rope_factors(rope: dict[str, Any], head_dim: int) -> np.ndarray:
    """[head_dim / 2] frequency factors of Llama 3.1's rope scaling, computed in float32
    as llama.cpp's converter computes them with torch (1 for high frequencies, `factor`
    for low ones, a smooth blend between). The power is rounded correctly here; torch's
    float32 power is off by one ulp for a few exponents, and so, rarely, is one factor."""
    f32 = np.float32
    base = rope.get("rope_theta", 10000.0)
    exponents = np.arange(0, head_dim, 2, dtype=f32) / f32(head_dim)  # [head_dim / 2]
    powers = (np.float64(f32(base)) ** exponents.astype(np.float64)).astype(f32)
    freqs = f32(1.0) / powers
    factor = rope.get("factor", 8.0)
    low, high = rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old_ctx = rope.get("original_max_position_embeddings", 8192)
    low_wavelen, high_wavelen = f32(old_ctx / low), f32(old_ctx / high)
    out = []
    for freq in freqs.astype(f32):
        wavelen = f32(2 * math.pi) / freq
        if wavelen < high_wavelen:
            out.append(f32(1))
        elif wavelen > low_wavelen:
            out.append(f32(factor))
        else:
            smooth = (f32(old_ctx) / wavelen - f32(low)) / f32(high - low)
            out.append(f32(1) / ((f32(1) - smooth) / f32(factor) + smooth))
    return np.array(out, dtype=f32)


def _layer_names(ck: Checkpoint) -> dict[str, str]:
    """HF name -> the name the converter works with: the one layer as model.layers.0."""
    out = {}
    for name in ck.tensors:
        if name.startswith("midlayer."):
            out[name] = "model.layers.0." + name[len("midlayer."):]
        elif name.startswith("layers.0."):
            out[name] = "model." + name
        else:
            out[name] = name
    return out


def convert(ck: Checkpoint, target: TargetInfo, outtype: str) -> HeadWriter:
    """The head GGUF of an EAGLE-3 checkpoint."""
    hp, raw = ck.hp, ck.config
    n_layer = ck.need_int(["n_layers", "num_hidden_layers", "n_layer", "num_layers"],
                          "the head's layer count")
    if "draft_vocab_size" not in hp or n_layer != 1:
        ck.fail(f"{ck.arch}: an EAGLE-3 config has draft_vocab_size and num_hidden_layers 1 "
                f"(this one: draft_vocab_size {hp.get('draft_vocab_size')!r}, "
                f"num_hidden_layers {n_layer}); llama.cpp would convert it as a plain Llama")
    layers = raw.get("eagle_aux_hidden_state_layer_ids") or [
        2, target.n_layer // 2, target.n_layer - 3]
    width = raw.get("target_hidden_size")
    width = target.n_embd if width is None else width
    _check_target(ck, target, layers, width)

    b = HeadWriter("eagle3", outtype)
    b.w.add_array(b.key("target_layers"), layers)
    b.w.add_uint32(b.key("target_hidden_size"), width)
    b.w.add_bool(b.key("norm_before_residual"), raw.get("norm_before_residual", False))
    b.w.add_bool(b.key("norm_before_fc"), raw.get("norm_before_fc", False))

    rope = rope_parameters(ck)
    rope_params = rope.get("full_attention", rope)
    if str(rope_params.get("rope_type", "")).lower() == "llama3":
        b.add_tensor("rope_freqs.weight", llama3_rope_factors(rope_params, ck.head_dim()))
    n_head = ck.n_head()
    n_head_kv = ck.find(["n_kv_heads", "num_key_value_heads"]) or n_head
    names = _layer_names(ck)
    d2t = None
    for hf_name, t in ck.tensors.items():
        name = names[hf_name]
        if name.endswith(SKIPPED_SUFFIXES) or name == "t2d":  # t2d: the inverse map, unused
            continue
        if name == "d2t":
            d2t = t
            continue
        data = t.read()
        if name == "fc.weight":
            b.add_tensor("fc.weight", data)
        elif name == "input_norm.weight":  # norm_before_fc: the features' norm
            b.add_tensor("enc.output_norm.weight", data)
        elif name.endswith(".hidden_norm.weight"):  # the norm of the projected features
            bid = block_id(name)
            if bid is None:
                ck.fail(f"tensor {hf_name!r} belongs to no layer")
            b.add_tensor(f"blk.{bid}.attn_norm_2.weight", data)
        else:
            if name.endswith(("q_proj.weight", "q_proj.bias")):
                data = _permute(data, n_head)
            elif name.endswith(("k_proj.weight", "k_proj.bias")):
                data = _permute(data, n_head_kv)
            b.add_tensor(_gguf_name(ck, name), data)
    if d2t is not None:
        b.add_ids("d2t", absolute_d2t(ck, d2t, target.n_vocab, None))

    b.add_general(ck.path)
    b.add_text_params(ck, n_layer, rope)
    b.w.add_vocab_size(ck.need_int(["vocab_size"], "the target vocabulary"))
    b.w.add_rope_dimension_count(ck.head_dim())
    b.add_quantization_version()
    b.add_tokenizer(target.tokenizer.items())
    return b


def _check_target(ck: Checkpoint, target: TargetInfo, layers: list[int], width: int) -> None:
    """The features the head reads and its vocabulary against the target."""
    where = f"the target {target.path.name}"
    fc = ck.tensors.get("fc.weight")
    if fc is None:
        ck.fail("no fc.weight (the projection of the target's hidden states)")
    if "target_hidden_size" not in ck.config and fc.shape[-1] != N_TARGET_LAYERS * width:
        ck.fail(f"fc.weight reads {fc.shape[-1]} features, not {N_TARGET_LAYERS} target "
                f"layers x {where}'s embedding_length {width}: the head was made for a "
                "target of another width")
    if width != target.n_embd:
        ck.fail(f"target_hidden_size {width} does not fit {where}, whose embedding_length "
                f"is {target.n_embd}")
    if len(layers) != N_TARGET_LAYERS:
        ck.fail(f"eagle_aux_hidden_state_layer_ids {layers} lists {len(layers)} layers; "
                f"EAGLE-3 reads exactly {N_TARGET_LAYERS}")
    for layer in layers:
        if not 1 <= layer <= target.n_layer:
            ck.fail(f"target layer {layer} is outside {where}, which has {target.n_layer} "
                    f"layers (1..{target.n_layer} can be read)")
    vocab = ck.hp.get("vocab_size")
    if vocab is not None and vocab != target.n_vocab:
        ck.fail(f"vocab_size {vocab} does not fit {where}, whose tokenizer has "
                f"{target.n_vocab} tokens")
    n_embd = ck.n_embd()
    if fc.shape != (n_embd, N_TARGET_LAYERS * width):
        ck.fail(f"fc.weight is {list(fc.shape)}, expected [{n_embd}, {N_TARGET_LAYERS} "
                f"target layers x {width}]")
