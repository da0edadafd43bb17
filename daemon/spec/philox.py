"""The counter-based uniforms a graph's sampler draws (ort_models/kernels/sample_tokens.c),
in numpy: Philox4x32-10 (Salmon et al. 2011, Random123) of the counter (position low,
position high, stream, draw) under the key (low, high), the top 53 bits of its first two
words times 2^-53.

A draft that proposes with the target's noise (coupled sampling, spec/coupling.py) draws
these on the host where its graph does not choose.
"""

from __future__ import annotations

import numpy as np

_M32 = np.uint64(0xFFFFFFFF)


def philox4x32(counter: np.ndarray, key: np.ndarray) -> np.ndarray:
    """Philox4x32-10 of counters [..., 4] under keys [..., 2] (uint32 values) -> [..., 4]."""
    c = [np.asarray(counter, dtype=np.uint64)[..., i] for i in range(4)]
    k0 = np.asarray(key, dtype=np.uint64)[..., 0]
    k1 = np.asarray(key, dtype=np.uint64)[..., 1]
    for r in range(10):
        if r:
            k0, k1 = (k0 + np.uint64(0x9E3779B9)) & _M32, (k1 + np.uint64(0xBB67AE85)) & _M32
        p0, p1 = np.uint64(0xD2511F53) * c[0], np.uint64(0xCD9E8D57) * c[2]
        c = [(p1 >> np.uint64(32)) ^ c[1] ^ k0, p1 & _M32,
             (p0 >> np.uint64(32)) ^ c[3] ^ k1, p0 & _M32]
    return np.stack(c, axis=-1)


def philox_uniform(key: int | np.ndarray, position: int | np.ndarray, stream: int | np.ndarray,
                   draw: int | np.ndarray) -> np.ndarray:
    """The graph's uniform (float64 in [0, 1)) for each (key, position, stream, draw)."""
    key, position, stream, draw = np.broadcast_arrays(
        *(_as_u64(a) for a in (key, position, stream, draw)))
    counter = np.stack([position & _M32, position >> np.uint64(32), stream, draw], axis=-1)
    out = philox4x32(counter, np.stack([key & _M32, key >> np.uint64(32)], axis=-1))
    bits = (out[..., 0] << np.uint64(32)) | out[..., 1]
    return (bits >> np.uint64(11)).astype(np.float64) * 2.0 ** -53


def _as_u64(a: int | np.ndarray) -> np.ndarray:
    """Integers as uint64 bits: Python ints modulo 2^64 (a key may pass 2^63), arrays'
    int64 bits as they are."""
    if isinstance(a, int):
        return np.asarray(a & 0xFFFFFFFFFFFFFFFF, dtype=np.uint64)
    return np.asarray(a, dtype=np.int64).view(np.uint64)
