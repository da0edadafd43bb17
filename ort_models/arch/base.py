"""Model hyper-parameters shared by every decoder architecture.

An architecture module reads its GGUF keys into `HParams` and sets the feature flags the
graph builder understands; adding an architecture is one small module plus a registry line.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..gguf_file import GGUFError, GGUFFile


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
    qk_norm: bool = False  # qwen3: per-head RMSNorm of q and k before RoPE
    tied_embeddings: bool = False

    @property
    def group_size(self) -> int:
        return self.n_head // self.n_head_kv

    def kv_bytes_per_token(self, dtype_bytes: int = 4) -> int:
        """K and V bytes per token per sequence, all layers."""
        return self.n_layer * self.n_head_kv * self.head_dim * 2 * dtype_bytes


def read_common(f: GGUFFile, *, rope_interleaved: bool, **flags: bool) -> HParams:
    n_embd = int(f.require("embedding_length"))
    n_head = int(f.require("attention.head_count"))
    n_head_kv = int(f.arch_key("attention.head_count_kv", n_head))
    head_dim = int(f.arch_key("attention.key_length", n_embd // n_head))
    value_dim = int(f.arch_key("attention.value_length", head_dim))
    if value_dim != head_dim:
        raise GGUFError(f"{f.path}: key_length {head_dim} != value_length {value_dim}")
    if n_head % n_head_kv:
        raise GGUFError(f"{f.path}: head_count {n_head} not a multiple of kv {n_head_kv}")
    embd = f.tensor("token_embd.weight")
    n_vocab = int(embd.shape[0])
    return HParams(
        arch=f.arch,
        n_layer=int(f.require("block_count")),
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim=head_dim,
        n_ff=int(f.require("feed_forward_length")),
        n_vocab=n_vocab,
        n_ctx_train=int(f.arch_key("context_length", 2048)),
        rms_eps=float(f.arch_key("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_base=float(f.arch_key("rope.freq_base", 10000.0)),
        rope_dim=int(f.arch_key("rope.dimension_count", head_dim)),
        rope_interleaved=rope_interleaved,
        tied_embeddings=not f.has_tensor("output.weight"),
        **flags,
    )
