"""Image files for tests: random-pixel PNGs, as data URLs too."""

from __future__ import annotations

import base64
import io

import numpy as np
from PIL import Image


def png(width: int = 100, height: int = 70, seed: int = 0) -> bytes:
    """A PNG of random RGB pixels (a seed gives the same file)."""
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"
