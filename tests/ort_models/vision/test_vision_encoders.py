"""specd's vision encoders (ONNX graphs built from llama.cpp's mmproj files) against the
independent numpy references of tests/support/numpy_vision.py, on images of several
sizes and shapes: equal within float32 rounding. Also: the built graph is cached, and
bad images fail in `prepare` with an ImageError."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
from numpy_vision import gemma3_embeddings, muse_glimmer_embeddings, qwen25vl_embeddings
from PIL import Image

from specd.ort_models.gguf_file import GGUFFile
from specd.ort_models.vision import ImageError, load_vision_encoder
from specd.ort_models.vision.encoder import MODEL_FILE, OrtVisionEncoder

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "vision"
REFERENCES = {"gemma3": gemma3_embeddings, "qwen25vl": qwen25vl_embeddings,
              "muse-glimmer": muse_glimmer_embeddings}


def png(width: int, height: int, seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    rgb = np.stack([x * 255 // width, y * 255 // height, (x * 7 + y * 3) % 256], -1) // 2
    rgb = (rgb + rng.integers(0, 128, rgb.shape)).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, "PNG")
    return buf.getvalue()


@pytest.fixture(scope="module", params=sorted(REFERENCES))
def encoder(request: pytest.FixtureRequest) -> tuple[str, OrtVisionEncoder]:
    return request.param, load_vision_encoder(FIXTURES / f"{request.param}-mmproj.gguf")


# sizes: square, wide, tall, tiny (scaled up), ones with partial windows (Qwen: 7 x 11
# merge groups in windows of 4 x 4; muse-glimmer: 14 x 22 and 8 x 34 patches in windows of
# 4 x 4, its position table resized up and down)
@pytest.mark.parametrize("size", [(56, 56), (100, 70), (60, 150), (9, 9), (300, 200),
                                  (500, 120)])
def test_encoder_equals_numpy_reference(encoder: tuple[str, OrtVisionEncoder],
                                        size: tuple[int, int]) -> None:
    family, enc = encoder
    image = enc.prepare(png(*size))
    out = enc.encode(image)  # [n_tokens, n_embd]
    assert out.shape == (image.n_tokens, enc.n_embd) == (image.grid[0] * image.grid[1], 64)
    assert out.dtype == np.float32
    ref = REFERENCES[family](GGUFFile(FIXTURES / f"{family}-mmproj.gguf"), image.pixels)
    scale = float(np.abs(ref).max())
    assert scale > 0.1  # the tiny model's weights make every block matter
    assert float(np.abs(out - ref).max()) / scale < 2e-6


def test_different_images_give_different_embeddings(
        encoder: tuple[str, OrtVisionEncoder]) -> None:
    _, enc = encoder
    a, b = (enc.encode(enc.prepare(png(100, 70, seed))) for seed in (0, 1))
    assert float(np.abs(a - b).max()) > 1e-3


def test_prepare_refuses_bad_images(encoder: tuple[str, OrtVisionEncoder]) -> None:
    _, enc = encoder
    with pytest.raises(ImageError, match="not an image"):
        enc.prepare(b"GIF89a is what this is not")
    with pytest.raises(ImageError, match="truncated"):
        enc.prepare(png(64, 64)[:200])


def test_the_graph_is_built_once() -> None:
    path = FIXTURES / "gemma3-mmproj.gguf"
    first = load_vision_encoder(path)
    stamp = first.model_path.stat().st_mtime_ns
    again = load_vision_encoder(path)
    assert again.model_path == first.model_path and again.model_path.name == MODEL_FILE
    assert again.model_path.stat().st_mtime_ns == stamp
    assert first.projector == "gemma3" and first.n_embd == 64
