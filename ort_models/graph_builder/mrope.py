"""M-RoPE (qwen2vl): each row rotated by four positions, one per section of the rotary
pairs (ort_models/arch/qwen2vl.py), read from the graph input `rope_positions` [4, S].

The graph gathers each row's angles from the rotary tables (rope.cos / rope.sin) at its
four positions, keeps per pair the section's, and names the result mrope.cos /
mrope.sin [S, rope_dim/2]: RotaryEmbedding then rotates row s by table row s (position
ids 0..S-1). Every step is per row, so a row's rotation is the same whatever the call.
"""

from __future__ import annotations

import numpy as np

from specd.ort_models.arch import HParams

from .context import BuildContext
from .options import I64

ROPE_POSITIONS = "rope_positions"  # int64 [4, S]: (t, h, w, e) of each new row
MROPE = "mrope"  # the per-row tables' name (mrope.cos, mrope.sin)


def pair_sections(hp: HParams) -> np.ndarray:
    """Per rotary pair, the position row (0 t, 1 h, 2 w, 3 e) its angle reads, as
    ggml's mrope cache: pair i is in sector i mod sum(sections)."""
    bounds = np.cumsum(hp.rope_sections)  # [4]
    sectors = np.arange(hp.rope_dim // 2) % int(bounds[-1])
    return np.searchsorted(bounds[:3], sectors, side="right").astype(np.int64)


def mrope_rows(c: BuildContext, s_len: str) -> str:
    """The graph input `rope_positions` [4, S] made into the per-row tables mrope.cos /
    mrope.sin [S, rope_dim/2] (the rotary tables are written first); returns the rows'
    indices [1, S], RotaryEmbedding's position ids into those tables."""
    from .attention import rotary_tables

    g, hp = c.g, c.hp
    rotary_tables(c)
    positions = g.input(ROPE_POSITIONS, I64, [4, "S"])
    half = hp.rope_dim // 2
    which = g.const(pair_sections(hp).reshape(1, 1, half))  # [1, 1, half]
    shape = g.op("Concat", [g.const([1]), s_len, g.const([half])], axis=0)
    index = g.op("Expand", [which, shape])  # [1, S, half]
    for part in ("cos", "sin"):
        every = g.op("Gather", [f"rope.{part}", positions], axis=0)  # [4, S, half]
        picked = g.op("GatherElements", [every, index], axis=0)  # [1, S, half]
        g.op("Squeeze", [picked, g.const([0])], out=[f"{MROPE}.{part}"])  # [S, half]
    rows = g.op("Range", [g.const(0), g.op("Squeeze", [s_len, g.const([0])]), g.const(1)])
    return g.op("Unsqueeze", [rows, g.const([0])])  # [1, S]
