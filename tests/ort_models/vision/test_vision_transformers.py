"""muse-glimmer's encoder against transformers' own model (MuseGlimmerModel
.get_image_features) on a tiny random checkpoint that llama.cpp's converter turned into
the mmproj: where the patch grid is the position table's own (no resize), specd's rows,
RMS-normed without a weight as transformers' perception_emb_norm does (llama.cpp's text
model does the same through its embedding norm), are transformers' within float32
rounding. That checks the converter's layouts as specd reads them (the temporal kernel
summed, Q/K un-permuted, the pixel shuffle's channel order) against the model itself.

Where the grid differs from the table, llama.cpp (specd's oracle, which specd follows)
resizes it with edges clamped (ggml_interpolate) where transformers' grid_sample pads
with zeros, so the two differ there (by 0.6% of the embeddings' scale on an 8 × 8 grid).
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from specd.ort_models.vision import load_vision_encoder

pytestmark = [pytest.mark.needs_torch, pytest.mark.needs_transformers]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The tiny checkpoint's folder and its mmproj, converted by llama.cpp."""
    import llama_cpp_convert

    if why := llama_cpp_convert.missing():
        pytest.skip(why)
    from tiny_hf_muse_glimmer import convert_vlm

    root = tmp_path_factory.mktemp("muse-glimmer-hf")
    _, mmproj = convert_vlm(root)
    return root / "hf", mmproj


def test_embeddings_are_transformers(checkpoint: tuple[Path, Path]) -> None:
    import torch
    from transformers import MuseGlimmerForConditionalGeneration

    folder, mmproj = checkpoint
    model = MuseGlimmerForConditionalGeneration.from_pretrained(folder, dtype=torch.float32)
    enc = load_vision_encoder(mmproj)
    buf = io.BytesIO()
    rgb = np.random.default_rng(1).integers(0, 256, (56, 56, 3), dtype=np.uint8)
    Image.fromarray(rgb).save(buf, "PNG")
    image = enc.prepare(buf.getvalue())
    assert image.grid == (2, 2)  # 4 x 4 patches: the position table's own grid
    p = 14
    _, h, w = image.pixels.shape
    gh, gw = h // p, w // p
    # transformers' pixel_values: a row per patch (raster order), both temporal frames
    patches = image.pixels.reshape(3, gh, p, gw, p).transpose(1, 3, 0, 2, 4)
    patches = patches.reshape(gh * gw, 3 * p * p)
    pixel_values = torch.from_numpy(np.concatenate([patches, patches], axis=1))
    with torch.no_grad():
        theirs = model.model.get_image_features(
            pixel_values, torch.tensor([[1, gh, gw]])).pooler_output[0].numpy()
    ours = enc.encode(image).astype(np.float64)
    eps = model.config.text_config.rms_norm_eps
    ours = ours / np.sqrt((ours * ours).mean(-1, keepdims=True) + eps)
    assert ours.shape == theirs.shape == (4, 64)
    assert float(np.abs(ours - theirs).max()) / float(np.abs(theirs).max()) < 1e-5
