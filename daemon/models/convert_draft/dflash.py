"""DFlash, DFlash2 and DSpark checkpoints -> a GGUF of architecture `dflash`, as llama.cpp's
`DFlashModel` and `DSparkModel` (conversion/qwen.py) write them.

- DFlash (z-lab `DFlashDraftModel`): `fc`, `hidden_norm`, Qwen3 layers, `norm`; the
  config's `dflash_config` gives target_layer_ids (written + 1), mask_token_id and
  block_size.
- DFlash2 (`DFlash2DraftModel`, or DFlash with conv keys in `dflash_config`): per layer
  `attention_conv` / `mlp_conv` (base kernel, kernel projection), and the
  `candidate_selector` (two codebooks, a hidden projection).
- DSpark (`DSparkDraftModel` and its kin): DFlash plus `markov_head` (w1 [vocab, R], w2
  [draft vocab, R]), an optional `confidence_head.proj`, and over a reduced vocabulary
  its own `lm_head` and `d2t`. Its config keeps target_layer_ids and mask_token_id at the
  top level, or (speculators exports) `aux_hidden_state_layer_ids`, absolute.
- The muse-glimmer drafter (transformers' `MuseGlimmerAssistantModel`, llama.cpp's
  conversion/muse_glimmer.py): `encoder.fc`, `encoder.output_norm_enc`, Exaone4-style
  layers with q/k norms, `norm`; block_size, mask_token_id and target_layer_ids at the
  config's top level; a sliding window wherever the config has one and layer_types. Its
  Q/K stay in transformers' rotate_half order, which is llama.cpp's NeoX rope, the
  dflash architecture's (the target's own Q/K are un-permuted to NORM rope).
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from .common import (
    LLAMA_LAYER,
    SKIPPED_SUFFIXES,
    Checkpoint,
    HeadWriter,
    absolute_d2t,
    rope_parameters,
)
from .target import TargetInfo

DFLASH_ARCHS = ("DFlashDraftModel", "DFlash2DraftModel")
DSPARK_ARCHS = ("Qwen3DSparkModel", "DSparkDraftModel", "DSparkSpeculator",
                "Lfm2DSparkDraftModel", "LingDSparkModel")
DEFAULT_BLOCK_SIZE = 16  # llama.cpp's converter writes this where the config has none
MUSE_GLIMMER_ARCHS = ("MuseGlimmerAssistantModel",)
DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")

# HF names (with the `model.` prefix the converter adds) -> GGUF names, without suffix
_GLOBAL = {
    "model.embed_tokens": "token_embd",
    "model.lm_head": "output",
    "model.norm": "output_norm",
    "model.fc": "fc",
    "model.hidden_norm": "enc.output_norm",
    "model.encoder.fc": "fc",
    "model.encoder.output_norm_enc": "enc.output_norm",
    "model.markov_head.markov_w1": "markov_w1",
    "model.markov_head.markov_w2": "markov_w2",
    "model.confidence_head.proj": "conf_proj",
    "model.candidate_selector.predecessor_codebook": "selector_predecessor",
    "model.candidate_selector.successor_codebook": "selector_successor",
    "model.candidate_selector.hidden_projection": "selector_hidden",
}
_LAYER = {
    **LLAMA_LAYER,
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "self_attn.sinks": "attn_sinks",
    "attention_conv.base_kernel": "attn_conv_base",
    "attention_conv.kernel_projection": "attn_conv_proj",
    "mlp_conv.base_kernel": "ffn_conv_base",
    "mlp_conv.kernel_projection": "ffn_conv_proj",
}
_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)")
# interleaved-rope checkpoints: these are permuted to llama.cpp's NeoX layout
_ROPE_PERMUTED = ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                  "self_attn.q_norm.weight", "self_attn.k_norm.weight")
_CODEBOOKS = ("model.candidate_selector.predecessor_codebook",
              "model.candidate_selector.successor_codebook")


def _gguf_name(ck: Checkpoint, name: str, n_layer: int) -> str:
    """The GGUF name of HF tensor `name` (ConvertError naming it where none fits)."""
    for stem, suffix in ((name, ""), *((name[:-len(s)], s) for s in (".weight", ".bias")
                                       if name.endswith(s))):
        if stem in _GLOBAL:
            return _GLOBAL[stem] + suffix
        m = _LAYER_RE.fullmatch(stem)
        if m and int(m.group(1)) < n_layer and m.group(2) in _LAYER:
            return f"blk.{m.group(1)}.{_LAYER[m.group(2)]}{suffix}"
    ck.fail(f"tensor {name!r} has no place in a {ck.arch} head GGUF (llama.cpp's converter "
            f"cannot map it either; the head has {n_layer} layers)")


def _dflash_config(ck: Checkpoint, dspark: bool) -> dict[str, Any]:
    """`dflash_config`, which DSpark configs lack: built from their top-level keys."""
    hp = ck.hp
    if ck.arch in MUSE_GLIMMER_ARCHS:
        return {k: hp[k] for k in ("target_layer_ids", "mask_token_id", "block_size")
                if k in hp}
    if "dflash_config" in hp or not dspark:
        dc = hp.get("dflash_config")
        return dc if isinstance(dc, dict) else {}
    if "aux_hidden_state_layer_ids" in hp:  # speculators: absolute ids, the GGUF's own
        return {"mask_token_id": hp.get("mask_token_id"),
                "target_layer_ids": [i - 1 for i in hp["aux_hidden_state_layer_ids"]]}
    return {k: hp[k] for k in ("target_layer_ids", "mask_token_id") if k in hp}


def _check_target(ck: Checkpoint, target: TargetInfo, layers: list[int]) -> None:
    """The head's width, layers and vocabulary against the target's."""
    n_embd = ck.n_embd()
    if n_embd != target.n_embd:
        ck.fail(f"hidden_size {n_embd} does not fit the target {target.path.name}: a DFlash "
                f"head reads target hidden states of its own width, and the target's "
                f"embedding_length is {target.n_embd}")
    for layer in layers:
        if not 1 <= layer <= target.n_layer:
            ck.fail(f"target layer id {layer - 1} (GGUF {layer}) is outside the target "
                    f"{target.path.name}, which has {target.n_layer} layers (HF ids 0.."
                    f"{target.n_layer - 1})")
    vocab = ck.hp.get("vocab_size")
    if vocab is not None and vocab != target.n_vocab:
        ck.fail(f"vocab_size {vocab} does not fit the target {target.path.name}, whose "
                f"tokenizer has {target.n_vocab} tokens")
    fc = next((ck.tensors[n] for n in ("fc.weight", "model.fc.weight", "encoder.fc.weight")
               if n in ck.tensors), None)
    if fc is None:
        ck.fail("no fc.weight (the projection of the target's hidden states)")
    if fc.shape != (n_embd, len(layers) * target.n_embd):
        ck.fail(f"fc.weight is {list(fc.shape)}, expected [{n_embd}, {len(layers)} target "
                f"layers x {target.n_embd}]")


def convert(ck: Checkpoint, target: TargetInfo, outtype: str) -> HeadWriter:
    """The head GGUF of a DFlash, DFlash2 or DSpark checkpoint."""
    dspark = ck.arch in DSPARK_ARCHS
    hp = ck.hp
    if (ck.path / "mask_embedding.pt").is_file():
        ck.fail("mask_embedding.pt (a trained mask row patched into the target's "
                "embeddings) is a torch pickle; convert this head with llama.cpp's "
                "convert_hf_to_gguf.py")
    dc = _dflash_config(ck, dspark)
    n_layer = ck.need_int(["n_layers", "num_hidden_layers", "n_layer", "num_layers"],
                          "the head's layer count")
    hf_layers = dc.get("target_layer_ids", hp.get("target_layer_ids", []))
    if not hf_layers:
        ck.fail("config.json has no dflash_config.target_layer_ids (the target layers the "
                "head reads; llama.cpp cannot load a head without them)")
    layers = [int(i) + 1 for i in hf_layers]  # the residual stream entering HF layer i + 1
    _check_target(ck, target, layers)
    mask = dc.get("mask_token_id")
    if mask is None and "tokenizer.ggml.mask_token_id" not in target.tokenizer:
        ck.fail("config.json has no mask_token_id (dflash_config.mask_token_id for DFlash), "
                "and the target's tokenizer has no mask token either")
    n_vocab = draft_vocab = 0
    if dspark:
        if (markov := hp.get("markov_head_type", "vanilla")) != "vanilla":
            ck.fail(f"markov_head_type {markov!r}: only 'vanilla' Markov heads convert")
        n_vocab = ck.need_int(["vocab_size"], "the target vocabulary")
        draft_vocab = hp.get("draft_vocab_size") or n_vocab
        if draft_vocab > n_vocab:
            ck.fail(f"draft_vocab_size {draft_vocab} exceeds vocab_size {n_vocab}")
    rope = rope_parameters(ck)
    b = HeadWriter("dflash", outtype)

    d2t = None
    head_dim = ck.head_dim()
    for name, t in ck.tensors.items():
        if dspark and name == "t2d":  # the inverse map; llama.cpp does not use it
            continue
        full = name if name.startswith("model.") else "model." + name
        if "sink" in full and not full.endswith(".weight"):
            full += ".weight"
        if full.endswith(SKIPPED_SUFFIXES):
            continue
        if dspark and full == "model.d2t":
            d2t = t
            continue
        if dspark and draft_vocab == n_vocab and full.endswith("lm_head.weight"):
            continue  # a full-vocabulary DSpark drafts through the target's LM head
        if full == "model.embed_tokens.weight" and not hp.get("has_embed_tokens", True):
            continue
        data = t.read()
        if not hp.get("rope_is_neox_style", True) and full.endswith(_ROPE_PERMUTED):
            # per head, (pairs, 2) -> (2, pairs): even dims first, then odd (NeoX rope)
            shape = data.shape
            data = np.swapaxes(data.reshape(-1, head_dim // 2, 2, *shape[1:]), 1, 2)
            data = data.reshape(shape)
        if full in _CODEBOOKS:
            full += ".weight"
        b.add_tensor(_gguf_name(ck, full, n_layer), data)
    if dspark and draft_vocab < n_vocab and d2t is None:
        ck.fail(f"draft_vocab_size {draft_vocab} < vocab_size {n_vocab} but the checkpoint "
                "has no d2t (the draft -> target token map)")
    if d2t is not None:
        b.add_ids("d2t", absolute_d2t(ck, d2t, n_vocab, draft_vocab))

    b.add_general(ck.path)
    if ck.arch in MUSE_GLIMMER_ARCHS:
        _muse_glimmer_params(b, ck, dc, rope, n_layer, layers)
    else:
        _params(b, ck, target, dc, rope, n_layer, layers)
    if dspark:
        b.w.add_bool(b.key("sample_from_anchor"), ck.config.get(
            "sample_from_anchor", "transformer_layer_config" not in ck.config
            and "aux_hidden_state_layer_ids" not in ck.config))
        b.w.add_bool(b.key("has_confidence_head"),
                     any("confidence_head.proj" in n for n in ck.tensors))
    b.add_quantization_version()
    b.add_tokenizer(target.tokenizer.items())
    if mask is not None:
        b.w.add_mask_token_id(mask)
    return b


def _params(b: HeadWriter, ck: Checkpoint, target: TargetInfo, dc: dict[str, Any],
            rope: dict[str, Any], n_layer: int, layers: list[int]) -> None:
    """DFlashModel.set_gguf_parameters: the text-model keys, then the DFlash ones."""
    hp, w = ck.hp, b.w
    b.add_text_params(ck, n_layer, rope)
    head_dim = ck.head_dim()
    if (partial := rope.get("partial_rotary_factor")) is not None:
        w.add_rope_dimension_count(int(head_dim * partial))
    if (value_scale := dc.get("attention_value_scale")) is not None:
        w.add_float32(b.key("attention.value_scale"), float(value_scale))
    w.add_uint32(b.key("block_size"), dc.get("block_size", hp.get("block_size",
                                                                 DEFAULT_BLOCK_SIZE)))
    if "conv_kernel_size" in dc:  # DFlash2
        for key in DFLASH2_KEYS:
            if key not in dc:
                ck.fail(f"config.json dflash_config has conv_kernel_size but no {key} "
                        "(DFlash2 needs all of " + ", ".join(DFLASH2_KEYS) + ")")
            w.add_uint32(b.key(key), int(dc[key]))
    if (scale := dc.get("output_multiplier", hp.get("output_multiplier"))) is not None:
        w.add_logit_scale(float(scale))
    softcap = dc.get("final_logit_softcapping", hp.get("final_logit_softcapping"))
    if softcap is not None and float(softcap) > 0:
        w.add_final_logit_softcapping(float(softcap))
    embedding_scale = dc.get("input_embedding_scale", hp.get("input_embedding_scale"))
    if embedding_scale is None and target.is_gemma:
        # the head shares the target's embeddings, which Gemma scales in its forward pass
        embedding_scale = target.n_embd ** 0.5
    if embedding_scale is not None:
        w.add_embedding_scale(float(embedding_scale))
    w.add_array(b.key("target_layers"), layers)
    window = dc.get("swa_window_size") or hp.get("sliding_window")
    if (hp.get("use_sliding_window", False) or dc.get("use_swa", False)) and window:
        pattern = ([True] * n_layer if dc.get("use_swa", False) else
                   [t == "sliding_attention" for t in hp.get("layer_types") or []])
        w.add_sliding_window(window)
        w.add_sliding_window_pattern(pattern)
    causal = hp.get("is_causal")
    if causal is None:
        causal = dc.get("causal")
    if causal is not None:
        w.add_causal_attention(bool(causal))
    if target.uses_mrope:  # the head ropes on the temporal sections only
        w.add_rope_dimension_sections([head_dim // 2, 0, 0, 0])


def _muse_glimmer_params(b: HeadWriter, ck: Checkpoint, dc: dict[str, Any],
                         rope: dict[str, Any], n_layer: int, layers: list[int]) -> None:
    """MuseGlimmerAssistantModel.set_gguf_parameters: the text-model keys, the block
    size, the target layers, and the sliding window with its per-layer pattern."""
    hp, w = ck.hp, b.w
    b.add_text_params(ck, n_layer, rope)
    w.add_uint32(b.key("block_size"), int(dc.get("block_size", DEFAULT_BLOCK_SIZE)))
    w.add_array(b.key("target_layers"), layers)
    if hp.get("sliding_window") and hp.get("layer_types"):
        w.add_sliding_window(int(hp["sliding_window"]))
        w.add_sliding_window_pattern([t == "sliding_attention" for t in hp["layer_types"]])
