"""Build one ONNX decoder graph from a GGUF file.

Graph contract (one sequence per call, S >= 1 new tokens on top of the KV cache):

inputs
    input_ids    int64 [S]           tokens at positions pos .. pos+S-1
    position     int64 [1]           pos: where the first new token goes
    attn_len     int64 [1]           keys attended: a bucket end >= pos+S (see ATTN_BUCKET);
                                     a runner's filler rows (CUDA) may lie past it
    logits_rows  int64 [R]           rows of the S new tokens whose logits are wanted
    past_key_i / past_value_i float32 [1, n_kv, kv_len, head_dim]  per layer i (kv_len >= n_ctx)
outputs
    logits       float32 [R, vocab] (vocab: the first `vocab_rows` ids, where set)
    present_key_i / present_value_i  the same buffers, written in place at pos..pos+S-1
    hidden_l     float32 [S, n_embd] residual stream after layer l (optional)

Batch invariance: every op computes a row the same way whatever S is, so a verified row
equals a single-token step bit for bit. MatMulNBits (accuracy_level 4) and prepacked
MatMul are row-invariant (MatMulNBits from M = 2 on some CPUs: the runner measures it and
runs single steps as two rows there, row_invariance.py); attention is written out
(TensorScatter + MatMul + Softmax) over `attn_len` keys, padded to a multiple of
ATTN_BUCKET with masked keys, so a row's softmax and weighted sum see exactly the same
numbers in a block as alone, as long as the block does not cross a bucket boundary (the
runner guarantees that for verify).
Drafts may take attention="fused" instead: GroupQueryAttention, faster, not row-invariant
(`attn_len` is then unused). Where specd's own kernels run (native_ops), kernels="gguf"
multiplies Q4_0 / Q4_1 / Q4_K / Q6_K matrices with GgufMatMul on the GGUF's own blocks and
attention="native" rotates, writes the cache in place and attends over it in one
CachedAttention node: both compute
each row alone in a fixed order, so they are row-invariant by construction (`attn_len`
is unused there too). Wherever specd's ops are registered the gated feed-forward
activation is one SwiGlu node over the stacked gate/up product (elementwise, the same
operations whatever S).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np
from onnx import TensorProto

from .arch import HParams
from .gguf_file import GGUFFile
from .gguf_layouts import regroup
from .native_ops import DOMAIN as NATIVE
from .native_ops import GGUF_MATMUL_TYPES
from .onnx_writer import MS, GraphWriter
from .quant import (
    QK_K,
    REQUANT_KINDS,
    QuantizedMatrix,
    dense_float32,
    float_rows,
    load_matrix,
    quantize_q4_k,
    requant_block_size,
    requantize_q4,
)

BUILDER_VERSION = "13"
ATTN_BUCKET = 256
ACCURACY_LEVEL = 4
ATTENTION_KINDS = ("exact", "fused", "native")
# "ort": every quantized matrix through MatMulNBits (lossless re-layout); "gguf": Q4_0 /
# Q4_1 / Q4_K / Q6_K matrices through specd's GgufMatMul kernel on the GGUF's own blocks
# (native_ops)
KERNEL_KINDS = ("ort", "gguf")
F32 = TensorProto.FLOAT
F16 = TensorProto.FLOAT16
I64 = TensorProto.INT64

Progress = Callable[[int, int, str], None]


@dataclass(frozen=True)
class BuildOptions:
    hidden_layers: tuple[int, ...] = ()  # extra outputs: residual stream after these layers
    max_positions: int = 0  # rope table size; 0 = the model's trained context
    # MatMulNBits accuracy: 4 = int8 activations (fast, row-invariant); 1 = fp32 (tests)
    accuracy_level: int = ACCURACY_LEVEL
    # "" keeps every weight exactly as the GGUF has it (targets); "q4" re-quantizes the
    # matrices to 4 bits (drafts: fewer bytes per step, the output stays the target's)
    requant: str = ""
    # "exact": attention written out, batch-invariant (targets: a verified row must equal
    # a single step); "fused": ORT's GroupQueryAttention, fewer nodes and no KV prefix
    # copy, but a row's result depends on the block around it (~1e-7), so drafts only;
    # "native": specd's CachedAttention kernel (rotary + cache write + exact attention in
    # one node), batch-invariant, no copy (native_ops)
    attention: str = "exact"
    kernels: str = "ort"
    # KV cache element type: "f32", or "f16" (half the memory and the attention's reads;
    # native attention only, which converts exactly to float32 before any arithmetic)
    kv_dtype: str = "f32"
    # logits for the ids below this only, 0 = all (drafts: a draft then proposes only
    # those ids, and its output matrix, a quarter of a small draft's bytes, is cut)
    vocab_rows: int = 0

    def __post_init__(self) -> None:
        if self.vocab_rows < 0:
            raise ValueError(f"vocab_rows must be >= 0 (0: all), got {self.vocab_rows}")
        if self.requant not in REQUANT_KINDS:
            raise ValueError(f"unknown requant {self.requant!r} (one of "
                             f"{', '.join(repr(k) for k in REQUANT_KINDS)})")
        if self.attention not in ATTENTION_KINDS:
            raise ValueError(f"unknown attention {self.attention!r} (one of "
                             f"{', '.join(ATTENTION_KINDS)})")
        if self.kernels not in KERNEL_KINDS:
            raise ValueError(f"unknown kernels {self.kernels!r} (one of "
                             f"{', '.join(KERNEL_KINDS)})")
        if self.kv_dtype not in ("f32", "f16"):
            raise ValueError(f"unknown kv_dtype {self.kv_dtype!r} (f32 or f16)")
        if self.kv_dtype == "f16" and self.attention != "native":
            raise ValueError("kv_dtype 'f16' needs attention='native'")
        if self.requant == "q4k" and self.kernels != "gguf":
            raise ValueError("requant 'q4k' makes Q4_K blocks for GgufMatMul: it needs "
                             "kernels='gguf'")

    def key(self) -> str:
        layers = "-".join(map(str, self.hidden_layers)) or "none"
        rq = f"_r{self.requant}" if self.requant else ""
        at = {"exact": "", "fused": "_gqa", "native": "_natt"}[self.attention]
        kn = "_kgguf" if self.kernels == "gguf" else ""
        kv = "_kv16" if self.kv_dtype == "f16" else ""
        vr = f"_v{self.vocab_rows}" if self.vocab_rows else ""
        return f"h{layers}_p{self.max_positions}_a{self.accuracy_level}{rq}{at}{kn}{kv}{vr}"

    def logits_width(self, n_vocab: int) -> int:
        """Ids the graph's logits cover."""
        return min(self.vocab_rows, n_vocab) if self.vocab_rows else n_vocab

    def for_vocab(self, n_vocab: int) -> BuildOptions:
        """These options for a model of n_vocab ids: a cut that keeps every row is no cut
        (vocab_rows 0), so it builds and caches the same graph as none."""
        if self.vocab_rows and self.vocab_rows >= n_vocab:
            return replace(self, vocab_rows=0)
        return self

    @property
    def kv_bytes(self) -> int:
        """Bytes of one KV cache element."""
        return 2 if self.kv_dtype == "f16" else 4

    @property
    def uses_native(self) -> bool:
        """Whether the graph holds specd's own ops (sessions must register native_ops)."""
        return self.kernels == "gguf" or self.attention == "native"


@dataclass
class GgufRows:
    """A matrix [N, K] as the GGUF's raw rows of blocks, for GgufMatMul."""

    type_name: str
    n: int
    k: int  # the product's K; K-quant rows hold ceil(K / 256) superblocks (zero-padded),
    # Q4_0 / Q4_1 rows K / 32 blocks
    data: np.ndarray  # [N, row_bytes] uint8


Matrix = QuantizedMatrix | GgufRows | np.ndarray


def _rows(w: Matrix) -> int:
    return w.shape[0] if isinstance(w, np.ndarray) else w.n


@dataclass
class _Pending:
    """An activation no node has computed yet: the RMS norm of a block's input, or the
    SwiGlu of the stacked gate and up. A GgufMatMul taking it computes it as its prologue,
    in the pass that quantizes its input (a node fewer, ~10 us of dispatch each); any
    other consumer gets it from its own node (`_materialize`)."""

    kind: str  # "rms_norm" | "swiglu"
    x: str  # rms_norm: the block input (or its rows); swiglu: [S, 2F] gate then up
    delta: str | None = None  # rms_norm: added to x first
    weight: str = ""  # rms_norm: the norm's weight initializer [K]
    total: str | None = None  # rms_norm with delta: the name x + delta is given
    tensor: str | None = None  # the activation, once a node wrote it
    share: bool = False  # rms_norm: the product computing it writes it (others read it)


Activation = str | _Pending


@dataclass
class _Ctx:
    g: GraphWriter
    hp: HParams
    f: GGUFFile
    options: BuildOptions
    progress: Progress | None
    done: int = 0
    total: int = 0
    shared: dict[str, Matrix] = field(default_factory=dict)

    def tick(self, label: str) -> None:
        self.done += 1
        if self.progress:
            self.progress(self.done, self.total, label)


def _matrix(c: _Ctx, name: str, *, exact: bool = False) -> Matrix:
    """The GGUF matrix `name` as the graph multiplies by it: raw GGUF rows where the
    options ask for specd's kernels and they read its type, else MatMulNBits inputs
    (re-quantized if asked) or dense float32; exact=True: as MatMulNBits inputs holding
    the GGUF's values, whatever the options (the embedding lookup)."""
    requant = "" if exact else c.options.requant
    key = name if not exact else f"{name}@exact"
    if key not in c.shared:
        t = c.f.tensor(name)
        n, k = t.shape
        if (not exact and not requant and c.options.kernels == "gguf"
                and t.type_name in GGUF_MATMUL_TYPES):
            data = np.ascontiguousarray(t.data).view(np.uint8).reshape(n, -1)
            c.shared[key] = GgufRows(t.type_name, n, k, data)
        elif requant == "q4k":  # drafts: Q4_K blocks for GgufMatMul, rows zero-padded
            x = np.pad(float_rows(load_matrix(t)), ((0, 0), (0, -k % QK_K)))
            c.shared[key] = GgufRows("Q4_K", n, k, quantize_q4_k(x))
        else:
            w = load_matrix(t)
            bs = requant_block_size(requant, w.shape[1] if isinstance(w, np.ndarray) else w.k)
            c.shared[key] = requantize_q4(w, bs) if bs else w
    return c.shared[key]


def _vector(c: _Ctx, name: str) -> str:
    return c.g.weight(name, dense_float32(c.f.tensor(name)).reshape(-1))


def _write_quant(g: GraphWriter, name: str, w: QuantizedMatrix) -> None:
    """The MatMulNBits inputs of `name` (once, shared by the embedding and the output)."""
    if g.has(f"{name}.B"):
        return
    g.weight(f"{name}.B", w.packed_b())  # [N, K/bs, bs*bits/8]
    g.weight(f"{name}.scales", w.scales)  # [N, K/bs]
    zp = w.packed_zero_points()
    if zp is not None:
        g.weight(f"{name}.zp", zp)


def _fusable(a: Matrix, b: Matrix) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, np.ndarray):
        return True
    if isinstance(a, GgufRows):
        return (a.type_name, a.k) == (b.type_name, b.k)  # type: ignore[union-attr]
    assert isinstance(b, QuantizedMatrix) and isinstance(a, QuantizedMatrix)

    def zp_kind(w: QuantizedMatrix) -> object:
        return "per-block" if isinstance(w.zero_point, np.ndarray) else w.zero_point

    return (a.k, a.bits, a.block_size, zp_kind(a), a.bias is None) == (
        b.k, b.bits, b.block_size, zp_kind(b), b.bias is None)


def _concat_rows(ws: list[Matrix]) -> Matrix:
    w0 = ws[0]
    if isinstance(w0, np.ndarray):
        return np.concatenate(ws, axis=0)
    if isinstance(w0, GgufRows):
        return GgufRows(w0.type_name, sum(_rows(w) for w in ws), w0.k,
                        np.concatenate([w.data for w in ws]))  # type: ignore[union-attr]
    qs: list[QuantizedMatrix] = ws  # type: ignore[assignment]
    return QuantizedMatrix(
        n=sum(w.n for w in qs), k=w0.k, bits=w0.bits, block_size=w0.block_size,
        q=np.concatenate([w.q for w in qs]), scales=np.concatenate([w.scales for w in qs]),
        zero_point=np.concatenate([w.zero_point for w in qs])  # type: ignore[misc]
        if isinstance(w0.zero_point, np.ndarray) else w0.zero_point,
        bias=None if w0.bias is None else np.concatenate([w.bias for w in qs]))  # type: ignore[misc]


def _first_rows(w: Matrix, rows: int) -> Matrix:
    """The matrix's first `rows` rows (output channels)."""
    if isinstance(w, np.ndarray):
        return w[:rows]
    if isinstance(w, GgufRows):
        return GgufRows(w.type_name, rows, w.k, w.data[:rows])
    return QuantizedMatrix(
        n=rows, k=w.k, bits=w.bits, block_size=w.block_size, q=w.q[:rows],
        scales=w.scales[:rows],
        zero_point=w.zero_point[:rows] if isinstance(w.zero_point, np.ndarray)
        else w.zero_point,
        bias=None if w.bias is None else w.bias[:rows])


def _linears(c: _Ctx, x: Activation, names: list[str]) -> list[str]:
    """Several matrices applied to one input; runs of compatible ones share one MatMul."""
    outs: list[str] = []
    for y, group in _grouped_linears(c, x, names):
        outs.extend(_split(c, y, group))
    return outs


def _grouped_linears(c: _Ctx, x: Activation, names: list[str]) -> list[tuple[str, list[str]]]:
    """The products of `_linears` before any Split: (output, the matrices stacked in it)
    for each run of compatible matrices."""
    if not all(_fusable(_matrix(c, names[0]), _matrix(c, n)) for n in names[1:]):
        if isinstance(x, _Pending) and x.kind == "rms_norm" and x.tensor is None:
            x.share = True  # the first product's prologue also writes it for the others
        else:
            x = _materialize(c, x)  # one node computes it for all the products
    out: list[tuple[str, list[str]]] = []
    i = 0
    while i < len(names):
        j = i + 1
        while j < len(names) and _fusable(_matrix(c, names[i]), _matrix(c, names[j])):
            j += 1
        group = names[i:j]
        out.append((_linear(c, x, group[0]) if len(group) == 1
                    else _stacked_linear(c, x, group), group))
        i = j
    return out


def _split(c: _Ctx, y: str, group: list[str]) -> list[str]:
    """A stacked product's output [S, N_0 + N_1 + ...] as one tensor per matrix."""
    if len(group) == 1:
        return [y]
    sizes = [_rows(_matrix(c, n)) for n in group]
    return list(c.g.op("Split", [y, c.g.const(sizes)], len(group), axis=-1))


def _stacked_linear(c: _Ctx, x: Activation, names: list[str]) -> str:
    """x @ [W_0; W_1; ...]^T (+ their biases) -> [S, N_0 + N_1 + ...] in one product, for
    matrices `_fusable` says can share one."""
    fused = names[0].rsplit(".", 2)[0] + "." + "+".join(
        n.split(".")[-2] for n in names) + ".weight"
    c.shared[fused] = _concat_rows([_matrix(c, n) for n in names])
    biases = [n.replace(".weight", ".bias") for n in names]
    return _linear(c, x, fused, bias=[b for b in biases if c.f.has_tensor(b)])


def _gated_ffn(c: _Ctx, h: Activation, p: str) -> Activation:
    """silu(h @ gate^T) * (h @ up^T) -> [S, n_ff]: with specd's kernels one product over
    the stacked gate and up, then SwiGlu (pending: the down product's prologue, where it
    is a GgufMatMul), else Split, Sigmoid and Muls."""
    names = [p + "ffn_gate.weight", p + "ffn_up.weight"]
    if c.options.uses_native and _fusable(_matrix(c, names[0]), _matrix(c, names[1])):
        return _Pending("swiglu", _stacked_linear(c, h, names))
    gate, up = _linears(c, h, names)
    return c.g.op("Mul", [c.g.op("Mul", [gate, c.g.op("Sigmoid", [gate])]), up])


def _linear(c: _Ctx, x: Activation, name: str, bias: list[str] | None = None) -> str:
    """x [S, K] @ W^T (+ bias) -> [S, N] for the GGUF matrix `name` [N, K]."""
    g, w = c.g, _matrix(c, name)
    pending = x if isinstance(x, _Pending) and x.tensor is None else None
    if pending is None or not isinstance(w, GgufRows):
        x = _materialize(c, x)
    if bias is None:
        own = name.replace(".weight", ".bias")
        bias = [own] if name.startswith("blk.") and c.f.has_tensor(own) else []
    bias_name = ""
    if bias:
        vec = np.concatenate([dense_float32(c.f.tensor(b)).reshape(-1) for b in bias])
        bias_name = g.weight(name.replace(".weight", ".bias"), vec)  # [N]
    if isinstance(w, np.ndarray):  # dense float32 [N, K]
        wt = f"{name}.W"
        if not g.has(wt):
            g.weight(wt, np.ascontiguousarray(w.T))  # [K, N]
        y = g.op("MatMul", [x, wt])
    elif isinstance(w, GgufRows):  # specd's kernel on the GGUF's own blocks
        raw = f"{name}.gguf"
        if not g.has(raw):
            g.weight(raw, regroup(w.type_name, w.data, w.n, w.k))  # [N/16, group bytes]
        attrs = dict(ggml_type=GGUF_MATMUL_TYPES[w.type_name], K=w.k, N=w.n)
        if pending is None:
            assert isinstance(x, str)
            ins = [x, raw, bias_name] if bias_name else [x, raw]  # the kernel adds the bias
            return g.op("GgufMatMul", ins, domain=NATIVE, **attrs)
        if pending.kind == "swiglu":
            ins = [pending.x, raw, bias_name] if bias_name else [pending.x, raw]
            return g.op("GgufMatMul", ins, domain=NATIVE, prologue=2, **attrs)
        # the norm (of x + delta, whose sum the kernel also writes for the next block)
        ins = [pending.x, raw, bias_name, pending.weight]
        if pending.delta is not None:
            ins.append(pending.delta)
        y = g.fresh("gguf_matmul")
        outs = [y, pending.total or ""]
        if pending.share:
            pending.tensor = g.fresh("norm")
            outs.append(pending.tensor)
        g.op("GgufMatMul", ins, domain=NATIVE, out=outs if any(outs[1:]) else [y],
             prologue=1, epsilon=c.hp.rms_eps, **attrs)
        pending.total = None  # written: a later materialization must not write it again
        return y
    else:
        _write_quant(g, name, w)
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
    if bias_name:
        y = g.op("Add", [y, bias_name])
    return y


def _embedding(c: _Ctx, ids: str) -> str:
    """Rows of token_embd dequantized exactly as gguf.quants.dequantize does."""
    g, src = c.g, "token_embd.weight"
    w = _matrix(c, src, exact=True)
    # a re-quantized tied output must not share the lookup's initializers
    name = f"{src}.exact" if c.options.requant else src
    if isinstance(w, np.ndarray):
        table = g.weight(f"{name}.table", w)
        return g.op("Gather", [table, ids], axis=0)  # [S, E]
    _write_quant(g, name, w)
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
    scales = g.op("Unsqueeze", [g.op("Gather", [f"{name}.scales", ids], axis=0), g.const([-1])])
    rows = g.op("Mul", [q, scales])  # [S, nb, bs]
    if w.bias is not None:
        rows = g.op("Reshape", [rows, g.const([0, w.k // 32, 32])])
        bias = g.op("Unsqueeze", [g.op("Gather", [f"{name}.rowbias", ids], axis=0),
                                  g.const([-1])])
        rows = g.op("Add", [rows, bias])
    return g.op("Reshape", [rows, g.const([0, w.k])])  # [S, E]


def _rope_tables(hp: HParams, max_pos: int) -> tuple[np.ndarray, np.ndarray]:
    inv = hp.rope_base ** (-np.arange(0, hp.rope_dim, 2, dtype=np.float64) / hp.rope_dim)
    ang = np.arange(max_pos, dtype=np.float64)[:, None] * inv[None, :]  # [P, rot/2]
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def _rms_norm(c: _Ctx, x: str, weight: str) -> str:
    return c.g.op("SimplifiedLayerNormalization", [x, weight], axis=-1, epsilon=c.hp.rms_eps,
                  stash_type=1)


def _head_norm(c: _Ctx, x: str, n_heads: int, weight: str) -> str:
    """qwen3: RMSNorm over head_dim for each head of x [S, n_heads*hd]."""
    g, hd = c.g, c.hp.head_dim
    y = _rms_norm(c, g.op("Reshape", [x, g.const([0, n_heads, hd])]), _vector(c, weight))
    return g.op("Reshape", [y, g.const([0, n_heads * hd])])


def _attention(c: _Ctx, i: int, h: Activation, pos_ids: str, mask: str,
               io: dict[str, str]) -> str:
    g, hp = c.g, c.hp
    hd, nkv = hp.head_dim, hp.n_head_kv
    p = f"blk.{i}."
    names = [p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"]
    kv_type = F16 if c.options.kv_dtype == "f16" else F32
    for name in (f"past_key_{i}", f"past_value_{i}"):
        g.input(name, kv_type, [1, nkv, "n_ctx", hd])
    for name in (f"present_key_{i}", f"present_value_{i}"):
        g.output(name, kv_type, [1, nkv, "n_ctx", hd])
    if c.options.attention == "native" and not hp.qk_norm:
        # CachedAttention reads q, k and v out of the stacked products, no Split between
        return _linear(c, _cached_attention(c, i, _grouped_linears(c, h, names)),
                       p + "attn_output.weight")
    q, k, v = _linears(c, h, names)  # [S, H*hd], [S, Hkv*hd], [S, Hkv*hd]
    if hp.qk_norm:
        q = _head_norm(c, q, hp.n_head, p + "attn_q_norm.weight")
        k = _head_norm(c, k, nkv, p + "attn_k_norm.weight")
    if c.options.attention == "native":
        return _linear(c, _cached_attention(c, i, [(q, names[:1]), (k, names[1:2]),
                                                   (v, names[2:])]), p + "attn_output.weight")
    q3, k3 = (g.op("Unsqueeze", [t, g.const([0])]) for t in (q, k))  # [1, S, *]
    fused = c.options.attention == "fused"
    v3 = g.op("Unsqueeze", [v, g.const([0])]) if fused else ""
    if fused and hp.rope_dim == hd:
        out = _fused_attention(c, i, q3, k3, v3, io, rotary=True)
    else:
        rot = dict(domain=MS, interleaved=int(hp.rope_interleaved),
                   rotary_embedding_dim=hp.rope_dim)
        q3 = g.op("RotaryEmbedding", [q3, pos_ids, "rope.cos", "rope.sin"],
                  num_heads=hp.n_head, **rot)  # [1, S, H*hd]
        k3 = g.op("RotaryEmbedding", [k3, pos_ids, "rope.cos", "rope.sin"], num_heads=nkv, **rot)
        if fused:
            out = _fused_attention(c, i, q3, k3, v3, io, rotary=False)
        else:
            out = _exact_attention(c, i, q3, k3, v, mask, io)
    return _linear(c, out, p + "attn_output.weight")


def _fused_attention(c: _Ctx, i: int, q3: str, k3: str, v3: str, io: dict[str, str], *,
                     rotary: bool) -> str:
    """GroupQueryAttention on [1, S, *] projections (rotated inside if `rotary`), writing
    the cache buffers in place."""
    g, hp = c.g, c.hp
    extra = ["rope.cos", "rope.sin"] if rotary else []
    out, _, _ = g.op("GroupQueryAttention", [q3, k3, v3, f"past_key_{i}", f"past_value_{i}",
                                             io["seqlens_k"], io["total_len"], *extra], 3,
                     domain=MS, out=[g.fresh("gqa"), f"present_key_{i}", f"present_value_{i}"],
                     num_heads=hp.n_head, kv_num_heads=hp.n_head_kv,
                     scale=1.0 / math.sqrt(hp.head_dim), do_rotary=int(rotary),
                     rotary_interleaved=int(hp.rope_interleaved))  # [1, S, H*hd]
    return g.op("Reshape", [out, g.const([-1, hp.n_head * hp.head_dim])])


def _write_kv(c: _Ctx, i: int, k3: str, v: str) -> tuple[str, str]:
    """New keys/values -> [1, Hkv, S, hd], written in place into layer i's cache at
    `position`; returns the updated caches."""
    g, hp = c.g, c.hp
    hd, nkv = hp.head_dim, hp.n_head_kv
    k4 = g.op("Transpose", [g.op("Reshape", [k3, g.const([1, -1, nkv, hd])])], perm=[0, 2, 1, 3])
    v4 = g.op("Transpose", [g.op("Reshape", [v, g.const([1, -1, nkv, hd])])], perm=[0, 2, 1, 3])
    if c.options.kv_dtype == "f16":  # rounded once, when written
        k4, v4 = (g.op("Cast", [t], to=F16) for t in (k4, v4))
    ck = g.op("TensorScatter", [f"past_key_{i}", k4, "position"], axis=2,
              out=[f"present_key_{i}"])
    cv = g.op("TensorScatter", [f"past_value_{i}", v4, "position"], axis=2,
              out=[f"present_value_{i}"])
    return ck, cv


def _cached_attention(c: _Ctx, i: int, products: list[tuple[str, list[str]]]) -> str:
    """specd's CachedAttention on the unrotated projections: rotary, the write of the new
    keys and values into layer i's cache in place, and the exact attention over it in one
    node (~14 fewer per layer than RotaryEmbedding + TensorScatter + CausalAttention):
    [S, H*hd]. `products`: the q, k and v products as `_grouped_linears` gives them;
    q + k + v or q + k stacked in one are read in place (`packed`), anything else split."""
    shapes = [len(group) for _, group in products]
    if shapes == [3]:
        packed, (t,) = 2, [y for y, _ in products]
        q = k = v = t
    elif shapes == [2, 1]:
        packed, q, v = 1, products[0][0], products[1][0]
        k = q
    else:
        packed = 0
        q, k, v = [t for y, group in products for t in _split(c, y, group)]
    g, hp = c.g, c.hp
    op = "CachedAttentionF16" if c.options.kv_dtype == "f16" else "CachedAttention"
    out, _, _ = g.op(op, [q, k, v, f"past_key_{i}", f"past_value_{i}", "position", "rope.cos",
                          "rope.sin"], 3, domain=NATIVE,
                     out=[g.fresh("attn"), f"present_key_{i}", f"present_value_{i}"],
                     num_heads=hp.n_head, kv_num_heads=hp.n_head_kv,
                     scale=1.0 / math.sqrt(hp.head_dim), rotary_dim=hp.rope_dim,
                     interleaved=int(hp.rope_interleaved),
                     **({"packed": packed} if packed else {}))
    return out


def _exact_attention(c: _Ctx, i: int, q3: str, k3: str, v: str, mask: str,
                     io: dict[str, str]) -> str:
    g, hp = c.g, c.hp
    hd, nkv, grp = hp.head_dim, hp.n_head_kv, hp.group_size
    ck, cv = _write_kv(c, i, k3, v)
    zero, two = g.const([0]), g.const([2])
    keys = g.op("Reshape", [g.op("Slice", [ck, zero, "attn_len", two]), g.const([nkv, -1, hd])])
    vals = g.op("Reshape", [g.op("Slice", [cv, zero, "attn_len", two]), g.const([nkv, -1, hd])])
    # queries -> [Hkv, G*S, hd]; query head h uses kv head h // G
    q4 = g.op("Transpose", [g.op("Reshape", [q3, g.const([-1, nkv, grp, hd])])],
              perm=[1, 2, 0, 3])  # [Hkv, G, S, hd]
    qm = g.op("Reshape", [q4, g.const([nkv, -1, hd])])
    if grp == 1:  # keep M >= 2 so MLAS never takes its M == 1 GEMV path (not row-invariant)
        qm = g.op("Concat", [qm, io["qpad"]], axis=1)
    scores = g.op("MatMul", [qm, g.op("Transpose", [keys], perm=[0, 2, 1])])  # [Hkv, M, T]
    scores = g.op("Mul", [scores, g.const(1.0 / math.sqrt(hd), np.float32)])
    if grp == 1:
        scores = g.op("Slice", [scores, g.const([0]), io["s_len"], g.const([1])])
    s4 = g.op("Reshape", [scores, io["shape4"]])  # [Hkv, G, S, T]
    probs = g.op("Softmax", [g.op("Add", [s4, mask])], axis=-1)
    probs = g.op("Reshape", [probs, io["shape3"]])  # [Hkv, G*S, T]
    if grp == 1:
        probs = g.op("Concat", [probs, io["ppad"]], axis=1)
    out = g.op("MatMul", [probs, vals])  # [Hkv, M, hd]
    if grp == 1:
        out = g.op("Slice", [out, g.const([0]), io["s_len"], g.const([1])])
    out = g.op("Transpose", [g.op("Reshape", [out, g.const([nkv, grp, -1, hd])])],
               perm=[2, 0, 1, 3])  # [S, Hkv, G, hd]
    return g.op("Reshape", [out, g.const([-1, hp.n_head * hd])])


def _causal_mask(g: GraphWriter, s_len: str) -> str:
    """[S, T] additive mask: 0 where key t <= position of row s, -inf after."""
    t = g.op("Range", [g.const(0), g.op("Squeeze", ["attn_len", g.const([0])]), g.const(1)])
    rows = g.op("Range", [g.const(0), g.op("Squeeze", [s_len, g.const([0])]), g.const(1)])
    row_pos = g.op("Unsqueeze", [g.op("Add", [rows, "position"]), g.const([1])])  # [S, 1]
    allowed = g.op("LessOrEqual", [t, row_pos])  # [S, T]
    return g.op("Where", [allowed, g.const(0.0, np.float32), g.const(-np.inf, np.float32)])


def build_graph(f: GGUFFile, hp: HParams, g: GraphWriter, options: BuildOptions,
                progress: Progress | None = None) -> None:
    c = _Ctx(g, hp, f, options, progress, total=hp.n_layer + 2)
    ids = g.input("input_ids", I64, ["S"])
    g.input("position", I64, [1])
    g.input("attn_len", I64, [1])
    g.input("logits_rows", I64, ["R"])
    s_len = g.op("Shape", [ids])  # [1]
    pos_ids = g.op("Unsqueeze", [g.op("Add", [g.op("Range", [
        g.const(0), g.op("Squeeze", [s_len, g.const([0])]), g.const(1)]), "position"]),
        g.const([0])])  # [1, S]
    max_pos = options.max_positions or hp.n_ctx_train
    cos, sin = _rope_tables(hp, max_pos)
    g.weight("rope.cos", cos)
    g.weight("rope.sin", sin)
    mask, io = _attention_inputs(g, hp, options.attention, s_len)

    x = _embedding(c, ids)  # [S, E] residual stream
    c.tick("embedding")
    delta: str | None = None  # the block output not yet added to x
    for i in range(hp.n_layer):
        p = f"blk.{i}."
        x, h = _add_norm(c, x, delta, p + "attn_norm.weight")
        x, h = _add_norm(c, x, _attention(c, i, h, pos_ids, mask, io), p + "ffn_norm.weight")
        delta = _linear(c, _gated_ffn(c, h, p), p + "ffn_down.weight")
        if i in options.hidden_layers:
            g.op("Add", [x, delta], out=[f"hidden_{i}"])
            g.output(f"hidden_{i}", F32, ["S", hp.n_embd])
        c.shared.clear()
        c.tick(f"layer {i + 1}/{hp.n_layer}")

    assert delta is not None
    rows_x = g.op("Gather", [x, "logits_rows"], axis=0)  # [R, E]
    rows_d = g.op("Gather", [delta, "logits_rows"], axis=0)
    _, h = _add_norm(c, rows_x, rows_d, "output_norm.weight", keep_sum=False)
    out_name = "token_embd.weight" if hp.tied_embeddings else "output.weight"
    width = options.logits_width(hp.n_vocab)
    if width < hp.n_vocab:  # the first ids only (drafts)
        head = f"output.first{width}.weight"
        c.shared[head] = _first_rows(_matrix(c, out_name), width)
        out_name = head
    g.op("Identity", [_linear(c, h, out_name)], out=["logits"])
    g.output("logits", F32, ["R", width])
    c.tick("output")


def _attention_inputs(g: GraphWriter, hp: HParams, attention: str, s_len: str
                      ) -> tuple[str, dict[str, str]]:
    """What every layer's attention shares: (causal mask, named tensors), built only for
    the kind of attention the graph uses."""
    io: dict[str, str] = {"s_len": s_len}
    if attention == "native":  # CachedAttention takes `position` and masks by itself
        return "", io
    if attention == "fused":  # GroupQueryAttention's int32 lengths; it masks by itself
        end = g.op("Cast", [g.op("Add", ["position", s_len])], to=TensorProto.INT32)
        io["seqlens_k"] = g.op("Sub", [end, g.const([1], np.int32)])  # [1]
        io["total_len"] = g.op("Squeeze", [end, g.const([0])])  # scalar
        return "", io
    nkv, grp = hp.n_head_kv, hp.group_size
    io["shape4"] = g.op("Concat", [g.const([nkv, grp, -1]), "attn_len"], axis=0)
    io["shape3"] = g.op("Concat", [g.const([nkv, -1]), "attn_len"], axis=0)
    if grp == 1:
        io["qpad"] = g.const(np.zeros((nkv, 1, hp.head_dim), np.float32), np.float32)
        t_len = g.op("Concat", [g.const([nkv, 1]), "attn_len"], axis=0)
        io["ppad"] = g.op("ConstantOfShape", [t_len], value=_f32_tensor(0.0))
    return _causal_mask(g, s_len), io


def _add_norm(c: _Ctx, x: str, delta: str | None, weight: str, *, keep_sum: bool = True
              ) -> tuple[str, Activation]:
    """(x + delta, RMSNorm(x + delta)): with specd's kernels left pending, for the
    product that reads it to compute (`_Pending`), else one SkipSimplifiedLayerNormalization.
    keep_sum=False: x + delta is not needed (the first of the pair is then meaningless)."""
    w = _vector(c, weight)
    if c.options.kernels == "gguf":
        total = None if delta is None or not keep_sum else c.g.fresh("residual")
        pending = _Pending("rms_norm", x, delta, w, total)
        return (x if total is None else total), pending
    if delta is None:
        return x, _rms_norm(c, x, w)
    h, _, _, total = c.g.op("SkipSimplifiedLayerNormalization", [delta, x, w], 4, domain=MS,
                            epsilon=c.hp.rms_eps)
    return total, h


def _materialize(c: _Ctx, x: Activation) -> str:
    """The activation as a tensor: a pending one gets its own node (once)."""
    if isinstance(x, str):
        return x
    if x.tensor is None:
        if x.kind == "swiglu":
            x.tensor = c.g.op("SwiGlu", [x.x], domain=NATIVE)
        elif x.delta is None:
            x.tensor = _rms_norm(c, x.x, x.weight)
        else:
            outs = [c.g.fresh("norm"), "", "", x.total or c.g.fresh("residual")]
            c.g.op("SkipSimplifiedLayerNormalization", [x.delta, x.x, x.weight], domain=MS,
                   out=outs, epsilon=c.hp.rms_eps)
            x.tensor, x.total = outs[0], None
    return x.tensor


def _f32_tensor(value: float):  # noqa: ANN202 - onnx TensorProto
    from onnx import helper

    return helper.make_tensor("value", F32, [1], [value])
