"""ort_models.quant: the lossy 4-bit re-quantization used for drafts."""

from __future__ import annotations

import numpy as np
import pytest

from specd.ort_models.gguf_file import GGUFError
from specd.ort_models.quant import requantize_q4


@pytest.mark.parametrize("k", [64, 96])  # 96: an odd number of blocks per row
def test_requantize_q4_rounds_each_value_to_its_block_grid(k: int) -> None:
    rng = np.random.default_rng(0)
    w = rng.normal(0, 0.05, (7, k)).astype(np.float32)
    w[0, :32] = 0.0  # a constant block
    w[1, :32] = np.abs(w[1, :32])  # a block without negative values
    q = requantize_q4(w)
    assert (q.bits, q.block_size, q.bias) == (4, 32, None)
    assert q.q.max() <= 15 and q.zero_point.max() <= 15
    blocks = w.reshape(7, -1, 32)
    lo = np.minimum(blocks.min(-1), 0)
    hi = np.maximum(blocks.max(-1), 0)
    step = (hi - lo) / 15  # [7, nb]
    err = np.abs(q.dequantize() - w).reshape(7, -1, 32).max(-1)
    assert (err <= step / 2 + 1e-7).all()  # nearest grid point, grid covering the block
    np.testing.assert_array_equal(q.dequantize()[0, :32], 0.0)  # zero is on the grid
    # packed zero points: two per byte, low nibble first, as MatMulNBits reads them
    packed = q.packed_zero_points()
    assert packed.shape == (7, (k // 32 + 1) // 2)
    np.testing.assert_array_equal(packed[:, 0] & 0x0F, q.zero_point[:, 0])
    np.testing.assert_array_equal(packed[:, 0] >> 4, q.zero_point[:, 1])


def test_requantize_q4_refuses_a_ragged_row() -> None:
    with pytest.raises(GGUFError, match="rows of 40"):
        requantize_q4(np.zeros((2, 40), np.float32))
