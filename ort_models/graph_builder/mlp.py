"""The gated feed-forward block: down(act(gate(h)) * up(h)), act silu or (gemma) GELU."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from specd.ort_models.native_ops import DOMAIN as NATIVE

from .context import BuildContext
from .linear import linear, linears, stacked_linear
from .moe import moe_ffn
from .pending import Activation, Pending
from .weights import matrix


@dataclass
class PendingSwiGlu(Pending):
    """silu(gate) * up of the stacked gate/up product, not computed yet; a GgufMatMul
    computes it in its prologue, anything else reads one SwiGlu node's output."""

    x: str  # [S, 2F]: gate then up
    tensor: str | None = None

    def compute(self, c: BuildContext) -> str:
        return c.g.op("SwiGlu", [self.x], domain=NATIVE)  # [S, F]

    def gguf_product(self, c: BuildContext, raw: str, bias: str, attrs: dict[str, Any]) -> str:
        ins = [self.x, raw, bias] if bias else [self.x, raw]
        return c.g.op("GgufMatMul", ins, domain=NATIVE, prologue=2, **attrs)


def gated_ffn(c: BuildContext, h: Activation, p: str) -> Activation:
    """silu(h @ gate^T) * (h @ up^T) -> [S, n_ff]: where specd's ops are registered one
    product over the stacked gate and up, then SwiGlu (pending: the down product's
    prologue, where that is a GgufMatMul), else Split, Sigmoid and Muls."""
    names = [p + "ffn_gate.weight", p + "ffn_up.weight"]
    if c.hp.ffn_act == "gelu":  # gemma: gelu(gate) * up, GELU's tanh approximation
        gate, up = linears(c, h, names)
        return c.g.op("Mul", [c.g.op("Gelu", [gate], approximate="tanh"), up])
    if c.options.uses_native and matrix(c, names[0]).fusable(matrix(c, names[1])):
        return PendingSwiGlu(stacked_linear(c, h, names))
    gate, up = linears(c, h, names)
    return c.g.op("Mul", [c.g.op("Mul", [gate, c.g.op("Sigmoid", [gate])]), up])


def feed_forward(c: BuildContext, h: Activation, p: str) -> str:
    """The block `p`'s feed-forward output [S, n_embd] for its normed input h (a mixture
    of experts where the model has one: moe.py)."""
    if c.hp.moe is not None:
        return moe_ffn(c, h, p)
    return linear(c, gated_ffn(c, h, p), p + "ffn_down.weight")
