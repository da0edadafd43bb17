"""ort_models.quant: the lossy 4-bit re-quantization used for drafts."""

from __future__ import annotations

import numpy as np
import pytest

from specd.ort_models.gguf_file import GGUFError
from specd.ort_models.quant import quantize_q4_k, requant_block_size, requantize_q4


@pytest.mark.parametrize("k, bs", [(64, 32), (96, 32), (384, 128)])  # odd blocks per row
def test_requantize_q4_rounds_each_value_to_its_block_grid(k: int, bs: int) -> None:
    rng = np.random.default_rng(0)
    w = rng.normal(0, 0.05, (7, k)).astype(np.float32)
    w[0, :bs] = 0.0  # a constant block
    w[1, :bs] = np.abs(w[1, :bs])  # a block without negative values
    q = requantize_q4(w, bs)
    assert (q.bits, q.block_size, q.bias) == (4, bs, None)
    assert q.q.max() <= 15 and q.zero_point.max() <= 15
    blocks = w.reshape(7, -1, bs)
    lo = np.minimum(blocks.min(-1), 0)
    hi = np.maximum(blocks.max(-1), 0)
    step = (hi - lo) / 15  # [7, nb]
    err = np.abs(q.dequantize() - w).reshape(7, -1, bs).max(-1)
    assert (err <= step / 2 + 1e-7).all()  # nearest grid point, grid covering the block
    np.testing.assert_array_equal(q.dequantize()[0, :bs], 0.0)  # zero is on the grid
    # packed zero points: two per byte, low nibble first, as MatMulNBits reads them
    packed = q.packed_zero_points()
    assert packed.shape == (7, (k // bs + 1) // 2)
    np.testing.assert_array_equal(packed[:, 0] & 0x0F, q.zero_point[:, 0])
    np.testing.assert_array_equal(packed[:, 0] >> 4, q.zero_point[:, 1])


def test_requantize_q4_refuses_a_ragged_row() -> None:
    with pytest.raises(GGUFError, match="rows of 40"):
        requantize_q4(np.zeros((2, 40), np.float32))


def test_requant_block_size_falls_back_to_32_where_its_own_does_not_divide() -> None:
    assert requant_block_size("", 1536) == 0
    assert requant_block_size("q4", 1536) == 32
    assert requant_block_size("q4g128", 1536) == 128
    assert requant_block_size("q4g128", 4864) == 128
    assert requant_block_size("q4g128", 96) == 32


def test_quantize_q4_k_is_close_and_reads_back_with_gguf_py() -> None:
    """Q4_K blocks made for drafts decode (with gguf-py's own dequantizer) to within the
    grids' steps: 6-bit sub-block scales and mins on top of the 16 levels."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    rng = np.random.default_rng(4)
    w = rng.normal(0, 0.05, (6, 512)).astype(np.float32)
    w[0, :32] = 0.0  # an all-zero sub-block
    w[1] = 0.0  # an all-zero row (d = dmin = 0)
    raw = quantize_q4_k(w)
    assert raw.shape == (6, 2 * 144)
    back = dequantize(raw, GGMLQuantizationType.Q4_K).reshape(6, 512)
    np.testing.assert_array_equal(back[1], 0.0)
    err = np.abs(back - w).reshape(6, -1, 32).max(-1)
    spread = np.ptp(w.reshape(6, -1, 32), axis=-1)
    assert (err <= spread / 15 + 0.03 * np.abs(w).max()).all()
    assert np.abs(back - w).mean() < 0.25 * np.abs(w).mean()


def test_quantize_q4_k_refuses_a_ragged_row() -> None:
    with pytest.raises(GGUFError, match="rows of 300"):
        quantize_q4_k(np.zeros((2, 300), np.float32))
