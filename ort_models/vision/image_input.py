"""Images in: decoding an upload (PNG, JPEG, WebP) with Pillow, and the resizes and
normalisation llama.cpp's mtmd applies before an encoder sees the pixels.

Decoding refuses, with an `ImageError` naming the problem: empty data, bytes that are
not an image, formats other than PNG / JPEG / WebP, images over `MAX_IMAGE_PIXELS`
(checked from the header, before any pixel is decoded: a decompression bomb never
allocates), and truncated or corrupt data. An animated PNG or WebP gives its first
frame, as llama.cpp's decoder (stb_image) reads it; alpha is dropped, not composited,
also as stb_image does when it asks for three channels.

`resize` is llama.cpp's `img_tool::resize` (mtmd-image.cpp): a Pillow-compatible
separable resampler (bilinear, bicubic with a = -0.5, Lanczos-3; fixed-point weights of
22 bits) and, unless asked for no padding, an aspect-preserving fit centred on a black
canvas. llama.cpp ported that resampler from Pillow, so Pillow's `Image.resize` of one
axis gives the same bytes as its pass of that axis (tests/support/numpy_vision.py holds
an independent port of both passes).
"""

from __future__ import annotations

import hashlib
import io
import math
import warnings
from dataclasses import dataclass

import numpy as np

# the most pixels an image may have (a 50-megapixel photo; larger is refused unread)
MAX_IMAGE_PIXELS = 50_000_000
FORMATS = ("PNG", "JPEG", "WEBP")
RESAMPLING = ("bilinear", "bicubic", "lanczos")


class ImageError(ValueError):
    """An image that cannot be used; the message names the problem (an API's 400)."""


@dataclass(frozen=True)
class DecodedImage:
    rgb: np.ndarray  # [H, W, 3] uint8
    digest: str  # sha256 of the file's bytes


def decode_image(data: bytes, *, max_pixels: int = MAX_IMAGE_PIXELS) -> DecodedImage:
    """The RGB pixels of a PNG, JPEG or WebP file's bytes (module doc); ImageError else."""
    from PIL import Image, UnidentifiedImageError

    if not data:
        raise ImageError("the image is empty (0 bytes)")
    digest = hashlib.sha256(data).hexdigest()
    try:
        with warnings.catch_warnings():  # a huge image is refused below, by its size
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data))
    except UnidentifiedImageError:
        raise ImageError(f"the data is not an image specd can read ({len(data):,} bytes "
                         f"starting {data[:8]!r}; send PNG, JPEG or WebP)") from None
    except Image.DecompressionBombError:
        raise ImageError(f"the image is larger than the {max_pixels:,} pixels specd "
                         f"accepts") from None
    except (OSError, ValueError, SyntaxError) as exc:  # Pillow's header errors
        raise ImageError(f"the image is truncated or its header is corrupt: {exc}") from None
    with img:
        if img.format not in FORMATS:
            raise ImageError(f"unsupported image format {img.format} (specd reads PNG, JPEG "
                             f"and WebP)")
        width, height = img.size
        if width < 1 or height < 1:
            raise ImageError(f"the image has no pixels ({width}x{height})")
        if width * height > max_pixels:
            raise ImageError(f"the image is {width:,}x{height:,} = {width * height:,} pixels, "
                             f"more than the {max_pixels:,} specd accepts")
        try:
            img.seek(0)
            rgb = np.asarray(img.convert("RGB"), dtype=np.uint8)
        except Image.DecompressionBombError:
            raise ImageError(f"the image is larger than the {max_pixels:,} pixels specd "
                             f"accepts") from None
        except (OSError, ValueError, SyntaxError, EOFError) as exc:
            raise ImageError(f"the {img.format} image is truncated or corrupt: {exc}") from None
    return DecodedImage(np.ascontiguousarray(rgb), digest)


def _resample(name: str) -> int:
    from PIL import Image

    return {"bilinear": Image.Resampling.BILINEAR, "bicubic": Image.Resampling.BICUBIC,
            "lanczos": Image.Resampling.LANCZOS}[name]


def resample(rgb: np.ndarray, width: int, height: int, algo: str) -> np.ndarray:
    """`rgb` [H, W, 3] uint8 resized to [height, width, 3] by Pillow's resampler, as
    llama.cpp's `resize_pillow` does: no padding."""
    from PIL import Image

    img = Image.fromarray(rgb, "RGB")
    # one axis at a time, horizontal first as llama.cpp does (Pillow picks its own order
    # when both change, which rounds the intermediate differently)
    if img.width != width:
        img = img.resize((width, img.height), _resample(algo))
    if img.height != height:
        img = img.resize((width, height), _resample(algo))
    return np.asarray(img, dtype=np.uint8)


def resize(rgb: np.ndarray, width: int, height: int, algo: str, *, pad: bool = True
           ) -> np.ndarray:
    """llama.cpp's `img_tool::resize` with PAD_CEIL (pad=True: fit inside, centred on
    black) or PAD_NONE (a stretch): [height, width, 3] uint8."""
    h, w = rgb.shape[:2]
    if (w, h) == (width, height):
        return rgb
    if not pad:
        return resample(rgb, width, height, algo)
    f32 = np.float32
    scale = min(f32(width) / f32(w), f32(height) / f32(h))  # float arithmetic, as llama.cpp
    new_w = min(int(math.ceil(f32(w) * scale)), width)
    new_h = min(int(math.ceil(f32(h) * scale)), height)
    out = np.zeros((height, width, 3), np.uint8)
    x0, y0 = (width - new_w) // 2, (height - new_h) // 2
    out[y0:y0 + new_h, x0:x0 + new_w] = resample(rgb, new_w, new_h, algo)
    return out


def _round_half_away(x: np.float32) -> int:
    return int(math.floor(float(x) + 0.5))


def smart_size(width: int, height: int, align: int, min_pixels: int, max_pixels: int
               ) -> tuple[int, int]:
    """llama.cpp's `calc_size_preserved_ratio` (transformers' smart_resize): a size near
    (width, height), each side a multiple of `align`, the area within [min, max] pixels
    where it can be, in float arithmetic as llama.cpp computes it: (width, height)."""
    f32 = np.float32
    fa = f32(align)
    w_bar = max(align, _round_half_away(f32(width) / fa) * align)
    h_bar = max(align, _round_half_away(f32(height) / fa) * align)
    if max_pixels > 0 and h_bar * w_bar > max_pixels:
        beta = np.sqrt(f32(height) * f32(width) / f32(max_pixels))
        h_bar = max(align, int(math.floor(f32(f32(height) / beta) / fa)) * align)
        w_bar = max(align, int(math.floor(f32(f32(width) / beta) / fa)) * align)
    elif min_pixels > 0 and h_bar * w_bar < min_pixels:
        beta = np.sqrt(f32(min_pixels) / (f32(height) * f32(width)))
        h_bar = int(math.ceil(f32(f32(height) * beta) / fa)) * align
        w_bar = int(math.ceil(f32(f32(width) * beta) / fa)) * align
    return w_bar, h_bar


def normalize(rgb: np.ndarray, mean: tuple[float, float, float],
              std: tuple[float, float, float]) -> np.ndarray:
    """[H, W, 3] uint8 -> [3, H, W] float32: x / 255, then (x - mean) / std per channel,
    in float32 as llama.cpp's clip_image_f32 does."""
    x = rgb.astype(np.float32) / np.float32(255.0)
    y = (x - np.asarray(mean, np.float32)) / np.asarray(std, np.float32)
    return np.ascontiguousarray(y.transpose(2, 0, 1), dtype=np.float32)
