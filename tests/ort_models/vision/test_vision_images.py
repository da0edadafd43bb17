"""Images in: decoding (PNG, JPEG, WebP) and every bad upload refused with a clear
ImageError; llama.cpp's resize (Pillow's resampler, checked against an independent numpy
port), its aspect-preserving padding, its smart size and its normalisation."""

from __future__ import annotations

import hashlib
import io
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from numpy_vision import pillow_resize
from PIL import Image

from specd.ort_models.vision import ImageError
from specd.ort_models.vision.encoder import read_checked
from specd.ort_models.vision.image_input import (
    decode_image,
    normalize,
    resample,
    resize,
    smart_size,
)

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "vision"


def picture(width: int = 37, height: int = 23, seed: int = 0) -> np.ndarray:
    """[height, width, 3] uint8: gradients plus noise (every resample weight matters)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 // width, y * 255 // height, (x * y) % 256], -1)
    return ((base // 2) + rng.integers(0, 128, base.shape)).astype(np.uint8)


def encoded(rgb: np.ndarray, fmt: str, **kw: object) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, fmt, **kw)
    return buf.getvalue()


@pytest.mark.parametrize("fmt", ["PNG", "WEBP"])
def test_lossless_formats_decode_to_their_pixels(fmt: str) -> None:
    rgb = picture()
    data = encoded(rgb, fmt, **({"lossless": True} if fmt == "WEBP" else {}))
    out = decode_image(data)
    assert np.array_equal(out.rgb, rgb)
    assert out.digest == hashlib.sha256(data).hexdigest()


def test_jpeg_decodes_near_its_pixels() -> None:
    y, x = np.mgrid[0:48, 0:64]
    rgb = np.stack([x * 4, y * 5, (x + y) * 2], -1).astype(np.uint8)  # smooth
    out = decode_image(encoded(rgb, "JPEG", quality=95)).rgb
    assert out.shape == rgb.shape and np.abs(out.astype(int) - rgb).mean() < 3


def test_alpha_and_grey_become_rgb() -> None:
    rgba = np.dstack([picture(), np.full((23, 37), 7, np.uint8)])
    assert np.array_equal(decode_image(encoded(rgba, "PNG")).rgb, rgba[..., :3])  # dropped
    grey = picture()[..., 0]
    assert np.array_equal(decode_image(encoded(grey, "PNG")).rgb, np.dstack([grey] * 3))


def test_an_animated_png_gives_its_first_frame() -> None:
    frames = [Image.fromarray(picture(seed=s)) for s in range(3)]
    buf = io.BytesIO()
    frames[0].save(buf, "PNG", save_all=True, append_images=frames[1:])
    assert np.array_equal(decode_image(buf.getvalue()).rgb, picture(seed=0))


@pytest.mark.parametrize(("data", "message"), [
    (b"", r"empty \(0 bytes\)"),
    (b"hello, this is text", r"not an image specd can read .*b'hello, t'"),
    (encoded(picture(), "GIF"), r"unsupported image format GIF"),
    (encoded(picture(), "TIFF"), r"unsupported image format TIFF"),
    (encoded(picture(), "BMP"), r"unsupported image format BMP"),
    (encoded(picture(64, 64), "PNG")[:300], r"PNG image is truncated or corrupt"),
    (encoded(picture(64, 64), "JPEG")[:400], r"truncated or its header is corrupt"),
    (encoded(picture(64, 64), "JPEG")[:-10], r"JPEG image is truncated or corrupt"),
    (encoded(picture(64, 64), "WEBP")[:100], r"truncated"),
])
def test_bad_uploads_are_refused_with_their_problem(data: bytes, message: str) -> None:
    with pytest.raises(ImageError, match=message):
        decode_image(data)


def test_a_decompression_bomb_is_refused_from_its_header() -> None:
    # 12,000 x 12,000 one-bit pixels: a few kilobytes of PNG, 144 million pixels
    buf = io.BytesIO()
    Image.new("1", (12_000, 12_000)).save(buf, "PNG")
    assert len(buf.getvalue()) < 100_000
    with pytest.raises(ImageError, match=r"12,000x12,000 = 144,000,000 pixels, more than "
                                         r"the 50,000,000"):
        decode_image(buf.getvalue())
    with pytest.raises(ImageError, match=r"more than the 100 specd accepts"):
        decode_image(encoded(picture(), "PNG"), max_pixels=100)


def test_an_image_error_is_a_value_error() -> None:
    assert issubclass(ImageError, ValueError)  # the APIs map it to a 400


@pytest.mark.parametrize("algo", ["bilinear", "bicubic", "lanczos"])
@pytest.mark.parametrize("size", [(56, 56), (17, 40), (100, 9), (37, 23)])
def test_pillows_resample_is_llama_cpps(algo: str, size: tuple[int, int]) -> None:
    rgb = picture()
    assert np.array_equal(resample(rgb, *size, algo), pillow_resize(rgb, *size, algo))


def test_a_resize_with_padding_fits_and_centres_on_black() -> None:
    rgb = picture(40, 20)
    out = resize(rgb, 56, 56, "bilinear")  # scale 1.4: 56 x 28, rows 14..41
    assert out.shape == (56, 56, 3)
    assert not out[:14].any() and not out[42:].any()
    assert np.array_equal(out[14:42], pillow_resize(rgb, 56, 28, "bilinear"))
    stretched = resize(rgb, 56, 56, "bilinear", pad=False)
    assert np.array_equal(stretched, pillow_resize(rgb, 56, 56, "bilinear"))


@pytest.mark.parametrize(("size", "expected"), [
    ((100, 70), (112, 84)),  # 70/28 = 2.5 rounds away from zero, as std::round
    ((300, 200), (308, 196)),
    ((10, 10), (84, 84)),  # below 8 tokens: scaled up to the minimum
    ((5000, 4000), (1988, 1596)),  # above 4096 tokens: scaled down (floor)
])
def test_smart_size_is_llama_cpps(size: tuple[int, int], expected: tuple[int, int]) -> None:
    area = 28 * 28
    assert smart_size(*size, 28, 8 * area, 4096 * area) == expected


def test_normalise_is_per_channel_in_float32() -> None:
    rgb = picture()
    out = normalize(rgb, (0.1, 0.2, 0.3), (0.5, 0.25, 2.0))
    assert out.shape == (3, 23, 37) and out.dtype == np.float32
    want = (rgb.astype(np.float32) / np.float32(255) - np.float32(0.2)) / np.float32(0.25)
    assert np.array_equal(out[1], want[..., 1])


def test_families_prepare_their_grids() -> None:
    _, gemma, ghp = read_checked(FIXTURES / "gemma3-mmproj.gguf")
    img = gemma.prepare(decode_image(encoded(picture(100, 70), "PNG")), ghp)
    assert img.pixels.shape == (3, 56, 56) and img.grid == (2, 2) and img.n_tokens == 4
    _, qwen, qhp = read_checked(FIXTURES / "qwen25vl-mmproj.gguf")
    img = qwen.prepare(decode_image(encoded(picture(300, 200), "PNG")), qhp)
    assert img.pixels.shape == (3, 196, 308) and img.grid == (7, 11) and img.n_tokens == 77


@pytest.mark.parametrize("size", [(100, 70), (300, 200), (40, 90), (9, 9), (500, 120)])
def test_muse_glimmer_prepares_a_stretched_lanczos_grid(size: tuple[int, int]) -> None:
    """mtmd's muse-glimmer preprocessor: the grid of 28-pixel cells nearest the aspect
    ratio, the image stretched onto it (Lanczos, no padding), then normalised."""
    _, family, hp = read_checked(FIXTURES / "muse-glimmer-mmproj.gguf")
    rgb = picture(*size)
    img = family.prepare(decode_image(encoded(rgb, "PNG")), hp)
    rows, cols = img.grid
    assert img.n_tokens == rows * cols
    want = normalize(pillow_resize(rgb, cols * 28, rows * 28, "lanczos"), hp.image_mean,
                     hp.image_std)
    assert np.array_equal(img.pixels, want)


def transformers_smart_resize() -> Any:
    """transformers' muse-glimmer `smart_resize`, taken from its module's source: the
    module imports torchvision, which the function does not need."""
    import ast
    import importlib.util
    import itertools
    import math

    spec = importlib.util.find_spec("transformers")
    if spec is None or spec.origin is None:
        pytest.skip("transformers is not installed")
    path = (Path(spec.origin).parent / "models" / "muse_glimmer"
            / "image_processing_muse_glimmer.py")
    if not path.is_file():
        pytest.skip(f"this transformers has no muse-glimmer image processor ({path})")
    tree = ast.parse(path.read_text())
    fn = next(n for n in tree.body
              if isinstance(n, ast.FunctionDef) and n.name == "smart_resize")
    scope: dict[str, Any] = {"math": math, "itertools": itertools}
    exec(compile(ast.Module([fn], type_ignores=[]), str(path), "exec"), scope)
    return scope["smart_resize"]


@pytest.mark.needs_transformers
def test_muse_glimmer_grid_is_transformers_smart_resize() -> None:
    """grid_size against transformers' own muse-glimmer smart_resize (an independent
    implementation) wherever its choice is unique, and the 4096-token cap."""
    smart_resize = transformers_smart_resize()
    from specd.ort_models.vision.muse_glimmer import grid_size

    rng = np.random.default_rng(0)
    sizes = [(int(w), int(h)) for w, h in rng.integers(1, 4000, (300, 2))]
    sizes += [(9, 9), (28, 28), (100, 70), (7000, 50), (50, 7000), (6000, 4000)]
    compared = 0
    for w, h in sizes:
        rows, cols = grid_size(w, h, 28, 4096)
        assert 1 <= rows * cols <= 4096
        th, tw = smart_resize(h, w, 28, 4096)
        cands = {(r, c) for r in (th // 28 - 1, th // 28, th // 28 + 1)
                 for c in (tw // 28 - 1, tw // 28, tw // 28 + 1)}
        best = abs(th / tw - h / w)
        if any(0 < r * c <= 4096 and (r, c) != (th // 28, tw // 28)
               and abs(r / c - h / w) == best for r, c in cands):
            continue  # a tie, which mtmd breaks towards more tokens
        assert (rows * 28, cols * 28) == (th, tw), (w, h)
        compared += 1
    assert compared > 250


def test_muse_glimmer_grid_ties_go_to_more_tokens() -> None:
    from specd.ort_models.vision.muse_glimmer import grid_size

    # 42 x 42 pixels: 1.5 cells a side; 1 x 1 and 2 x 2 are both exactly square
    assert grid_size(42, 42, 28, 4096) == (2, 2)
