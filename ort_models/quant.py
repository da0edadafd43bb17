"""Lossless mapping of GGUF tensor types onto ONNX Runtime weight layouts.

Every quantized GGUF matrix [N, K] (a row is an output channel) is rewritten as the
inputs of `com.microsoft.MatMulNBits` without re-quantizing:

    W[n, k] = (q[n, k] - zp[n, b]) * scale[n, b] + bias[n, k // 32]

with b = k // block_size. `q` is an unsigned integer code (4 or 8 bits), `scale` float32,
`zp` an unsigned integer zero point (explicit, or MatMulNBits' default 2^(bits-1)), and
`bias` an optional per-32-column additive term (the "min" of Q4_1 / Q4_K / Q5_K) that
the graph adds as `blocksum(A) @ bias^T`. The products scale*q and the bias are exact in
float32 for these types, so the dequantized rows the embedding gathers equal
`gguf.quants.dequantize` bit for bit.

F32 / F16 / BF16 matrices stay dense float32 (lossless widening).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .gguf_file import GGUFError, TensorInfo

QK_K = 256


class UnsupportedTensorType(GGUFError):
    pass


@dataclass
class QuantizedMatrix:
    """MatMulNBits inputs for one [N, K] matrix."""

    n: int
    k: int
    bits: int  # 4 or 8
    block_size: int  # 16 or 32
    q: np.ndarray  # [N, K] uint8 codes (unpacked)
    scales: np.ndarray  # [N, K/bs] float32
    # None: MatMulNBits' default 2^(bits-1); an int: that code for every block;
    # an array: one code per block [N, K/bs] (re-quantized drafts)
    zero_point: int | np.ndarray | None
    bias: np.ndarray | None  # [N, K/32] float32 added per 32-column block, or None

    def packed_b(self) -> np.ndarray:
        """[N, K/bs, bs*bits/8] uint8 in MatMulNBits order (element 2i low nibble)."""
        n_blocks = self.k // self.block_size
        if self.bits == 8:
            return np.ascontiguousarray(self.q.reshape(self.n, n_blocks, self.block_size))
        pairs = self.q.reshape(self.n, n_blocks, self.block_size // 2, 2)
        return np.ascontiguousarray(pairs[..., 0] | (pairs[..., 1] << 4)).astype(np.uint8)

    def packed_zero_points(self) -> np.ndarray | None:
        """[N, ceil(K/bs * bits / 8)] uint8, or None for the default zero point."""
        if self.zero_point is None:
            return None
        n_blocks = self.k // self.block_size
        zp = np.broadcast_to(np.asarray(self.zero_point, np.uint8), (self.n, n_blocks))
        if self.bits == 8:
            return np.ascontiguousarray(zp)
        if n_blocks % 2:
            zp = np.concatenate([zp, np.zeros((self.n, 1), np.uint8)], axis=1)
        z = zp & 0x0F
        return np.ascontiguousarray(z[:, 0::2] | (z[:, 1::2] << 4))

    def dequantize(self) -> np.ndarray:
        """[N, K] float32 with the same arithmetic the graph's embedding gather uses."""
        zp = (1 << (self.bits - 1)) if self.zero_point is None else self.zero_point
        zp = np.asarray(zp, np.float32)
        zp = zp[:, :, None] if zp.ndim else zp  # [N, K/bs, 1] or a scalar
        q = self.q.reshape(self.n, self.k // self.block_size, self.block_size).astype(np.float32)
        w = ((q - zp) * self.scales[:, :, None]).reshape(self.n, self.k)
        if self.bias is not None:
            w = (w.reshape(self.n, -1, 32) + self.bias[:, :, None]).reshape(self.n, self.k)
        return w


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _blocks(t: TensorInfo, block_bytes: int) -> np.ndarray:
    return np.ascontiguousarray(t.data).view(np.uint8).reshape(-1, block_bytes)


def _nibbles_split(qs: np.ndarray) -> np.ndarray:
    """GGUF 32-wide nibble layout: byte j holds element j (low) and j+16 (high)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _q4_0(t: TensorInfo, n: int, k: int) -> QuantizedMatrix:
    b = _blocks(t, 18)
    d = _f16(b[:, :2])  # [nb, 1]
    q = _nibbles_split(b[:, 2:])  # [nb, 32]
    return QuantizedMatrix(n, k, 4, 32, q.reshape(n, k), d.reshape(n, k // 32), None, None)


def _q4_1(t: TensorInfo, n: int, k: int) -> QuantizedMatrix:
    b = _blocks(t, 20)
    d, m = _f16(b[:, :2]), _f16(b[:, 2:4])
    q = _nibbles_split(b[:, 4:])
    return QuantizedMatrix(
        n, k, 4, 32, q.reshape(n, k), d.reshape(n, k // 32), 0, m.reshape(n, k // 32)
    )


def _q5_0(t: TensorInfo, n: int, k: int) -> QuantizedMatrix:
    b = _blocks(t, 22)
    d = _f16(b[:, :2])
    qh = np.ascontiguousarray(b[:, 2:6]).view(np.uint32)  # [nb, 1]
    hi = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)  # [nb, 32]
    q = _nibbles_split(b[:, 6:]) | (hi << 4)  # 0..31, value d*(q-16)
    return QuantizedMatrix(n, k, 8, 32, (q + 112).reshape(n, k), d.reshape(n, k // 32), None, None)


def _q8_0(t: TensorInfo, n: int, k: int) -> QuantizedMatrix:
    b = _blocks(t, 34)
    d = _f16(b[:, :2])
    q = b[:, 2:] ^ np.uint8(0x80)  # int8 -> q + 128
    return QuantizedMatrix(n, k, 8, 32, q.reshape(n, k), d.reshape(n, k // 32), None, None)


def k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K 12-byte packed 6-bit scales and mins -> ([nb, 8], [nb, 8]) uint8."""
    s = scales.reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def _k_scales(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])  # [nb, 1]
    sc, mn = k_scale_min(b[:, 4:16])
    scale = d * sc.astype(np.float32)  # [nb, 8]
    bias = -(dmin * mn.astype(np.float32))  # [nb, 8]
    return scale, bias


def _q4_k(t: TensorInfo, n: int, k: int) -> QuantizedMatrix:
    b = _blocks(t, 144)
    scale, bias = _k_scales(b)
    qs = b[:, 16:].reshape(-1, 4, 32)  # 4 chunks of 32 bytes -> 64 values each
    q = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(-1, QK_K)  # [nb, 256]
    return QuantizedMatrix(
        n, k, 4, 32, q.reshape(n, k), scale.reshape(n, k // 32), 0, bias.reshape(n, k // 32)
    )


def _q5_k(t: TensorInfo, n: int, k: int) -> QuantizedMatrix:
    b = _blocks(t, 176)
    scale, bias = _k_scales(b)
    qh = b[:, 16:48]  # [nb, 32]
    qs = b[:, 48:].reshape(-1, 4, 32)
    ql = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(-1, 8, 32)
    hi = (qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1  # [nb, 8, 32]
    q = (ql | (hi << 4)).reshape(-1, QK_K) + np.uint8(128)  # stored q+128, default zp
    return QuantizedMatrix(
        n, k, 8, 32, q.reshape(n, k), scale.reshape(n, k // 32), None, bias.reshape(n, k // 32)
    )


def _q6_k(t: TensorInfo, n: int, k: int) -> QuantizedMatrix:
    b = _blocks(t, 210)
    ql = b[:, :128].reshape(-1, 2, 1, 64)
    qh = b[:, 128:192].reshape(-1, 2, 1, 32)
    sc = np.ascontiguousarray(b[:, 192:208]).view(np.int8).astype(np.float32)  # [nb, 16]
    d = _f16(b[:, 208:210])
    lo = ((ql >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 0x0F).reshape(-1, 2, 4, 32)
    hi = ((qh >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 0x03).reshape(-1, 2, 4, 32)
    q = (lo | (hi << 4)).reshape(-1, QK_K) + np.uint8(96)  # (q6 - 32) + 128
    scale = d * sc  # [nb, 16]
    return QuantizedMatrix(n, k, 8, 16, q.reshape(n, k), scale.reshape(n, k // 16), None, None)


_QUANT = {
    "Q4_0": (_q4_0, 32),
    "Q4_1": (_q4_1, 32),
    "Q5_0": (_q5_0, 32),
    "Q8_0": (_q8_0, 32),
    "Q4_K": (_q4_k, QK_K),
    "Q5_K": (_q5_k, QK_K),
    "Q6_K": (_q6_k, QK_K),
}
DENSE_TYPES = ("F32", "F16", "BF16")
# 3-D expert tensors: the types specd's GgufExperts kernel reads, with the ggml type id it
# reads each as (F16 / BF16 experts are widened to float32 rows, exactly)
EXPERT_TYPE_IDS = {"F32": 0, "F16": 0, "BF16": 0, "Q4_0": 2, "Q4_1": 3, "Q8_0": 8,
                   "Q4_K": 12, "Q6_K": 14, "MXFP4": 39}
SUPPORTED_TYPES = tuple(_QUANT) + DENSE_TYPES


def dense_float32(t: TensorInfo) -> np.ndarray:
    """A dense tensor as float32 with its GGUF shape (lossless)."""
    raw = np.ascontiguousarray(t.data)
    if t.type_name == "F32":
        return raw.view(np.float32).reshape(t.shape)
    if t.type_name == "F16":
        return raw.view(np.float16).astype(np.float32).reshape(t.shape)
    if t.type_name == "BF16":
        bits = raw.view(np.uint16).astype(np.uint32) << 16
        return bits.view(np.float32).reshape(t.shape)
    raise UnsupportedTensorType(
        f"tensor {t.name!r} has type {t.type_name}, expected a float type (F32, F16, BF16)"
    )


def load_matrix(t: TensorInfo) -> QuantizedMatrix | np.ndarray:
    """A 2-D weight as MatMulNBits inputs (quantized types) or dense float32 [N, K]."""
    if len(t.shape) != 2:
        raise GGUFError(f"tensor {t.name!r} should be a matrix, has shape {t.shape}")
    n, k = t.shape
    if t.type_name in DENSE_TYPES:
        return dense_float32(t)
    if t.type_name not in _QUANT:
        raise UnsupportedTensorType(
            f"tensor {t.name!r} has GGUF type {t.type_name}, which specd does not support "
            f"(supported: {', '.join(SUPPORTED_TYPES)})"
        )
    fn, row_block = _QUANT[t.type_name]
    if k % row_block:
        raise GGUFError(f"tensor {t.name!r}: row size {k} is not a multiple of {row_block}")
    return fn(t, n, k)


def float_rows(w: QuantizedMatrix | np.ndarray) -> np.ndarray:
    """[N, K] float32 values of a matrix, as loaded (dequantized where quantized)."""
    return w.dequantize() if isinstance(w, QuantizedMatrix) else np.asarray(w, np.float32)


def requantize_q4(w: QuantizedMatrix | np.ndarray, block_size: int = 32) -> QuantizedMatrix:
    """Re-quantize a matrix to 4-bit codes with a float32 scale and a 4-bit zero point per
    block: min/max rounding, as GGUF's Q4_1 does. Lossy, so only for drafts, whose
    weights decide acceptance, never the output: ~5.1 bits/weight instead of the 8-9
    that Q5_0 / Q8_0 / Q6_K take in the lossless layout.
    """
    x = float_rows(w)
    n, k = x.shape
    if k % block_size:
        raise GGUFError(f"cannot re-quantize a matrix with rows of {k} in blocks of {block_size}")
    scales = np.empty((n, k // block_size), np.float32)
    zps = np.empty((n, k // block_size), np.uint8)
    q = np.empty((n, k), np.uint8)
    step = max(1, (1 << 22) // k)  # rows per chunk: bounded temporaries
    for r in range(0, n, step):
        xb = x[r:r + step].reshape(-1, k // block_size, block_size)  # [rows, nb, bs]
        lo = np.minimum(xb.min(axis=-1), 0.0)  # the grid holds 0 exactly
        hi = np.maximum(xb.max(axis=-1), 0.0)
        scale = (hi - lo) / 15.0
        scale[scale == 0] = 1.0
        zp = np.clip(np.rint(-lo / scale), 0, 15)
        codes = np.clip(np.rint(xb / scale[..., None]) + zp[..., None], 0, 15)
        scales[r:r + step] = scale
        zps[r:r + step] = zp.astype(np.uint8)
        q[r:r + step] = codes.astype(np.uint8).reshape(-1, k)
    return QuantizedMatrix(n, k, 4, block_size, q, scales, zps, None)


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """Float rows [N, K] (K a multiple of 256) -> GGUF Q4_K blocks [N, K/256*144] uint8.

    Lossy, for drafts only (like requantize_q4): per 32 values a min/max grid of 16
    levels, w = d*sc*q - dmin*m with 6-bit sc, m and f16 d, dmin per 256, as ggml's
    simplest Q4_K quantizer does (no iterative refinement).
    """
    x = np.asarray(x, np.float32)
    n, k = x.shape
    if k % QK_K:
        raise GGUFError(f"cannot quantize rows of {k} values to Q4_K (blocks of {QK_K})")
    out = np.empty((n, k // QK_K, 144), np.uint8)
    step = max(1, (1 << 21) // k)  # rows per chunk: bounded temporaries
    for r in range(0, n, step):
        xb = x[r:r + step].reshape(-1, QK_K // 32, 32).astype(np.float64)  # [nb, 8, 32]
        lo = np.minimum(xb.min(axis=-1), 0.0)
        hi = np.maximum(xb.max(axis=-1), 0.0)
        scale, offset = (hi - lo) / 15.0, -lo  # per sub-block, >= 0
        d = (scale.max(axis=-1) / 63.0).astype(np.float16)  # [nb]
        dmin = (offset.max(axis=-1) / 63.0).astype(np.float16)
        df, dminf = d.astype(np.float64)[:, None], dmin.astype(np.float64)[:, None]
        with np.errstate(divide="ignore", invalid="ignore"):
            sc = np.where(df > 0, np.clip(np.rint(scale / df), 0, 63), 0)
            m = np.where(dminf > 0, np.clip(np.rint(offset / dminf), 0, 63), 0)
            step_w = (df * sc)[..., None]  # the grid as stored
            q = np.where(step_w > 0, np.rint((xb + (dminf * m)[..., None]) / step_w), 0)
        q = np.clip(q, 0, 15).astype(np.uint8).reshape(-1, 4, 2, 32)  # [nb, chunk, half, l]
        sc, m = sc.astype(np.uint8), m.astype(np.uint8)
        blk = out[r:r + step].reshape(-1, 144)
        blk[:, 0:2] = d.view(np.uint8).reshape(-1, 2)
        blk[:, 2:4] = dmin.view(np.uint8).reshape(-1, 2)
        blk[:, 4:8] = (sc[:, 0:4] & 0x3F) | ((sc[:, 4:8] >> 4) << 6)
        blk[:, 8:12] = (m[:, 0:4] & 0x3F) | ((m[:, 4:8] >> 4) << 6)
        blk[:, 12:16] = (sc[:, 4:8] & 0x0F) | ((m[:, 4:8] & 0x0F) << 4)
        blk[:, 16:] = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)
    return out.reshape(n, -1)


# requant kind -> block size: "" = lossless (targets, 0 = keep the GGUF's blocks);
# "q4" = requantize_q4 in blocks of 32 (drafts); "q4g128" in blocks of 128 along K (fewer
# scale and zero-point bytes and a faster MLAS kernel, a coarser grid); "q4k" = GGUF Q4_K
# blocks (quantize_q4_k) for specd's GgufMatMul kernel, rows padded to a multiple of 256
REQUANT_KINDS = {"": 0, "q4": 32, "q4g128": 128, "q4k": QK_K}


def requant_block_size(kind: str, k: int) -> int:
    """The block size a `kind` re-quantization uses for rows of `k` values (0: none):
    its own where it divides `k`, else 32, which every GGUF row length is a multiple of."""
    bs = REQUANT_KINDS[kind]
    return bs if not bs or k % bs == 0 else 32


def check_supported(t: TensorInfo, where: object = "") -> None:
    """UnsupportedTensorType unless specd reads `t`'s type (a 3-D tensor holds experts,
    which specd's GgufExperts kernel reads: EXPERT_TYPE_IDS); `where` (the file) leads the
    message."""
    experts = len(t.shape) == 3
    supported = tuple(EXPERT_TYPE_IDS) if experts else SUPPORTED_TYPES
    if t.type_name not in supported:
        raise UnsupportedTensorType(
            (f"{where}: " if where else "")
            + f"tensor {t.name!r} has GGUF type {t.type_name}, which specd does not support"
            + (" for experts" if experts else "") + f" (supported: {', '.join(supported)})"
        )
