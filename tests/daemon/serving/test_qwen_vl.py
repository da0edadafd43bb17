"""Qwen2.5-VL end to end against llama.cpp: a tiny random-weight checkpoint (text model
and vision tower, converted by llama.cpp's own convert_hf_to_gguf.py and --mmproj:
tests/support/tiny_vlm.py). The qwen2vl text model's log probabilities and greedy
continuation are llama-server's; an image prompt through specd's engine (its encoder,
mtmd's M-RoPE grid positions) continues greedily as llama-server --mmproj does, up to
the first near tie; and prompt lookup after an image leaves that output byte-identical
while its rounds are drafted. (A drafter head gets no M-RoPE positions yet.)"""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import pytest
import tiny_vlm
from PIL import Image

from specd.daemon.serving.engine import Engine, EngineConfig
from specd.daemon.spec.drafter import DraftParams
from specd.daemon.spec.generation import GenerationParams
from specd.daemon.spec.media import MEDIA_MARKER
from specd.daemon.spec.sampling import SamplerParams

from llama_cpp_oracle import greedy_with_logprobs, missing, mtmd_greedy_with_logprobs
from logprob_agreement import assert_agrees, assert_continuation_agrees, assert_generation_agrees
from speculation_checks import assert_drafted, decode_all

# the checkpoints are made with torch and transformers
pytestmark = [pytest.mark.needs_torch, pytest.mark.needs_transformers]

NEAR_TIE = 0.25  # top-two logit margin two implementations' rounding may flip
LOGPROB_TOL = 0.03  # llama.cpp's f16 products round activations to f16
# "Describe the picture in a few words, then say it again." in Qwen2.5's ids
PROMPT = [74785, 279, 6802, 304, 264, 2421, 4244, 11, 1221, 1977, 432, 1549, 13]


@pytest.fixture(scope="module")
def vlm() -> tiny_vlm.TinyVlm:
    return tiny_vlm.tiny_vlm_or_skip("qwen25vl")


def png(width: int = 120, height: int = 80, seed: int = 3) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def engine(vlm: tiny_vlm.TinyVlm, spec_type: str = "none") -> Engine:
    return Engine(EngineConfig(target=str(vlm.text), mmproj=str(vlm.mmproj),
                               spec_type=spec_type, n_ctx=512, fetch=False))


@pytest.mark.llama_cpp_oracle
def test_text_model_is_llama_servers(vlm: tiny_vlm.TinyVlm) -> None:
    """Text only (every M-RoPE section the position): llama.cpp's likely tokens' log
    probabilities, and its greedy continuation up to specd's first near tie."""
    if why := missing("llama-server"):
        pytest.skip(why)
    theirs = greedy_with_logprobs(vlm.text, PROMPT, 16)
    assert_agrees(vlm.text, PROMPT, theirs, 0.05, likely=-30.0)
    assert_continuation_agrees(vlm.text, PROMPT, 24, near=0.05)


@pytest.mark.llama_cpp_oracle
def test_greedy_after_an_image_is_llama_servers(vlm: tiny_vlm.TinyVlm) -> None:
    """The same prompt string and image (120 x 80: a grid of 3 rows and 4 columns): specd's
    greedy tokens are llama-server's (--mmproj, its /completion's multimodal_data),
    parting (if at all) only where llama-server's top two are within NEAR_TIE, and up to
    there the likely tokens' log probabilities agree within LOGPROB_TOL (an image's rows
    placed otherwise, e.g. rows and columns swapped, moves them by more)."""
    if why := missing("llama-server"):
        pytest.skip(why)
    image = png()
    text = f"Describe {MEDIA_MARKER} in words:"
    n = 24
    theirs = mtmd_greedy_with_logprobs(vlm.text, vlm.mmproj, text, [image], n, n_probs=5)
    e = engine(vlm)
    prompt, images = e.image_prompt(text, [image])
    assert [im.chunk.grid for im in images] == [(3, 4)]  # 12 tokens, 4 rope positions
    gen = e.start(0, prompt, GenerationParams(max_tokens=n, ignore_eos=True, logprobs=5),
                  images=images)
    decode_all(gen)
    assert_generation_agrees(gen, theirs, near_tie=NEAR_TIE, tol=LOGPROB_TOL)


def test_prompt_lookup_after_an_image_is_the_targets(vlm: tiny_vlm.TinyVlm) -> None:
    """Greedy output of a two-image prompt is byte-identical with and without prompt
    lookup, and rounds were drafted after the images. The random model's text is kept
    to the prompt's words by a logit bias (the same on both runs), so lookup finds
    matches."""
    def run(spec_type: str) -> tuple[list[int], Any]:
        e = engine(vlm, spec_type)
        text = "Say it again and again: red blue red blue red blue " + MEDIA_MARKER
        prompt, images = e.image_prompt(text * 2, [png(seed=5), png(90, 130, seed=6)])
        words = {t: 40.0 for t in e.tokenizer.encode(" red blue", add_bos=False,
                                                      add_eos=False)}
        gen = e.start(0, prompt, GenerationParams(
            max_tokens=48, ignore_eos=True, draft=DraftParams(n_max=3), adaptive=False,
            sampling=SamplerParams(temperature=0.0, logit_bias=words)), images=images)
        return decode_all(gen), gen.stats

    want, _ = run("none")
    got, stats = run("ngram")
    assert got == want
    assert_drafted(stats)
    assert stats.accepted > 0, stats.as_dict()
