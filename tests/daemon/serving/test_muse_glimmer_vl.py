"""muse-glimmer (the Onyx family) end to end against llama.cpp: a tiny random-weight
checkpoint (text model and vision tower, tests/support/tiny_hf_muse_glimmer.py) converted
by llama.cpp's own convert_hf_to_gguf.py and --mmproj. An image prompt through specd's
engine (its encoder, mtmd's <|image_start|> … <|image_end|> around the image's rows, the
text model's weightless embedding norm over them as over token rows) continues greedily as
llama-server --mmproj does, up to the first near tie."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from specd.daemon.serving.engine import Engine, EngineConfig
from specd.daemon.spec.generation import GenerationParams
from specd.daemon.spec.media import MEDIA_MARKER

from llama_cpp_oracle import missing, mtmd_greedy_with_logprobs
from speculation_checks import decode_all

# the checkpoint is made with torch and transformers, the reference is llama-server's
pytestmark = [pytest.mark.needs_torch, pytest.mark.needs_transformers,
              pytest.mark.llama_cpp_oracle]

NEAR_TIE = 0.25  # top-two logit margin two implementations' rounding may flip
# llama.cpp's f16 products round activations to f16, and this model's logits are scaled
# up (output multiplier 1.5): its text-only log probabilities differ by up to 0.045 too
LOGPROB_TOL = 0.06


@pytest.fixture(scope="module")
def vlm(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The tiny checkpoint's text GGUF (f16) and mmproj (float32)."""
    import llama_cpp_convert

    why = missing("llama-server") or llama_cpp_convert.missing()
    if why:
        pytest.skip(why)
    from tiny_hf_muse_glimmer import convert_vlm

    return convert_vlm(tmp_path_factory.mktemp("muse-glimmer-vlm"))


def png(width: int = 120, height: int = 80, seed: int = 3) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def test_greedy_after_an_image_is_llama_servers(vlm: tuple[Path, Path]) -> None:
    """The same prompt string and image (120 x 80: a grid of 3 rows and 5 columns of
    merged tokens): specd's greedy tokens are llama-server's (--mmproj, its /completion's
    multimodal_data), parting (if at all) only where llama-server's top two are within
    NEAR_TIE, and up to there the likely tokens' log probabilities agree within
    LOGPROB_TOL (an image encoded or placed otherwise moves them by more)."""
    text_gguf, mmproj = vlm
    image = png()
    text = f"Describe {MEDIA_MARKER} in words:"
    n = 24
    theirs = mtmd_greedy_with_logprobs(text_gguf, mmproj, text, [image], n, n_probs=5)
    e = Engine(EngineConfig(target=str(text_gguf), mmproj=str(mmproj), spec_type="none",
                            n_ctx=512, fetch=False))
    prompt, images = e.image_prompt(text, [image])
    assert [im.chunk.grid for im in images] == [(3, 5)]
    gen = e.start(0, prompt, GenerationParams(max_tokens=n, ignore_eos=True, logprobs=5),
                  images=images)
    got = decode_all(gen)
    margins = [two[0] - two[1] if len(two := sorted(top.values(), reverse=True)) > 1 else 0.0
               for _, top in theirs]
    parted = next((i for i, (a, (b, _)) in enumerate(zip(got, theirs, strict=True))
                   if a != b), n)
    assert parted == n or margins[parted] < NEAR_TIE, (parted, margins, got, theirs)
    assert parted >= 8, (parted, got, theirs)
    compared = 0
    for ours, (_, top) in zip(gen.token_logprobs[:parted], theirs, strict=False):
        for tid, lp in ours.top:
            if tid in top:
                assert abs(lp - top[tid]) < LOGPROB_TOL, (tid, lp, top[tid])
                compared += 1
    assert compared >= 2 * parted
