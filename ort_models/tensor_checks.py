"""A decoder model's tensors against its hyper-parameters, checked before anything is built.

`GGUFFile` checks the file's structure and the architecture's `read_hparams` the matrices'
shapes. What else a graph reads is checked here, so that a file whose metadata disagrees
with its tensors fails with one line naming the tensor or key, before a graph is built or
a session created (rather than at the first token, inside ONNX Runtime):

* every tensor the decoder reads is there: the embeddings, the final norm, and each
  layer's norms, attention and feed-forward matrices (a mixture of experts' router and
  3-D experts, with their biases where the architecture has them), the q/k/v biases
  (`qkv_bias`), the output product's (`attn_out_bias`), the q/k norms (`qk_norm`), the
  output norms (`post_norms`), the attention gate (`attn_gate`) and sinks (`attn_sinks`,
  one logit per head);
* vectors (norms, biases) are float tensors of the right length: n_embd for the layer
  and output norms, head_dim for per-head q/k norms (also n_head·head_dim or
  n_kv·head_dim where the architecture does not read them per head, as llama.cpp's
  OLMo 2), n_embd or head_dim for other norms an architecture may add, and a bias the
  rows of its matrix;
* the embeddings have a row per vocabulary token, the output matrix as many rows;
* the trained context is one the rotary tables can be built for: they take
  context_length × rope_dim × 4 bytes, allowed up to the file's own size (at least
  64 MiB), so a corrupt context_length cannot make a build allocate without bound;
* float hyper-parameters are finite;
* the tensors' data follow each other in order in each file, as llama.cpp's loader
  requires.

`check_values` looks at the weights themselves (NaN or infinite floats and block scales),
which costs a pass over the file, so it runs only before a build.
"""

from __future__ import annotations

import math
import re

import numpy as np

from .arch import HParams
from .gguf_file import GGUFError, GGUFFile, GGUFPart, TensorInfo

FLOAT_TYPES = ("F32", "F16", "BF16")
ROPE_TABLE_FLOOR_BYTES = 64 << 20  # rotary tables always allowed this much
# norms every layer has, and those an architecture flag adds (length n_embd)
LAYER_NORMS = ("attn_norm", "ffn_norm")
POST_NORMS = ("post_attention_norm", "post_ffw_norm")
ATTENTION_MATRICES = ("attn_q", "attn_k", "attn_v", "attn_output")
FFN_MATRICES = ("ffn_gate", "ffn_up", "ffn_down")
LAYER_MATRICES = ATTENTION_MATRICES + FFN_MATRICES
# a mixture of experts' router and 3-D experts, in place of the dense FFN matrices
MOE_MATRICES = ("ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
_VECTOR = re.compile(r"(?:blk\.\d+\.)?(\w+?)\.(weight|bias)$")


def check_model(f: GGUFFile, hp: HParams) -> None:
    """GGUFError naming the first tensor or key that does not fit `hp` (module doc)."""
    _check_numbers(f, hp)
    _check_context(f, hp)
    for name in required_tensors(hp):
        f.tensor(name)  # "missing tensor 'blk.1.ffn_down.weight'"
    for t in f.tensors.values():
        _check_vector(f, hp, t)
    _check_vocabulary(f, hp)
    check_layout(f)


def check_layout(f: GGUFFile) -> None:
    """In each file of the model, each tensor's data starts where the one before it (in
    the tensor infos' order) ends, padded to the alignment, as llama.cpp's loader
    requires, and the last one's ends the file (but for its padding): a tensor whose type
    or dimensions were changed, or a header whose size or alignment was, would otherwise
    read bytes it was never written as (with the shapes checked, what differs is then a
    type or the data's start)."""
    for part in f.parts:
        _check_part_layout(part)


def _check_part_layout(part: GGUFPart) -> None:
    end, before = 0, None
    for t in part.tensors.values():
        if t.offset != end:
            what = ("the first tensor's data" if before is None
                    else f"tensor {before.name!r} ({before.type_name}, "
                         f"{list(before.shape)}) takes {before.data.size:,} bytes, but "
                         "the next tensor's data")
            raise GGUFError(
                f"{part.path}: {what} ({t.name!r}) starts at offset {t.offset:,}, not "
                f"{end:,}: a tensor's type or dimensions do not match its data")
        end = t.offset + -(-t.data.size // part.alignment) * part.alignment
        before = t
    if before is not None:
        after = part.size - (part.data_start + before.offset + before.data.size)
        if after >= part.alignment:
            raise GGUFError(
                f"{part.path}: the file goes on {after:,} bytes past the end of its last "
                f"tensor's data ({before.name!r}): its header's size or alignment, or the "
                f"last tensor's type, does not match the data")


def required_tensors(hp: HParams) -> list[str]:
    """The tensors a decoder graph of `hp` reads."""
    names = ["token_embd.weight", "output_norm.weight"]
    if not hp.tied_embeddings:
        names.append("output.weight")
    per_layer = ["attn_norm", hp.ffn_norm, *ATTENTION_MATRICES,
                 *(FFN_MATRICES if hp.moe is None else MOE_MATRICES)]
    if getattr(hp, "post_norms", False):
        per_layer += POST_NORMS
    if hp.qk_norm:
        per_layer += ["attn_q_norm", "attn_k_norm"]
    if hp.attn_gate:
        per_layer.append("attn_gate")
    if hp.attn_sinks:
        per_layer.append("attn_sinks")
    layer_names = [f"{n}.weight" for n in per_layer]
    if hp.moe is not None and hp.moe.biases:
        layer_names += [f"{n}.bias" for n in MOE_MATRICES]
    if hp.qkv_bias:
        layer_names += ["attn_q.bias", "attn_k.bias", "attn_v.bias"]
    if hp.attn_out_bias:
        layer_names.append("attn_output.bias")
    for i in range(hp.n_layer):
        names += [f"blk.{i}.{n}" for n in layer_names]
    return names


def _check_numbers(f: GGUFFile, hp: HParams) -> None:
    for what, value in (("attention.layer_norm_rms_epsilon", hp.rms_eps),
                        ("rope.freq_base", hp.rope_base),
                        ("rope.freq_base_swa", getattr(hp, "rope_base_swa", None)),
                        ("final_logit_softcapping", getattr(hp, "final_softcap", None)),
                        ("logit_scale", hp.logit_scale)):
        if value is not None and not math.isfinite(value):
            raise GGUFError(f"{f.path}: {hp.arch}.{what} must be a finite number, got {value}")


def _check_context(f: GGUFFile, hp: HParams) -> None:
    table_bytes = hp.n_ctx_train * hp.rope_dim * 4  # cos and sin, rope_dim / 2 each, f32
    size = f.file_bytes
    if table_bytes > max(size, ROPE_TABLE_FLOOR_BYTES):
        raise GGUFError(
            f"{f.path}: {hp.arch}.context_length {hp.n_ctx_train:,} is not credible: its "
            f"rotary tables alone would take {table_bytes / 1e6:,.0f} MB, more than the "
            f"{size / 1e6:,.0f} MB file")


def _vector_lengths(hp: HParams, kind: str) -> tuple[int, ...] | None:
    """The lengths a `<kind>.weight` vector may have (None: not a vector)."""
    if kind in ("token_embd", "output", "rope_freqs") or kind in LAYER_MATRICES:
        return None  # matrices (read_hparams checks them) and tables of their own
    if kind in (*LAYER_NORMS, *POST_NORMS, "output_norm"):
        return (hp.n_embd,)
    if kind == "attn_sinks":
        return (hp.n_head,)
    if kind in ("attn_q_norm", "attn_k_norm"):
        heads = hp.n_head if kind == "attn_q_norm" else hp.n_head_kv
        return (hp.head_dim,) if hp.qk_norm else (hp.head_dim, heads * hp.head_dim)
    if kind.endswith("_norm"):  # an architecture's extra norm (gemma's, OLMo's)
        return (hp.n_embd, hp.head_dim)
    return None


def _check_vector(f: GGUFFile, hp: HParams, t: TensorInfo) -> None:
    m = _VECTOR.fullmatch(t.name)
    if m is None:
        return
    kind, part = m.groups()
    lengths: tuple[int, ...] | None
    if part == "bias":  # a bias has its matrix's (or norm's) rows
        weight = f.tensors.get(t.name[: -len("bias")] + "weight")
        if weight is not None and len(weight.shape) == 3:  # experts': one row each
            _check_expert_bias(f, t, weight)
            return
        lengths = None if weight is None else (weight.shape[0],)
    else:
        lengths = _vector_lengths(hp, kind)
    if lengths is None:
        return
    if len(t.shape) != 1 or t.shape[0] not in lengths:
        want = " or ".join(f"[{n}]" for n in dict.fromkeys(lengths))
        raise GGUFError(
            f"{f.part_path(t)}: tensor {t.name} is {list(t.shape)}, but the metadata "
            f"(embedding_length {hp.n_embd}, heads {hp.n_head}/{hp.n_head_kv}, head dim "
            f"{hp.head_dim}) implies {want}")
    if t.type_name not in FLOAT_TYPES:
        raise GGUFError(f"{f.part_path(t)}: tensor {t.name} is stored as {t.type_name}; "
                        f"specd reads vectors (norms, biases) as {', '.join(FLOAT_TYPES)}")


def _check_expert_bias(f: GGUFFile, t: TensorInfo, weight: TensorInfo) -> None:
    """The bias of 3-D experts [n_expert, N, K] is [n_expert, N], a float type."""
    if t.shape != weight.shape[:2]:
        raise GGUFError(f"{f.path}: tensor {t.name} is {list(t.shape)}, but its experts "
                        f"{weight.name} ({list(weight.shape)}) imply {list(weight.shape[:2])}")
    if t.type_name not in FLOAT_TYPES:
        raise GGUFError(f"{f.path}: tensor {t.name} is stored as {t.type_name}; specd reads "
                        f"biases as {', '.join(FLOAT_TYPES)}")


def _check_vocabulary(f: GGUFFile, hp: HParams) -> None:
    tokens = f.get("tokenizer.ggml.tokens")
    if tokens is not None and len(tokens) > hp.n_vocab:
        raise GGUFError(f"{f.path}: tensor token_embd.weight has {hp.n_vocab:,} rows, fewer "
                        f"than the vocabulary's {len(tokens):,} tokens")
    if f.has_tensor("output.weight"):
        rows = f.tensor("output.weight").shape
        if rows != (hp.n_vocab, hp.n_embd):
            raise GGUFError(f"{f.path}: tensor output.weight is {list(rows)}, but "
                            f"token_embd.weight implies [{hp.n_vocab}, {hp.n_embd}]")


# byte offsets of the float16 scales in each block of a quantized type (ggml's layouts)
SCALE_OFFSETS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
                 "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2),
                 "Q6_K": (208,)}
_CHUNK_BYTES = 1 << 26  # scanned in pieces: a check must not hold a copy of a big tensor


def check_values(f: GGUFFile) -> None:
    """GGUFError naming the first tensor holding a NaN or infinite value, in its floats or
    its blocks' scales (such a file can only give NaN logits). Reads every float tensor
    and every block's scales: a pass over the file, made before a build."""
    for t in f.tensors.values():
        if not _finite(t):
            raise GGUFError(f"{f.part_path(t)}: tensor {t.name} holds NaN or infinite values "
                            f"(a damaged file?)")


def _finite(t: TensorInfo) -> bool:
    raw = t.data
    if t.type_name in FLOAT_TYPES:
        width = 4 if t.type_name == "F32" else 2
        step = _CHUNK_BYTES // width * width
        for at in range(0, raw.size, step):
            piece = np.ascontiguousarray(raw[at:at + step])
            if t.type_name == "F32":
                ok = bool(np.isfinite(piece.view(np.float32)).all())
            else:  # all exponent bits set: infinity or NaN (F16: 5 bits, BF16: 8)
                mask = 0x7C00 if t.type_name == "F16" else 0x7F80
                ok = not bool(((piece.view(np.uint16) & mask) == mask).any())
            if not ok:
                return False
        return True
    offsets = SCALE_OFFSETS.get(t.type_name)
    if not offsets:
        return True
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    type_size = GGML_QUANT_SIZES[GGMLQuantizationType[t.type_name]][1]
    blocks = raw.reshape(-1, type_size)
    step = max(1, _CHUNK_BYTES // type_size)
    for at in range(0, blocks.shape[0], step):
        piece = blocks[at:at + step]
        for off in offsets:
            hi = piece[:, off + 1]  # little-endian float16: the exponent is in the high byte
            if bool(((hi & 0x7C) == 0x7C).any()):
                return False
    return True
