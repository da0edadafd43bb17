"""GGUF rows regrouped for specd's GgufMatMul kernel (kernels/gguf_matmul.c).

The kernel reads 16 output rows at a time, one per 32-bit lane of a 512-bit vector, so
the blocks of 16 consecutive rows are interleaved per superblock of 256 columns and a
row group is read as one sequential stream. Nothing is re-quantized: every code, scale
and f16 factor is the GGUF's own; only the 6-bit scales of Q4_K are unpacked to bytes
(2368 bytes per 16 rows instead of 16 x 144, +2.8%). Q6_K keeps its size (3360 =
16 x 210). Rows are padded to a multiple of 16 with zero blocks. Where the product's K
ends inside a superblock (re-quantized drafts: the 0.5B's K = 896 is 3.5 superblocks), a
Q4_K group's last superblock keeps only the codes of the sub-blocks of 32 that K reaches:
the kernel skips the rest, which only ever met zeros.

Q4_K group: d[16] f16 | dmin[16] f16 | sc[8 sub][16 rows] | m[8 sub][16 rows] |
            codes[8 sub][4 p][16 rows][4 e]: low nibble code 32j+8p+e, high 32j+8p+4+e
Q6_K group: d[16] f16 | sc[16 sub][16 rows] i8 | per sub-block j (192 bytes):
            low nibbles[2 p][16 rows][4 e]: low 16j+8p+e, high 16j+8p+4+e |
            high bits[16 rows][4 e]: bits 2t..2t+1 = code 16j+4t+e >> 4
Q4_0 / Q4_1 (blocks of 32, no superblocks), per block of 16 rows: d[16] f16 |
            (Q4_1: m[16] f16 |) codes[4 p][16 rows][4 e] as a Q4_K sub-block's
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import numpy as np

from .quant import EXPERT_TYPE_IDS, QK_K, k_scale_min

GROUP = 16  # rows per group (kernels/gguf_matmul.c's GROUP)
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q4_K": 144, "Q6_K": 210}
# bytes per 16 rows of a superblock of 256 (K-quants) or of a block of 32 (Q4_0 / Q4_1)
GROUP_BYTES = {"Q4_0": GROUP * (2 + 16), "Q4_1": GROUP * (2 + 2 + 16),
               "Q4_K": GROUP * (2 + 2 + 8 + 8 + 128), "Q6_K": GROUP * BLOCK_BYTES["Q6_K"]}
SUB_CODE_BYTES = GROUP * 16  # Q4_K: the codes of one sub-block of 32, 16 rows


def _padded_blocks(raw: np.ndarray, type_name: str, n: int, k: int) -> np.ndarray:
    """[N, row_bytes] GGUF rows -> [N16, nb, block_bytes], zero rows appended."""
    nb = -(-k // QK_K)
    b = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, nb, BLOCK_BYTES[type_name])
    pad = -n % GROUP
    if pad:
        b = np.concatenate([b, np.zeros((pad, nb, b.shape[2]), np.uint8)])
    return b


def _by_group(a: np.ndarray) -> np.ndarray:
    """[N16, nb, ...] -> [G, nb, ..., 16]: the row inside its group becomes the last axis."""
    g = a.reshape(-1, GROUP, *a.shape[1:])  # [G, 16, nb, ...]
    return np.moveaxis(g, 1, -1)


def q4_k_x16(raw: np.ndarray, n: int, k: int) -> np.ndarray:
    b = _padded_blocks(raw, "Q4_K", n, k)  # [N16, nb, 144]
    n16, nb = b.shape[:2]
    sc, mn = k_scale_min(b[..., 4:16].reshape(-1, 12))  # [N16*nb, 8] each
    qs = b[..., 16:].reshape(n16, nb, 4, 32)
    q = np.stack([qs & 0x0F, qs >> 4], axis=3).reshape(n16, nb, 8, 4, 2, 4)  # j, p, half, e
    codes = q[..., 0, :] | (q[..., 1, :] << 4)  # [N16, nb, 8 j, 4 p, 4 e]
    parts = [
        _by_group(b[..., 0:2]).transpose(0, 1, 3, 2),  # d: [G, nb, 16 rows, 2 bytes]
        _by_group(b[..., 2:4]).transpose(0, 1, 3, 2),  # dmin
        _by_group(sc.reshape(n16, nb, 8)),  # [G, nb, 8 sub, 16 rows]
        _by_group(mn.reshape(n16, nb, 8)),
        _by_group(codes).transpose(0, 1, 2, 3, 5, 4),  # [G, nb, j, p, rows, e]
    ]
    g = n16 // GROUP
    out = np.concatenate([p.reshape(g, nb, -1) for p in parts], axis=2)
    assert out.shape[2] == GROUP_BYTES["Q4_K"]
    trim = (nb * QK_K - k) // 32  # sub-blocks of the last superblock past K
    if trim:
        keep = GROUP_BYTES["Q4_K"] - trim * SUB_CODE_BYTES
        return np.ascontiguousarray(np.concatenate(
            [out[:, :-1].reshape(g, -1), out[:, -1, :keep]], axis=1))
    return np.ascontiguousarray(out.reshape(g, -1))


def q6_k_x16(raw: np.ndarray, n: int, k: int) -> np.ndarray:
    b = _padded_blocks(raw, "Q6_K", n, k)  # [N16, nb, 210]
    n16, nb = b.shape[:2]
    ql = b[..., :128].reshape(n16, nb, 2, 1, 64)
    qh = b[..., 128:192].reshape(n16, nb, 2, 1, 32)
    lo = (ql >> np.array([0, 4], np.uint8).reshape(2, 1)) & 0x0F  # [.., half, 2, 64]
    hi = (qh >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)) & 0x03  # [.., half, 4, 32]
    q = (lo.reshape(n16, nb, 2, 4, 32) | (hi << 4)).reshape(n16, nb, 16, 4, 4)  # j, t, e
    low = q[..., 0:4:2, :] & 0x0F | ((q[..., 1:4:2, :] & 0x0F) << 4)  # [.., j, 2 p, 4 e]
    h = q >> 4  # the 2 high bits of each code, [.., j, 4 t, 4 e]
    high = h[..., 0, :] | (h[..., 1, :] << 2) | (h[..., 2, :] << 4) | (h[..., 3, :] << 6)
    g = n16 // GROUP
    codes = np.concatenate([  # one sequential stream: per sub-block j, its 192 bytes
        _by_group(low).transpose(0, 1, 2, 3, 5, 4).reshape(g, nb, 16, 8 * GROUP),  # [j, p, rows, e]
        _by_group(high).transpose(0, 1, 2, 4, 3).reshape(g, nb, 16, 4 * GROUP),  # [j, rows, e]
    ], axis=3)
    parts = [
        _by_group(b[..., 208:210]).transpose(0, 1, 3, 2),  # d: [G, nb, rows, 2 bytes]
        _by_group(b[..., 192:208]),  # sc: [G, nb, 16 sub, 16 rows]
        codes,
    ]
    out = np.concatenate([p.reshape(g, nb, -1) for p in parts], axis=2)
    assert out.shape[2] == GROUP_BYTES["Q6_K"]
    return np.ascontiguousarray(out.reshape(g, -1))


def q4_legacy_x16(raw: np.ndarray, n: int, k: int, type_name: str) -> np.ndarray:
    """Q4_0 / Q4_1 rows [N, K/32 blocks] -> [ceil(N/16), K/32 * group bytes]."""
    bb, nblk = BLOCK_BYTES[type_name], k // 32
    b = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, nblk, bb)
    b = np.concatenate([b, np.zeros((-n % GROUP, nblk, bb), np.uint8)])  # [N16, nblk, bb]
    n16, g = b.shape[0], b.shape[0] // GROUP
    qs = b[..., bb - 16:]  # [N16, nblk, 16]: code l < 16 in the low nibble of byte l
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=2).reshape(n16, nblk, 4, 2, 4)  # p, half, e
    codes = q[..., 0, :] | (q[..., 1, :] << 4)  # [N16, nblk, 4 p, 4 e]
    parts = [_by_group(b[..., f:f + 2]).transpose(0, 1, 3, 2)  # d (Q4_1: m): [G, nblk, rows, 2]
             for f in range(0, bb - 16, 2)]
    parts.append(_by_group(codes).transpose(0, 1, 2, 4, 3))  # [G, nblk, p, rows, e]
    out = np.concatenate([p.reshape(g, nblk, -1) for p in parts], axis=2)
    assert out.shape[2] == GROUP_BYTES[type_name]
    return np.ascontiguousarray(out.reshape(g, -1))


REGROUP: dict[str, Callable[[np.ndarray, int, int], np.ndarray]] = {
    "Q4_K": q4_k_x16, "Q6_K": q6_k_x16,
    "Q4_0": partial(q4_legacy_x16, type_name="Q4_0"),
    "Q4_1": partial(q4_legacy_x16, type_name="Q4_1")}


def regroup(type_name: str, raw: np.ndarray, n: int, k: int) -> np.ndarray:
    """GGUF rows [N, row_bytes] of `type_name` -> GgufMatMul's W [ceil(N/16), group bytes].
    K-quant rows hold ceil(k / 256) superblocks (zero-padded past the product's K = k),
    Q4_0 / Q4_1 rows their k / 32 blocks."""
    return REGROUP[type_name](raw, n, k)



def expert_rows(type_name: str, rows: np.ndarray, k: int) -> np.ndarray:
    """A 3-D expert tensor as GgufExperts' W [n_expert, ceil(N/16), group bytes]: `rows`
    [n_expert, N, row_bytes] uint8 (the GGUF's rows) or, for float types, float32
    [n_expert, N, K]. Q4_0 / Q4_1 / Q4_K / Q6_K experts are each regrouped as GgufMatMul
    reads them; Q8_0, MXFP4 and float32 rows stay as they are, 16 rows a group (the last
    group padded with zero rows)."""
    n_expert, n = rows.shape[:2]
    if type_name in REGROUP:
        return np.stack([regroup(type_name, rows[e], n, k) for e in range(n_expert)])
    if type_name not in EXPERT_TYPE_IDS:
        raise ValueError(f"experts of type {type_name} are not read (supported: "
                         f"{', '.join(EXPERT_TYPE_IDS)})")
    flat = np.ascontiguousarray(rows).view(np.uint8).reshape(n_expert, n, -1)
    flat = np.pad(flat, ((0, 0), (0, -n % GROUP), (0, 0)))  # [n_expert, N16, row bytes]
    return np.ascontiguousarray(flat.reshape(n_expert, -1, GROUP * flat.shape[2]))
