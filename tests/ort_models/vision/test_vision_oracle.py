"""llama.cpp's mtmd as the oracle of specd's vision encoders: tiny random-weight VLMs made
with transformers and converted by llama.cpp's own convert_hf_to_gguf.py (text model and
--mmproj, tests/support/tiny_vlm.py), the same PNG files encoded by llama-mtmd-cli (its
MTMD_DEBUG_EMBEDDINGS dump) and by specd. Equal within llama.cpp's own rounding: its CPU
GELU reads a float16 table and its F16 matrices (Gemma 3's input projection) multiply
float16 activations, about 1e-3 of the embeddings' scale; a difference of preprocessing,
order or semantics moves them by far more. Skipped without the binary, or without torch
and transformers to make the checkpoints."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import tiny_vlm
from PIL import Image

from specd.ort_models.vision import load_vision_encoder

from llama_cpp_oracle import missing, mtmd_image_embeddings

# llama-mtmd-cli's embeddings of checkpoints llama.cpp's converter wrote (torch, transformers)
pytestmark = [pytest.mark.llama_cpp_oracle, pytest.mark.needs_torch,
              pytest.mark.needs_transformers]

CHAT_TEMPLATE = {"gemma3": "gemma", "qwen25vl": ""}  # the tiny gemma has none of its own
TOLERANCE = 2e-3  # of the embeddings' largest magnitude


@pytest.fixture(scope="module")
def tiny_vlms() -> dict[str, tiny_vlm.TinyVlm]:
    """Both families' tiny VLMs, made once per machine (cached by tiny_vlm.py's hash)."""
    why = missing("llama-mtmd-cli") or tiny_vlm.missing()
    if why:
        pytest.skip(why)
    return {family: tiny_vlm.cached_tiny_vlm(family) for family in tiny_vlm.BUILDERS}


def write_png(path: Path, width: int, height: int, seed: int) -> Path:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    rgb = np.stack([x * 255 // width, y * 255 // height, (x + y) % 256], -1) // 2
    buf = io.BytesIO()
    Image.fromarray((rgb + rng.integers(0, 128, rgb.shape)).astype(np.uint8)).save(buf, "PNG")
    path.write_bytes(buf.getvalue())
    return path


@pytest.mark.parametrize("family", sorted(tiny_vlm.BUILDERS))
@pytest.mark.parametrize("size", [(100, 70), (300, 200), (40, 90)])
def test_embeddings_equal_llama_cpps(tiny_vlms: dict[str, tiny_vlm.TinyVlm], family: str,
                                     size: tuple[int, int], tmp_path: Path) -> None:
    vlm = tiny_vlms[family]
    image = write_png(tmp_path / "image.png", *size, seed=size[0])
    theirs = mtmd_image_embeddings(vlm.text, vlm.mmproj, image,
                                   chat_template=CHAT_TEMPLATE[family]).embeddings
    enc = load_vision_encoder(vlm.mmproj)
    ours = enc.encode(enc.prepare(image.read_bytes()))
    assert ours.shape == theirs.shape
    scale = float(np.abs(theirs).max())
    assert scale > 0.1
    assert float(np.abs(ours - theirs).max()) / scale < TOLERANCE


@pytest.fixture(scope="module")
def tiny_muse_glimmer(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny muse-glimmer (tests/support/tiny_hf_muse_glimmer.py) converted by llama.cpp:
    its text GGUF and mmproj."""
    import llama_cpp_convert

    why = missing("llama-mtmd-cli") or llama_cpp_convert.missing()
    if why:
        pytest.skip(why)
    from tiny_hf_muse_glimmer import convert_vlm

    return convert_vlm(tmp_path_factory.mktemp("muse-glimmer-vlm"))


# a square grid equal to the 4 x 4 position table, wide and tall ones (the table resized up
# and down), several windows with partial ones, and the smallest (one token)
@pytest.mark.parametrize("size", [(56, 56), (100, 70), (300, 200), (40, 90), (500, 120),
                                  (9, 9)])
def test_muse_glimmer_embeddings_equal_llama_cpps(tiny_muse_glimmer: tuple[Path, Path],
                                                  size: tuple[int, int],
                                                  tmp_path: Path) -> None:
    text, mmproj = tiny_muse_glimmer
    image = write_png(tmp_path / "image.png", *size, seed=size[0])
    theirs = mtmd_image_embeddings(text, mmproj, image, chat_template="chatml").embeddings
    enc = load_vision_encoder(mmproj)
    ours = enc.encode(enc.prepare(image.read_bytes()))
    assert ours.shape == theirs.shape
    scale = float(np.abs(theirs).max())
    assert scale > 0.1
    assert float(np.abs(ours - theirs).max()) / scale < TOLERANCE
