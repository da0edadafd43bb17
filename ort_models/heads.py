"""One-pass drafter heads (DFlash, DFlash2, DSpark, EAGLE-3), read from GGUF files as
llama.cpp writes them: architecture `dflash` (DFlash, DFlash2, DSpark) or `eagle3`.

A head drafts from the target's hidden states: its GGUF lists target layers, and the
residual stream entering each of them, for every verified token, is the head's input.
`read_head` reads a head into `HeadParams` and checks every tensor its kind uses against
the shape the metadata implies, so a malformed head is refused (`HeadFormatError`, naming
the key or tensor) before anything is built. Whether a head fits a given target is
`specd.daemon.models.compat.head_incompatibilities`'s question. `head_kind` tells a head
from an ordinary draft model, by llama.cpp's rules.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any, NoReturn

import numpy as np

from .gguf_file import GGUFError, GGUFFile, TensorInfo
from .quant import dense_float32

KINDS = ("dflash", "dflash2", "dspark", "eagle3")
DEFAULT_BLOCK_SIZE = 16  # what llama.cpp drafts with where dflash.block_size is absent
MASK_TOKEN_KEY = "tokenizer.ggml.mask_token_id"
EAGLE3_TARGET_LAYERS = 3  # llama.cpp's eagle3 loader refuses any other count


class HeadFormatError(GGUFError, ValueError):
    """A head GGUF that cannot be used: the message names the key or tensor at fault."""


@dataclass(frozen=True)
class HeadParams:
    """Everything a head GGUF says, as llama.cpp reads it (shapes already checked)."""

    kind: str  # "dflash" | "dflash2" | "dspark" | "eagle3"
    arch: str  # general.architecture: "dflash" (the first three kinds) or "eagle3"
    # the head's own decoder
    n_layer: int
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ctx_train: int
    rms_eps: float
    rope_base: float
    rope_dim: int
    rope_interleaved: bool  # eagle3: llama.cpp NORM rope (adjacent pairs); dflash: NEOX
    rope_sections: tuple[int, ...]  # M-RoPE sections as written (drafts for M-RoPE targets)
    rope_scaling: str | None  # {arch}.rope.scaling.type
    rope_scaling_factor: float | None
    rope_freq_factors: tuple[float, ...]  # rope_freqs.weight: one per rotated pair (or ())
    hidden_act: str  # "silu" | "gelu"
    causal: bool  # attention within the drafted block (dflash family default: not causal)
    shared_kv: bool  # layers without attn_v use K as V (llama.cpp's optional attn_v)
    sliding_window: int  # 0: full attention
    sliding_window_pattern: tuple[bool, ...]  # per layer, where sliding_window > 0
    embedding_scale: float | None  # scales the token embeddings (None: 1)
    attention_scale: float | None  # replaces 1/sqrt(head_dim) in attention (None: that)
    attention_value_scale: float | None  # scales the attention output (None: 1)
    logit_scale: float | None  # {arch}.logit_scale
    final_logit_softcapping: float | None
    # the features it reads from the target
    target_layers: tuple[int, ...]  # as written: L = the residual stream entering layer L
    hidden_layers: tuple[int, ...]  # specd's target outputs hidden_{L - 1}, in the same order
    target_hidden_size: int  # width of each target feature (the target's n_embd)
    # vocabulary
    n_vocab: int | None  # the head's vocabulary (target token ids); None: nothing says
    draft_vocab: int | None  # rows of its logits where `d2t` reduces them; None: n_vocab
    d2t_max_id: int | None  # largest target id in d2t (absolute ids)
    has_token_embd: bool  # its own token_embd (else the target's is shared)
    has_output: bool  # its own LM head (output, or for dflash its token_embd; else shared)
    mask_token_id: int | None  # the id filling a block's drafted slots (dflash family)
    # kind-specific
    block_size: int | None  # trained block length (dflash family)
    sample_from_anchor: bool  # DSpark anchor-first block; False: the 1 + N layout (slot 0 =
    # the last token, drafts from slot 1), which DFlash and DFlash2 always use
    has_confidence_head: bool  # DSpark conf_proj
    markov_rank: int | None  # DSpark Markov head rank R
    conv_kernel_size: int  # DFlash2 (0 elsewhere)
    conv_group_size: int
    selector_rank: int
    selector_top_k: int
    norm_before_residual: bool  # EAGLE-3 (RedHat speculators)
    norm_before_fc: bool  # EAGLE-3 3.1: RMSNorm of the features before fc (enc.output_norm)
    extra_tensors: tuple[str, ...]  # optional tensors present (attention sinks, post-norms,
    # rope factors, scales, conf_proj.bias, ...), sorted


def head_kind(metadata: Mapping[str, Any], tensor_names: Collection[str]) -> str | None:
    """The kind of head a GGUF holds, by llama.cpp's rules: architecture `dflash` is DSpark
    where the file has the Markov head (`markov_w1.weight`), DFlash2 where
    `dflash.selector_top_k` > 0, else DFlash; `eagle3` is EAGLE-3; anything else None (an
    ordinary draft model)."""
    arch = metadata.get("general.architecture")
    if arch == "eagle3":
        return "eagle3"
    if arch != "dflash":
        return None
    if "markov_w1.weight" in tensor_names:
        return "dspark"
    top_k = metadata.get("dflash.selector_top_k", 0)
    if isinstance(top_k, int) and not isinstance(top_k, bool) and top_k > 0:
        return "dflash2"
    return "dflash"


def hidden_index(layer: int) -> int:
    """The target hidden-state output specd builds for a head's target layer id.

    A head's id L names the residual stream entering target layer L (L == the target's
    n_layer: after its last layer, before the final norm). specd's target graph outputs
    `hidden_i`, the stream after layer i, so L reads hidden_{L-1}. L == 0 would be the
    embedding output, which the graph does not output: ValueError."""
    if layer < 1:
        raise ValueError(f"target layer {layer} is the token embedding (the stream entering "
                         "layer 0), which specd's target graph does not output; it outputs "
                         "the stream after a layer, so heads can read layers 1 and up")
    return layer - 1


_REQUIRED: Any = object()


class _Meta:
    """Typed reads of a head's metadata; a missing or malformed key names itself. Names
    are relative to the architecture (`block_count` reads `dflash.block_count`), except the
    tokenizer's (`tokenizer.ggml...`)."""

    def __init__(self, f: GGUFFile) -> None:
        self.f = f

    def fail(self, msg: str) -> NoReturn:
        raise HeadFormatError(f"{self.f.path}: {msg}")

    def key(self, name: str) -> str:
        return name if name.startswith("tokenizer.") else f"{self.f.arch}.{name}"

    def _get(self, name: str, default: Any) -> tuple[str, bool, Any]:
        key = self.key(name)
        if key in self.f.metadata:
            return key, True, self.f.metadata[key]
        if default is _REQUIRED:
            self.fail(f"missing metadata key {key!r}")
        return key, False, default

    def count(self, name: str, default: Any = _REQUIRED, lo: int = 1) -> Any:
        """An integer >= lo (a default is returned as it is)."""
        key, found, v = self._get(name, default)
        if found and (isinstance(v, bool) or not isinstance(v, int) or v < lo):
            self.fail(f"{key} must be an integer >= {lo}, got {v!r}")
        return v

    def real(self, name: str, default: Any = _REQUIRED) -> Any:
        """A positive number; where the default is None (an optional scale), 0 also means
        unset and reads as None, as in llama.cpp."""
        key, found, v = self._get(name, default)
        if not found:
            return v
        if isinstance(v, bool) or not isinstance(v, int | float) or not np.isfinite(v) or (
                v < 0 or (v == 0 and default is not None)):
            self.fail(f"{key} must be a positive number, got {v!r}")
        return float(v) if v else None

    def flag(self, name: str, default: bool) -> bool:
        key, found, v = self._get(name, default)
        if not isinstance(v, bool):
            self.fail(f"{key} must be a boolean, got {v!r}")
        return v

    def text(self, name: str, default: str | None) -> str | None:
        key, found, v = self._get(name, default)
        if found and not isinstance(v, str):
            self.fail(f"{key} must be a string, got {v!r}")
        return v

    def ints(self, name: str, default: Any = _REQUIRED) -> tuple[int, ...]:
        key, found, v = self._get(name, default)
        if found and (not isinstance(v, list) or not all(
                isinstance(x, int) and not isinstance(x, bool) for x in v)):
            self.fail(f"{key} must be an array of integers, got {v!r}")
        return tuple(v)

    def bools(self, name: str) -> tuple[bool, ...]:
        key, _, v = self._get(name, _REQUIRED)
        if not isinstance(v, list) or not all(isinstance(x, bool) for x in v):
            self.fail(f"{key} must be an array of booleans, got {v!r}")
        return tuple(v)


class _Tensors:
    """Shape checks of a head's tensors (numpy order: (rows, cols) = (out, in)), each with
    the reason for the shape it must have; a tensor none of them asks for is refused, as
    llama.cpp's loader refuses a file with tensors it did not create."""

    def __init__(self, f: GGUFFile, kind: str) -> None:
        self.f, self.kind, self.used = f, kind, set[str]()

    def fail(self, msg: str) -> NoReturn:
        raise HeadFormatError(f"{self.f.path}: {msg}")

    def need(self, name: str, shape: tuple[int | None, ...], why: str) -> TensorInfo:
        """The tensor, whose dims must equal `shape` (None: any)."""
        if name not in self.f.tensors:
            self.fail(f"missing tensor {name!r} ({why})")
        t = self.f.tensors[name]
        self.used.add(name)
        if len(t.shape) != len(shape) or any(
                w is not None and g != w for g, w in zip(t.shape, shape, strict=False)):
            want = ["*" if w is None else w for w in shape]
            self.fail(f"tensor {name!r} is {list(t.shape)}, expected {want} ({why})")
        return t

    def may(self, name: str, shape: tuple[int | None, ...], why: str) -> TensorInfo | None:
        return self.need(name, shape, why) if name in self.f.tensors else None

    def check_all_used(self) -> None:
        for name in self.f.tensors:
            if name not in self.used:
                self.fail(f"unexpected tensor {name!r}: a {self.kind} head has no such "
                          "tensor (llama.cpp refuses the file too)")


def read_head(f: GGUFFile) -> HeadParams:
    """Read and check the head GGUF `f` (HeadFormatError: a key or tensor missing or
    malformed, or a head kind specd does not run)."""
    kind = head_kind(f.metadata, f.tensors)
    if kind is None:
        raise HeadFormatError(f"{f.path}: not a drafter head: architecture {f.arch!r} "
                              "(heads are 'dflash' or 'eagle3')")
    m, t = _Meta(f), _Tensors(f, kind)
    if m.count("hyper_connection.count", 0, lo=0):
        m.fail(f"{m.key('hyper_connection.count')} > 0: DeepSeek-V4 DSpark heads "
               "(hyper-connection stages) are not supported")
    p = _decoder(m, kind)
    p |= _target(m, t, kind, p["n_embd"])
    p |= _block_params(m, t, kind, p["n_embd"])
    p["shared_kv"] = _layers(t, kind, p)
    p |= _vocabulary(m, t, kind, p)
    t.check_all_used()
    freqs = f.tensors.get("rope_freqs.weight")
    p["rope_freq_factors"] = () if freqs is None else tuple(
        float(x) for x in dense_float32(freqs).reshape(-1))
    extras = sorted(name for name in t.used if _is_extra(name))
    return HeadParams(kind=kind, arch=f.arch, extra_tensors=tuple(extras), **p)


def _decoder(m: _Meta, kind: str) -> dict[str, Any]:
    """The head's own decoder hyper-parameters."""
    n_embd = m.count("embedding_length")
    n_head = m.count("attention.head_count")
    n_head_kv = m.count("attention.head_count_kv", n_head)
    if n_head % n_head_kv:
        m.fail(f"{m.key('attention.head_count')} {n_head} is not a multiple of "
               f"{m.key('attention.head_count_kv')} {n_head_kv}")
    head_dim = m.count("attention.key_length", n_embd // n_head)
    value_dim = m.count("attention.value_length", head_dim)
    if value_dim != head_dim:
        m.fail(f"{m.key('attention.key_length')} {head_dim} != "
               f"{m.key('attention.value_length')} {value_dim}")
    rope_dim = m.count("rope.dimension_count", head_dim)
    if rope_dim % 2 or rope_dim > head_dim:
        m.fail(f"{m.key('rope.dimension_count')} is {rope_dim}; it must be even and at most "
               f"the head dimension {head_dim}")
    act = "silu"
    if kind != "eagle3":  # llama.cpp's dflash loader: silu unless gelu is written
        act = m.text("hidden_activation", "silu") or "silu"
        if act not in ("silu", "gelu", "gelu_pytorch_tanh"):
            m.fail(f"{m.key('hidden_activation')} {act!r} is not silu or gelu")
    n_layer = m.count("block_count")
    window = m.count("attention.sliding_window", 0, lo=0)
    pattern = m.bools("attention.sliding_window_pattern") if window else ()
    if window and len(pattern) != n_layer:
        m.fail(f"{m.key('attention.sliding_window_pattern')} has {len(pattern)} entries "
               f"for {n_layer} layers")
    return {
        "n_layer": n_layer,
        "n_embd": n_embd,
        "n_head": n_head,
        "n_head_kv": n_head_kv,
        "head_dim": head_dim,
        "n_ff": m.count("feed_forward_length"),
        "n_ctx_train": m.count("context_length"),
        "rms_eps": m.real("attention.layer_norm_rms_epsilon"),
        "rope_base": m.real("rope.freq_base", 10000.0),
        "rope_dim": rope_dim,
        "rope_interleaved": kind == "eagle3",
        "rope_sections": m.ints("rope.dimension_sections", ()),
        "rope_scaling": m.text("rope.scaling.type", None),
        "rope_scaling_factor": m.real("rope.scaling.factor", None),
        "hidden_act": "silu" if act == "silu" else "gelu",
        "causal": m.flag("attention.causal", kind == "eagle3"),
        "sliding_window": window,
        "sliding_window_pattern": pattern,
        "embedding_scale": m.real("embedding_scale", None),
        "attention_scale": m.real("attention.scale", None),
        "attention_value_scale": m.real("attention.value_scale", None),
        "logit_scale": m.real("logit_scale", None),
        "final_logit_softcapping": m.real("final_logit_softcapping", None),
    }


def _target(m: _Meta, t: _Tensors, kind: str, n_embd: int) -> dict[str, Any]:
    """Which target layers the head reads, their width, and the feature projection."""
    key = m.key("target_layers")
    layers = m.ints("target_layers")
    if not layers:
        m.fail(f"{key} is empty")
    if any(layer < 0 for layer in layers):
        m.fail(f"{key} {list(layers)} has a negative layer id")
    if kind == "eagle3" and len(layers) != EAGLE3_TARGET_LAYERS:
        m.fail(f"{key} {list(layers)} lists {len(layers)} layers; EAGLE-3 reads exactly "
               f"{EAGLE3_TARGET_LAYERS}")
    try:
        hidden = tuple(hidden_index(layer) for layer in layers)
    except ValueError as exc:
        m.fail(f"{key} {list(layers)}: {exc}")
    if kind == "eagle3":
        width = m.count("target_hidden_size")
    else:  # llama.cpp sizes a dflash head's fc by its own width, whatever this key says
        width = m.count("target_hidden_size", n_embd)
        if width != n_embd:
            m.fail(f"{m.key('target_hidden_size')} is {width} but embedding_length is "
                   f"{n_embd}: llama.cpp's dflash heads read target features of their own "
                   "width")
    n_in = len(layers) * width
    t.need("fc.weight", (n_embd, n_in), f"{len(layers)} target layers x target hidden size "
           f"{width} -> embedding_length {n_embd}")
    if kind != "eagle3":
        t.may("fc.scale", (1,), "a scale of fc")
        t.need("enc.output_norm.weight", (n_embd,), "the norm of the projected features")
    elif m.flag("norm_before_fc", False):
        t.need("enc.output_norm.weight", (n_in,),
               f"{m.key('norm_before_fc')}: the norm of the features before fc")
    return {"target_layers": layers, "hidden_layers": hidden, "target_hidden_size": width,
            "norm_before_fc": kind == "eagle3" and m.flag("norm_before_fc", False),
            "norm_before_residual": kind == "eagle3" and m.flag("norm_before_residual", False)}


def _block_params(m: _Meta, t: _Tensors, kind: str, n_embd: int) -> dict[str, Any]:
    """Block length, mask token and the DFlash2 / DSpark extras."""
    if kind == "eagle3":
        return {"block_size": None, "sample_from_anchor": False, "has_confidence_head": False,
                "markov_rank": None, "conv_kernel_size": 0, "conv_group_size": 0,
                "selector_rank": 0, "selector_top_k": 0}
    conv = {name: m.count(name, 0, lo=0) for name in
            ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")}
    block = m.count("block_size", DEFAULT_BLOCK_SIZE if kind == "dflash" else _REQUIRED)
    if kind == "dflash2":
        for name, value in conv.items():
            if value < 1:
                key = m.key(name)
                m.fail(f"{key} is {value}: DFlash2 needs it > 0" if key in m.f.metadata
                       else f"missing metadata key {key!r} (DFlash2 needs it)")
        top_k, group = conv["selector_top_k"], conv["conv_group_size"]
        if n_embd % group:
            m.fail(f"embedding_length {n_embd} is not a multiple of "
                   f"{m.key('conv_group_size')} {group}")
        if n_embd < top_k * (top_k + 1):
            m.fail(f"embedding_length {n_embd} is too small for the selector lattice of "
                   f"{m.key('selector_top_k')} {top_k} (needs top_k x (top_k + 1))")
        rank = conv["selector_rank"]
        why = f"the candidate selector of rank {m.key('selector_rank')} {rank}"
        t.need("selector_predecessor.weight", (None, rank), why)
        t.need("selector_successor.weight", (None, rank), why)
        t.need("selector_hidden.weight", (rank, n_embd), why)
    elif "selector_hidden.weight" in t.f.tensors:
        m.fail(f"tensor 'selector_hidden.weight' (DFlash2's selector) but "
               f"{m.key('selector_top_k')} is {conv['selector_top_k']}")
    rank, conf = None, False
    if kind == "dspark":
        rank = t.need("markov_w1.weight", (None, None), "the Markov head").shape[1]
        conf = t.may("conf_proj.weight", (1, n_embd + rank),
                     f"the confidence head over [hidden {n_embd} ; Markov rank {rank}]") is not None
        t.may("conf_proj.bias", (1,), "the confidence head's bias")
        written = m.flag("has_confidence_head", conf)
        if written != conf:
            m.fail(f"{m.key('has_confidence_head')} is {written} but the file "
                   f"{'has' if conf else 'has no'} conf_proj.weight")
    return {
        "block_size": block,
        "sample_from_anchor": kind == "dspark" and m.flag("sample_from_anchor", True),
        "has_confidence_head": conf,
        "markov_rank": rank,
        **conv,
    }


def _layers(t: _Tensors, kind: str, p: Mapping[str, Any]) -> bool:
    """Checks every layer's tensors; True where no layer has attn_v (K serves as V)."""
    n_embd, hd, n_ff = p["n_embd"], p["head_dim"], p["n_ff"]
    q_dim, kv_dim = p["n_head"] * hd, p["n_head_kv"] * hd
    n_in = 2 * n_embd if kind == "eagle3" else n_embd  # EAGLE-3: [embedding ; features]
    dims = (f"embedding_length {n_embd}, heads {p['n_head']}/{p['n_head_kv']}, head dim "
            f"{hd}, feed_forward_length {n_ff}")
    if kind == "eagle3" and p["n_layer"] != 1:
        t.fail(f"{t.f.arch}.block_count is {p['n_layer']}; an EAGLE-3 head has one layer")
    no_v = 0
    for i in range(p["n_layer"]):
        b = f"blk.{i}."
        for name, shape in (("attn_norm", (n_embd,)), ("attn_q", (q_dim, n_in)),
                            ("attn_k", (kv_dim, n_in)), ("attn_output", (n_embd, q_dim)),
                            ("ffn_norm", (n_embd,)), ("ffn_gate", (n_ff, n_embd)),
                            ("ffn_up", (n_ff, n_embd)), ("ffn_down", (n_embd, n_ff))):
            t.need(b + name + ".weight", shape, dims)
        if kind == "eagle3":
            t.need(b + "attn_v.weight", (kv_dim, n_in), dims)
            t.need(b + "attn_norm_2.weight", (n_embd,), "the norm of the projected features")
            continue
        no_v += t.may(b + "attn_v.weight", (kv_dim, n_in), dims) is None
        t.need(b + "attn_q_norm.weight", (hd,), dims)
        t.need(b + "attn_k_norm.weight", (hd,), dims)
        t.may(b + "post_attention_norm.weight", (n_embd,), dims)
        t.may(b + "post_ffw_norm.weight", (n_embd,), dims)
        t.may(b + "layer_output_scale.weight", (1,), "a scale of the layer's output")
        t.may(b + "attn_sinks.weight", (p["n_head"],), "one attention sink per head")
        if kind == "dflash2":
            k, group = p["conv_kernel_size"], p["conv_group_size"]
            proj = 2 * k * (n_embd // group)
            why = f"conv_kernel_size {k}, conv_group_size {group}, {dims}"
            for part in ("attn", "ffn"):
                t.need(f"{b}{part}_conv_base", (2, k, n_embd), why)
                t.need(f"{b}{part}_conv_proj.weight", (proj, n_embd), why)
    if 0 < no_v < p["n_layer"]:
        t.fail(f"{no_v} of {p['n_layer']} layers have no attn_v.weight: all or none may "
               "share K as V")
    t.may("rope_freqs.weight", ((p["rope_dim"] if kind == "eagle3" else hd) // 2,),
          "one rope frequency factor per rotated pair")
    t.need("output_norm.weight", (n_embd,), "the final norm")
    return no_v > 0


def _vocabulary(m: _Meta, t: _Tensors, kind: str, p: Mapping[str, Any]) -> dict[str, Any]:
    """The head's vocabulary, its LM head, d2t and mask token. Every source of the
    vocabulary size must agree (llama.cpp's n_vocab is the tokenizer's, and it creates
    each of these tensors with that many rows)."""
    n_embd, rank = p["n_embd"], p["markov_rank"]
    d2t = t.may("d2t", (None,), "one target id per draft row")
    draft = None if d2t is None else d2t.shape[0]
    per_row = f"one row per draft token of d2t's {draft}" if draft else "one row per token"
    embd = t.may("token_embd.weight", (None, n_embd), f"embedding_length {n_embd}")
    output = t.may("output.weight", (draft, n_embd), f"{per_row}, embedding_length {n_embd}")
    if kind == "dspark":
        t.need("markov_w2.weight", (draft, rank), f"{per_row}, Markov rank {rank}")
        t.may("markov_w2.scale", (1,), "a scale of markov_w2")
    if draft is not None and output is None:
        t.fail(f"tensor 'd2t' maps {draft} draft rows, but the head has no output.weight "
               "of its own to compute them (the target's covers its whole vocabulary)")
    sizes: dict[str, int] = {}
    if tokens := m.f.get("tokenizer.ggml.tokens"):
        sizes["tokenizer.ggml.tokens"] = len(tokens)
    if (written := m.count("vocab_size", None)) is not None:
        sizes[m.key("vocab_size")] = written
    by_token = ["token_embd.weight", "markov_w1.weight", "selector_predecessor.weight",
                "selector_successor.weight"]
    if draft is None:  # the logits cover the whole vocabulary
        by_token += ["output.weight", "markov_w2.weight"]
    sizes |= {f"{name} rows": t.f.tensors[name].shape[0] for name in by_token
              if name in t.used}
    if len(set(sizes.values())) > 1:
        t.fail("vocabulary sizes disagree: " + ", ".join(f"{k} {v}" for k, v in sizes.items()))
    n_vocab = next(iter(sizes.values()), None)
    d2t_max = None if d2t is None else _check_d2t(t, d2t, n_vocab)
    mask = m.count(MASK_TOKEN_KEY, None if kind == "eagle3" else _REQUIRED, lo=0)
    if mask is not None and n_vocab is not None and mask >= n_vocab:
        m.fail(f"{MASK_TOKEN_KEY} {mask} is past the vocabulary of {n_vocab}")
    return {"n_vocab": n_vocab, "draft_vocab": draft, "d2t_max_id": d2t_max,
            "has_token_embd": embd is not None,
            "has_output": output is not None or (embd is not None and kind != "eagle3"),
            "mask_token_id": mask}


def _check_d2t(t: _Tensors, d2t: TensorInfo, n_vocab: int | None) -> int:
    """d2t holds absolute target ids (llama.cpp's converter adds each row's index to the
    HF offsets): int64, distinct, within the vocabulary. Returns the largest."""
    if d2t.type_name != "I64":
        t.fail(f"tensor 'd2t' is {d2t.type_name}; llama.cpp stores the draft -> target "
               "map as I64")
    ids = d2t.data.view("<i8")  # [draft_vocab] target token ids
    if ids.size and int(ids.min()) < 0:
        t.fail(f"tensor 'd2t' has a negative target id {int(ids.min())}")
    unique, first = np.unique(ids, return_index=True)
    if unique.size != ids.size:
        row = int(np.setdiff1d(np.arange(ids.size), first)[0])
        t.fail(f"tensor 'd2t' maps two draft rows to target id {int(ids[row])} (row {row}): "
               "llama.cpp's converter writes absolute ids, all distinct; offsets as HF "
               "checkpoints store them would repeat like this")
    top = int(ids.max()) if ids.size else -1
    if n_vocab is not None and top >= n_vocab:
        t.fail(f"tensor 'd2t' maps a draft row to target id {top}, past the head's "
               f"vocabulary of {n_vocab}")
    return top


def _is_extra(name: str) -> bool:
    """An optional tensor a kind may carry but does not need."""
    return name.endswith((".scale", "post_attention_norm.weight", "post_ffw_norm.weight",
                          "layer_output_scale.weight", "attn_sinks.weight", "conf_proj.bias",
                          "rope_freqs.weight"))
