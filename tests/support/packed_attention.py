"""The check every packed CachedAttention test makes: each segment of a packed call equals
that segment's call alone, bit for bit, outputs and the slot's cache."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


def assert_segments_equal_alone(packed: Sequence[np.ndarray], alone: Any,
                                proj: dict[str, np.ndarray], caches: Sequence[np.ndarray],
                                segs: Sequence[tuple[int, int, int]], cos: np.ndarray,
                                sin: np.ndarray) -> None:
    """packed: (y, present keys, present values) of a call over `segs` (slot, position,
    rows) with projections `proj` [S, *] and per-slot caches; `alone`: a session of the
    same op taking one sequence."""
    y, pk, pv = packed
    start = 0
    for slot, pos, n in segs:
        rows = slice(start, start + n)
        want = alone.run(None, {**{k: v[rows] for k, v in proj.items()},
                                "pk": caches[0][slot:slot + 1], "pv": caches[1][slot:slot + 1],
                                "pos": np.array([pos]), "cos": cos, "sin": sin})
        np.testing.assert_array_equal(y[rows], want[0])
        np.testing.assert_array_equal(pk[slot:slot + 1], want[1])
        np.testing.assert_array_equal(pv[slot:slot + 1], want[2])
        start += n
