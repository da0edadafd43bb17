"""muse-glimmer (the Onyx family) end to end against llama.cpp: a tiny random-weight
checkpoint (text model and vision tower, tests/support/tiny_hf_muse_glimmer.py) converted
by llama.cpp's own convert_hf_to_gguf.py and --mmproj. An image prompt through specd's
engine (its encoder, mtmd's <|image_start|> … <|image_end|> around the image's rows, the
text model's weightless embedding norm over them as over token rows) continues greedily as
llama-server --mmproj does, up to the first near tie; prompt lookup and a DFlash head
(a transformers MuseGlimmerAssistantModel converted by llama.cpp, fed the target's
features over the image's positions) draft after the image and leave the greedy output
byte-identical to the target's alone."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from specd.daemon.serving.engine import Engine, EngineConfig
from specd.daemon.spec.drafter import DraftParams
from specd.daemon.spec.generation import GenerationParams
from specd.daemon.spec.media import MEDIA_MARKER
from specd.daemon.spec.sampling import SamplerParams
from specd.daemon.spec.stats import SpecStats
from specd.ort_models.gguf_file import GGUFFile

from llama_cpp_oracle import missing, mtmd_greedy_with_logprobs
from logprob_agreement import assert_generation_agrees
from speculation_checks import assert_drafted, assert_speculated, decode_all

# the checkpoint is made with torch and transformers
pytestmark = [pytest.mark.needs_torch, pytest.mark.needs_transformers]

NEAR_TIE = 0.25  # top-two logit margin two implementations' rounding may flip
# llama.cpp's f16 products round activations to f16, and this model's logits are scaled
# up (output multiplier 1.5): its text-only log probabilities differ by up to 0.045 too
LOGPROB_TOL = 0.06


@pytest.fixture(scope="module")
def vlm(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The tiny checkpoint's text GGUF (f16) and mmproj (float32)."""
    import llama_cpp_convert

    if why := llama_cpp_convert.missing():
        pytest.skip(why)
    from tiny_hf_muse_glimmer import convert_vlm

    return convert_vlm(tmp_path_factory.mktemp("muse-glimmer-vlm"))


def png(width: int = 120, height: int = 80, seed: int = 3) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


@pytest.mark.llama_cpp_oracle
def test_greedy_after_an_image_is_llama_servers(vlm: tuple[Path, Path]) -> None:
    """The same prompt string and image (120 x 80: a grid of 3 rows and 5 columns of
    merged tokens): specd's greedy tokens are llama-server's (--mmproj, its /completion's
    multimodal_data), parting (if at all) only where llama-server's top two are within
    NEAR_TIE, and up to there the likely tokens' log probabilities agree within
    LOGPROB_TOL (an image encoded or placed otherwise moves them by more)."""
    if why := missing("llama-server"):
        pytest.skip(why)
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
    decode_all(gen)
    assert_generation_agrees(gen, theirs, near_tie=NEAR_TIE, tol=LOGPROB_TOL)


@pytest.fixture(scope="module")
def dflash_head(vlm: tuple[Path, Path]) -> Path:
    """A tiny MuseGlimmerAssistantModel for the checkpoint, converted by llama.cpp."""
    import llama_cpp_convert
    from tiny_hf_muse_glimmer import write_assistant

    root = vlm[0].parent
    n_vocab = GGUFFile(vlm[0]).tensor("token_embd.weight").shape[0]
    head = write_assistant(root / "assistant-hf", n_vocab, seed=1)
    return llama_cpp_convert.convert(head, root / "dflash.gguf", target_model_dir=root / "hf")


def _run_after_images(vlm: tuple[Path, Path], spec_type: str, draft: Path | None = None
                      ) -> tuple[list[int], SpecStats]:
    """Greedy after two images (the random model's text kept to the prompt's words by a
    logit bias, the same on every run, so that prompt lookup finds matches)."""
    e = Engine(EngineConfig(target=str(vlm[0]), mmproj=str(vlm[1]), spec_type=spec_type,
                            draft=None if draft is None else str(draft), n_ctx=512,
                            fetch=False))
    text = "Say it again and again: red blue red blue red blue " + MEDIA_MARKER
    prompt, images = e.image_prompt(text * 2, [png(seed=5), png(90, 130, seed=6)])
    words = {t: 40.0 for t in e.tokenizer.encode(" red blue", add_bos=False, add_eos=False)}
    gen = e.start(0, prompt, GenerationParams(
        max_tokens=48, ignore_eos=True, draft=DraftParams(n_max=3), adaptive=False,
        sampling=SamplerParams(temperature=0.0, logit_bias=words)), images=images)
    return decode_all(gen), gen.stats


def test_prompt_lookup_after_an_image_is_the_targets(vlm: tuple[Path, Path]) -> None:
    want, _ = _run_after_images(vlm, "none")
    got, stats = _run_after_images(vlm, "ngram")
    assert got == want
    assert_speculated(stats)


def test_a_dflash_head_after_an_image_is_the_targets(vlm: tuple[Path, Path],
                                                     dflash_head: Path) -> None:
    """The head (with prompt lookup in front, as the spec type chains them) drafts after
    the images, its KV seeded with the target's features over their positions."""
    want, _ = _run_after_images(vlm, "none")
    got, stats = _run_after_images(vlm, "draft-dflash", dflash_head)
    assert got == want
    assert_drafted(stats)
    assert stats.source_calls.get("dflash", 0) > 0, stats.as_dict()  # the head's own rounds
