"""An independent float64 numpy forward pass for llama / qwen2 / qwen3 / gemma3 GGUF files.

Reads the file with `gguf.GGUFReader`, dequantizes every tensor with
`gguf.quants.dequantize` and follows llama.cpp's semantics:

* RMSNorm: x / sqrt(mean(x^2) + eps) * w   (eps = {arch}.attention.layer_norm_rms_epsilon)
* q = Wq x (+ bq for qwen2), k, v likewise; split into heads of head_dim
  (head_dim = {arch}.attention.key_length, else n_embd / n_head).
* qwen3: per-head RMSNorm of q and k with attn_q_norm / attn_k_norm (same eps) before RoPE.
* RoPE over the first n_rot = {arch}.rope.dimension_count dims (default head_dim),
  theta_i = pos * base^(-2i / n_rot), i = 0 .. n_rot/2 - 1:
    llama ("NORM" rope):        pairs (x[2i], x[2i+1])
    qwen2/qwen3 ("NEOX" rope):  pairs (x[i], x[i + n_rot/2])
  (a, b) -> (a cos - b sin, a sin + b cos).
* GQA: kv head j serves query heads j*G .. j*G+G-1, G = n_head / n_head_kv.
* scores = q.k / sqrt(head_dim), causal softmax, then attn_output.
* SwiGLU FFN: down(silu(gate(x)) * up(x)); pre-norm residual blocks.
* final output_norm, logits = output.weight @ h (token_embd.weight when output is absent).
* gemma3: NEOX rope and qwen3's q/k norms; token embeddings times sqrt(n_embd); the
  attention and FFN outputs RMSNorm'd (post_attention_norm, post_ffw_norm) before their
  residual adds; GELU (tanh approximation) instead of silu; sliding-window layers (from
  {arch}.attention.sliding_window and the pattern: an array, or a period n, every n-th
  layer global, default 6) see their own key and the window - 1 before it, and rotate with
  {arch}.rope.freq_base_swa (default 10000); logits soft-capped where
  {arch}.final_logit_softcapping is set.
* rows given as embeddings (`step_embeddings`, an image's): not scaled; not causal where
  asked (each row sees the whole block, a sliding window still counted from the row).
* qwen2vl: qwen2 with M-RoPE: four positions per row (t, h, w, e; text at KV position p:
  (p, p, p, 0) unless given), {arch}.rope.dimension_sections [s0, s1, s2, s3]: rotary
  pair i reads t, h, w or e as i mod (s0+s1+s2+s3) falls below s0, s0+s1, s0+s1+s2 or
  past them (ggml's mrope cache), NEOX halves; the mask follows the KV order.

Nothing from specd is imported.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType
from gguf.quants import dequantize

SUPPORTED_ARCHES = ("llama", "qwen2", "qwen2vl", "qwen3", "gemma3")


def _field_value(f: Any) -> Any:
    main = f.types[0]
    if main == GGUFValueType.ARRAY:
        return f.contents()
    if main == GGUFValueType.STRING:
        return bytes(f.parts[-1]).decode("utf-8")
    return f.parts[-1].tolist()[0]


def read_gguf(path: Path) -> tuple[dict[str, Any], dict[str, np.ndarray], dict[str, str]]:
    """(metadata, float64 weights in numpy order, tensor type names) of a GGUF file; I64
    tensors (a head's d2t) stay int64."""
    reader = GGUFReader(str(path), "r")
    metadata = {name: _field_value(f) for name, f in reader.fields.items()
                if not name.startswith("GGUF.")}
    weights: dict[str, np.ndarray] = {}
    types: dict[str, str] = {}
    for t in reader.tensors:
        shape = tuple(int(s) for s in reversed(t.shape.tolist()))  # numpy order
        if t.tensor_type.name == "I64":
            weights[t.name] = np.asarray(t.data, dtype=np.int64).reshape(shape)
        else:
            values = dequantize(np.asarray(t.data), t.tensor_type)
            weights[t.name] = np.asarray(values, dtype=np.float64).reshape(shape)
        types[t.name] = t.tensor_type.name
    del reader
    return metadata, weights, types


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm over the last axis, float64."""
    ms = np.mean(x * x, axis=-1, keepdims=True)
    return x / np.sqrt(ms + eps) * w


def rope(x: np.ndarray, positions: np.ndarray, n_rot: int, base: float, neox: bool,
         freq_scale: float = 1.0, factors: np.ndarray | None = None) -> np.ndarray:
    """Rotate x [..., T, head_dim] at integer `positions` [T] (llama.cpp NORM or NEOX);
    freq_scale: linear rope scaling's 1 / factor; factors [half]: rope_freqs.weight, each
    pair's frequency divided by its factor."""
    half = n_rot // 2
    inv_freq = base ** (-np.arange(half, dtype=np.float64) * 2.0 / n_rot)  # [half]
    if factors is not None:
        inv_freq = inv_freq / np.asarray(factors, np.float64).reshape(-1)
    inv_freq = inv_freq * freq_scale
    theta = positions.astype(np.float64)[:, None] * inv_freq[None, :]  # [T, half]
    return rotate(x, np.cos(theta), np.sin(theta), n_rot, neox)


def rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, n_rot: int, neox: bool
           ) -> np.ndarray:
    """x [..., T, head_dim] with its first n_rot dims rotated by cos, sin [T, n_rot/2]."""
    half = n_rot // 2
    out = x.copy()
    if neox:
        a, b = x[..., :half], x[..., half:n_rot]
        out[..., :half] = a * cos - b * sin
        out[..., half:n_rot] = a * sin + b * cos
    else:
        a, b = x[..., 0:n_rot:2], x[..., 1:n_rot:2]
        out[..., 0:n_rot:2] = a * cos - b * sin
        out[..., 1:n_rot:2] = a * sin + b * cos
    return out


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """GELU's tanh approximation (llama.cpp's ggml_gelu, ONNX Gelu approximate="tanh")."""
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x ** 3)))


@dataclass
class KVCache:
    """Per layer: keys/values after RoPE, [n_head_kv, T, head_dim] float64."""

    keys: list[np.ndarray] = field(default_factory=list)
    values: list[np.ndarray] = field(default_factory=list)

    @property
    def length(self) -> int:
        return 0 if not self.keys else int(self.keys[0].shape[1])


class ReferenceModel:
    """float64 oracle for a GGUF file (see the module docstring for the semantics)."""

    arches: tuple[str, ...] = SUPPORTED_ARCHES  # a subclass reads more
    neox_arches: tuple[str, ...] = ("qwen2", "qwen2vl", "qwen3", "gemma3")
    swa_arches: tuple[str, ...] = ("gemma3",)  # read the sliding window
    swa_period = 6  # the sliding-window pattern's period where the file gives none

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.metadata, self.weights, self.tensor_types = read_gguf(self.path)

        md = self.metadata
        arch = md["general.architecture"]
        if arch not in self.arches:
            raise ValueError(f"reference model does not support architecture {arch!r}")
        self.arch: str = arch
        self.n_layer = int(md[f"{arch}.block_count"])
        self.n_embd = int(md[f"{arch}.embedding_length"])
        self.n_ff = int(md.get(f"{arch}.feed_forward_length", 0))
        self.n_head = int(md[f"{arch}.attention.head_count"])
        self.n_head_kv = int(md.get(f"{arch}.attention.head_count_kv", self.n_head))
        self.head_dim = int(md.get(f"{arch}.attention.key_length", self.n_embd // self.n_head))
        value_dim = int(md.get(f"{arch}.attention.value_length", self.head_dim))
        if value_dim != self.head_dim:
            raise ValueError("value_length != key_length is not supported")
        self.n_rot = int(md.get(f"{arch}.rope.dimension_count", self.head_dim))
        self.eps = float(md[f"{arch}.attention.layer_norm_rms_epsilon"])
        self.rope_base = float(md.get(f"{arch}.rope.freq_base", 10000.0))
        self.neox = arch in self.neox_arches
        sections = md.get(f"{arch}.rope.dimension_sections")  # M-RoPE (qwen2vl)
        self.rope_sections: list[int] | None = (
            [int(x) for x in sections] + [0] * (4 - len(sections)) if sections else None)
        self.vocab_size = int(self.weights["token_embd.weight"].shape[0])
        # gemma3 (as llama.cpp runs it): embeddings times sqrt(n_embd), norms of the
        # attention and FFN outputs, GELU (tanh), sliding-window layers with their own rope
        # base (every 6th layer global unless the file says), final soft-capping
        gemma = arch == "gemma3"
        self.embed_scale = float(np.sqrt(self.n_embd)) if gemma else 1.0
        self.post_norms = gemma
        self.ffn_norm = "ffn_norm"  # the FFN input norm's stem (a subclass may rename it)
        self.window = (int(md.get(f"{arch}.attention.sliding_window", 0))
                       if arch in self.swa_arches else 0)
        pattern = md.get(f"{arch}.attention.sliding_window_pattern", self.swa_period)
        self.swa = ([bool(x) for x in pattern] if isinstance(pattern, list) else
                    [int(pattern) == 0 or i % int(pattern) < int(pattern) - 1
                     for i in range(self.n_layer)]) if self.window else [False] * self.n_layer
        self.rope_base_swa = float(md.get(f"{arch}.rope.freq_base_swa", 10000.0))
        self.softcap = md.get(f"{arch}.final_logit_softcapping") if gemma else None
        self.act = gelu_tanh if gemma else silu
        self.bos_id: int | None = md.get("tokenizer.ggml.bos_token_id")
        self.eos_id: int | None = md.get("tokenizer.ggml.eos_token_id")
        self.tied = "output.weight" not in self.weights
        self.output_weight = self.weights["output.weight" if not self.tied else "token_embd.weight"]

    # -- forward -------------------------------------------------------------------------

    def new_cache(self) -> KVCache:
        return KVCache()

    def step(self, tokens: list[int] | np.ndarray, cache: KVCache,
             layer_inputs: dict[int, np.ndarray] | None = None,
             rope_positions: np.ndarray | None = None) -> np.ndarray:
        """Run `tokens` at positions cache.length.., append to `cache`; logits [T, vocab].
        layer_inputs, if given, receives the residual stream entering each layer L [T,
        n_embd] (L = n_layer: after the last layer, before the final norm).
        rope_positions [4, T]: M-RoPE's positions of the rows (default: each row's KV
        position in t, h and w, 0 in e)."""
        ids = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if ids.size == 0:
            return np.zeros((0, self.vocab_size), dtype=np.float64)
        if ids.min() < 0 or ids.max() >= self.vocab_size:
            raise ValueError("token id out of range")
        x = self.weights["token_embd.weight"][ids] * self.embed_scale  # [T, n_embd]
        return self._layers(x, cache, layer_inputs, causal=True, rope_positions=rope_positions)

    def step_embeddings(self, embeddings: np.ndarray, cache: KVCache, *, causal: bool = True,
                        layer_inputs: dict[int, np.ndarray] | None = None,
                        rope_positions: np.ndarray | None = None) -> np.ndarray:
        """Run rows given as embeddings [T, n_embd] (an image's) at positions
        cache.length.., as llama.cpp decodes an embeddings batch: the rows enter the
        residual stream as they are (gemma's sqrt(n_embd) scales token rows only).
        causal False (llama.cpp's non-causal image batches, gemma3): each row sees every
        key up to the block's last, a sliding-window layer still none at or before its own
        position - window. Logits [T, vocab]."""
        x = np.asarray(embeddings, dtype=np.float64)
        if x.ndim != 2 or x.shape[1] != self.n_embd or not len(x):
            raise ValueError(f"embeddings must be [T >= 1, {self.n_embd}], got {x.shape}")
        return self._layers(x, cache, layer_inputs, causal=causal, rope_positions=rope_positions)

    def _layers(self, x: np.ndarray, cache: KVCache, layer_inputs: dict[int, np.ndarray] | None,
                *, causal: bool, rope_positions: np.ndarray | None = None) -> np.ndarray:
        """The layers and the output head over the new rows x [T, n_embd]."""
        start = cache.length
        n_new = x.shape[0]
        positions = np.arange(start, start + n_new)
        if rope_positions is None and self.rope_sections is not None:  # text rows
            rope_positions = np.stack([positions] * 3 + [np.zeros_like(positions)])
        if rope_positions is not None and self.rope_sections is None:
            raise ValueError(f"{self.arch} has one rope position per row, not four")
        if rope_positions is not None and np.shape(rope_positions) != (4, n_new):
            raise ValueError(f"rope_positions must be [4, {n_new}], got "
                             f"{list(np.shape(rope_positions))}")
        hd, nh, nkv = self.head_dim, self.n_head, self.n_head_kv
        group = nh // nkv
        scale = 1.0 / np.sqrt(float(hd))
        # causal mask over [new queries, all keys] (not causal: the block's keys all seen)
        key_pos = np.arange(start + n_new)
        seen_to = positions[:, None] if causal else np.full((n_new, 1), start + n_new - 1)
        mask = key_pos[None, :] > seen_to  # True = masked

        first = not cache.keys
        for layer in range(self.n_layer):
            if layer_inputs is not None:
                layer_inputs[layer] = x
            p = f"blk.{layer}."
            w = self.weights
            h = rms_norm(x, w[p + "attn_norm.weight"], self.eps)
            q = h @ w[p + "attn_q.weight"].T
            k = h @ w[p + "attn_k.weight"].T
            v = h @ w[p + "attn_v.weight"].T
            if p + "attn_q.bias" in w:
                q = q + w[p + "attn_q.bias"]
                k = k + w[p + "attn_k.bias"]
                v = v + w[p + "attn_v.bias"]
            q = q.reshape(n_new, nh, hd).transpose(1, 0, 2)  # [nh, T, hd]
            k = k.reshape(n_new, nkv, hd).transpose(1, 0, 2)  # [nkv, T, hd]
            v = v.reshape(n_new, nkv, hd).transpose(1, 0, 2)
            if p + "attn_q_norm.weight" in w:
                q = rms_norm(q, w[p + "attn_q_norm.weight"], self.eps)
                k = rms_norm(k, w[p + "attn_k_norm.weight"], self.eps)
            base = self.rope_base_swa if self.swa[layer] else self.rope_base
            if rope_positions is not None:
                q = self.mrope(q, rope_positions, base)
                k = self.mrope(k, rope_positions, base)
            else:
                q = self.rope(q, positions, base)
                k = self.rope(k, positions, base)
            if first:
                cache.keys.append(k)
                cache.values.append(v)
            else:
                cache.keys[layer] = np.concatenate([cache.keys[layer], k], axis=1)
                cache.values[layer] = np.concatenate([cache.values[layer], v], axis=1)
            keys = np.repeat(cache.keys[layer], group, axis=0)  # [nh, S, hd]
            vals = np.repeat(cache.values[layer], group, axis=0)
            scores = (q @ keys.transpose(0, 2, 1)) * scale  # [nh, T, S]
            masked = mask
            if self.swa[layer]:  # a query sees itself and the window - 1 keys before it
                masked = mask | (positions[:, None] - key_pos[None, :] >= self.window)
            scores = np.where(masked[None], -np.inf, scores)
            top = scores.max(axis=-1, keepdims=True)  # [nh, T, 1]
            sinks = w.get(p + "attn_sinks.weight")  # [nh]: a column with no value
            if sinks is not None:
                top = np.maximum(top, sinks[:, None, None])
            probs = np.exp(scores - top)
            total = probs.sum(axis=-1, keepdims=True)
            if sinks is not None:
                total = total + np.exp(sinks[:, None, None] - top)
            probs = probs / total
            attn = (probs @ vals).transpose(1, 0, 2).reshape(n_new, nh * hd)
            a = attn @ w[p + "attn_output.weight"].T
            if p + "attn_output.bias" in w:
                a = a + w[p + "attn_output.bias"]
            if self.post_norms:
                a = rms_norm(a, w[p + "post_attention_norm.weight"], self.eps)
            x = x + a

            h = rms_norm(x, w[p + self.ffn_norm + ".weight"], self.eps)
            f = self.feed_forward(layer, h)
            if p + "post_ffw_norm.weight" in w:
                f = rms_norm(f, w[p + "post_ffw_norm.weight"], self.eps)
            x = x + f

        if layer_inputs is not None:
            layer_inputs[self.n_layer] = x
        h = rms_norm(x, self.weights["output_norm.weight"], self.eps)
        logits = h @ self.output_weight.T
        if self.softcap:
            logits = self.softcap * np.tanh(logits / self.softcap)
        return logits

    def rope(self, x: np.ndarray, positions: np.ndarray, base: float) -> np.ndarray:
        """x [..., T, head_dim] rotated at `positions` (a subclass scales the angles)."""
        return rope(x, positions, self.n_rot, base, self.neox)

    def mrope(self, x: np.ndarray, positions: np.ndarray, base: float) -> np.ndarray:
        """x [..., T, head_dim] rotated by M-RoPE at `positions` [4, T] (t, h, w, e)."""
        assert self.rope_sections is not None
        s0, s1, s2, s3 = self.rope_sections
        half = self.n_rot // 2
        theta = np.zeros((positions.shape[1], half))  # [T, half]
        for i in range(half):
            sector = i % (s0 + s1 + s2 + s3)
            row = 0 if sector < s0 else 1 if sector < s0 + s1 else 2 if sector < s0 + s1 + s2 else 3
            theta[:, i] = positions[row].astype(np.float64) * base ** (-2.0 * i / self.n_rot)
        return rotate(x, np.cos(theta), np.sin(theta), self.n_rot, True)

    def feed_forward(self, layer: int, h: np.ndarray) -> np.ndarray:
        """Layer `layer`'s feed-forward output for its normed input h [T, n_embd] (a
        subclass replaces it: tiny_moe.ReferenceMoeModel)."""
        w, p = self.weights, f"blk.{layer}."
        gate = h @ w[p + "ffn_gate.weight"].T
        up = h @ w[p + "ffn_up.weight"].T
        return (self.act(gate) * up) @ w[p + "ffn_down.weight"].T

    def forward(self, tokens: list[int] | np.ndarray) -> np.ndarray:
        """Full causal forward from position 0: logits [len(tokens), vocab] float64."""
        return self.step(tokens, self.new_cache())

    def greedy(self, prompt: list[int], n: int) -> list[int]:
        """`n` greedily generated token ids after `prompt` (no stop on eos)."""
        return self.greedy_with_margins(prompt, n)[0]

    def greedy_with_margins(self, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
        """Greedy tokens and, per step, top-1 minus top-2 logit (small = a near tie that a
        lower-precision implementation may legitimately break the other way)."""
        if not prompt:
            raise ValueError("empty prompt")
        cache = self.new_cache()
        logits = self.step(prompt, cache)
        out: list[int] = []
        margins: list[float] = []
        for _ in range(n):
            row = logits[-1]
            top2 = np.partition(row, -2)[-2:]
            nxt = int(np.argmax(row))
            out.append(nxt)
            margins.append(float(top2[1] - top2[0]))
            if len(out) == n:
                break
            logits = self.step([nxt], cache)
        return out, margins


# ---------------------------------------------------------------------------------------
# specd.GgufMatMul's arithmetic contract (ort_models/kernels/gguf_matmul.c), from the
# blocks' logical fields (tiny_gguf.KQuantBlocks), not from their bytes
# ---------------------------------------------------------------------------------------


def quantize_activations(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[M, K] float32 -> (q [M, K/256, 256] int64, da [M, K/256] float32): per 256 values
    q = rint(x * (127 / amax)), da = amax / 127 (zeros where 127 / amax is not finite:
    amax = 0, or below ~3.7e-37)."""
    xb = np.asarray(x, np.float32).reshape(x.shape[0], -1, 256)
    amax = np.abs(xb).max(axis=-1)
    with np.errstate(divide="ignore", over="ignore"):
        ok = np.isfinite(np.float32(127) / amax)
    safe = np.where(ok, amax, np.float32(1))
    inv = (np.float32(127) / safe).astype(np.float32)
    q = np.where(ok[..., None], np.rint(xb * inv[..., None]), 0).astype(np.int64)
    da = np.where(ok, safe / np.float32(127), np.float32(0)).astype(np.float32)
    return q, da


def gguf_rms_norm(x: np.ndarray, gamma: np.ndarray, eps: float) -> np.ndarray:
    """GgufMatMul's prologue 1, bit for bit: per row of x [M, K] (float32), the sum of
    squares in double as four chains (element i into chain i % 4, each summed in order,
    then (c0 + c1) + (c2 + c3)), scale = float32(1 / sqrt(ss / K + eps)), and
    h = (x * scale) * gamma in float32."""
    x = np.asarray(x, np.float32)
    sq = x.astype(np.float64) ** 2
    chains = [np.cumsum(sq[:, j::4], axis=1)[:, -1] if sq.shape[1] > j else np.zeros(len(x))
              for j in range(4)]
    ss = (chains[0] + chains[1]) + (chains[2] + chains[3])  # [M]
    scale = (1.0 / np.sqrt(ss / x.shape[1] + float(np.float32(eps)))).astype(np.float32)
    return (x * scale[:, None]) * np.asarray(gamma, np.float32)


def gguf_matmul(x: np.ndarray, blocks: Any) -> np.ndarray:
    """x [M, K] @ W^T for Q4_K / Q6_K blocks (tiny_gguf.KQuantBlocks) or Q4_0 / Q4_1
    blocks (tiny_gguf.Q4Blocks), rounding exactly as the kernel does."""
    if blocks.qtype in ("Q4_0", "Q4_1"):
        return _gguf_matmul_q4(x, blocks)
    n, k = blocks.rows, blocks.cols
    nb = k // 256
    x = np.pad(np.asarray(x, np.float32), ((0, 0), (0, k - x.shape[1])))  # K < row: zeros
    xq, da = quantize_activations(x)  # [M, nb, 256], [M, nb]
    d = blocks.d.astype(np.float32).reshape(n, nb)
    q = blocks.q.astype(np.int64)
    if blocks.qtype == "Q4_K":
        q = q.reshape(n, nb, 8, 32)
        sc = blocks.sc.astype(np.int64).reshape(n, nb, 8)
        mn = blocks.m.astype(np.int64).reshape(n, nb, 8)
        xs = xq.reshape(-1, nb, 8, 32)
        isum = np.einsum("nbjl,mbjl,nbj->mnb", q, xs, sc)
        imin = np.einsum("mbjl,nbj->mnb", xs, mn)
        dmin = blocks.dmin.astype(np.float32).reshape(n, nb)
        part = da[:, None, :] * (d[None] * isum.astype(np.float32)
                                 - dmin[None] * imin.astype(np.float32))
    elif blocks.qtype == "Q6_K":
        q = q.reshape(n, nb, 16, 16)  # signed, -32..31
        sc = blocks.sc.astype(np.int64).reshape(n, nb, 16)
        isum = np.einsum("nbjl,mbjl,nbj->mnb", q, xq.reshape(-1, nb, 16, 16), sc)
        part = da[:, None, :] * (d[None] * isum.astype(np.float32))
    else:
        raise ValueError(f"GgufMatMul does not read {blocks.qtype}")
    y = np.zeros(part.shape[:2], np.float32)
    for b in range(nb):  # superblocks in order, float32 adds
        y = y + part[:, :, b]
    return y


def _gguf_matmul_q4(x: np.ndarray, blocks: Any) -> np.ndarray:
    """Q4_0 / Q4_1: per superblock i of 256 columns, t = sum over its blocks j of 32 (in
    order, float32) of d[j] * (s[j] - 8 * sum a) (Q4_0) or d[j] * s[j] + m[j] * sum a
    (Q4_1), s[j] the integer dot product of codes and A's int8 values; y += da[i] * t."""
    n, k = blocks.rows, blocks.cols
    nb, nblk = -(-k // 256), k // 32
    x = np.pad(np.asarray(x, np.float32), ((0, 0), (0, nb * 256 - x.shape[1])))
    xq, da = quantize_activations(x)  # [M, nb, 256], [M, nb]
    xs = xq.reshape(x.shape[0], -1, 32)[:, :nblk]  # [M, nblk, 32]
    s = np.einsum("njl,mjl->mnj", blocks.q.reshape(n, nblk, 32).astype(np.int64), xs)
    bs = xs.sum(axis=-1)[:, None, :]  # [M, 1, nblk]
    d = blocks.d.astype(np.float32)[None]  # [1, N, nblk]
    m = blocks.m.astype(np.float32)[None] if blocks.qtype == "Q4_1" else None
    y = np.zeros((x.shape[0], n), np.float32)
    for i in range(nb):
        t = np.zeros_like(y)
        for j in range(8 * i, min(8 * i + 8, nblk)):
            if m is not None:
                u = (d[..., j] * s[..., j].astype(np.float32)
                     + m[..., j] * bs[..., j].astype(np.float32))
            else:
                u = d[..., j] * (s[..., j] - 8 * bs[..., j]).astype(np.float32)
            t = t + u
        y = y + da[:, i:i + 1] * t
    return y


# ---------------------------------------------------------------------------------------
# A DFlash head (llama.cpp b11434, src/models/dflash.cpp), beside a ReferenceModel target
# ---------------------------------------------------------------------------------------


def _linear_rope_scale(md: dict[str, Any], arch: str) -> float:
    """1 / {arch}.rope.scaling.factor where the scaling is linear, else 1."""
    factor = md.get(f"{arch}.rope.scaling.factor")
    linear = md.get(f"{arch}.rope.scaling.type", "linear") == "linear"
    return 1.0 / float(factor) if linear and factor else 1.0


class ReferenceDFlash:
    """float64 oracle of a DFlash, DSpark or DFlash2 head drafting for `target`.

    inject(features, positions): g = RMSNorm(fc @ clamp(features), enc.output_norm); per
    layer K = RoPE(RMSNorm_head(W_k g, attn_k_norm)), V = W_v g, stored at the positions.
    block(tokens, pos): Qwen3-style layers over [cached rows < pos, the block's own rows],
    every row attending to all of them (causal within the block only where
    dflash.attention.causal says so); output_norm, then the LM head: the head's output,
    else its token_embd, else the target's; d2t scatters reduced-vocabulary logits to
    target ids (-inf elsewhere). Token embeddings: the head's, else the target's. RoPE is
    NEOX, as for qwen3.

    What llama.cpp's dflash layers add where the head has it (Gemma targets' heads): the
    block's embeddings times dflash.embedding_scale; q.k times dflash.attention.scale
    instead of 1/sqrt(head_dim); sliding-window layers (dflash.attention.sliding_window
    and its per-layer pattern) where a row sees no key window or more positions before it
    (later ones in the block still); GELU (tanh) where dflash.hidden_activation says
    gelu; the attention output times dflash.attention.value_scale; post_attention_norm /
    post_ffw_norm RMSNorm the attention / FFN output before its residual add; the layer's
    output times layer_output_scale; a layer without attn_v takes its values from its key
    product, each head RMSNorm'd (unweighted), before the key's norm and rotary; attention
    sinks (attn_sinks, one per head) add exp(sink) to the softmax's denominator; linear
    rope scaling (dflash.rope.scaling.factor) and rope_freqs.weight scale the rotary
    frequencies.
    """

    def __init__(self, path: str | Path, target: ReferenceModel, n_ctx: int = 512):
        self.metadata, self.weights, _ = read_gguf(Path(path))
        md, w = self.metadata, self.weights
        self.n_layer = int(md["dflash.block_count"])
        self.n_embd = int(md["dflash.embedding_length"])
        self.n_head = int(md["dflash.attention.head_count"])
        self.n_head_kv = int(md.get("dflash.attention.head_count_kv", self.n_head))
        self.head_dim = int(md.get("dflash.attention.key_length", self.n_embd // self.n_head))
        self.n_rot = int(md.get("dflash.rope.dimension_count", self.head_dim))
        self.eps = float(md["dflash.attention.layer_norm_rms_epsilon"])
        self.rope_base = float(md.get("dflash.rope.freq_base", 10000.0))
        self.rope_scale = _linear_rope_scale(md, "dflash")
        self.rope_factors = w.get("rope_freqs.weight")
        self.causal = bool(md.get("dflash.attention.causal", False))
        self.embed_scale = float(md.get("dflash.embedding_scale", 1.0))
        self.attn_scale = float(md.get("dflash.attention.scale", 0.0)) or (
            1.0 / np.sqrt(float(self.head_dim)))
        self.value_scale = float(md.get("dflash.attention.value_scale", 1.0))
        self.window = int(md.get("dflash.attention.sliding_window", 0))
        self.swa = ([bool(x) for x in md["dflash.attention.sliding_window_pattern"]]
                    if self.window else [False] * self.n_layer)
        self.act = gelu_tanh if str(md.get("dflash.hidden_activation", "silu")).startswith(
            "gelu") else silu
        self.target_layers = [int(x) for x in md["dflash.target_layers"]]
        self.target = target
        self.embed = w.get("token_embd.weight", target.weights["token_embd.weight"])
        self.output = w.get("output.weight", w.get("token_embd.weight", target.output_weight))
        self.d2t = w.get("d2t")
        shape = (self.n_head_kv, n_ctx, self.head_dim)
        self.keys = [np.zeros(shape) for _ in range(self.n_layer)]
        self.values = [np.zeros(shape) for _ in range(self.n_layer)]

    def features(self, layer_inputs: dict[int, np.ndarray]) -> np.ndarray:
        """The head's input rows [T, L*E]: the target's streams entering its layers."""
        return np.concatenate([layer_inputs[i] for i in self.target_layers], axis=-1)

    def _kv(self, h: np.ndarray, layer: int, positions: np.ndarray) -> None:
        """K and V of rows h [T, E] at `positions`, written into the layer's cache."""
        p, w = f"blk.{layer}.", self.weights
        n = h.shape[0]
        k = (h @ w[p + "attn_k.weight"].T).reshape(n, self.n_head_kv, self.head_dim)
        v = ((h @ w[p + "attn_v.weight"].T).reshape(n, self.n_head_kv, self.head_dim)
             if p + "attn_v.weight" in w else rms_norm(k, 1.0, self.eps))  # shared K/V
        k = rms_norm(k, w[p + "attn_k_norm.weight"], self.eps).transpose(1, 0, 2)
        k = rope(k, positions, self.n_rot, self.rope_base, True, self.rope_scale,
                 self.rope_factors)  # [Hkv, T, hd]
        self.keys[layer][:, positions] = k
        self.values[layer][:, positions] = v.transpose(1, 0, 2)

    def inject(self, features: np.ndarray, positions: np.ndarray) -> None:
        x = np.clip(np.nan_to_num(np.asarray(features, np.float64), nan=0.0),
                    -65504.0, 65504.0)
        g = rms_norm(x @ self.weights["fc.weight"].T, self.weights["enc.output_norm.weight"],
                     self.eps)
        for layer in range(self.n_layer):
            self._kv(g, layer, np.asarray(positions))

    def block(self, tokens: list[int], pos: int) -> np.ndarray:
        """Logits [B, target vocab] of the block `tokens` at positions pos.. ."""
        return self._to_target(self._hidden(tokens, pos) @ self.output.T)

    def _to_target(self, logits: np.ndarray) -> np.ndarray:
        """Logits [n, Vd] in the head's vocabulary at their target ids [n, target vocab]."""
        if self.d2t is None:
            return logits
        full = np.full((logits.shape[0], self.target.vocab_size), -np.inf)
        full[:, self.d2t.reshape(-1)] = logits
        return full

    def markov_block(self, tokens: list[int], pos: int, rows: list[int],
                     chain: list[int] | None = None) -> tuple[np.ndarray, np.ndarray | None]:
        """DSpark: logits [R, target vocab] of the block's `rows`, each biased by
        markov_w2 @ markov_w1[prev] with prev the block's first token, then the argmax of the
        previous row's biased logits (`chain`: the target ids chosen at the rows instead,
        prev of row r + 1 being chain[r]); and the rows' confidences [R] (None without a
        confidence head): sigmoid(conf_proj @ [normed hidden ; markov_w1[prev]] + bias)."""
        w = self.weights
        hidden = self._hidden(tokens, pos)[rows]  # [R, E] after output_norm
        base = hidden @ self.output.T  # [R, Vd]
        w1, w2 = w["markov_w1.weight"], w["markov_w2.weight"]  # [V, rank], [Vd, rank]
        prev, logits, conf = tokens[0], [], []
        for r in range(len(rows)):
            col = base[r] + w2 @ w1[prev]  # [Vd]
            logits.append(col)
            if "conf_proj.weight" in w:
                z = w["conf_proj.weight"] @ np.concatenate([hidden[r], w1[prev]])
                z = z + w.get("conf_proj.bias", np.zeros(1))
                conf.append(1.0 / (1.0 + np.exp(-z[0])))
            best = int(np.argmax(col))
            prev = best if self.d2t is None else int(self.d2t.reshape(-1)[best])
            if chain is not None and r < len(chain):
                prev = chain[r]
        return self._to_target(np.stack(logits)), np.array(conf) if conf else None

    def _hidden(self, tokens: list[int], pos: int) -> np.ndarray:
        """The block's rows [B, E] after the head's layers and output_norm."""
        w, n = self.weights, len(tokens)
        positions = np.arange(pos, pos + n)
        end = pos + n
        group, hd = self.n_head // self.n_head_kv, self.head_dim
        masked = (np.arange(end)[None, :] > positions[:, None]) if self.causal else (
            np.zeros((n, end), bool))
        old = positions[:, None] - np.arange(end)[None, :] >= self.window  # [B, end]
        x = self.embed[np.asarray(tokens)] * self.embed_scale
        conv = self._conv if "blk.0.attn_conv_base" in w else None
        for layer in range(self.n_layer):
            p = f"blk.{layer}."
            h = rms_norm(x, w[p + "attn_norm.weight"], self.eps)
            if conv is not None:
                dyn = h @ w[p + "attn_conv_proj.weight"].T  # [B, 2*K*G]
                h = conv(h, dyn, w[p + "attn_conv_base"], 0)
            q = (h @ w[p + "attn_q.weight"].T).reshape(n, self.n_head, hd)
            q = rms_norm(q, w[p + "attn_q_norm.weight"], self.eps).transpose(1, 0, 2)
            q = rope(q, positions, self.n_rot, self.rope_base, True, self.rope_scale,
                     self.rope_factors)  # [H, B, hd]
            self._kv(h, layer, positions)
            keys = np.repeat(self.keys[layer][:, :end], group, axis=0)  # [H, end, hd]
            vals = np.repeat(self.values[layer][:, :end], group, axis=0)
            scores = q @ keys.transpose(0, 2, 1) * self.attn_scale  # [H, B, end]
            hidden = masked | old if self.swa[layer] else masked
            scores = np.where(hidden[None], -np.inf, scores)
            # attention sinks: one more logit per head in the softmax's denominator
            sink = w.get(p + "attn_sinks.weight", np.full(self.n_head, -np.inf))
            top = np.maximum(scores.max(axis=-1, keepdims=True), sink[:, None, None])
            probs = np.exp(scores - top)
            probs /= probs.sum(axis=-1, keepdims=True) + np.exp(sink[:, None, None] - top)
            attn = (probs @ vals).transpose(1, 0, 2).reshape(n, self.n_head * hd)
            a = attn @ w[p + "attn_output.weight"].T * self.value_scale
            a = a if conv is None else conv(a, dyn, w[p + "attn_conv_base"], 1)
            if p + "post_attention_norm.weight" in w:
                a = rms_norm(a, w[p + "post_attention_norm.weight"], self.eps)
            x = x + a
            h = rms_norm(x, w[p + "ffn_norm.weight"], self.eps)
            if conv is not None:
                dyn = h @ w[p + "ffn_conv_proj.weight"].T
                h = conv(h, dyn, w[p + "ffn_conv_base"], 0)
            f = (self.act(h @ w[p + "ffn_gate.weight"].T) * (h @ w[p + "ffn_up.weight"].T)
                 ) @ w[p + "ffn_down.weight"].T
            f = f if conv is None else conv(f, dyn, w[p + "ffn_conv_base"], 1)
            if p + "post_ffw_norm.weight" in w:
                f = rms_norm(f, w[p + "post_ffw_norm.weight"], self.eps)
            x = x + f
            if p + "layer_output_scale.weight" in w:
                x = x * w[p + "layer_output_scale.weight"].reshape(-1)[0]
        return rms_norm(x, w["output_norm.weight"], self.eps)

    def _conv(self, h: np.ndarray, dyn: np.ndarray, base: np.ndarray, side: int
              ) -> np.ndarray:
        """DFlash2's grouped convolution within the block: out[t, c] = sum over taps k of
        (base[side, k, c] + dyn[t, side, k, c // group]) * h[t - k, c] (zero before row 0)."""
        n, e = h.shape
        taps = base.shape[1]
        group = int(self.metadata["dflash.conv_group_size"])
        coeff = dyn.reshape(n, 2, taps, e // group)[:, side]  # [B, K, G]
        out = np.zeros_like(h)
        for t in range(n):
            for k in range(min(taps, t + 1)):
                weight = base[side, k] + np.repeat(coeff[t, k], group)  # [E]
                out[t] += weight * h[t - k]
        return out

    def lattice(self, tokens: list[int], pos: int, rows: list[int]
                ) -> tuple[np.ndarray, np.ndarray]:
        """DFlash2: the read rows' top-k candidates [R, k] (by logit, after logit_scale and
        soft-capping, scattered through d2t) and scores [R, k (predecessor), k (successor)]:
        logit of the successor + sum_j succ[s, j] * prev[p, j] * (selector_hidden @ h)[j],
        the predecessors of row 0 the block's first token, of row r row r - 1's
        candidates."""
        w, md = self.weights, self.metadata
        k = int(md["dflash.selector_top_k"])
        hidden = self._hidden(tokens, pos)[rows]  # [R, E]
        logits = hidden @ self.output.T
        if (scale := md.get("dflash.logit_scale")) is not None:
            logits = logits * scale
        if (cap := md.get("dflash.final_logit_softcapping")) is not None:
            logits = np.tanh(logits / cap) * cap
        logits = self._to_target(logits)  # [R, V]
        cand = np.argsort(-logits, axis=-1, kind="stable")[:, :k]  # [R, k]
        gate = hidden @ w["selector_hidden.weight"].T  # [R, rank]
        pred = np.concatenate([np.full((1, k), tokens[0]), cand[:-1]])  # [R, k]
        prev = w["selector_predecessor.weight"][pred] * gate[:, None, :]  # [R, k, rank]
        succ = w["selector_successor.weight"][cand]  # [R, k, rank]
        scores = prev @ succ.transpose(0, 2, 1)  # [R, k, k]
        scores += np.take_along_axis(logits, cand, axis=-1)[:, None, :]
        return cand, scores


class ReferenceEagle3:
    """float64 oracle of an EAGLE-3 head drafting for `target`.

    encode(features): g = fc @ features (RMSNorm'd by enc.output_norm first where
    `eagle3.norm_before_fc`). step(tokens, g, positions): the pair (tokens[i], g[i]) at
    positions[i] through the one llama layer: x = [RMSNorm(embed(token), attn_norm) ;
    RMSNorm(g, attn_norm_2)], q/k/v = W x, RoPE NORM (adjacent pairs), causal attention
    over the cache (K/V of every row stored at its position), plus the residual g (its norm
    where `eagle3.norm_before_residual`), then the FFN with its residual: the pre-norm
    hidden state; logits through output_norm and the LM head (the head's output, else the
    target's), scattered through d2t (-inf elsewhere). Token embeddings: the head's, else
    the target's.
    """

    def __init__(self, path: str | Path, target: ReferenceModel, n_ctx: int = 512):
        self.metadata, self.weights, _ = read_gguf(Path(path))
        md, w = self.metadata, self.weights
        self.n_embd = int(md["eagle3.embedding_length"])
        self.n_head = int(md["eagle3.attention.head_count"])
        self.n_head_kv = int(md.get("eagle3.attention.head_count_kv", self.n_head))
        self.head_dim = int(md.get("eagle3.attention.key_length", self.n_embd // self.n_head))
        self.n_rot = int(md.get("eagle3.rope.dimension_count", self.head_dim))
        self.eps = float(md["eagle3.attention.layer_norm_rms_epsilon"])
        self.rope_base = float(md.get("eagle3.rope.freq_base", 10000.0))
        self.rope_scale = _linear_rope_scale(md, "eagle3")
        self.rope_factors = w.get("rope_freqs.weight")
        self.norm_before_residual = bool(md.get("eagle3.norm_before_residual", False))
        self.norm_before_fc = bool(md.get("eagle3.norm_before_fc", False))
        self.target_layers = [int(x) for x in md["eagle3.target_layers"]]
        self.target = target
        self.embed = w.get("token_embd.weight", target.weights["token_embd.weight"])
        self.output = w.get("output.weight", target.output_weight)
        self.d2t = w.get("d2t")
        shape = (self.n_head_kv, n_ctx, self.head_dim)
        self.keys, self.values = np.zeros(shape), np.zeros(shape)

    def features(self, layer_inputs: dict[int, np.ndarray]) -> np.ndarray:
        """The head's input rows [T, 3*E_t]: the target's streams entering its layers."""
        return np.concatenate([layer_inputs[i] for i in self.target_layers], axis=-1)

    def encode(self, features: np.ndarray) -> np.ndarray:
        x = np.asarray(features, np.float64)
        if self.norm_before_fc:
            x = rms_norm(x, self.weights["enc.output_norm.weight"], self.eps)
        return x @ self.weights["fc.weight"].T  # [T, E]

    def step(self, tokens: list[int], g: np.ndarray, positions: np.ndarray
             ) -> tuple[np.ndarray, np.ndarray]:
        """Logits [T, target vocab] and pre-norm hidden states [T, E] of the pairs."""
        w, p, n = self.weights, "blk.0.", len(tokens)
        positions = np.asarray(positions)
        group, hd = self.n_head // self.n_head_kv, self.head_dim
        g = np.asarray(g, np.float64)
        g_norm = rms_norm(g, w[p + "attn_norm_2.weight"], self.eps)
        x = np.concatenate([rms_norm(self.embed[np.asarray(tokens)], w[p + "attn_norm.weight"],
                                     self.eps), g_norm], axis=-1)  # [T, 2E]
        q = (x @ w[p + "attn_q.weight"].T).reshape(n, self.n_head, hd).transpose(1, 0, 2)
        k = (x @ w[p + "attn_k.weight"].T).reshape(n, self.n_head_kv, hd).transpose(1, 0, 2)
        v = (x @ w[p + "attn_v.weight"].T).reshape(n, self.n_head_kv, hd).transpose(1, 0, 2)
        q = rope(q, positions, self.n_rot, self.rope_base, False, self.rope_scale,
                 self.rope_factors)
        self.keys[:, positions] = rope(k, positions, self.n_rot, self.rope_base, False,
                                       self.rope_scale, self.rope_factors)
        self.values[:, positions] = v
        end = int(positions.max()) + 1
        keys = np.repeat(self.keys[:, :end], group, axis=0)  # [H, end, hd]
        vals = np.repeat(self.values[:, :end], group, axis=0)
        scores = q @ keys.transpose(0, 2, 1) / np.sqrt(float(hd))  # [H, T, end]
        scores = np.where(np.arange(end)[None, None, :] > positions[None, :, None], -np.inf,
                          scores)
        probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
        probs /= probs.sum(axis=-1, keepdims=True)
        attn = (probs @ vals).transpose(1, 0, 2).reshape(n, self.n_head * hd)
        h = attn @ w[p + "attn_output.weight"].T + (g_norm if self.norm_before_residual else g)
        f = rms_norm(h, w[p + "ffn_norm.weight"], self.eps)
        hidden = h + (silu(f @ w[p + "ffn_gate.weight"].T) * (f @ w[p + "ffn_up.weight"].T)
                      ) @ w[p + "ffn_down.weight"].T
        logits = rms_norm(hidden, w["output_norm.weight"], self.eps) @ self.output.T
        if self.d2t is not None:
            full = np.full((n, self.target.vocab_size), -np.inf)
            full[:, self.d2t.reshape(-1)] = logits
            logits = full
        return logits, hidden
