"""RMS norms: plain, per attention head (qwen3), and the residual add + norm that opens
each block, left pending for a GgufMatMul prologue where specd's kernels run."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from specd.ort_models.native_ops import DOMAIN as NATIVE
from specd.ort_models.onnx_writer import MS

from .context import BuildContext
from .pending import Activation, Pending


def rms_norm(c: BuildContext, x: str, weight: str, eps: float | None = None) -> str:
    """RMSNorm of x over its last axis, scaled by the initializer `weight` (eps: the
    model's rms eps unless given)."""
    return c.g.op("SimplifiedLayerNormalization", [x, weight], axis=-1,
                  epsilon=c.hp.rms_eps if eps is None else eps, stash_type=1)


def head_norm(c: BuildContext, x: str, n_heads: int, weight: str) -> str:
    """qwen3: RMSNorm over head_dim for each head of x [S, n_heads*hd]."""
    g, hd = c.g, c.hp.head_dim
    y = rms_norm(c, g.op("Reshape", [x, g.const([0, n_heads, hd])]), c.vector(weight))
    return g.op("Reshape", [y, g.const([0, n_heads * hd])])


@dataclass
class PendingNorm(Pending):
    """RMSNorm(x + delta), not computed yet; a GgufMatMul computes it (and writes the sum
    x + delta for the next block) in its prologue."""

    x: str  # the block input (or its rows)
    delta: str | None  # added to x first
    weight: str  # the norm's weight initializer [K]
    total: str | None  # with delta: the name x + delta is given (None: not needed)
    tensor: str | None = None
    share: bool = False  # the product computing it also writes it (others read it)

    def compute(self, c: BuildContext) -> str:
        if self.delta is None:
            return rms_norm(c, self.x, self.weight)
        outs = [c.g.fresh("norm"), "", "", self.total or c.g.fresh("residual")]
        c.g.op("SkipSimplifiedLayerNormalization", [self.delta, self.x, self.weight],
               domain=MS, out=outs, epsilon=c.hp.rms_eps)
        self.total = None  # written
        return outs[0]

    def for_products(self, c: BuildContext) -> Activation:
        if self.tensor is None:
            self.share = True  # the first product's prologue also writes it for the others
            return self
        return self.tensor

    def gguf_product(self, c: BuildContext, raw: str, bias: str, attrs: dict[str, Any]) -> str:
        g = c.g
        ins = [self.x, raw, bias, self.weight]
        if self.delta is not None:
            ins.append(self.delta)
        y = g.fresh("gguf_matmul")
        outs = [y, self.total or ""]
        if self.share:
            self.tensor = g.fresh("norm")
            outs.append(self.tensor)
        g.op("GgufMatMul", ins, domain=NATIVE, out=outs if any(outs[1:]) else [y],
             prologue=1, epsilon=c.hp.rms_eps, **attrs)
        self.total = None  # written: a later materialization must not write it again
        return y


def add_norm(c: BuildContext, x: str, delta: str | None, weight: str, *,
             keep_sum: bool = True) -> tuple[str, Activation]:
    """(x + delta, RMSNorm(x + delta)): with specd's kernels left pending, for the
    product that reads it to compute (PendingNorm), else one SkipSimplifiedLayerNormalization.
    keep_sum=False: x + delta is not needed (the first of the pair is then meaningless)."""
    w = c.vector(weight)
    if c.options.kernels == "gguf":
        total = None if delta is None or not keep_sum else c.g.fresh("residual")
        return (x if total is None else total), PendingNorm(x, delta, w, total)
    if delta is None:
        return x, rms_norm(c, x, w)
    h, _, _, total = c.g.op("SkipSimplifiedLayerNormalization", [delta, x, w], 4, domain=MS,
                            epsilon=c.hp.rms_eps)
    return total, h
