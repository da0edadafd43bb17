"""Model hyper-parameters shared by every decoder architecture.

An architecture module reads its GGUF keys into `HParams` and sets the feature flags the
graph builder understands; adding an architecture is one small module plus a registry line.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from specd.ort_models.gguf_file import GGUFError, GGUFFile

from .rope_scaling import RopeScaling, read_rope_scaling


@dataclass(frozen=True)
class MoeParams:
    """A mixture-of-experts feed-forward block: a router picks `n_used` of `n_expert`
    gated experts per token (as llama.cpp's build_moe_ffn)."""

    n_expert: int
    n_used: int  # experts a token wakes (top-k)
    n_ff: int  # an expert's hidden width
    gating: str = "softmax"  # "softmax": top-k of softmax(logits); "softmax_weight":
    # top-k of the logits, then a softmax over those k (gpt-oss)
    norm: bool = False  # the chosen weights divided by their sum
    scale: float = 0.0  # the weights times this (0: not scaled)
    act: str = "silu"  # "silu": silu(gate) * up; "swiglu_oai": gpt-oss's clamped variant
    biases: bool = False  # the router and the experts have biases (gpt-oss)


@dataclass(frozen=True)
class HParams:
    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    n_vocab: int
    n_ctx_train: int
    rms_eps: float
    rope_base: float
    rope_dim: int
    rope_interleaved: bool  # llama.cpp NORM rope (adjacent pairs); False = NEOX (half split)
    qkv_bias: bool = False  # qwen2
    attn_out_bias: bool = False  # gpt-oss: the attention output product has a bias
    qk_norm: bool = False  # qwen3: per-head RMSNorm of q and k before RoPE
    tied_embeddings: bool = False
    # gemma3's mechanisms, each a shared building block the next architecture reuses
    sliding_window: int = 0  # keys a sliding-window layer's query sees (itself included)
    swa_layers: tuple[bool, ...] = ()  # per layer: attends over the sliding window
    rope_base_swa: float | None = None  # the sliding-window layers' rope base
    embedding_scale: float | None = None  # token embeddings scaled (gemma: sqrt(n_embd))
    attention_scale: float | None = None  # replaces 1/sqrt(head_dim)
    post_norms: bool = False  # RMSNorm of the attention and FFN outputs before each residual
    ffn_act: str = "silu"  # gated FFN activation: "silu" or "gelu" (tanh approximation)
    final_softcap: float | None = None  # logits = cap * tanh(logits / cap)
    moe: MoeParams | None = None  # a mixture-of-experts FFN in every layer (None: dense)
    # rope_freqs.weight: one divisor per rotary pair of the angles (a drafter head's)
    rope_freq_factors: tuple[float, ...] = ()
    # muse-glimmer's mechanisms (llama.cpp's src/models/muse-glimmer.cpp)
    embedding_norm: bool = False  # the token embeddings RMS-normed (no weight) first
    rope_swa_only: bool = False  # RoPE on the sliding-window layers only, global ones NoPE
    attn_gate: bool = False  # sigmoid(attn_gate @ h) times the attention, before its output
    post_norm_eps: float | None = None  # the post-norms' eps where it is not rms_eps
    logit_scale: float | None = None  # logits times this, before any soft-capping
    rope_scaling: RopeScaling | None = None  # linear or YaRN (rope_scaling.py); None: none
    attn_sinks: bool = False  # gpt-oss: a learned logit per head in every softmax's sum
    ffn_norm: str = "ffn_norm"  # the FFN input norm's tensor stem (gpt-oss:
    # post_attention_norm, read as the norm of the residual after attention)
    # M-RoPE (qwen2vl): rotary pairs per position section (t, h, w, e), each row having
    # four positions (graph input `rope_positions`); empty: one position per row
    rope_sections: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        # a tuple however it was given (a meta.json round trip gives a list)
        object.__setattr__(self, "swa_layers", tuple(self.swa_layers))
        if isinstance(self.moe, dict):  # a meta.json round trip gives a dict
            object.__setattr__(self, "moe", MoeParams(**self.moe))
        object.__setattr__(self, "rope_freq_factors", tuple(self.rope_freq_factors))
        object.__setattr__(self, "rope_sections", tuple(self.rope_sections))
        if isinstance(self.rope_scaling, dict):
            object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))

    @property
    def group_size(self) -> int:
        return self.n_head // self.n_head_kv

    @property
    def attn_scale(self) -> float:
        """The factor of q . k."""
        return self.attention_scale or 1.0 / math.sqrt(self.head_dim)

    def is_swa(self, layer: int) -> bool:
        """Whether `layer` attends over the sliding window only."""
        return bool(self.sliding_window) and self.swa_layers[layer]

    def uses_rope(self, layer: int) -> bool:
        """Whether `layer` rotates its queries and keys."""
        return not self.rope_swa_only or self.is_swa(layer)

    def rope_base_of(self, layer: int) -> float:
        """`layer`'s rope base."""
        return self.rope_base_swa if self.is_swa(layer) and self.rope_base_swa else self.rope_base

    @property
    def mrope(self) -> bool:
        """Whether a row's rotary angles come from four positions (M-RoPE)."""
        return bool(self.rope_sections)

    def kv_bytes_per_token(self, dtype_bytes: int = 4) -> int:
        """K and V bytes per token per sequence, all layers."""
        return self.n_layer * self.n_head_kv * self.head_dim * 2 * dtype_bytes


def _count(f: GGUFFile, key: str, value: object, lo: int = 1) -> int:
    """An integer hyper-parameter, checked: a corrupt value names its key."""
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise GGUFError(f"{f.path}: {f.arch}.{key} must be an integer >= {lo}, got {value!r}")
    return value


def _real(f: GGUFFile, key: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise GGUFError(f"{f.path}: {f.arch}.{key} must be a positive number, got {value!r}")
    return float(value)


def read_common(f: GGUFFile, *, rope_interleaved: bool, **flags: object) -> HParams:
    n_embd = _count(f, "embedding_length", f.require("embedding_length"))
    n_head = _count(f, "attention.head_count", f.require("attention.head_count"))
    n_head_kv = _count(f, "attention.head_count_kv",
                       f.arch_key("attention.head_count_kv", n_head))
    head_dim = _count(f, "attention.key_length",
                      f.arch_key("attention.key_length", n_embd // n_head))
    value_dim = _count(f, "attention.value_length",
                       f.arch_key("attention.value_length", head_dim))
    if value_dim != head_dim:
        raise GGUFError(f"{f.path}: key_length {head_dim} != value_length {value_dim}")
    if n_head % n_head_kv:
        raise GGUFError(f"{f.path}: head_count {n_head} not a multiple of kv {n_head_kv}")
    embd = f.tensor("token_embd.weight")
    n_vocab = int(embd.shape[0])
    n_ctx_train = _count(f, "context_length", f.arch_key("context_length", 2048))
    hp = HParams(
        arch=f.arch,
        n_layer=_count(f, "block_count", f.require("block_count")),
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim=head_dim,
        n_ff=_count(f, "feed_forward_length",
                     f.arch_key("feed_forward_length", 0) if flags.get("moe") else
                     f.require("feed_forward_length"), lo=0 if flags.get("moe") else 1),
        n_vocab=n_vocab,
        n_ctx_train=n_ctx_train,
        rms_eps=_real(f, "attention.layer_norm_rms_epsilon",
                      f.arch_key("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_base=_real(f, "rope.freq_base", f.arch_key("rope.freq_base", 10000.0)),
        rope_dim=_count(f, "rope.dimension_count", f.arch_key("rope.dimension_count", head_dim)),
        rope_interleaved=rope_interleaved,
        tied_embeddings=not f.has_tensor("output.weight"),
        rope_scaling=read_rope_scaling(f, n_ctx_train),
        **flags,  # type: ignore[arg-type]
    )
    check_shapes(f, hp)
    return hp


def read_moe(f: GGUFFile, **kinds: object) -> MoeParams:
    """The mixture-of-experts keys: expert_count, expert_used_count, the experts' width
    (expert_feed_forward_length, one value or the same in every layer), and
    expert_weights_scale where present; `kinds` sets the router's and experts' kind."""
    n_expert = _count(f, "expert_count", f.require("expert_count"))
    n_used = _count(f, "expert_used_count", f.require("expert_used_count"))
    if n_used > n_expert:
        raise GGUFError(f"{f.path}: {f.arch}.expert_used_count {n_used} exceeds "
                        f"expert_count {n_expert}")
    width = f.arch_key("expert_feed_forward_length", None)
    if width is None:  # llama.cpp: n_ff / n_used where the key is absent
        width = _count(f, "feed_forward_length", f.require("feed_forward_length")) // n_used
    if isinstance(width, list):
        if len(set(width)) != 1:
            raise GGUFError(f"{f.path}: {f.arch}.expert_feed_forward_length differs between "
                            f"layers ({sorted(set(width))}); specd reads one width")
        width = width[0]
    scale = f.arch_key("expert_weights_scale", 0.0)
    if isinstance(scale, bool) or not isinstance(scale, int | float) or scale < 0:
        raise GGUFError(f"{f.path}: {f.arch}.expert_weights_scale must be a number >= 0, "
                        f"got {scale!r}")
    return MoeParams(n_expert=n_expert, n_used=n_used,
                     n_ff=_count(f, "expert_feed_forward_length", width),
                     scale=float(scale), **kinds)  # type: ignore[arg-type]


def check_shapes(f: GGUFFile, hp: HParams) -> None:
    """Every layer's matrices must have the shapes the metadata implies, and the rotary
    width must fit the head (a file whose metadata disagrees with its tensors would
    otherwise fail inside ONNX Runtime, at the first token)."""
    if hp.rope_dim % 2 or hp.rope_dim > hp.head_dim:
        raise GGUFError(f"{f.path}: {hp.arch}.rope.dimension_count is {hp.rope_dim}; it must "
                        f"be even and at most the head dimension {hp.head_dim}")
    want: dict[str, tuple[int, ...]] = {"token_embd": (hp.n_vocab, hp.n_embd)}
    for i in range(hp.n_layer):
        want |= {f"blk.{i}.attn_q": (hp.n_head * hp.head_dim, hp.n_embd),
                 f"blk.{i}.attn_k": (hp.n_head_kv * hp.head_dim, hp.n_embd),
                 f"blk.{i}.attn_v": (hp.n_head_kv * hp.head_dim, hp.n_embd),
                 f"blk.{i}.attn_output": (hp.n_embd, hp.n_head * hp.head_dim),
                 f"blk.{i}.ffn_gate": (hp.n_ff, hp.n_embd),
                 f"blk.{i}.ffn_up": (hp.n_ff, hp.n_embd),
                 f"blk.{i}.ffn_down": (hp.n_embd, hp.n_ff)}
    if hp.moe is not None:
        m = hp.moe
        for i in range(hp.n_layer):
            want |= {f"blk.{i}.ffn_gate_inp": (m.n_expert, hp.n_embd),
                     f"blk.{i}.ffn_gate_exps": (m.n_expert, m.n_ff, hp.n_embd),
                     f"blk.{i}.ffn_up_exps": (m.n_expert, m.n_ff, hp.n_embd),
                     f"blk.{i}.ffn_down_exps": (m.n_expert, hp.n_embd, m.n_ff)}
    for name, shape in want.items():
        if f.has_tensor(name + ".weight"):
            t = f.tensor(name + ".weight")
            got = tuple(int(d) for d in t.shape)
            if got != shape:  # named with the file holding it (a split model's part)
                raise GGUFError(f"{f.part_path(t)}: tensor {name}.weight is {list(got)}, but the "
                                f"metadata (embedding_length {hp.n_embd}, heads "
                                f"{hp.n_head}/{hp.n_head_kv}, head dim {hp.head_dim}, "
                                f"feed_forward_length {hp.n_ff}) implies {list(shape)}")
    if not f.has_tensor(f"blk.{hp.n_layer - 1}.attn_norm.weight") and f.has_tensor(
            "blk.0.attn_norm.weight"):
        raise GGUFError(f"{f.path}: block_count is {hp.n_layer} but the file has no layer "
                        f"{hp.n_layer - 1}")
