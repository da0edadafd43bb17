"""Images on an M-RoPE target (qwen2vl, Qwen-VL's text model): an image's tokens at
their grid positions and the text after it max(rows, cols) past the image's start, as
llama.cpp's mtmd places them (media.mrope_positions), through Generation's prefill and
rounds, against the numpy reference; prompt lookup and an M-RoPE draft model after an
image byte-identical to the target alone, the draft placing the text as the target does;
a reused prefix past an image keeps its positions."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from specd.daemon.drafters.composite import CompositeDrafter
from specd.daemon.drafters.draft_model import DraftModelDrafter
from specd.daemon.drafters.ngram import NgramDrafter
from specd.daemon.models.building import build_options, image_options
from specd.daemon.spec.drafter import Drafter, DraftParams
from specd.daemon.spec.generation import Generation, GenerationParams, RequestError
from specd.daemon.spec.media import ImageChunk, PromptImage, assemble, mrope_positions
from specd.ort_models.graph_builder import BuildOptions
from specd.ort_models.model_cache import load_or_build
from specd.ort_models.runner import ModelRunner
from specd.ort_models.shared_initializers import same_named

from numpy_reference import ReferenceModel
from speculation_checks import assert_drafted, decode_all
from tiny_gguf import write_tiny_qwen2vl

BEFORE = [348, 20, 31, 42, 53]
# text after the image that repeats itself: prompt lookup has matches to offer
AFTER = [64, 75, 86, 97, 108, 64, 75, 86, 97, 108, 64, 75]
GRID = (3, 8)  # 24 tokens taking 8 rope positions
MAX_TOKENS = 96


@pytest.fixture(scope="module")
def qwen2vl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_qwen2vl(tmp_path_factory.mktemp("qwen2vl") / "tiny.gguf",
                              sections=(2, 3, 3, 0), seed=20, weight_type="Q8_0")


def image(n_embd: int, seed: int = 0, grid: tuple[int, int] | None = GRID) -> ImageChunk:
    n = GRID[0] * GRID[1]
    rows = np.random.default_rng(seed).normal(0, 1.0, (n, n_embd)).astype(np.float32)
    return ImageChunk(rows, f"{seed:064x}", grid)


def with_embeddings(built: Any) -> ModelRunner:
    r = ModelRunner(built, n_ctx=512)
    emb = load_or_build(built.gguf_path, image_options(built.options, built.hparams.arch))
    r.attach_embeddings(emb, same_named(emb.model_path, built.model_path))
    return r


def generate(r: ModelRunner, segments: list[Any], drafter: Drafter | None = None,
             reuse: int = 0, **params: Any) -> tuple[list[int], Generation]:
    prompt, images = assemble(segments)
    params = {"max_tokens": 32, "ignore_eos": True, **params}
    gen = Generation(r, 0, prompt, GenerationParams(**params), eog=set(), drafter=drafter,
                     images=images, reuse=reuse)
    return decode_all(gen), gen


def test_positions_are_mtmds() -> None:
    """Text, a 2 x 3 image at rope position 3, text from rope position 3 + 3 on; a
    second image after it starts where the text left off."""
    a = ImageChunk(np.zeros((6, 4), np.float32), "a" * 64, (2, 3))
    b = ImageChunk(np.zeros((4, 4), np.float32), "b" * 64, (4, 1))
    images = (PromptImage(3, a), PromptImage(11, b))
    pos = mrope_positions(images, 0, 17)
    assert pos.tolist() == [
        [0, 1, 2, 3, 3, 3, 3, 3, 3, 6, 7, 8, 8, 8, 8, 12, 13],
        [0, 1, 2, 3, 3, 3, 4, 4, 4, 6, 7, 8, 9, 10, 11, 12, 13],
        [0, 1, 2, 3, 4, 5, 3, 4, 5, 6, 7, 8, 8, 8, 8, 12, 13],
        [0] * 17]
    # any window of it (a chunk, a round past the prompt) is the same rows
    assert np.array_equal(mrope_positions(images, 5, 14), pos[:, 5:14])
    assert mrope_positions(images, 20, 22).tolist() == [[17, 18]] * 3 + [[0, 0]]


@pytest.mark.parametrize(("options", "near"), [
    pytest.param(BuildOptions(accuracy_level=1), 1e-2, id="exact"),
    # int8 activations (specd's GgufMatMul) and an f16 KV cache: a wider near tie
    pytest.param(build_options("target"), 0.25, id="serving")])
def test_greedy_after_an_image_is_the_references(qwen2vl: Path, options: BuildOptions,
                                                 near: float) -> None:
    """Prefill through Generation, then its rounds: greedy tokens are the float64
    reference's (at mtmd's positions) up to its first near tie."""
    r = with_embeddings(load_or_build(qwen2vl, options))
    img = image(r.hp.n_embd)
    got, gen = generate(r, [BEFORE, img, AFTER], max_tokens=12)
    prompt, images = assemble([BEFORE, img, AFTER])
    ref = ReferenceModel(qwen2vl)
    cache = ref.new_cache()
    p0, p1 = len(BEFORE), len(BEFORE) + img.n_tokens
    ref.step(BEFORE, cache)
    ref.step_embeddings(img.embeddings, cache, rope_positions=mrope_positions(images, p0, p1))
    logits = ref.step(AFTER, cache, rope_positions=mrope_positions(images, p1, len(prompt)))[-1]
    compared = 0
    for i, tok in enumerate(got):
        top2 = np.sort(logits)[-2:]
        if top2[1] - top2[0] < near:
            break  # a near tie: float32 (or the serving graph's int8 products) may differ
        assert tok == int(np.argmax(logits)), (i, top2[1] - top2[0])
        compared += 1
        pos = len(prompt) + i
        logits = ref.step([tok], cache, rope_positions=mrope_positions(images, pos, pos + 1))[-1]
    assert compared >= 4


def test_text_only_prompts_are_at_their_kv_positions(qwen2vl: Path) -> None:
    """No image: every section is the position (the runner's default), the reference's."""
    r = ModelRunner(load_or_build(qwen2vl, BuildOptions(accuracy_level=1)), n_ctx=512)
    prompt = BEFORE + AFTER
    gen = Generation(r, 0, prompt, GenerationParams(max_tokens=6, ignore_eos=True), eog=set())
    assert decode_all(gen) == ReferenceModel(qwen2vl).greedy(prompt, 6)


def test_prompt_lookup_after_an_image(qwen2vl: Path) -> None:
    """Greedy output with prompt lookup equals the target's alone, rounds drafted over
    rows shifted from their KV positions."""
    built = load_or_build(qwen2vl, build_options("target"))
    r = with_embeddings(built)
    segments = [BEFORE, image(r.hp.n_embd), AFTER]
    want, _ = generate(r, segments, max_tokens=MAX_TOKENS)
    got, gen = generate(r, segments, NgramDrafter(), draft=DraftParams(n_max=3),
                        max_tokens=MAX_TOKENS)
    assert got == want
    assert_drafted(gen.stats)
    assert gen.stats.accepted > 0


def test_an_m_rope_draft_model_after_an_image(qwen2vl: Path) -> None:
    """A qwen2vl draft model (the target's own file, without vision) places the text after
    the image where the target has it. The image's rows here are token 0's embedding,
    which the draft reads at the placeholders: its view is the target's, so every draft
    is accepted (a draft at its KV positions would part from the target after the
    image); the output is the target's alone."""
    built = load_or_build(qwen2vl, BuildOptions(accuracy_level=1))
    r = with_embeddings(built)
    row0 = ReferenceModel(qwen2vl).weights["token_embd.weight"][0].astype(np.float32)
    n = GRID[0] * GRID[1]
    segments = [BEFORE, ImageChunk(np.tile(row0, (n, 1)), "0" * 64, GRID), AFTER]
    want, _ = generate(r, segments, max_tokens=MAX_TOKENS)
    draft = DraftModelDrafter(ModelRunner(built, n_ctx=512))
    got, gen = generate(r, segments, draft, draft=DraftParams(n_max=3), max_tokens=MAX_TOKENS)
    assert got == want
    assert_drafted(gen.stats)
    assert gen.stats.accepted == gen.stats.drafted, gen.stats.as_dict()
    # beside prompt lookup: the composite hands the draft model the images too
    both = CompositeDrafter("draft+ngram", [DraftModelDrafter(ModelRunner(built, n_ctx=512))])
    got, gen = generate(r, segments, both, draft=DraftParams(n_max=3), max_tokens=MAX_TOKENS)
    assert got == want
    assert_drafted(gen.stats)  # (its lookup offers are not all accepted)
    assert gen.stats.accepted > 0


def test_a_reused_prefix_past_an_image_keeps_its_positions(qwen2vl: Path) -> None:
    """A follow-up whose cached prefix holds the image: the text after it is evaluated at
    the shifted positions, as a fresh prefill's."""
    r = with_embeddings(load_or_build(qwen2vl, BuildOptions(accuracy_level=1)))
    segments = [BEFORE, image(r.hp.n_embd, 3), AFTER]
    fresh, _ = generate(r, segments)
    reuse = len(BEFORE) + GRID[0] * GRID[1] + 4
    again, gen = generate(r, segments, reuse=reuse)
    assert gen.stats.cached_tokens == reuse
    assert again == fresh


def test_an_image_without_its_grid_is_refused(qwen2vl: Path) -> None:
    r = with_embeddings(load_or_build(qwen2vl, BuildOptions(accuracy_level=1)))
    prompt, images = assemble([BEFORE, image(r.hp.n_embd, grid=None), AFTER])
    with pytest.raises(RequestError, match="needs its grid"):
        Generation(r, 0, prompt, GenerationParams(), eog=set(), images=images)
