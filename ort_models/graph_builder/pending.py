"""Activations no node has computed yet, for a GgufMatMul to compute as its prologue.

A block's RMS norm (norms.PendingNorm) and the feed-forward's SwiGlu (mlp.PendingSwiGlu)
are left pending where specd's kernels run: the GgufMatMul that reads one computes it in
the pass that quantizes its input, a node fewer. Any other consumer gets the activation
from its own node (`materialize`). Each kind says how it is computed either way; the
products only call this interface.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from .context import BuildContext


class Pending(ABC):
    tensor: str | None  # the activation, once a node wrote it

    @abstractmethod
    def compute(self, c: BuildContext) -> str:
        """Write the node that computes the activation; returns it."""

    @abstractmethod
    def gguf_product(self, c: BuildContext, raw: str, bias: str, attrs: dict[str, Any]) -> str:
        """A GgufMatMul of the regrouped matrix `raw` (+ `bias`, "" for none) that computes
        the activation as its prologue; `attrs`: the kernel's type and shape attributes.
        Returns the product [S, N]."""

    def materialize(self, c: BuildContext) -> str:
        """The activation as a tensor: its own node, written once."""
        if self.tensor is None:
            self.tensor = self.compute(c)
        return self.tensor

    def for_products(self, c: BuildContext) -> Activation:
        """The activation as several products that do not share one node take it: by
        default computed once by its own node."""
        return self.materialize(c)


Activation = str | Pending


def materialize(c: BuildContext, x: Activation) -> str:
    """The activation as a tensor (a pending one gets its own node, once)."""
    return x if isinstance(x, str) else x.materialize(c)


def for_products(c: BuildContext, x: Activation) -> Activation:
    """The activation as several separate products take it (Pending.for_products)."""
    return x if isinstance(x, str) else x.for_products(c)
