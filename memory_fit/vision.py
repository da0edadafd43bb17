"""The vision encoder's memory: its built weights and the activations of the largest
image it takes.

An encoder runs one image at a time and keeps no cache, so its cost does not grow with
the context: weights (the built graph's weights file, as its session maps them) and a
workspace bounded from the graph's shapes for the most
patches an image can have: a few [patches, width] tensors per block, the FFN's
[patches, n_ff], and the attention scores [n_head, patches, patches] of a global block.
An image's tokens take the target's KV like any other tokens (within n_ctx).
"""

from __future__ import annotations

import os
from pathlib import Path

from specd.ort_models.model_cache import WEIGHTS_FILE
from specd.ort_models.vision.encoder import build_vision_graph, read_checked
from specd.ort_models.vision.mmproj import VisionHParams

from .measure import ModelCost

F32 = 4
LIVE_ROWS = 4  # [patches, width] float32 tensors alive at once in a block (x, q, k, v)


def max_patches(hp: VisionHParams) -> int:
    """The most patches one image gives the tower (fixed size: image_size²; dynamic:
    max_pixels)."""
    side = hp.patch_size
    if hp.min_pixels:  # a dynamic-size family: its resize's pixel bound
        return max(hp.max_pixels // (side * side), 1)
    return (hp.image_size // side) ** 2


def vision_workspace(hp: VisionHParams) -> int:
    """Bytes of activations for the largest image (module doc)."""
    n = max_patches(hp)
    return F32 * (n * (LIVE_ROWS * hp.n_embd + hp.n_ff) + hp.n_head * n * n)


def vision_cost(mmproj: str | os.PathLike[str]) -> ModelCost:
    """The encoder of `mmproj` (built if it is not), as the memory plan counts it."""
    f, family, hp = read_checked(mmproj)
    folder = build_vision_graph(f, family, hp)
    return ModelCost(weights_bytes=(folder / WEIGHTS_FILE).stat().st_size,
                     kv_bytes_per_token=0, workspace_base=vision_workspace(hp),
                     name=Path(mmproj).name)
