"""Products of activations with GGUF matrices: one, several sharing one input (stacked
into one product where their kinds allow), and the bias each may have."""

from __future__ import annotations

import numpy as np

from specd.ort_models.quant import dense_float32

from .context import BuildContext
from .pending import Activation, Pending, for_products, materialize
from .weights import matrix, stack_rows


def linear(c: BuildContext, x: Activation, name: str, bias: list[str] | None = None) -> str:
    """x [S, K] @ W^T (+ bias) -> [S, N] for the GGUF matrix `name` [N, K]; bias: the
    bias vectors to add (default: `name`'s own, where a block's matrix has one)."""
    w = matrix(c, name)
    # a pending activation is left to the product's prologue where the kind computes one
    pending = x if isinstance(x, Pending) and x.tensor is None and w.takes_prologue else None
    xt = materialize(c, x) if pending is None else ""
    if bias is None:
        own = name.replace(".weight", ".bias")
        bias = [own] if name.startswith("blk.") and c.f.has_tensor(own) else []
    bias_name = ""
    if bias:
        vec = np.concatenate([dense_float32(c.f.tensor(b)).reshape(-1) for b in bias])
        bias_name = c.g.weight(name.replace(".weight", ".bias"), vec)  # [N]
    if pending is not None:
        return w.prologue_product(c, name, pending, bias_name)
    return w.product(c, name, xt, bias_name)


def linears(c: BuildContext, x: Activation, names: list[str]) -> list[str]:
    """Several matrices applied to one input; runs of compatible ones share one product."""
    outs: list[str] = []
    for y, group in grouped_linears(c, x, names):
        outs.extend(split(c, y, group))
    return outs


def grouped_linears(c: BuildContext, x: Activation, names: list[str]
                    ) -> list[tuple[str, list[str]]]:
    """The products of `linears` before any Split: (output, the matrices stacked in it)
    for each run of compatible matrices."""
    if not all(matrix(c, names[0]).fusable(matrix(c, n)) for n in names[1:]):
        x = for_products(c, x)  # several products read it
    out: list[tuple[str, list[str]]] = []
    i = 0
    while i < len(names):
        j = i + 1
        while j < len(names) and matrix(c, names[i]).fusable(matrix(c, names[j])):
            j += 1
        group = names[i:j]
        out.append((linear(c, x, group[0]) if len(group) == 1
                    else stacked_linear(c, x, group), group))
        i = j
    return out


def split(c: BuildContext, y: str, group: list[str]) -> list[str]:
    """A stacked product's output [S, N_0 + N_1 + ...] as one tensor per matrix."""
    if len(group) == 1:
        return [y]
    sizes = [matrix(c, n).n for n in group]
    return list(c.g.op("Split", [y, c.g.const(sizes)], len(group), axis=-1))


def stacked_linear(c: BuildContext, x: Activation, names: list[str]) -> str:
    """x @ [W_0; W_1; ...]^T (+ their biases) -> [S, N_0 + N_1 + ...] in one product, for
    matrices that are pairwise `fusable`."""
    fused = names[0].rsplit(".", 2)[0] + "." + "+".join(
        n.split(".")[-2] for n in names) + ".weight"
    c.shared[fused] = stack_rows([matrix(c, n) for n in names])
    biases = [n.replace(".weight", ".bias") for n in names]
    return linear(c, x, fused, bias=[b for b in biases if c.f.has_tensor(b)])
