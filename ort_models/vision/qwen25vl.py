"""Qwen2.5-VL's vision tower (projector type "qwen2.5vl_merger"): a window-attention ViT
with 2-D rotary positions and a patch merger.

Preprocessing (mtmd's dynamic-size preprocessor): the image's size rounded to multiples
of patch_size · 2 within 8 … 4096 merged tokens (`image_input.smart_size`), fitted
into it (bicubic, aspect kept, centred on black), normalised with the file's mean/std.

The tower (clip.cpp `clip_graph_qwen2vl`): the temporal patch convolution split into two
2-D ones (v.patch_embd.weight and .weight.1, summed: a still image is both frames), the
patches ordered so each 2×2 merge group is four consecutive rows, RMSNorm blocks with a
SiLU-gated FFN. Rotary positions are 2-D: of each head's d dims, the first half rotates
by the patch's row and its second half by its column (NeoX halves over the head,
llama.cpp's "vision" M-RoPE with sections [d/4] × 4, base 10000). Blocks attend within
windows of 112 pixels (4 × 4 merge groups at patch 14), every n_wa_pattern-th block
globally: the merge groups are reordered window by window, and a mask keeps each patch
within its window. The merger: the final RMSNorm, four patches' rows concatenated, mm.0,
GELU (tanh, as llama.cpp), mm.2, then the groups put back in raster order.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
from onnx import TensorProto

from specd.ort_models.gguf_file import GGUFError, GGUFFile

from .family import EMBEDDINGS, PIXELS, PreparedImage, VisionFamily, vit_layer_shapes
from .image_input import DecodedImage, normalize, resize, smart_size
from .mmproj import VisionHParams, read_vision_hparams
from .vit_graph import MASKED, VisionGraph

MERGE = 2  # the graph's merge is 2 × 2 whatever the key says (clip.cpp asserts it)
WINDOW_PIXELS = 112  # llama.cpp's attention window for Qwen2.5-VL
ROPE_BASE = 10000.0
MIN_TOKENS, MAX_TOKENS = 8, 4096
WINDOW_ORDER, WINDOW_RESTORE = "window_order", "window_restore"
WINDOW_MASK, ROPE_COS, ROPE_SIN = "window_mask", "rope_cos", "rope_sin"


class Qwen25VLVision(VisionFamily):
    projector: ClassVar[str] = "qwen2.5vl_merger"
    image_begin: ClassVar[str] = "<|vision_start|>"
    image_end: ClassVar[str] = "<|vision_end|>"

    def read_hparams(self, f: GGUFFile) -> VisionHParams:
        if "clip.vision.n_wa_pattern" not in f.metadata:
            raise GGUFError(f"{f.path}: missing metadata key 'clip.vision.n_wa_pattern' "
                            f"(Qwen2.5-VL's window attention pattern)")
        hp = read_vision_hparams(f, n_merge=MERGE, min_tokens=MIN_TOKENS,
                                 max_tokens=MAX_TOKENS)
        if hp.n_merge != MERGE:
            raise GGUFError(f"{f.path}: clip.vision.spatial_merge_size is {hp.n_merge}; the "
                            f"Qwen2.5-VL merger merges {MERGE} × {MERGE} patches")
        if hp.head_dim % 4:
            raise GGUFError(f"{f.path}: the vision head dimension {hp.head_dim} is not a "
                            f"multiple of 4 (its 2-D rotary sections)")
        if WINDOW_PIXELS // hp.patch_size // MERGE < 1:
            raise GGUFError(f"{f.path}: clip.vision.patch_size {hp.patch_size} is over the "
                            f"{WINDOW_PIXELS}-pixel attention window")
        return hp

    def tensor_shapes(self, hp: VisionHParams) -> dict[str, tuple[int, ...]]:
        e, p, wide = hp.n_embd, hp.patch_size, hp.n_embd * MERGE * MERGE
        return {"v.patch_embd.weight": (e, 3, p, p), "v.patch_embd.weight.1": (e, 3, p, p),
                **vit_layer_shapes(hp, biases=True, norm_bias=False, gate=True),
                "v.post_ln.weight": (e,), "mm.0.weight": (wide, wide), "mm.0.bias": (wide,),
                "mm.2.weight": (hp.projection_dim, wide), "mm.2.bias": (hp.projection_dim,)}

    def prepare(self, image: DecodedImage, hp: VisionHParams) -> PreparedImage:
        h, w = image.rgb.shape[:2]
        align = hp.patch_size * MERGE
        width, height = smart_size(w, h, align, hp.min_pixels, hp.max_pixels)
        rgb = resize(image.rgb, width, height, "bicubic", pad=True)
        rows, cols = height // align, width // align
        return PreparedImage(normalize(rgb, hp.image_mean, hp.image_std), (rows, cols),
                             rows * cols, image.digest)

    def feeds(self, image: PreparedImage, hp: VisionHParams) -> dict[str, np.ndarray]:
        rows, cols = image.grid
        order, mask = window_layout(rows, cols, WINDOW_PIXELS // hp.patch_size // MERGE)
        restore = np.empty_like(order)
        restore[order] = np.arange(order.size)
        cos, sin = rope_tables(rows, cols, order, hp.head_dim)
        return {WINDOW_ORDER: order, WINDOW_RESTORE: restore, WINDOW_MASK: mask,
                ROPE_COS: cos, ROPE_SIN: sin}

    def build(self, vg: VisionGraph) -> None:
        g, hp = vg.g, vg.hp
        e, wide = hp.n_embd, hp.n_embd * MERGE * MERGE
        pixels = g.input(PIXELS, TensorProto.FLOAT, [3, "height", "width"])
        order = g.input(WINDOW_ORDER, TensorProto.INT64, ["groups"])
        restore = g.input(WINDOW_RESTORE, TensorProto.INT64, ["groups"])
        mask = g.input(WINDOW_MASK, TensorProto.FLOAT, ["patches", "patches"])
        rope = (g.input(ROPE_COS, TensorProto.FLOAT, ["patches", hp.head_dim]),
                g.input(ROPE_SIN, TensorProto.FLOAT, ["patches", hp.head_dim]))
        conv = g.op("Add", [vg.patch_conv(pixels, "v.patch_embd.weight"),
                            vg.patch_conv(pixels, "v.patch_embd.weight.1")])  # [1, E, h, w]
        # each 2 × 2 group's patches as one row (dy, dx, channel), groups in raster order
        groups = vg.channels_last(g.op("SpaceToDepth", [conv], blocksize=MERGE))
        x = g.op("Reshape", [g.op("Gather", [groups, order], axis=0), g.const([-1, e])])
        for il in range(hp.n_layer):
            full = hp.n_wa_pattern == 0 or (il + 1) % hp.n_wa_pattern == 0
            x = vg.layer(x, il, norm="rms", ffn=hp.ffn, rope=rope,
                         mask=None if full else mask)
        x = g.op("Reshape", [vg.norm(x, "v.post_ln", "rms"), g.const([-1, wide])])
        x = vg.linear(vg.activation(vg.linear(x, "mm.0"), "gelu"), "mm.2")
        g.op("Gather", [x, restore], axis=0, out=[EMBEDDINGS])
        g.output(EMBEDDINGS, TensorProto.FLOAT, ["groups", hp.projection_dim])


def window_layout(rows: int, cols: int, window: int) -> tuple[np.ndarray, np.ndarray]:
    """The merge groups window by window (`order`: the raster index of each group in the
    windowed sequence, [rows * cols] int64) and the attention mask over their patches
    ([n, n] float32, n = 4 · rows · cols: 0 within a window, MASKED across), as clip.cpp
    lays them out for Qwen2.5-VL."""
    order: list[int] = []
    spans: list[tuple[int, int]] = []
    for y in range(0, rows, window):
        for x in range(0, cols, window):
            start = len(order)
            for dy in range(min(window, rows - y)):
                order.extend((y + dy) * cols + x + dx for dx in range(min(window, cols - x)))
            spans.append((start, len(order)))
    unit = MERGE * MERGE
    n = rows * cols * unit
    mask = np.full((n, n), MASKED, np.float32)
    for a, b in spans:
        mask[a * unit:b * unit, a * unit:b * unit] = 0.0
    return np.asarray(order, np.int64), mask


def rope_tables(rows: int, cols: int, order: np.ndarray, head_dim: int
                ) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin [n, head_dim] for the patches in windowed order: the first half of a
    head rotates by the patch's row, the second by its column, each at frequencies
    base^(-4j/d), j < d/4; the halves repeated for NeoX rotation."""
    y2, x2 = np.divmod(order, cols)  # each group's place in the merged grid
    dy, dx = np.divmod(np.arange(MERGE * MERGE), MERGE)
    ys = (y2[:, None] * MERGE + dy[None, :]).reshape(-1)  # [n]
    xs = (x2[:, None] * MERGE + dx[None, :]).reshape(-1)
    inv = ROPE_BASE ** (-4.0 * np.arange(head_dim // 4) / head_dim)
    angles = np.concatenate([ys[:, None] * inv, xs[:, None] * inv], axis=1)  # [n, d/2]
    angles = np.concatenate([angles, angles], axis=1)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
