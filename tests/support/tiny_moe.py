"""Tiny random mixture-of-experts GGUF models for tests, and their float64 reference.

`write_tiny_qwen3moe` writes a `qwen3moe` file as llama.cpp lays it out: qwen3's attention
(tiny_gguf's tensors and tokenizer), and in every layer a float32 router `ffn_gate_inp`
[n_expert, n_embd] and 3-D experts `ffn_gate_exps` / `ffn_up_exps` [n_expert, n_ff_exp,
n_embd] and `ffn_down_exps` [n_expert, n_embd, n_ff_exp] of `expert_type` (random float
weights quantized by gguf-py; K-quants as tiny_gguf's random raw blocks). The router is
sharper than the other matrices so that each token's top experts are clearly apart (two
implementations that round differently then choose the same ones).

`ReferenceMoeModel` is numpy_reference.ReferenceModel with llama.cpp's MoE block in float64:
softmax over the router's logits, the top k (ties to the lower id), their weights divided
by their sum, sum over the chosen experts of weight * down(silu(gate(h)) * up(h)).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, TokenType

from numpy_reference import ReferenceModel, rotate, silu
from tiny_gguf import (
    KQUANT_TYPES,
    RESIDUAL_GAIN,
    TinyVocab,
    _encode,
    _make_config,
    _name_seed,
    _write,
    random_kquant_blocks,
)

ROUTER_GAIN = 4.0
EXPERT_TYPES = ("F32", "F16", "Q8_0", "Q4_0", "Q4_K", "Q6_K", "MXFP4")


def shared_part(name: str, shape: tuple[int, int], seed: int, std: float, spread: float
                ) -> np.ndarray:
    """What every expert of the tensor `name` shares where `spread` is set (the dense twin's
    matrix): std * base / sqrt(1 + spread^2)."""
    base = _name_seed(seed, name, 2).standard_normal(shape)
    return std * base / np.sqrt(1 + spread * spread)


def expert_tensor(name: str, shape: tuple[int, int, int], qtype: str, seed: int, std: float,
                  spread: float | None = None
                  ) -> tuple[np.ndarray, GGMLQuantizationType | None]:
    """A 3-D expert tensor [n_expert, rows, cols] of `qtype` for GGUFWriter.add_tensor:
    independent random experts, or (spread set) the shared part plus each expert's own
    noise of relative size `spread` (K-quants: always independent)."""
    rng = _name_seed(seed, name, 0)
    n_expert, rows, cols = shape
    if qtype in KQUANT_TYPES:
        blocks = random_kquant_blocks(rng, n_expert * rows, cols, qtype, std)
        return blocks.pack().reshape(n_expert, rows, -1), GGMLQuantizationType[qtype]
    if spread is None:
        return _encode(std * rng.standard_normal(shape), qtype)
    own = std * spread / np.sqrt(1 + spread * spread) * rng.standard_normal(shape)
    return _encode(shared_part(name, shape[1:], seed, std, spread)[None] + own, qtype)


def expert_specs(layer: int, n_embd: int, n_expert: int, n_ff_exp: int
                 ) -> list[tuple[str, tuple[int, int, int], float]]:
    """(name, shape, std) of a layer's gate, up and down experts."""
    p = f"blk.{layer}."
    return [(p + "ffn_gate_exps.weight", (n_expert, n_ff_exp, n_embd), 1 / np.sqrt(n_embd)),
            (p + "ffn_up_exps.weight", (n_expert, n_ff_exp, n_embd), 1 / np.sqrt(n_embd)),
            (p + "ffn_down_exps.weight", (n_expert, n_embd, n_ff_exp),
             RESIDUAL_GAIN / np.sqrt(n_ff_exp))]


def add_experts(w: GGUFWriter, *, n_layer: int, n_embd: int, n_expert: int, n_ff_exp: int,
                expert_type: str, seed: int, down_type: str | None = None,
                spread: float | None = None) -> None:
    """Each layer's router and experts (qwen3moe's names and shapes)."""
    for i in range(n_layer):
        p = f"blk.{i}."
        rng = _name_seed(seed, p + "ffn_gate_inp.weight", 0)
        router = ROUTER_GAIN / np.sqrt(n_embd) * rng.standard_normal((n_expert, n_embd))
        w.add_tensor(p + "ffn_gate_inp.weight", router.astype(np.float32))
        for name, shape, std in expert_specs(i, n_embd, n_expert, n_ff_exp):
            qtype = down_type if down_type and "down" in name else expert_type
            data, raw = expert_tensor(name, shape, qtype, seed, float(std), spread)
            w.add_tensor(name, data, raw_dtype=raw)


def write_tiny_qwen3moe(path: str | Path, *, expert_type: str = "Q8_0",
                        weight_type: str | None = None, seed: int = 0, n_layer: int = 2,
                        n_embd: int = 64, n_head: int = 4, n_head_kv: int = 2,
                        n_expert: int = 8, n_used: int = 2, n_ff_exp: int = 32,
                        down_type: str | None = None, context_length: int = 512,
                        spread: float | None = None) -> Path:
    """A tiny random qwen3moe model (weight_type: the attention's and output's matrices,
    default expert_type where gguf-py writes it, else Q8_0; down_type: ffn_down_exps' type
    where it differs, as Q4_K_M files' Q6_K; spread: experts that share a part, which
    `write_dense_twin` writes as a dense qwen3 model's FFN)."""
    if expert_type not in EXPERT_TYPES:
        raise ValueError(f"unsupported expert_type {expert_type!r}; choose from "
                         f"{', '.join(EXPERT_TYPES)}")
    wt = weight_type or (expert_type if expert_type not in ("MXFP4", "Q6_K") else "Q8_0")
    cfg = _make_config("qwen3", wt, n_layer, n_embd, n_head, n_head_kv, None, n_ff_exp, None,
                       None, None, None, "F32", context_length, None, None)

    def moe(w: GGUFWriter) -> None:
        w.add_expert_count(n_expert)
        w.add_expert_used_count(n_used)
        w.add_expert_feed_forward_length(n_ff_exp)
        add_experts(w, n_layer=n_layer, n_embd=n_embd, n_expert=n_expert, n_ff_exp=n_ff_exp,
                    expert_type=expert_type, seed=seed, down_type=down_type, spread=spread)

    return _write(Path(path), cfg, seed=seed, perturb=None, arch_name="qwen3moe",
                  drop=_dense_ffn(n_layer), extra=moe)


def _dense_ffn(n_layer: int) -> list[str]:
    return [f"blk.{i}.ffn_{m}.weight" for i in range(n_layer) for m in ("gate", "up", "down")]


def write_dense_twin(path: str | Path, *, spread: float, seed: int = 0, n_layer: int = 2,
                     n_embd: int = 64, n_head: int = 4, n_head_kv: int = 2, n_expert: int = 8,
                     n_ff_exp: int = 32, weight_type: str = "Q8_0",
                     context_length: int = 512) -> Path:
    """A dense qwen3 model sharing a `write_tiny_qwen3moe(spread=...)` model's vocabulary,
    embeddings and attention (the same seed), whose FFN is the experts' shared part: a
    draft that mostly agrees with that target, as a small dense Qwen3 with Qwen3-MoE."""
    cfg = _make_config("qwen3", weight_type, n_layer, n_embd, n_head, n_head_kv, None,
                       n_ff_exp, None, None, None, None, "F32", context_length, None, None)

    def ffn(w: GGUFWriter) -> None:
        for i in range(n_layer):
            for name, shape, std in expert_specs(i, n_embd, n_expert, n_ff_exp):
                dense = name.replace("_exps", "")
                data, raw = _encode(shared_part(name, shape[1:], seed, float(std), spread),
                                    weight_type)
                w.add_tensor(dense, data, raw_dtype=raw)

    return _write(Path(path), cfg, seed=seed, perturb=None, drop=_dense_ffn(n_layer),
                  extra=ffn)


def top_k(v: np.ndarray, k: int) -> np.ndarray:
    """The ids of v's k largest values, the largest first, ties to the lower id."""
    return np.argsort(-v, kind="stable")[:k]


def softmax(v: np.ndarray) -> np.ndarray:
    e = np.exp(v - v.max())
    return e / e.sum()


class ReferenceMoeModel(ReferenceModel):
    """float64 oracle of a qwen3moe file (the module docstring)."""

    arches = ("qwen3moe",)
    neox_arches = ("qwen3moe",)

    def __init__(self, path: str | Path):
        super().__init__(path)
        md, a = self.metadata, self.arch
        self.n_expert = int(md[f"{a}.expert_count"])
        self.n_used = int(md[f"{a}.expert_used_count"])
        self.expert_scale = float(md.get(f"{a}.expert_weights_scale", 0.0))
        self.chosen: list[list[np.ndarray]] = []  # per call of feed_forward: each token's ids

    def route(self, layer: int, h: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per token of h [T, E]: the chosen experts [T, k] and their weights [T, k]."""
        logits = h @ self.weights[f"blk.{layer}.ffn_gate_inp.weight"].T  # [T, n_expert]
        ids = np.stack([top_k(softmax(row), self.n_used) for row in logits])
        weights = np.stack([softmax(row)[i] for row, i in zip(logits, ids, strict=True)])
        weights = weights / weights.sum(axis=1, keepdims=True)
        if self.expert_scale not in (0.0, 1.0):
            weights = weights * self.expert_scale
        return ids, weights

    def expert(self, layer: int, e: int, h: np.ndarray) -> np.ndarray:
        """Expert e of the layer on h [E] -> [E]."""
        w, p = self.weights, f"blk.{layer}."
        gate = w[p + "ffn_gate_exps.weight"][e] @ h
        up = w[p + "ffn_up_exps.weight"][e] @ h
        return w[p + "ffn_down_exps.weight"][e] @ (silu(gate) * up)

    def feed_forward(self, layer: int, h: np.ndarray) -> np.ndarray:
        ids, weights = self.route(layer, h)
        self.chosen.append(list(ids))
        out = np.zeros_like(h)
        for t in range(h.shape[0]):
            for e, wt in zip(ids[t], weights[t], strict=True):
                out[t] += wt * self.expert(layer, int(e), h[t])
        return out


# ---------------------------------------------------------------------------------------
# gpt-oss
# ---------------------------------------------------------------------------------------

SINK_STD = 1.0  # the sinks' logits: of the scores' size, so they take a real share
HARMONY_TOKENS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>",
                  "<|return|>", "<|call|>")
# a small harmony template: messages as gpt-oss's own template writes their headers, the
# assistant's in the final channel, and the new assistant turn opened
HARMONY_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}"
    "<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>"
    "{%- else -%}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{%- endif -%}"
    "{%- endfor -%}{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}")


def harmony_vocab(voc: TinyVocab) -> TinyVocab:
    """`voc` with harmony's control tokens after its own (padded to a multiple of 32),
    <|return|> its end of sequence, as gpt-oss's o200k_harmony vocabulary has them."""
    tokens = [t for t in voc.tokens if not t.startswith("[PAD")] + list(HARMONY_TOKENS)
    types = voc.token_types[:len(tokens) - len(HARMONY_TOKENS)] + [
        int(TokenType.CONTROL)] * len(HARMONY_TOKENS)
    while len(tokens) % 32:
        tokens.append(f"[PAD{len(tokens)}]")
        types.append(int(TokenType.UNUSED))
    return dataclasses.replace(voc, tokens=tokens, token_types=types,
                               eos_id=tokens.index("<|return|>"),
                               chat_template=HARMONY_TEMPLATE)


def write_tiny_gpt_oss(path: str | Path, *, expert_type: str = "MXFP4",
                       weight_type: str = "Q8_0", seed: int = 0, n_layer: int = 2,
                       n_embd: int = 64, n_head: int = 4, n_head_kv: int = 2,
                       n_expert: int = 8, n_used: int = 2, n_ff_exp: int = 32,
                       context_length: int = 8192, sliding_window: int = 8,
                       yarn: tuple[float, int] | None = (32.0, 256),
                       rope_freq_base: float = 150000.0,
                       harmony: bool = False, drop: tuple[str, ...] = ()) -> Path:
    """A tiny random gpt-oss model as llama.cpp lays it out: qwen2's attention tensors
    (q/k/v biases) plus the output's bias and a sink logit per head, the FFN's input norm
    named post_attention_norm, the sliding window on even layers (the default pattern),
    YaRN rope scaling (factor, original context) where `yarn` is given, and in every
    layer a biased router and biased experts of `expert_type` (drop: those of its vectors
    left out). harmony: the vocabulary has harmony's control tokens (`harmony_vocab`) and
    the chat template is HARMONY_TEMPLATE."""
    if expert_type not in EXPERT_TYPES:
        raise ValueError(f"unsupported expert_type {expert_type!r}; choose from "
                         f"{', '.join(EXPERT_TYPES)}")
    cfg = _make_config("qwen2", weight_type, n_layer, n_embd, n_head, n_head_kv, None,
                       n_ff_exp, None, False, None, None, "F32", context_length, 1e-5,
                       rope_freq_base)
    if harmony:
        cfg = dataclasses.replace(cfg, vocab=harmony_vocab(cfg.vocab))
    arch = "gpt-oss"

    def extra(w: GGUFWriter) -> None:
        w.add_uint32(f"{arch}.expert_count", n_expert)
        w.add_uint32(f"{arch}.expert_used_count", n_used)
        w.add_uint32(f"{arch}.expert_feed_forward_length", n_ff_exp)
        w.add_uint32(f"{arch}.attention.sliding_window", sliding_window)
        if yarn is not None:
            w.add_string(f"{arch}.rope.scaling.type", "yarn")
            w.add_float32(f"{arch}.rope.scaling.factor", yarn[0])
            w.add_uint32(f"{arch}.rope.scaling.original_context_length", yarn[1])
        add_experts(w, n_layer=n_layer, n_embd=n_embd, n_expert=n_expert, n_ff_exp=n_ff_exp,
                    expert_type=expert_type, seed=seed)
        for i in range(n_layer):
            p = f"blk.{i}."
            vectors = {p + "post_attention_norm.weight": 1.0 + 0.1 * _normal(seed, p + "pan",
                                                                             (n_embd,)),
                       p + "attn_output.bias": 0.2 * _normal(seed, p + "ob", (n_embd,)),
                       p + "attn_sinks.weight": SINK_STD * _normal(seed, p + "sk", (n_head,)),
                       p + "ffn_gate_inp.bias": 0.5 * _normal(seed, p + "rb", (n_expert,)),
                       p + "ffn_gate_exps.bias": 0.2 * _normal(seed, p + "gb",
                                                               (n_expert, n_ff_exp)),
                       p + "ffn_up_exps.bias": 0.2 * _normal(seed, p + "ub",
                                                             (n_expert, n_ff_exp)),
                       p + "ffn_down_exps.bias": 0.2 * _normal(seed, p + "db",
                                                               (n_expert, n_embd))}
            for name, value in vectors.items():
                if name not in drop:
                    w.add_tensor(name, value.astype(np.float32))

    dense = _dense_ffn(n_layer) + [f"blk.{i}.ffn_norm.weight" for i in range(n_layer)]
    return _write(Path(path), cfg, seed=seed, perturb=None, arch_name=arch, drop=dense,
                  extra=extra)


def _normal(seed: int, name: str, shape: tuple[int, ...]) -> np.ndarray:
    return _name_seed(seed, name, 0).standard_normal(shape)


def yarn_cos_sin(positions: np.ndarray, n_rot: int, base: float, factor: float,
                 n_ctx_orig: int) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin [T, n_rot/2] of llama.cpp's YaRN (ggml's rope_yarn with llama.cpp's
    defaults: beta_fast 32, beta_slow 1, extrapolation 1; the magnitude 1 + 0.1 ln factor,
    the attention factor cancelling get_mscale), in float64."""
    half = n_rot // 2

    def corr_dim(beta: float) -> float:
        return n_rot * np.log(n_ctx_orig / (beta * 2 * np.pi)) / (2 * np.log(base))

    lo = max(0.0, float(np.floor(corr_dim(32.0))))
    hi = min(n_rot - 1.0, float(np.ceil(corr_dim(1.0))))
    i = np.arange(half, dtype=np.float64)
    extrap = positions.astype(np.float64)[:, None] * base ** (-2.0 * i / n_rot)  # [T, half]
    ramp = 1.0 - np.clip((i - lo) / max(0.001, hi - lo), 0.0, 1.0)
    theta = extrap / factor * (1.0 - ramp) + extrap * ramp
    m = 1.0 + 0.1 * np.log(factor)
    return np.cos(theta) * m, np.sin(theta) * m


def swiglu_oai(gate: np.ndarray, up: np.ndarray, alpha: float = 1.702, limit: float = 7.0
               ) -> np.ndarray:
    """gpt-oss's clamped SwiGLU (ggml_swiglu_oai)."""
    x = np.minimum(gate, limit)
    return x / (1.0 + np.exp(-alpha * x)) * (np.clip(up, -limit, limit) + 1.0)


class ReferenceGptOssModel(ReferenceMoeModel):
    """float64 oracle of a gpt-oss file, as llama.cpp's openai-moe graph: the base
    reference's attention with q/k/v and output biases, sinks (a logit per head joining
    each softmax), sliding windows on the layers the pattern says (period 2 by default),
    YaRN where the file scales its rope; the FFN's input norm post_attention_norm; the
    router's logits plus its bias, their top k, a softmax over those k; each expert's
    gate and up plus their biases through the clamped SwiGLU, down plus its bias."""

    arches = ("gpt-oss",)
    neox_arches = ("gpt-oss",)
    swa_arches = ("gpt-oss",)
    swa_period = 2

    def __init__(self, path: str | Path):
        super().__init__(path)
        md, a = self.metadata, self.arch
        self.ffn_norm = "post_attention_norm"
        self.rope_base_swa = float(md.get(f"{a}.rope.freq_base_swa", self.rope_base))
        self.yarn = (float(md[f"{a}.rope.scaling.factor"]),
                     int(md.get(f"{a}.rope.scaling.original_context_length",
                                md[f"{a}.context_length"]))
                     ) if md.get(f"{a}.rope.scaling.type") == "yarn" else None

    def rope(self, x: np.ndarray, positions: np.ndarray, base: float) -> np.ndarray:
        if self.yarn is None:
            return super().rope(x, positions, base)
        cos, sin = yarn_cos_sin(positions, self.n_rot, base, *self.yarn)
        return rotate(x, cos, sin, self.n_rot, self.neox)

    def route(self, layer: int, h: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        p = f"blk.{layer}."
        logits = h @ self.weights[p + "ffn_gate_inp.weight"].T + self.weights[
            p + "ffn_gate_inp.bias"]  # [T, n_expert]
        ids = np.stack([top_k(row, self.n_used) for row in logits])
        weights = np.stack([softmax(row[i]) for row, i in zip(logits, ids, strict=True)])
        return ids, weights

    def expert(self, layer: int, e: int, h: np.ndarray) -> np.ndarray:
        w, p = self.weights, f"blk.{layer}."
        gate = w[p + "ffn_gate_exps.weight"][e] @ h + w[p + "ffn_gate_exps.bias"][e]
        up = w[p + "ffn_up_exps.weight"][e] @ h + w[p + "ffn_up_exps.bias"][e]
        return (w[p + "ffn_down_exps.weight"][e] @ swiglu_oai(gate, up)
                + w[p + "ffn_down_exps.bias"][e])


def file_factory(write: Callable[..., Path], root: Path) -> Callable[..., Path]:
    """`make(**kw)`: `write(root / "mN.gguf", **kw)`, once per distinct kw (the files are
    shared by a module's tests: open them read-only)."""
    made: dict[str, Path] = {}

    def make(**kw: Any) -> Path:
        key = repr(sorted(kw.items()))
        if key not in made:
            made[key] = write(root / f"m{len(made)}.gguf", **kw)
        return made[key]

    return make
