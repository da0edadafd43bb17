"""Independent numpy references for specd's vision encoders and their preprocessing.

Written from the models' definitions (transformers' SigLIP / Gemma3MultiModalProjector
and Qwen2_5_VisionTransformer), not from specd's graphs, and computed in float64:
  * patches are cut out of the pixels and multiplied by the flattened convolution;
  * Qwen2.5-VL's window attention runs window by window (no mask), its patches in the
    image processor's order, its rotary angles as transformers' `rot_pos_emb` makes them;
  * `pillow_resize` is Pillow's fixed-point resampler (Resample.c) as llama.cpp ported it,
    in plain numpy.
Where llama.cpp differs from transformers the reference follows llama.cpp, the oracle:
the merger's GELU is the tanh approximation, and the attention window is 112 pixels.
"""

from __future__ import annotations

import math

import numpy as np

from specd.ort_models.gguf_file import GGUFFile
from specd.ort_models.quant import dense_float32, float_rows, load_matrix

PRECISION_BITS = 22


def tensor(f: GGUFFile, name: str) -> np.ndarray:
    t = f.tensor(name)
    if t.type_name in ("F32", "F16", "BF16"):
        return dense_float32(t).astype(np.float64)
    return float_rows(load_matrix(t)).reshape(t.shape).astype(np.float64)


# -- preprocessing -------------------------------------------------------------------------

def _filter(algo: str, x: float) -> float:
    if algo == "lanczos":
        def sinc(v: float) -> float:
            return 1.0 if v == 0.0 else math.sin(math.pi * v) / (math.pi * v)
        return sinc(x) * sinc(x / 3.0) if -3.0 <= x < 3.0 else 0.0
    x = abs(x)
    if algo == "bilinear":
        return 1.0 - x if x < 1.0 else 0.0
    a = -0.5
    if x < 1.0:
        return ((a + 2.0) * x - (a + 3.0)) * x * x + 1
    if x < 2.0:
        return (((x - 5) * x + 8) * x - 4) * a
    return 0.0


def _weights(algo: str, n_in: int, n_out: int) -> list[tuple[int, list[int]]]:
    support = {"bilinear": 1.0, "bicubic": 2.0, "lanczos": 3.0}[algo]
    scale = n_in / n_out
    fscale = max(scale, 1.0)
    support *= fscale
    out = []
    for xx in range(n_out):
        center = (xx + 0.5) * scale
        xmin = max(int(center - support + 0.5), 0)
        xmax = min(int(center + support + 0.5), n_in) - xmin
        w = [_filter(algo, (x + xmin - center + 0.5) / fscale) for x in range(xmax)]
        total = sum(w)
        w = [v / total if total != 0.0 else v for v in w]
        fixed = [int(v * (1 << PRECISION_BITS) + (-0.5 if v < 0 else 0.5)) for v in w]
        out.append((xmin, fixed))
    return out


def _pass(src: np.ndarray, n_out: int, algo: str) -> np.ndarray:
    """Resample axis 1 of src [A, n_in, 3] (int64) to n_out."""
    res = np.empty((src.shape[0], n_out, 3), np.int64)
    for xx, (xmin, w) in enumerate(_weights(algo, src.shape[1], n_out)):
        acc = np.full((src.shape[0], 3), 1 << (PRECISION_BITS - 1), np.int64)
        for i, wi in enumerate(w):
            acc += src[:, xmin + i] * wi
        res[:, xx] = np.clip(acc >> PRECISION_BITS, 0, 255)
    return res


def pillow_resize(rgb: np.ndarray, width: int, height: int, algo: str) -> np.ndarray:
    """[H, W, 3] uint8 -> [height, width, 3]: horizontal pass, then vertical."""
    x = rgb.astype(np.int64)
    if width != x.shape[1]:
        x = _pass(x, width, algo)
    if height != x.shape[0]:
        x = _pass(x.transpose(1, 0, 2), height, algo).transpose(1, 0, 2)
    return x.astype(np.uint8)


# -- blocks ---------------------------------------------------------------------------------

def layer_norm(x: np.ndarray, w: np.ndarray, b: np.ndarray | None, eps: float) -> np.ndarray:
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    y = (x - mu) / np.sqrt(var + eps) * w
    return y + b if b is not None else y


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1 + np.exp(-x))


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def linear(f: GGUFFile, x: np.ndarray, prefix: str) -> np.ndarray:
    y = x @ tensor(f, f"{prefix}.weight").T
    return y + tensor(f, f"{prefix}.bias") if f.has_tensor(f"{prefix}.bias") else y


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, n_head: int) -> np.ndarray:
    """Full attention over the rows of q, k, v [S, n_head * d]."""
    s, e = q.shape
    d = e // n_head
    out = np.empty_like(q)
    for h in range(n_head):
        sl = slice(h * d, (h + 1) * d)
        p = softmax(q[:, sl] @ k[:, sl].T / math.sqrt(d))
        out[:, sl] = p @ v[:, sl]
    return out


def patches(pixels: np.ndarray, p: int) -> np.ndarray:
    """[3, H, W] -> [H/p * W/p, 3 * p * p], row-major over the grid, each patch (c, y, x)."""
    c, h, w = pixels.shape
    x = pixels.reshape(c, h // p, p, w // p, p).transpose(1, 3, 0, 2, 4)
    return x.reshape((h // p) * (w // p), c * p * p)


# -- Gemma 3 --------------------------------------------------------------------------------

def gemma3_embeddings(f: GGUFFile, pixels: np.ndarray) -> np.ndarray:
    """SigLIP + Gemma3MultiModalProjector on normalised pixels [3, S, S]."""
    md = f.metadata
    p, heads = md["clip.vision.patch_size"], md["clip.vision.attention.head_count"]
    eps, n_layer = md["clip.vision.attention.layer_norm_epsilon"], md["clip.vision.block_count"]
    merge = md.get("clip.vision.projector.scale_factor", 4)
    px = pixels.astype(np.float64)
    w = tensor(f, "v.patch_embd.weight")
    x = patches(px, p) @ w.reshape(w.shape[0], -1).T + tensor(f, "v.patch_embd.bias")
    x = x + tensor(f, "v.position_embd.weight")
    for il in range(n_layer):
        b = f"v.blk.{il}"
        h = layer_norm(x, tensor(f, f"{b}.ln1.weight"), tensor(f, f"{b}.ln1.bias"), eps)
        a = attention(linear(f, h, f"{b}.attn_q"), linear(f, h, f"{b}.attn_k"),
                      linear(f, h, f"{b}.attn_v"), heads)
        x = x + linear(f, a, f"{b}.attn_out")
        h = layer_norm(x, tensor(f, f"{b}.ln2.weight"), tensor(f, f"{b}.ln2.bias"), eps)
        x = x + linear(f, gelu_tanh(linear(f, h, f"{b}.ffn_up")), f"{b}.ffn_down")
    x = layer_norm(x, tensor(f, "v.post_ln.weight"), tensor(f, "v.post_ln.bias"), eps)
    side = int(round(math.sqrt(x.shape[0])))
    s = side // merge
    pooled = x.reshape(s, merge, s, merge, -1).mean(axis=(1, 3)).reshape(s * s, -1)
    pooled = rms_norm(pooled, tensor(f, "mm.soft_emb_norm.weight"), eps)
    return pooled @ tensor(f, "mm.input_projection.weight")


# -- Qwen2.5-VL -----------------------------------------------------------------------------

def _rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, heads: int) -> np.ndarray:
    s, e = x.shape
    d = e // heads
    xh = x.reshape(s, heads, d)
    rot = np.concatenate([-xh[..., d // 2:], xh[..., :d // 2]], axis=-1)
    return (xh * cos[:, None] + rot * sin[:, None]).reshape(s, e)


def qwen25vl_embeddings(f: GGUFFile, pixels: np.ndarray, window_pixels: int = 112
                        ) -> np.ndarray:
    """Qwen2_5_VisionTransformer (with llama.cpp's window of `window_pixels` and tanh
    GELU in the merger) on normalised pixels [3, H, W]; rows in raster order of the
    merged grid."""
    md = f.metadata
    p, heads = md["clip.vision.patch_size"], md["clip.vision.attention.head_count"]
    eps, n_layer = md["clip.vision.attention.layer_norm_epsilon"], md["clip.vision.block_count"]
    full_every = md["clip.vision.n_wa_pattern"]
    m = 2
    c, h, w = pixels.shape
    gh, gw = h // p, w // p
    # the image processor's order: merged rows, merged cols, then the 2 x 2 inside
    px = pixels.astype(np.float64).reshape(c, gh // m, m, p, gw // m, m, p)
    flat = px.transpose(1, 4, 2, 5, 0, 3, 6).reshape(gh * gw, c * p * p)
    k0, k1 = tensor(f, "v.patch_embd.weight"), tensor(f, "v.patch_embd.weight.1")
    x = flat @ (k0 + k1).reshape(k0.shape[0], -1).T  # both frames are the image
    # rot_pos_emb: (row, col) of each patch in this order
    hpos = np.arange(gh)[:, None].repeat(gw, 1).reshape(gh // m, m, gw // m, m)
    wpos = np.arange(gw)[None, :].repeat(gh, 0).reshape(gh // m, m, gw // m, m)
    hpos, wpos = hpos.transpose(0, 2, 1, 3).reshape(-1), wpos.transpose(0, 2, 1, 3).reshape(-1)
    e = x.shape[1]
    d = e // heads
    inv = 1.0 / 10000.0 ** (np.arange(0, d // 2, 2) / (d // 2))
    freqs = np.concatenate([hpos[:, None] * inv, wpos[:, None] * inv], axis=1)
    emb = np.concatenate([freqs, freqs], axis=1)
    cos, sin = np.cos(emb), np.sin(emb)
    # windows of merged groups, as get_window_index makes them (raster within a window)
    win = window_pixels // p // m
    mh, mw = gh // m, gw // m
    windows = [[(y + dy) * mw + (xw + dx) for dy in range(min(win, mh - y))
                for dx in range(min(win, mw - xw))]
               for y in range(0, mh, win) for xw in range(0, mw, win)]
    for il in range(n_layer):
        b = f"v.blk.{il}"
        hn = rms_norm(x, tensor(f, f"{b}.ln1.weight"), eps)
        q = _rotate(linear(f, hn, f"{b}.attn_q"), cos, sin, heads)
        k = _rotate(linear(f, hn, f"{b}.attn_k"), cos, sin, heads)
        v = linear(f, hn, f"{b}.attn_v")
        if full_every and (il + 1) % full_every != 0:
            a = np.empty_like(q)
            for groups in windows:
                rows = np.concatenate([np.arange(g * m * m, (g + 1) * m * m) for g in groups])
                a[rows] = attention(q[rows], k[rows], v[rows], heads)
        else:
            a = attention(q, k, v, heads)
        x = x + linear(f, a, f"{b}.attn_out")
        hn = rms_norm(x, tensor(f, f"{b}.ln2.weight"), eps)
        gate = silu(linear(f, hn, f"{b}.ffn_gate"))
        x = x + linear(f, gate * linear(f, hn, f"{b}.ffn_up"), f"{b}.ffn_down")
    x = rms_norm(x, tensor(f, "v.post_ln.weight"), eps).reshape(-1, e * m * m)
    return linear(f, gelu_tanh(linear(f, x, "mm.0")), "mm.2")


# -- muse-glimmer ---------------------------------------------------------------------------

def gelu_erf(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1 + np.vectorize(math.erf)(x / math.sqrt(2)))


def bilinear_clamped(table: np.ndarray, height: int, width: int) -> np.ndarray:
    """table [h, w, C] resampled to [height, width, C] as ggml_interpolate's bilinear mode
    does: half-pixel centres, coordinates and neighbours clamped to the edges."""
    h, w, _ = table.shape
    out = np.empty((height, width, table.shape[2]))
    for i in range(height):
        y = (i + 0.5) * h / height - 0.5
        y0 = min(max(math.floor(y), 0), h - 1)
        y1 = min(max(math.floor(y) + 1, 0), h - 1)
        dy = min(max(y - y0, 0.0), 1.0)
        for j in range(width):
            x = (j + 0.5) * w / width - 0.5
            x0 = min(max(math.floor(x), 0), w - 1)
            x1 = min(max(math.floor(x) + 1, 0), w - 1)
            dx = min(max(x - x0, 0.0), 1.0)
            out[i, j] = (table[y0, x0] * (1 - dx) * (1 - dy) + table[y0, x1] * dx * (1 - dy)
                         + table[y1, x0] * (1 - dx) * dy + table[y1, x1] * dx * dy)
    return out


def _rope_interleaved(x: np.ndarray, cols: np.ndarray, rows: np.ndarray, heads: int
                      ) -> np.ndarray:
    """ggml's 2-D rope as clip.cpp's build_rope_2d applies it: per head, the first half
    rotated by the column, the second by the row, pairs (2i, 2i+1) at base^(-2i/(d/2))."""
    s, e = x.shape
    d = e // heads
    half = d // 2
    out = x.reshape(s, heads, d).copy()
    inv = 10000.0 ** (-2.0 * np.arange(half // 2) / half)
    for offset, pos in ((0, cols + 1), (half, rows + 1)):
        theta = pos[:, None] * inv[None, :]  # [S, d/4]
        c, sn = np.cos(theta)[:, None], np.sin(theta)[:, None]
        a = out[:, :, offset:offset + half:2].copy()
        b = out[:, :, offset + 1:offset + half:2].copy()
        out[:, :, offset:offset + half:2] = a * c - b * sn
        out[:, :, offset + 1:offset + half:2] = a * sn + b * c
    return out.reshape(s, e)


def muse_glimmer_embeddings(f: GGUFFile, pixels: np.ndarray) -> np.ndarray:
    """clip.cpp's muse-glimmer tower and adapter on normalised pixels [3, H, W]: rows in
    raster order of the 2 × 2-merged grid. Windows are attended one at a time, in the
    image's own order (no permutation, no mask)."""
    md = f.metadata
    p, heads = md["clip.vision.patch_size"], md["clip.vision.attention.head_count"]
    eps, n_layer = md["clip.vision.attention.layer_norm_epsilon"], md["clip.vision.block_count"]
    m = 2
    _, h, w = pixels.shape
    gh, gw = h // p, w // p
    conv = tensor(f, "v.patch_embd.weight")
    x = patches(pixels.astype(np.float64), p) @ conv.reshape(conv.shape[0], -1).T
    table = tensor(f, "v.position_embd.weight")
    side = int(round(math.sqrt(table.shape[0])))
    x = x + bilinear_clamped(table.reshape(side, side, -1), gh, gw).reshape(gh * gw, -1)
    x = layer_norm(x, tensor(f, "v.pre_ln.weight"), tensor(f, "v.pre_ln.bias"), eps)
    rows, cols = np.divmod(np.arange(gh * gw), gw)
    windows = [((rows // side) == wy) & ((cols // side) == wx)
               for wy in range(-(-gh // side)) for wx in range(-(-gw // side))]
    for il in range(n_layer):
        b = f"v.blk.{il}"
        hn = layer_norm(x, tensor(f, f"{b}.ln1.weight"), tensor(f, f"{b}.ln1.bias"), eps)
        q = _rope_interleaved(linear(f, hn, f"{b}.attn_q"), cols, rows, heads)
        k = _rope_interleaved(linear(f, hn, f"{b}.attn_k"), cols, rows, heads)
        v = linear(f, hn, f"{b}.attn_v")
        if il == n_layer - 1 or (il + 1) % 4 == 0:
            a = attention(q, k, v, heads)
        else:
            a = np.empty_like(q)
            for sel in windows:
                a[sel] = attention(q[sel], k[sel], v[sel], heads)
        x = x + linear(f, a, f"{b}.attn_out")
        hn = layer_norm(x, tensor(f, f"{b}.ln2.weight"), tensor(f, f"{b}.ln2.bias"), eps)
        x = x + linear(f, gelu_erf(linear(f, hn, f"{b}.ffn_up")), f"{b}.ffn_down")
    x = layer_norm(x, tensor(f, "v.post_ln.weight"), tensor(f, "v.post_ln.bias"), eps)
    grid = x.reshape(gh, gw, -1)
    e = x.shape[1]
    merged = np.empty((gh // m, gw // m, e * m * m))
    for oy in range(gh // m):
        for ox in range(gw // m):
            group = [grid[oy * m + ry, ox * m + rx] for ry in range(m) for rx in range(m)]
            merged[oy, ox] = np.stack(group, axis=1).reshape(-1)  # [c * 4 + s]
    y = gelu_erf(linear(f, merged.reshape(-1, e * m * m), "mm.0"))
    y = gelu_erf(linear(f, y, "mm.1"))
    return linear(f, y, "mm.2")
