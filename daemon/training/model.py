"""A DFlash head in PyTorch: the computation of specd's head graphs
(`ort_models/graph_builder/dflash.py`) and of llama.cpp's dflash.cpp, written for training
many blocks of a sequence at once.

- context: g = RMSNorm_enc(fc · features) for every target row; per layer its K =
  RoPE(k_norm(W_k g)) and V = W_v g at the row's position (what injection writes).
- blocks: each block is [token at the anchor, MASK × (B - 1)] at positions a..a + B - 1,
  through Qwen3-style layers (q/k norms, NeoX RoPE, SwiGLU); a block row attends to the
  context rows strictly before its anchor and to every row of its own block (not causal);
  output_norm, then the frozen LM head (the target's, or its rows of a reduced draft
  vocabulary).

The target's token embeddings and LM head are frozen buffers, as in the DFlash recipe.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .config import HeadConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope(x: torch.Tensor, pos: torch.Tensor, base: float) -> torch.Tensor:
    """NeoX rotation of x [..., S, hd] at positions pos [..., S] (broadcast over heads):
    pairs (x[i], x[i + hd/2]), angle pos · base^(-2i / hd)."""
    hd = x.shape[-1]
    half = hd // 2
    inv = base ** (-torch.arange(half, device=x.device, dtype=torch.float64) * 2.0 / hd)
    theta = (pos.to(torch.float64)[..., None] * inv).to(x.dtype)  # [..., S, half]
    cos, sin = theta.cos(), theta.sin()
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


class HeadLayer(nn.Module):
    def __init__(self, cfg: HeadConfig) -> None:
        super().__init__()
        e, hd = cfg.n_embd, cfg.head_dim
        self.cfg = cfg
        self.attn_norm = RMSNorm(e, cfg.rms_eps)
        self.q = nn.Linear(e, cfg.n_head * hd, bias=False)
        self.k = nn.Linear(e, cfg.n_head_kv * hd, bias=False)
        self.v = nn.Linear(e, cfg.n_head_kv * hd, bias=False)
        self.o = nn.Linear(cfg.n_head * hd, e, bias=False)
        self.q_norm = RMSNorm(hd, cfg.rms_eps)
        self.k_norm = RMSNorm(hd, cfg.rms_eps)
        self.ffn_norm = RMSNorm(e, cfg.rms_eps)
        self.gate = nn.Linear(e, cfg.n_ff, bias=False)
        self.up = nn.Linear(e, cfg.n_ff, bias=False)
        self.down = nn.Linear(cfg.n_ff, e, bias=False)

    def kv(self, h: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [b, Hkv, S, hd] of rows h [b, S, E] at positions pos [b, S]."""
        b, s, _ = h.shape
        c = self.cfg
        k = self.k_norm(self.k(h).view(b, s, c.n_head_kv, c.head_dim)).transpose(1, 2)
        v = self.v(h).view(b, s, c.n_head_kv, c.head_dim).transpose(1, 2)
        return rope(k, pos[:, None, :], c.rope_base), v

    def forward(self, x: torch.Tensor, pos: torch.Tensor, ctx_k: torch.Tensor,
                ctx_v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Block rows x [b, R, E] at pos [b, R] over the context's K/V [b, Hkv, T, hd];
        mask [b, 1, R, T + R] (True: attended)."""
        b, r, _ = x.shape
        c = self.cfg
        h = self.attn_norm(x)
        q = self.q_norm(self.q(h).view(b, r, c.n_head, c.head_dim)).transpose(1, 2)
        q = rope(q, pos[:, None, :], c.rope_base)  # [b, H, R, hd]
        k, v = self.kv(h, pos)
        keys = torch.cat([ctx_k, k], dim=2)  # [b, Hkv, T + R, hd]
        vals = torch.cat([ctx_v, v], dim=2)
        group = c.n_head // c.n_head_kv  # kv head j serves query heads j*G .. j*G + G - 1
        keys = keys.repeat_interleave(group, dim=1)
        vals = vals.repeat_interleave(group, dim=1)
        attn = F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask,
                                              scale=1.0 / math.sqrt(c.head_dim))
        x = x + self.o(attn.transpose(1, 2).reshape(b, r, c.n_head * c.head_dim))
        h = self.ffn_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class DFlashHead(nn.Module):
    """embed [V_in, E]: the target's token embeddings of the ids the data uses (rows by
    `embed_index`); lm_head [Vd, E]: the target's LM head rows of the draft vocabulary."""

    embed: torch.Tensor  # frozen buffers (registered below)
    embed_index: torch.Tensor
    lm_head: torch.Tensor

    def __init__(self, cfg: HeadConfig, embed: np.ndarray, embed_index: np.ndarray,
                 lm_head: np.ndarray) -> None:
        super().__init__()
        self.cfg = cfg
        self.fc = nn.Linear(cfg.feature_width, cfg.n_embd, bias=False)
        self.enc_norm = RMSNorm(cfg.n_embd, cfg.rms_eps)
        self.layers = nn.ModuleList(HeadLayer(cfg) for _ in range(cfg.n_layer))
        self.out_norm = RMSNorm(cfg.n_embd, cfg.rms_eps)
        self.register_buffer("embed", torch.from_numpy(embed), persistent=False)
        self.register_buffer("embed_index", torch.from_numpy(embed_index.astype(np.int64)),
                             persistent=False)
        self.register_buffer("lm_head", torch.from_numpy(lm_head), persistent=False)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=0.02)

    def blocks(self) -> list[HeadLayer]:
        """The layers, typed (a ModuleList's items are only Modules to a type checker)."""
        return [m for m in self.layers if isinstance(m, HeadLayer)]

    def forward(self, feats: torch.Tensor, anchors: torch.Tensor, anchor_tokens: torch.Tensor
                ) -> torch.Tensor:
        """feats [b, T, F] (the context rows); anchors [b, N] (positions; blocks whose
        anchor is negative are padding); anchor_tokens [b, N] target ids. Returns the
        draft slots' output-normed rows [b, N, B - 1, E]."""
        c = self.cfg
        b, t, _ = feats.shape
        n, bs = anchors.shape[1], c.block_size
        dev = feats.device
        g = self.enc_norm(self.fc(feats))  # [b, T, E]
        ctx_pos = torch.arange(t, device=dev).expand(b, t)  # [b, T]
        slot = torch.arange(bs, device=dev)
        pos = (anchors.clamp(min=0)[..., None] + slot).reshape(b, n * bs)  # [b, R]
        ids = torch.full((b, n, bs), c.mask_token_id, device=dev, dtype=torch.long)
        ids[..., 0] = anchor_tokens
        x = self.embed[self.embed_index[ids.reshape(b, n * bs)]]  # [b, R, E]
        # a block row sees context rows before its anchor and its own block's rows
        row_anchor = anchors[..., None].expand(b, n, bs).reshape(b, n * bs)  # [b, R]
        sees_ctx = ctx_pos[:, None, :] < row_anchor[:, :, None]  # [b, R, T]
        blk = torch.arange(n, device=dev).repeat_interleave(bs)  # [R]
        sees_blk = (blk[:, None] == blk[None, :]).expand(b, -1, -1)  # [b, R, R]
        mask = torch.cat([sees_ctx, sees_blk], dim=-1)[:, None]  # [b, 1, R, T + R]
        for layer in self.blocks():
            ctx_k, ctx_v = layer.kv(g, ctx_pos)  # injection: no attn_norm on g
            x = layer(x, pos, ctx_k, ctx_v, mask)
        x = self.out_norm(x).view(b, n, bs, c.n_embd)
        return x[:, :, 1:]  # [b, N, B - 1, E]: slot 0 holds the anchor, no draft

    def logits(self, rows: torch.Tensor) -> torch.Tensor:
        """[..., E] -> [..., Vd] through the frozen LM head."""
        return rows @ self.lm_head.T

    def gguf_tensors(self) -> dict[str, np.ndarray]:
        """The trained weights under llama.cpp's names (numpy order (out, in), float32)."""
        def a(t: torch.Tensor) -> np.ndarray:
            return t.detach().to("cpu", torch.float32).numpy()

        out = {"fc.weight": a(self.fc.weight), "enc.output_norm.weight": a(self.enc_norm.weight)}
        for i, layer in enumerate(self.blocks()):
            p = f"blk.{i}."
            out |= {p + "attn_norm.weight": a(layer.attn_norm.weight),
                    p + "attn_q.weight": a(layer.q.weight),
                    p + "attn_k.weight": a(layer.k.weight),
                    p + "attn_v.weight": a(layer.v.weight),
                    p + "attn_output.weight": a(layer.o.weight),
                    p + "attn_q_norm.weight": a(layer.q_norm.weight),
                    p + "attn_k_norm.weight": a(layer.k_norm.weight),
                    p + "ffn_norm.weight": a(layer.ffn_norm.weight),
                    p + "ffn_gate.weight": a(layer.gate.weight),
                    p + "ffn_up.weight": a(layer.up.weight),
                    p + "ffn_down.weight": a(layer.down.weight)}
        out["output_norm.weight"] = a(self.out_norm.weight)
        return out
