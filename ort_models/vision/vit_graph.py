"""The blocks of a vision transformer as ONNX nodes: what clip.cpp's `build_vit`,
`build_attn`, `build_ffn` and `build_norm` compute, in float32.

The mmproj's tensors enter the graph as float32 initializers (quantized ones
dequantized): an image is encoded once per request, so the tower runs as dense MatMuls.
Activations are [S, n_embd] rows, one per patch; attention splits them into heads.
"""

from __future__ import annotations

import numpy as np

from specd.ort_models.gguf_file import GGUFFile
from specd.ort_models.onnx_writer import GraphWriter
from specd.ort_models.quant import dense_float32, float_rows, load_matrix

from .mmproj import VisionHParams

GELU_TANH_OPSET = 20  # Gelu with approximate="tanh"
# masked scores: the lowest float, as llama.cpp's window masks (exp gives exactly 0)
MASKED = float(np.finfo(np.float32).min)


class VisionGraph:
    """One encoder build: the writer, the mmproj and its hyper-parameters."""

    def __init__(self, g: GraphWriter, f: GGUFFile, hp: VisionHParams):
        self.g, self.f, self.hp = g, f, hp

    # -- weights ----------------------------------------------------------------------------
    def values(self, name: str) -> np.ndarray:
        """The GGUF tensor `name` as float32 in its numpy shape (dequantized)."""
        t = self.f.tensor(name)
        if t.type_name in ("F32", "F16", "BF16"):
            return dense_float32(t)
        return float_rows(load_matrix(t)).reshape(t.shape)

    def param(self, name: str, array: np.ndarray | None = None) -> str:
        """The initializer of `name` (its tensor's values unless `array` is given), once."""
        if not self.g.has(name):
            self.g.weight(name, np.ascontiguousarray(
                self.values(name) if array is None else array, dtype=np.float32))
        return name

    def has(self, name: str) -> bool:
        return self.f.has_tensor(name)

    def reorder_rows(self, prefix: str, rows: np.ndarray) -> None:
        """`{prefix}`'s weight and bias with their output rows taken in `rows` order,
        stored under the names `linear` reads, so that `linear(x, prefix)` (and `layer`)
        uses them: a layout change decided at build time costs nothing per image."""
        wt = f"{prefix}.weight^T"
        if not self.g.has(wt):
            self.g.weight(wt, np.ascontiguousarray(self.values(f"{prefix}.weight")[rows].T))
        if self.has(f"{prefix}.bias"):
            self.param(f"{prefix}.bias", self.values(f"{prefix}.bias")[rows])

    # -- blocks -----------------------------------------------------------------------------
    def linear(self, x: str, prefix: str) -> str:
        """x [S, K] @ W^T (+ bias where the file has `{prefix}.bias`) -> [S, N]."""
        w = f"{prefix}.weight"
        wt = f"{w}^T"
        if not self.g.has(wt):
            self.g.weight(wt, np.ascontiguousarray(self.values(w).T))  # [K, N]
        y = self.g.op("MatMul", [x, wt])
        return self.g.op("Add", [y, self.param(f"{prefix}.bias")]) if self.has(
            f"{prefix}.bias") else y

    def norm(self, x: str, prefix: str, kind: str) -> str:
        """clip.cpp's build_norm: LayerNorm ("layer") or RMSNorm ("rms") over the last
        axis, times `{prefix}.weight`, plus `{prefix}.bias` where there is one."""
        g, w = self.g, self.param(f"{prefix}.weight")
        if kind == "rms":
            y = g.op("SimplifiedLayerNormalization", [x, w], axis=-1, epsilon=self.hp.eps,
                     stash_type=1)
            return g.op("Add", [y, self.param(f"{prefix}.bias")]) if self.has(
                f"{prefix}.bias") else y
        ins = [x, w] + ([self.param(f"{prefix}.bias")] if self.has(f"{prefix}.bias") else [])
        return g.op("LayerNormalization", ins, axis=-1, epsilon=self.hp.eps)

    def activation(self, x: str, kind: str) -> str:
        g = self.g
        if kind == "gelu":  # ggml_gelu: the tanh approximation
            return g.op("Gelu", [x], approximate="tanh")
        if kind == "gelu_erf":
            return g.op("Gelu", [x])
        if kind == "silu":
            return g.op("Mul", [x, g.op("Sigmoid", [x])])
        if kind == "gelu_quick":  # x * sigmoid(1.702 x)
            return g.op("Mul", [x, g.op("Sigmoid", [
                g.op("Mul", [x, g.const(1.702, np.float32)])])])
        raise ValueError(f"unknown activation {kind!r}")

    def ffn(self, x: str, prefix: str, kind: str) -> str:
        """build_ffn: down(act(gate(x)) * up(x)) where there is a gate, else
        down(act(up(x)))."""
        up = self.linear(x, f"{prefix}.ffn_up")
        if self.has(f"{prefix}.ffn_gate.weight"):
            gate = self.activation(self.linear(x, f"{prefix}.ffn_gate"), kind)
            h = self.g.op("Mul", [gate, up])
        else:
            h = self.activation(up, kind)
        return self.linear(h, f"{prefix}.ffn_down")

    def heads(self, x: str) -> str:
        """[S, n_head * d] -> [n_head, S, d]."""
        g, hp = self.g, self.hp
        return g.op("Transpose", [g.op("Reshape", [x, g.const([0, hp.n_head, hp.head_dim])])],
                    perm=[1, 0, 2])

    def attention(self, q: str, k: str, v: str, mask: str | None = None) -> str:
        """build_attn without its output matrix: softmax(q k^T / sqrt(d) + mask) v for
        q, k, v [n_head, S, d] -> [S, n_head * d]; `mask` [S, S] is added to the scaled
        scores (0 where a patch may attend, a huge negative where it may not)."""
        g, hp = self.g, self.hp
        scores = g.op("MatMul", [q, g.op("Transpose", [k], perm=[0, 2, 1])])  # [H, S, S]
        scores = g.op("Mul", [scores, g.const(1.0 / np.sqrt(hp.head_dim), np.float32)])
        if mask is not None:
            scores = g.op("Add", [scores, mask])
        probs = g.op("Softmax", [scores], axis=-1)
        out = g.op("Transpose", [g.op("MatMul", [probs, v])], perm=[1, 0, 2])  # [S, H, d]
        return g.op("Reshape", [out, g.const([0, hp.n_embd])])

    def layer(self, x: str, il: int, *, norm: str, ffn: str, rope: tuple[str, str] | None = None,
              mask: str | None = None) -> str:
        """One pre-norm transformer block of build_vit: x + attn(norm1(x)), then
        + ffn(norm2(.)); `rope` (cos, sin) [S, d] rotates q and k first (NeoX halves)."""
        g, p = self.g, f"v.blk.{il}"
        h = self.norm(x, f"{p}.ln1", norm)
        q, k, v = (self.heads(self.linear(h, f"{p}.attn_{n}")) for n in "qkv")
        if rope is not None:
            q, k = self.rotate(q, rope), self.rotate(k, rope)
        attn = self.linear(self.attention(q, k, v, mask), f"{p}.attn_out")
        x = g.op("Add", [attn, x])
        h = self.ffn(self.norm(x, f"{p}.ln2", norm), p, ffn)
        return g.op("Add", [x, h])

    def rotate(self, x: str, rope: tuple[str, str]) -> str:
        """x [H, S, d] rotated by (cos, sin) [S, d] in NeoX halves:
        x * cos + rotate_half(x) * sin, rotate_half([a, b]) = [-b, a]."""
        g, half = self.g, self.hp.head_dim // 2
        cos, sin = rope
        a, b = g.op("Split", [x, g.const([half, half])], 2, axis=-1)
        rotated = g.op("Concat", [g.op("Neg", [b]), a], axis=-1)
        return g.op("Add", [g.op("Mul", [x, cos]), g.op("Mul", [rotated, sin])])

    def patch_conv(self, pixels: str, weight: str) -> str:
        """The patch embedding of build_inp: pixels [3, H, W] convolved by `weight`
        [n_embd, 3, p, p] with stride p -> [1, n_embd, H/p, W/p]."""
        g, p = self.g, self.hp.patch_size
        x = g.op("Unsqueeze", [pixels, g.const([0])])
        return g.op("Conv", [x, self.param(weight)], kernel_shape=[p, p], strides=[p, p])

    def channels_last(self, x: str) -> str:
        """[1, C, h, w] -> [h * w, C]: one row per patch, row-major over the grid."""
        g = self.g
        flat = g.op("Reshape", [x, g.const([0, 0, -1])])  # [1, C, h*w]
        return g.op("Squeeze", [g.op("Transpose", [flat], perm=[0, 2, 1]), g.const([0])])
