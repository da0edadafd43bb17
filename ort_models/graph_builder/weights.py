"""The matrices a graph multiplies by: one class per kind, behind one interface.

A GGUF matrix [N, K] enters the graph as one of
    DenseWeight  float32 rows (F32 / F16 / BF16 files): MatMul by its transpose
    NBitsWeight  MatMulNBits inputs (quant.QuantizedMatrix): the GGUF's blocks re-laid
                 out losslessly, or re-quantized to 4 bits (drafts)
    GgufWeight   the GGUF's own rows of blocks, or rows re-quantized to Q4_K (drafts),
                 for specd's GgufMatMul kernel (native_ops), which can compute a pending
                 activation as its prologue
`matrix` picks the kind from the build options (`load_weight`); the builder then only
calls the interface: `fusable` / `stack_rows` to share one product between matrices,
`first_rows` to cut the output head, `product` to multiply, `lookup` for embedding rows.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Self, cast

import numpy as np

from specd.ort_models.gguf_file import TensorInfo
from specd.ort_models.gguf_layouts import regroup
from specd.ort_models.native_ops import DOMAIN as NATIVE
from specd.ort_models.native_ops import GGUF_MATMUL_TYPES
from specd.ort_models.onnx_writer import MS, GraphWriter
from specd.ort_models.quant import (
    QK_K,
    QuantizedMatrix,
    float_rows,
    load_matrix,
    quantize_q4_k,
    requant_block_size,
    requantize_q4,
)

from .context import BuildContext
from .options import F32
from .pending import Pending


class Weight(ABC):
    """A matrix [N, K] as the graph multiplies by it."""

    n: int  # rows: the product's output channels
    k: int  # columns: the product's K
    # whether `product` takes a pending activation and computes it as its prologue
    takes_prologue: ClassVar[bool] = False

    def fusable(self, other: Weight) -> bool:
        """Whether one product can hold this matrix's rows and `other`'s (same kind and
        layout; both multiply the same input)."""
        return type(self) is type(other) and self.same_layout(cast(Self, other))

    @abstractmethod
    def same_layout(self, other: Self) -> bool:
        """fusable, for another matrix of this kind."""

    @classmethod
    @abstractmethod
    def stack(cls, ws: list[Self]) -> Self:
        """Matrices of this kind one under the other: [N_0 + N_1 + ..., K]."""

    @abstractmethod
    def first_rows(self, rows: int) -> Self:
        """The matrix's first `rows` rows (output channels)."""

    @abstractmethod
    def product(self, c: BuildContext, name: str, x: str, bias: str) -> str:
        """x [S, K] @ W^T (+ `bias` [N], "" for none) -> [S, N], the matrix's initializers
        named after `name` (written once)."""

    def prologue_product(self, c: BuildContext, name: str, x: Pending, bias: str) -> str:
        """`product` of a pending activation, computed by the product itself (only where
        takes_prologue)."""
        raise TypeError(f"{type(self).__name__} computes no prologue")

    def lookup(self, g: GraphWriter, name: str, ids: str) -> str:
        """The rows at `ids` [S] as float32 [S, K] (the embedding)."""
        raise TypeError(f"{type(self).__name__} rows are not looked up")


def _add_bias(g: GraphWriter, y: str, bias: str) -> str:
    return g.op("Add", [y, bias]) if bias else y


@dataclass
class DenseWeight(Weight):
    """float32 [N, K]."""

    w: np.ndarray  # [N, K] float32
    n: int = field(init=False)
    k: int = field(init=False)

    def __post_init__(self) -> None:
        self.n, self.k = self.w.shape

    def same_layout(self, other: Self) -> bool:
        return True

    @classmethod
    def stack(cls, ws: list[Self]) -> Self:
        return cls(np.concatenate([w.w for w in ws], axis=0))

    def first_rows(self, rows: int) -> Self:
        return type(self)(self.w[:rows])

    def product(self, c: BuildContext, name: str, x: str, bias: str) -> str:
        g, wt = c.g, f"{name}.W"
        if not g.has(wt):
            g.weight(wt, np.ascontiguousarray(self.w.T))  # [K, N]
        return _add_bias(g, g.op("MatMul", [x, wt]), bias)

    def lookup(self, g: GraphWriter, name: str, ids: str) -> str:
        table = g.weight(f"{name}.table", self.w)
        return g.op("Gather", [table, ids], axis=0)  # [S, E]


@dataclass
class NBitsWeight(Weight):
    """MatMulNBits inputs: codes, scales, zero points and, for K-quants, a min term per 32
    (quant.QuantizedMatrix)."""

    q: QuantizedMatrix
    n: int = field(init=False)
    k: int = field(init=False)

    def __post_init__(self) -> None:
        self.n, self.k = self.q.n, self.q.k

    def same_layout(self, other: Self) -> bool:
        def layout(w: QuantizedMatrix) -> tuple[object, ...]:
            zp = "per-block" if isinstance(w.zero_point, np.ndarray) else w.zero_point
            return w.k, w.bits, w.block_size, zp, w.bias is None

        return layout(self.q) == layout(other.q)

    @classmethod
    def stack(cls, ws: list[Self]) -> Self:
        qs = [w.q for w in ws]
        w0 = qs[0]
        return cls(QuantizedMatrix(
            n=sum(w.n for w in qs), k=w0.k, bits=w0.bits, block_size=w0.block_size,
            q=np.concatenate([w.q for w in qs]), scales=np.concatenate([w.scales for w in qs]),
            zero_point=np.concatenate([w.zero_point for w in qs])
            if isinstance(w0.zero_point, np.ndarray) else w0.zero_point,
            bias=None if w0.bias is None else np.concatenate([w.bias for w in qs])))

    def first_rows(self, rows: int) -> Self:
        w = self.q
        return type(self)(QuantizedMatrix(
            n=rows, k=w.k, bits=w.bits, block_size=w.block_size, q=w.q[:rows],
            scales=w.scales[:rows],
            zero_point=w.zero_point[:rows] if isinstance(w.zero_point, np.ndarray)
            else w.zero_point,
            bias=None if w.bias is None else w.bias[:rows]))

    def write(self, g: GraphWriter, name: str) -> None:
        """The MatMulNBits inputs of `name` (once, shared by the embedding and the output)."""
        if g.has(f"{name}.B"):
            return
        w = self.q
        g.weight(f"{name}.B", w.packed_b())  # [N, K/bs, bs*bits/8]
        g.weight(f"{name}.scales", w.scales)  # [N, K/bs]
        zp = w.packed_zero_points()
        if zp is not None:
            g.weight(f"{name}.zp", zp)

    def product(self, c: BuildContext, name: str, x: str, bias: str) -> str:
        g, w = c.g, self.q
        self.write(g, name)
        ins = [x, f"{name}.B", f"{name}.scales"]
        if w.zero_point is not None:
            ins.append(f"{name}.zp")
        y = g.op("MatMulNBits", ins, domain=MS, K=w.k, N=w.n, bits=w.bits,
                 block_size=w.block_size, accuracy_level=c.options.accuracy_level)
        if w.bias is not None:  # + blocksum(x) @ bias^T: the exact min term
            if not g.has(f"{name}.minT"):
                g.weight(f"{name}.minT", np.ascontiguousarray(w.bias.T))  # [K/32, N]
            blocks = g.op("Reshape", [x, g.const([0, w.k // 32, 32])])  # [S, K/32, 32]
            sums = g.op("ReduceSum", [blocks, g.const([-1])], keepdims=0)  # [S, K/32]
            y = g.op("Add", [y, g.op("MatMul", [sums, f"{name}.minT"])])
        return _add_bias(g, y, bias)

    def lookup(self, g: GraphWriter, name: str, ids: str) -> str:
        """Rows dequantized exactly as gguf.quants.dequantize does."""
        w = self.q
        self.write(g, name)
        if w.bias is not None:
            g.weight(f"{name}.rowbias", w.bias)  # [V, K/32]
        codes = g.op("Gather", [f"{name}.B", ids], axis=0)  # [S, nb, bs*bits/8]
        if w.bits == 4:
            lo = g.op("BitwiseAnd", [codes, g.const(15, np.uint8)])
            hi = g.op("BitShift", [codes, g.const(4, np.uint8)], direction="RIGHT")
            both = g.op("Concat", [g.op("Unsqueeze", [lo, g.const([-1])]),
                                   g.op("Unsqueeze", [hi, g.const([-1])])], axis=-1)
            codes = g.op("Reshape", [both, g.const([0, w.k // w.block_size, w.block_size])])
        zp = (1 << (w.bits - 1)) if w.zero_point is None else w.zero_point
        q = g.op("Sub", [g.op("Cast", [codes], to=F32), g.const(float(zp), np.float32)])
        scales = g.op("Unsqueeze", [g.op("Gather", [f"{name}.scales", ids], axis=0),
                                    g.const([-1])])
        rows = g.op("Mul", [q, scales])  # [S, nb, bs]
        if w.bias is not None:
            rows = g.op("Reshape", [rows, g.const([0, w.k // 32, 32])])
            bias = g.op("Unsqueeze", [g.op("Gather", [f"{name}.rowbias", ids], axis=0),
                                      g.const([-1])])
            rows = g.op("Add", [rows, bias])
        return g.op("Reshape", [rows, g.const([0, w.k])])  # [S, E]


@dataclass
class GgufWeight(Weight):
    """A matrix [N, K] as the GGUF's raw rows of blocks, for GgufMatMul."""

    takes_prologue: ClassVar[bool] = True

    type_name: str
    n: int
    k: int  # the product's K; K-quant rows hold ceil(K / 256) superblocks (zero-padded),
    # Q4_0 / Q4_1 rows K / 32 blocks
    data: np.ndarray  # [N, row_bytes] uint8

    @classmethod
    def of_tensor(cls, t: TensorInfo) -> GgufWeight:
        """The GGUF's own rows (a type GgufMatMul reads)."""
        n, k = t.shape
        return cls(t.type_name, n, k, np.ascontiguousarray(t.data).view(np.uint8).reshape(n, -1))

    @classmethod
    def requantized_q4_k(cls, t: TensorInfo) -> GgufWeight:
        """The tensor's values re-quantized to Q4_K rows, zero-padded to whole superblocks."""
        n, k = t.shape
        x = np.pad(float_rows(load_matrix(t)), ((0, 0), (0, -k % QK_K)))
        return cls("Q4_K", n, k, quantize_q4_k(x))

    def same_layout(self, other: Self) -> bool:
        return (self.type_name, self.k) == (other.type_name, other.k)

    @classmethod
    def stack(cls, ws: list[Self]) -> Self:
        return cls(ws[0].type_name, sum(w.n for w in ws), ws[0].k,
                   np.concatenate([w.data for w in ws]))

    def first_rows(self, rows: int) -> Self:
        return type(self)(self.type_name, rows, self.k, self.data[:rows])

    def product(self, c: BuildContext, name: str, x: str, bias: str) -> str:
        raw, attrs = self._kernel_inputs(c, name)
        ins = [x, raw, bias] if bias else [x, raw]  # the kernel adds the bias
        return c.g.op("GgufMatMul", ins, domain=NATIVE, **attrs)

    def prologue_product(self, c: BuildContext, name: str, x: Pending, bias: str) -> str:
        raw, attrs = self._kernel_inputs(c, name)
        return x.gguf_product(c, raw, bias, attrs)

    def _kernel_inputs(self, c: BuildContext, name: str) -> tuple[str, dict[str, Any]]:
        """The regrouped rows' initializer (written once) and GgufMatMul's attributes."""
        raw = f"{name}.gguf"
        if not c.g.has(raw):
            c.g.weight(raw, regroup(self.type_name, self.data, self.n, self.k))  # [N/16, group]
        return raw, {"ggml_type": GGUF_MATMUL_TYPES[self.type_name], "K": self.k, "N": self.n}


def stack_rows(ws: list[Weight]) -> Weight:
    """Matrices that are pairwise `fusable`, one under the other."""
    return type(ws[0]).stack(ws)


def load_weight(t: TensorInfo, *, requant: str = "", gguf_kernels: bool = False) -> Weight:
    """The GGUF matrix `t` as the graph multiplies by it: its own rows where specd's
    kernels run and read its type, Q4_K rows for requant "q4k", else MatMulNBits inputs
    (re-quantized if asked) or dense float32."""
    if gguf_kernels and not requant and t.type_name in GGUF_MATMUL_TYPES:
        return GgufWeight.of_tensor(t)
    if requant == "q4k":
        return GgufWeight.requantized_q4_k(t)
    w = load_matrix(t)
    if isinstance(w, np.ndarray):
        bs = requant_block_size(requant, w.shape[1])
        return NBitsWeight(requantize_q4(w, bs)) if bs else DenseWeight(w)
    bs = requant_block_size(requant, w.k)
    return NBitsWeight(requantize_q4(w, bs) if bs else w)


def matrix(c: BuildContext, name: str, *, exact: bool = False) -> Weight:
    """The GGUF matrix `name` as this build multiplies by it (loaded once per layer);
    exact=True: the GGUF's values as dense or MatMulNBits inputs, whatever the options
    (the embedding lookup)."""
    key = name if not exact else f"{name}@exact"
    if key not in c.shared:
        t = c.f.tensor(name)
        if exact:
            c.shared[key] = load_weight(t)
        else:
            c.shared[key] = load_weight(t, requant=c.options.requant,
                                        gguf_kernels=c.options.kernels == "gguf")
    return c.shared[key]
