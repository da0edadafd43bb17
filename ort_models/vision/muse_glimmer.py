"""muse-glimmer's vision tower (projector type "muse-glimmer", the Onyx family): a ViT with
learned position embeddings resized bilinearly to the image's grid, 2-D rotary positions,
window attention, a pixel-shuffle merge and a three-matrix adapter.

Preprocessing (mtmd's muse-glimmer preprocessor): the patch grid nearest the image's
aspect ratio under 4096 merged tokens (`grid_size`, transformers'
get_aspect_ratio_preserving_size), the image stretched to it (Lanczos, no padding),
normalised with the file's mean and std.

The tower (clip.cpp `clip_graph_muse_glimmer`):
  * the patch convolution (the converter sums the two temporal slabs into one kernel,
    no bias) plus the position table [g², n_embd], read as a g × g grid (row-major) and
    resized to the patch grid as ggml_interpolate does (bilinear, half-pixel centres,
    edges clamped: ONNX Resize, linear, half_pixel);
  * the patches reordered window by window (windows of g × g patches, raster within a
    window), then LayerNorm blocks with biases and an exact (erf) GELU FFN, between the
    pre- and post-LayerNorm; every 4th block and the last attend globally, the others
    within their window (a block-diagonal mask);
  * rotary positions: each head's first half rotates by the patch's column, its second
    half by its row, 1-indexed, at frequencies base^(-4j/d), j < d/4, in interleaved
    pairs (the converter un-permutes transformers' rotate-half Q/K). The graph permutes
    the Q/K rows back at build time and rotates in NeoX halves, which is the same;
  * the patches back in raster order, each 2 × 2 group's rows concatenated channel-major
    (out[c · 4 + s] = patch s's channel c), then mm.0, GELU, mm.1, GELU, mm.2 (no
    biases) into the text model's width.
mtmd puts <|image_start|> and <|image_end|> around the image's embeddings.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import ClassVar

import numpy as np
from onnx import TensorProto

from specd.ort_models.gguf_file import GGUFError, GGUFFile

from .family import EMBEDDINGS, PIXELS, PreparedImage, VisionFamily, vit_layer_shapes
from .image_input import DecodedImage, normalize, resize
from .mmproj import VisionHParams, read_vision_hparams
from .vit_graph import MASKED, VisionGraph

MERGE = 2  # clip.cpp's pixel shuffle groups 2 × 2 patches (its output-size formula)
GLOBAL_EVERY = 4  # every 4th block (and the last) attends over the whole image
ROPE_BASE = 10000.0
MIN_TOKENS, MAX_TOKENS = 1, 4096
POS_TABLE = "v.position_embd.weight"
WINDOW_ORDER, SHUFFLE = "window_order", "shuffle_order"
WINDOW_MASK, ROPE_COS, ROPE_SIN = "window_mask", "rope_cos", "rope_sin"


@dataclass(frozen=True)
class MuseGlimmerHParams(VisionHParams):
    pos_grid: int  # the position table's side (also the attention window), in patches
    adapter_width: int  # mm.0's and mm.1's output width


class MuseGlimmerVision(VisionFamily):
    projector: ClassVar[str] = "muse-glimmer"
    image_begin: ClassVar[str] = "<|image_start|>"
    image_end: ClassVar[str] = "<|image_end|>"

    def read_hparams(self, f: GGUFFile) -> VisionHParams:
        hp = read_vision_hparams(f, n_merge=MERGE, min_tokens=MIN_TOKENS,
                                 max_tokens=MAX_TOKENS)
        if hp.n_merge != MERGE:
            raise GGUFError(f"{f.path}: clip.vision.spatial_merge_size is {hp.n_merge}; the "
                            f"muse-glimmer pixel shuffle merges {MERGE} × {MERGE} patches")
        if hp.head_dim % 4:
            raise GGUFError(f"{f.path}: the vision head dimension {hp.head_dim} is not a "
                            f"multiple of 4 (its 2-D rotary halves)")
        n_pos = f.tensor(POS_TABLE).shape[0]
        side = math.isqrt(n_pos)
        if side * side != n_pos:
            raise GGUFError(f"{f.path}: tensor {POS_TABLE} has {n_pos} rows, not a square "
                            f"grid of positions")
        adapter = f.tensor("mm.0.weight").shape[0]
        return MuseGlimmerHParams(**{**asdict(hp), "ffn": "gelu_erf"}, pos_grid=side,
                                  adapter_width=adapter)

    def tensor_shapes(self, hp: VisionHParams) -> dict[str, tuple[int, ...]]:
        mg = _own(hp)
        e, p, a = hp.n_embd, hp.patch_size, mg.adapter_width
        return {"v.patch_embd.weight": (e, 3, p, p), POS_TABLE: (mg.pos_grid ** 2, e),
                "v.pre_ln.weight": (e,), "v.pre_ln.bias": (e,),
                **vit_layer_shapes(hp, biases=True, norm_bias=True, gate=False),
                "v.post_ln.weight": (e,), "v.post_ln.bias": (e,),
                "mm.0.weight": (a, e * MERGE * MERGE), "mm.1.weight": (a, a),
                "mm.2.weight": (hp.projection_dim, a)}

    def prepare(self, image: DecodedImage, hp: VisionHParams) -> PreparedImage:
        h, w = image.rgb.shape[:2]
        align = hp.patch_size * MERGE
        rows, cols = grid_size(w, h, align, hp.max_pixels // (align * align))
        rgb = resize(image.rgb, cols * align, rows * align, "lanczos", pad=False)
        return PreparedImage(normalize(rgb, hp.image_mean, hp.image_std), (rows, cols),
                             rows * cols, image.digest)

    def feeds(self, image: PreparedImage, hp: VisionHParams) -> dict[str, np.ndarray]:
        rows, cols = image.grid
        gh, gw = rows * MERGE, cols * MERGE  # the patch grid
        order, mask = window_layout(gh, gw, _own(hp).pos_grid)
        restore = np.empty_like(order)
        restore[order] = np.arange(order.size)
        cos, sin = rope_tables(order, gw, hp.head_dim)
        return {WINDOW_ORDER: order, SHUFFLE: restore[shuffle_order(gh, gw)],
                WINDOW_MASK: mask, ROPE_COS: cos, ROPE_SIN: sin}

    def build(self, vg: VisionGraph) -> None:
        g, hp = vg.g, _own(vg.hp)
        e, side, d = hp.n_embd, hp.pos_grid, hp.head_dim
        pixels = g.input(PIXELS, TensorProto.FLOAT, [3, "height", "width"])
        order = g.input(WINDOW_ORDER, TensorProto.INT64, ["patches"])
        shuffle = g.input(SHUFFLE, TensorProto.INT64, ["patches"])
        mask = g.input(WINDOW_MASK, TensorProto.FLOAT, ["patches", "patches"])
        rope = (g.input(ROPE_COS, TensorProto.FLOAT, ["patches", d]),
                g.input(ROPE_SIN, TensorProto.FLOAT, ["patches", d]))
        conv = vg.patch_conv(pixels, "v.patch_embd.weight")  # [1, E, gh, gw]
        table = vg.values(POS_TABLE).reshape(side, side, e).transpose(2, 0, 1)[None]
        pos = g.op("Resize", [vg.param(f"{POS_TABLE}.grid", table), "", "",
                              g.op("Shape", [conv])], mode="linear",
                   coordinate_transformation_mode="half_pixel")  # [1, E, gh, gw]
        x = vg.channels_last(g.op("Add", [conv, pos]))  # [P, E], raster order
        x = vg.norm(g.op("Gather", [x, order], axis=0), "v.pre_ln", "layer")
        neox = neox_rows(hp.n_head, d)  # interleaved pairs -> rotate-half halves
        for il in range(hp.n_layer):
            for n in ("attn_q", "attn_k"):
                vg.reorder_rows(f"v.blk.{il}.{n}", neox)
            full = il == hp.n_layer - 1 or (il + 1) % GLOBAL_EVERY == 0
            x = vg.layer(x, il, norm="layer", ffn=hp.ffn, rope=rope,
                         mask=None if full else mask)
        x = g.op("Gather", [vg.norm(x, "v.post_ln", "layer"), shuffle], axis=0)
        x = g.op("Transpose", [g.op("Reshape", [x, g.const([-1, MERGE * MERGE, e])])],
                 perm=[0, 2, 1])  # [tokens, E, 4]: channel-major within a group
        x = g.op("Reshape", [x, g.const([-1, e * MERGE * MERGE])])
        x = vg.activation(vg.linear(x, "mm.0"), "gelu_erf")
        x = vg.activation(vg.linear(x, "mm.1"), "gelu_erf")
        y = vg.linear(x, "mm.2")
        g.op("Identity", [y], out=[EMBEDDINGS])
        g.output(EMBEDDINGS, TensorProto.FLOAT, ["tokens", hp.projection_dim])


def _own(hp: VisionHParams) -> MuseGlimmerHParams:
    if not isinstance(hp, MuseGlimmerHParams):
        raise TypeError("muse-glimmer's hyper-parameters come from its read_hparams")
    return hp


def grid_size(width: int, height: int, align: int, max_tokens: int) -> tuple[int, int]:
    """mtmd's `muse_glimmer_grid_size`: the (rows, cols) of `align`-pixel cells nearest
    the image's aspect ratio with at most `max_tokens` cells (the most cells on a tie)."""
    nph, npw = height / align, width / align
    ratio = npw / nph if nph > 0 else 1.0
    if nph * npw > max_tokens:
        nph = math.sqrt(max_tokens / ratio)
        npw = nph * ratio
    target = height / width
    best: tuple[int, int] | None = None
    best_d = 0.0
    for r in (math.floor(nph), math.ceil(nph)):
        for c in (math.floor(npw), math.ceil(npw)):
            if r < 1 or c < 1 or r * c > max_tokens:
                continue
            d = abs(r / c - target)
            if best is None or d < best_d or (d == best_d and r * c > best[0] * best[1]):
                best, best_d = (r, c), d
    if best is None:  # nothing fits under the cap: rounded and clamped, as mtmd does
        best = (max(1, _round_half_away(nph)), max(1, _round_half_away(npw)))
    return best


def _round_half_away(x: float) -> int:
    return int(math.floor(x + 0.5)) if x >= 0 else -int(math.floor(-x + 0.5))


def window_layout(gh: int, gw: int, window: int) -> tuple[np.ndarray, np.ndarray]:
    """The patches window by window (`order`: each one's raster index, [P] int64) and
    the block-diagonal mask over them in that order ([P, P] float32: 0 within a window,
    MASKED across), as clip.cpp's muse-glimmer inputs lay them out."""
    order: list[int] = []
    mask = np.full((gh * gw, gh * gw), MASKED, np.float32)
    for y in range(0, gh, window):
        for x in range(0, gw, window):
            start = len(order)
            for dy in range(min(window, gh - y)):
                order.extend((y + dy) * gw + x + dx for dx in range(min(window, gw - x)))
            mask[start:len(order), start:len(order)] = 0.0
    return np.asarray(order, np.int64), mask


def shuffle_order(gh: int, gw: int) -> np.ndarray:
    """The raster indices of the patches, each 2 × 2 group's four consecutive
    (row-major inside), the groups in raster order: [P] int64."""
    idx = np.arange(gh * gw).reshape(gh // MERGE, MERGE, gw // MERGE, MERGE)
    return idx.transpose(0, 2, 1, 3).reshape(-1).astype(np.int64)


def rope_tables(order: np.ndarray, gw: int, head_dim: int) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin [P, head_dim] for the patches in `order`, in NeoX halves: angles
    [col · f, row · f] (1-indexed, f = base^(-4j/d), j < d/4), repeated."""
    rows, cols = np.divmod(order, gw)
    inv = ROPE_BASE ** (-4.0 * np.arange(head_dim // 4) / head_dim)
    angles = np.concatenate([(cols + 1)[:, None] * inv, (rows + 1)[:, None] * inv], axis=1)
    angles = np.concatenate([angles, angles], axis=1)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def neox_rows(n_head: int, head_dim: int) -> np.ndarray:
    """The row order that takes a Q/K matrix from llama.cpp's interleaved rotary pairs
    (2i, 2i+1) to rotate-half halves (i, i + d/2), head by head."""
    per_head = np.arange(head_dim).reshape(head_dim // 2, 2).T.reshape(-1)
    return (np.arange(n_head)[:, None] * head_dim + per_head[None, :]).reshape(-1)
