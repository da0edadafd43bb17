"""DFlash and DSpark heads in PyTorch: the computation of specd's head graphs
(`ort_models/graph_builder/dflash.py`, `dspark.py`) and of llama.cpp's dflash.cpp, written
for training many blocks of a sequence at once.

- context: g = RMSNorm_enc(fc · features) for every target row; per layer its K =
  RoPE(k_norm(W_k g)) and V = W_v g at the row's position (what injection writes).
- blocks: each block is [token at the anchor, MASK × (B - 1)] at positions a..a + B - 1,
  through Qwen3-style layers (q/k norms, NeoX RoPE, SwiGLU); a block row attends to the
  context rows strictly before its anchor and to every row of its own block (not causal);
  output_norm, then the frozen LM head (the target's, or its rows of a reduced draft
  vocabulary). DFlash drafts from slots 1..B-1 (each the token at its own position);
  DSpark, anchor-first, from slots 0..B-1 (each the token after its position).
- DSpark: slot k's logits gain W2 · W1[prev_k] (prev_0 the anchor, prev_k the token slot
  k - 1 drafts: in training the target's, which is what the chain's argmax is wherever
  the drafts before it are accepted); its confidence is
  sigmoid(conf_proj · [h_k ; W1[prev_k]] + b), h_k the slot's output-normed row.

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


class HeadModel(nn.Module):
    """What training asks of a head of any kind."""

    cfg: HeadConfig

    def rows(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The drafts' output-normed rows [b, N, S, E] of a batch (trainer.Batches)."""
        raise NotImplementedError

    def logits(self, rows: torch.Tensor, prev: torch.Tensor | None = None) -> torch.Tensor:
        """rows [..., E] -> [..., Vd] (`prev` [...], the tokens before the drafts, is
        DSpark's Markov input)."""
        raise NotImplementedError

    def confidence_logit(self, rows: torch.Tensor, prev: torch.Tensor) -> torch.Tensor | None:
        """The confidence head's logit per draft [...] (None: the head has none)."""
        return None

    def loss(self, rows: torch.Tensor, batch: dict[str, torch.Tensor],
             weight: torch.Tensor) -> tuple[torch.Tensor, int]:
        """The batch's loss from its drafts' rows [b, N, S, E], each draft weighted by
        weight [b, N, S], and the labels it counted: cross-entropy against the target's
        tokens (labels outside the draft vocabulary carry none)."""
        labels = batch["labels"]  # [b, N, S]
        valid = labels >= 0
        logits = self.logits(rows[valid])  # [M, Vd]
        ce = F.cross_entropy(logits, labels[valid], reduction="none")  # [M]
        w = weight[valid]
        return (w * ce).sum() / w.sum().clamp(min=1e-9), int(valid.sum())

    def gguf_tensors(self) -> dict[str, np.ndarray]:
        """The trained weights under llama.cpp's names (numpy order (out, in), float32)."""
        raise NotImplementedError


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


class DFlashHead(HeadModel):
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
        draft slots' output-normed rows [b, N, S, E] (S = cfg.n_slots)."""
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
        return x[:, :, c.first_slot:]  # [b, N, S, E]

    def rows(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self(batch["feats"], batch["anchors"], batch["anchor_tokens"])

    def logits(self, rows: torch.Tensor, prev: torch.Tensor | None = None) -> torch.Tensor:
        """Through the frozen LM head."""
        return rows @ self.lm_head.T

    def gguf_tensors(self) -> dict[str, np.ndarray]:
        out = {"fc.weight": as_numpy(self.fc.weight),
               "enc.output_norm.weight": as_numpy(self.enc_norm.weight)}
        for i, layer in enumerate(self.blocks()):
            p = f"blk.{i}."
            out |= {p + "attn_norm.weight": as_numpy(layer.attn_norm.weight),
                    p + "attn_q.weight": as_numpy(layer.q.weight),
                    p + "attn_k.weight": as_numpy(layer.k.weight),
                    p + "attn_v.weight": as_numpy(layer.v.weight),
                    p + "attn_output.weight": as_numpy(layer.o.weight),
                    p + "attn_q_norm.weight": as_numpy(layer.q_norm.weight),
                    p + "attn_k_norm.weight": as_numpy(layer.k_norm.weight),
                    p + "ffn_norm.weight": as_numpy(layer.ffn_norm.weight),
                    p + "ffn_gate.weight": as_numpy(layer.gate.weight),
                    p + "ffn_up.weight": as_numpy(layer.up.weight),
                    p + "ffn_down.weight": as_numpy(layer.down.weight)}
        out["output_norm.weight"] = as_numpy(self.out_norm.weight)
        return out


class DSparkHead(DFlashHead):
    """A DFlash head, anchor-first, with DSpark's Markov head (W1 [target vocab, R], an
    embedding by target id; W2 [R -> Vd]) and confidence head ([E + R -> 1])."""

    def __init__(self, cfg: HeadConfig, embed: np.ndarray, embed_index: np.ndarray,
                 lm_head: np.ndarray) -> None:
        super().__init__(cfg, embed, embed_index, lm_head)
        self.markov_w1 = nn.Embedding(cfg.target_vocab, cfg.markov_rank)
        self.markov_w2 = nn.Linear(cfg.markov_rank, len(lm_head), bias=False)
        self.conf_proj = nn.Linear(cfg.n_embd + cfg.markov_rank, 1)
        nn.init.normal_(self.markov_w1.weight, std=0.02)
        nn.init.zeros_(self.markov_w2.weight)  # no bias before it learns one
        nn.init.normal_(self.conf_proj.weight, std=0.02)
        nn.init.zeros_(self.conf_proj.bias)

    def logits(self, rows: torch.Tensor, prev: torch.Tensor | None = None) -> torch.Tensor:
        assert prev is not None, "DSpark's logits need the tokens before the slots"
        return rows @ self.lm_head.T + self.markov_w2(self.markov_w1(prev))

    def confidence_logit(self, rows: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        z = self.conf_proj(torch.cat([rows, self.markov_w1(prev).to(rows.dtype)], dim=-1))
        return z[..., 0]

    def loss(self, rows: torch.Tensor, batch: dict[str, torch.Tensor],
             weight: torch.Tensor) -> tuple[torch.Tensor, int]:
        """DeepSpec's: 0.1 CE + 0.9 TV (1 - p(label), the greedy target's acceptance rate)
        on the drafts whose label is in the draft vocabulary, and the confidence head's BCE
        against that rate (0 outside it) on every draft with a label."""
        at = batch["exists"]  # [b, N, S]
        lab = batch["labels"][at]  # [M], -1 outside the draft vocabulary
        prev = batch["prev"][at]
        h = rows[at]  # [M, E]
        logits = self.logits(h, prev).float()  # [M, Vd]
        valid = lab >= 0
        logp = torch.log_softmax(logits, dim=-1)
        lp = logp.gather(1, lab.clamp(min=0)[:, None])[:, 0]  # [M]
        rate = torch.where(valid, lp.exp(), torch.zeros_like(lp))  # greedy acceptance rate
        token = 0.1 * -lp + 0.9 * (1.0 - rate)
        w = weight[at]
        wv = w * valid
        loss = (wv * token).sum() / wv.sum().clamp(min=1e-9)
        bce = F.binary_cross_entropy_with_logits(
            self.confidence_logit(h, prev).float(), rate.detach(), reduction="none")  # [M]
        return loss + (w * bce).sum() / w.sum().clamp(min=1e-9), int(valid.sum())

    def gguf_tensors(self) -> dict[str, np.ndarray]:
        return {**super().gguf_tensors(), "markov_w1.weight": as_numpy(self.markov_w1.weight),
                "markov_w2.weight": as_numpy(self.markov_w2.weight),
                "conf_proj.weight": as_numpy(self.conf_proj.weight),
                "conf_proj.bias": as_numpy(self.conf_proj.bias)}


def as_numpy(t: torch.Tensor) -> np.ndarray:
    """A tensor as float32 numpy, detached, on the CPU."""
    return t.detach().to("cpu", torch.float32).numpy()


def rope_interleaved(x: torch.Tensor, pos: torch.Tensor, base: float) -> torch.Tensor:
    """llama.cpp's NORM rotation (a Llama layer's, EAGLE-3's) of x [..., S, hd] at
    positions pos [..., S]: adjacent pairs (x[2i], x[2i + 1]), angle pos · base^(-2i / hd)."""
    hd = x.shape[-1]
    inv = base ** (-torch.arange(hd // 2, device=x.device, dtype=torch.float64) * 2.0 / hd)
    theta = (pos.to(torch.float64)[..., None] * inv).to(x.dtype)  # [..., S, hd / 2]
    cos, sin = theta.cos(), theta.sin()
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2)


class Eagle3Head(HeadModel):
    """An EAGLE-3 head (specd's eagle3 graphs, llama.cpp's eagle3.cpp): g = fc · features
    of three target layers; one Llama layer whose input at position P is
    [RMSNorm(embed(token at P + 1)) ; RMSNorm_2(g_P)] (q/k/v 2E wide, interleaved rope, no
    q/k norms), residual g_P, attending causally over the pairs before it; its pre-norm
    output is the next step's g; output_norm, then the head's own LM head over the draft
    vocabulary (initialised from the target's rows), trained with it.

    Trained by the training-time test: per anchor a (the position of the token just
    verified), the steps of a draft are unrolled: step j at position a - 1 + j reads the
    token at a + j (the target's: what the drafts are wherever the ones before are
    accepted) and g = the target's g at a - 1 for j = 0, else step j - 1's output; it
    attends to the target's pairs before a and to the draft's own steps 1..j, as the
    cache holds them while drafting, and predicts the token at a + 1 + j."""

    embed: torch.Tensor
    embed_index: torch.Tensor

    def __init__(self, cfg: HeadConfig, embed: np.ndarray, embed_index: np.ndarray,
                 lm_head: np.ndarray) -> None:
        super().__init__()
        e, hd = cfg.n_embd, cfg.head_dim
        self.cfg = cfg
        self.fc = nn.Linear(cfg.feature_width, e, bias=False)
        self.embed_norm = RMSNorm(e, cfg.rms_eps)  # blk.0.attn_norm
        self.hidden_norm = RMSNorm(e, cfg.rms_eps)  # blk.0.attn_norm_2
        self.q = nn.Linear(2 * e, cfg.n_head * hd, bias=False)
        self.k = nn.Linear(2 * e, cfg.n_head_kv * hd, bias=False)
        self.v = nn.Linear(2 * e, cfg.n_head_kv * hd, bias=False)
        self.o = nn.Linear(cfg.n_head * hd, e, bias=False)
        self.ffn_norm = RMSNorm(e, cfg.rms_eps)
        self.gate = nn.Linear(e, cfg.n_ff, bias=False)
        self.up = nn.Linear(e, cfg.n_ff, bias=False)
        self.down = nn.Linear(cfg.n_ff, e, bias=False)
        self.out_norm = RMSNorm(e, cfg.rms_eps)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=0.02)
        self.lm_head = nn.Linear(e, len(lm_head), bias=False)
        with torch.no_grad():
            self.lm_head.weight.copy_(torch.from_numpy(lm_head))
        self.register_buffer("embed", torch.from_numpy(embed), persistent=False)
        self.register_buffer("embed_index", torch.from_numpy(embed_index.astype(np.int64)),
                             persistent=False)

    def _input(self, ids: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """The layer's input [..., 2E] of tokens ids [...] paired with g [..., E]."""
        return torch.cat([self.embed_norm(self.embed[self.embed_index[ids]]),
                          self.hidden_norm(g)], dim=-1)

    def _kv(self, x: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [..., S, Hkv, hd] of inputs x [..., S, 2E] at positions pos [..., S]."""
        c = self.cfg
        k = self.k(x).unflatten(-1, (c.n_head_kv, c.head_dim))
        k = rope_interleaved(k.transpose(-2, -3), pos[..., None, :], c.rope_base)
        return k.transpose(-2, -3), self.v(x).unflatten(-1, (c.n_head_kv, c.head_dim))

    def forward(self, feats: torch.Tensor, tokens: torch.Tensor, anchors: torch.Tensor,
                prev: torch.Tensor) -> torch.Tensor:
        """feats [b, T, F] and tokens [b, T + 1] of the context (features of positions
        before the last anchor, tokens through it); anchors [b, N] (negative: padding,
        else >= 1); prev [b, N, S] the token each step reads. Returns the steps'
        output-normed rows [b, N, S, E]."""
        c = self.cfg
        b, t, _ = feats.shape
        n, steps = anchors.shape[1], prev.shape[2]
        dev = feats.device
        group = c.n_head // c.n_head_kv
        g = self.fc(feats)  # [b, T, E]
        ctx_pos = torch.arange(t, device=dev).expand(b, t)  # [b, T]
        ctx_k, ctx_v = self._kv(self._input(tokens[:, 1:t + 1], g), ctx_pos)  # [b, T, Hkv, hd]
        ctx_k = ctx_k.repeat_interleave(group, dim=2)
        ctx_v = ctx_v.repeat_interleave(group, dim=2)
        a = anchors.clamp(min=1)  # [b, N]
        sees = ctx_pos[:, None, :] < a[:, :, None]  # [b, N, T]: the pairs before the anchor
        cur = torch.gather(g, 1, (a - 1)[..., None].expand(b, n, c.n_embd))  # [b, N, E]
        keys: list[torch.Tensor] = []  # the draft's own steps 1.. [b, N, H, hd] each
        vals: list[torch.Tensor] = []
        rows = []
        scale = 1.0 / math.sqrt(c.head_dim)
        for j in range(steps):
            pos = a - 1 + j  # [b, N]
            x = self._input(prev[:, :, j], cur)  # [b, N, 2E]
            q = self.q(x).unflatten(-1, (c.n_head, c.head_dim))  # [b, N, H, hd]
            q = rope_interleaved(q.transpose(1, 2), pos[:, None, :], c.rope_base)
            q = q.transpose(1, 2)  # [b, N, H, hd]
            if j:
                k, v = self._kv(x[:, :, None], pos[:, :, None])  # [b, N, 1, Hkv, hd]
                keys.append(k[:, :, 0].repeat_interleave(group, dim=2))
                vals.append(v[:, :, 0].repeat_interleave(group, dim=2))
            s_ctx = torch.einsum("bnhd,bthd->bnht", q, ctx_k) * scale  # [b, N, H, T]
            s_ctx = s_ctx.masked_fill(~sees[:, :, None, :], float("-inf"))
            if keys:
                own_k = torch.stack(keys, dim=3)  # [b, N, H, j, hd]
                s_own = torch.einsum("bnhd,bnhjd->bnhj", q, own_k) * scale  # [b, N, H, j]
                p = torch.softmax(torch.cat([s_ctx, s_own], dim=-1), dim=-1)
                attn = (torch.einsum("bnht,bthd->bnhd", p[..., :t], ctx_v)
                        + torch.einsum("bnhj,bnhjd->bnhd", p[..., t:],
                                       torch.stack(vals, dim=3)))
            else:
                p = torch.softmax(s_ctx, dim=-1)
                attn = torch.einsum("bnht,bthd->bnhd", p, ctx_v)
            h = self.o(attn.flatten(-2)) + cur
            f = self.ffn_norm(h)
            h = h + self.down(F.silu(self.gate(f)) * self.up(f))  # [b, N, E] pre-norm
            rows.append(self.out_norm(h))
            cur = h
        return torch.stack(rows, dim=2)  # [b, N, S, E]

    def rows(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self(batch["feats"], batch["tokens"], batch["anchors"], batch["prev"])

    def logits(self, rows: torch.Tensor, prev: torch.Tensor | None = None) -> torch.Tensor:
        return self.lm_head(rows)

    def gguf_tensors(self) -> dict[str, np.ndarray]:
        """The trained weights under llama.cpp's names (q and k already in its rope
        layout: the rotation here is llama.cpp's own)."""
        p = "blk.0."
        return {"fc.weight": as_numpy(self.fc.weight),
                p + "attn_norm.weight": as_numpy(self.embed_norm.weight),
                p + "attn_norm_2.weight": as_numpy(self.hidden_norm.weight),
                p + "attn_q.weight": as_numpy(self.q.weight),
                p + "attn_k.weight": as_numpy(self.k.weight),
                p + "attn_v.weight": as_numpy(self.v.weight),
                p + "attn_output.weight": as_numpy(self.o.weight),
                p + "ffn_norm.weight": as_numpy(self.ffn_norm.weight),
                p + "ffn_gate.weight": as_numpy(self.gate.weight),
                p + "ffn_up.weight": as_numpy(self.up.weight),
                p + "ffn_down.weight": as_numpy(self.down.weight),
                "output_norm.weight": as_numpy(self.out_norm.weight),
                "output.weight": as_numpy(self.lm_head.weight)}


# a head kind -> its torch model (each takes the batch through `rows`)
HEADS: dict[str, type[HeadModel]] = {"dflash": DFlashHead, "dspark": DSparkHead,
                                     "eagle3": Eagle3Head}
