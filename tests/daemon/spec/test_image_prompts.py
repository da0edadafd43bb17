"""Prompts holding images (random embeddings at their positions): the target's prefill
against the numpy reference, and greedy output byte-identical with and without each
drafter, which drafts after the image (media.py, drafters/)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from specd.daemon.drafters.composite import CompositeDrafter
from specd.daemon.drafters.dflash import DFlashDrafter
from specd.daemon.drafters.draft_model import DraftModelDrafter
from specd.daemon.drafters.eagle3 import Eagle3Drafter
from specd.daemon.drafters.ngram import NgramDrafter
from specd.daemon.spec.drafter import Drafter, DraftParams
from specd.daemon.spec.generation import (
    Generation,
    GenerationParams,
    RequestError,
    prompt_calls,
)
from specd.daemon.spec.media import (
    ImageChunk,
    assemble,
    chunk_end,
    outside_images,
    placeholder_id,
)
from specd.ort_models.gguf_file import GGUFFile
from specd.ort_models.graph_builder import BuildOptions
from specd.ort_models.head_runner import HeadRunner, load_or_build_head
from specd.ort_models.heads import read_head
from specd.ort_models.model_cache import load_or_build
from specd.ort_models.runner import ModelRunner
from specd.ort_models.shared_initializers import same_named

from numpy_reference import ReferenceModel
from speculation_checks import assert_drafted, assert_speculated, decode_all
from tiny_heads import write_tiny_head

BEFORE = [348, 20, 31, 42, 53]
# text after the image that repeats itself: prompt lookup has matches to offer
AFTER = [64, 75, 86, 97, 108, 64, 75, 86, 97, 108, 64, 75]
N_IMAGE = 24


def image(n_embd: int, seed: int = 0, n: int = N_IMAGE) -> ImageChunk:
    rows = np.random.default_rng(seed).normal(0, 1.0, (n, n_embd)).astype(np.float32)
    return ImageChunk(rows, f"{seed:064x}")


def with_embeddings(built: Any, causal: bool = True, n_ctx: int = 512) -> ModelRunner:
    r = ModelRunner(built, n_ctx=n_ctx)
    emb = load_or_build(built.gguf_path, replace(built.options, embeddings_input=True,
                                                 causal=causal))
    r.attach_embeddings(emb, same_named(emb.model_path, built.model_path))
    return r


def generate(r: ModelRunner, segments: list[Any], drafter: Drafter | None = None,
             **params: Any) -> tuple[list[int], Generation]:
    prompt, images = assemble(segments)
    params = {"max_tokens": 32, "ignore_eos": True, **params}
    gen = Generation(r, 0, prompt, GenerationParams(**params), eog=set(), drafter=drafter,
                     images=images)
    return decode_all(gen), gen


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_greedy_after_an_image_is_the_references(tiny_model_factory, arch) -> None:
    """The prompt's text, the image's rows (not causal for gemma3) and the text after it,
    prefilled through Generation: greedy tokens are the float64 reference's wherever its
    margin is clear."""
    kw = {"sliding_window": 8, "swa_pattern": 2} if arch == "gemma3" else {}
    path = tiny_model_factory(arch=arch, weight_type="F32", **kw)
    r = with_embeddings(load_or_build(path, BuildOptions(accuracy_level=1)),
                        causal=arch != "gemma3")
    img = image(r.hp.n_embd)
    got, gen = generate(r, [BEFORE, img, AFTER], max_tokens=8)
    ref = ReferenceModel(path)
    cache = ref.new_cache()
    ref.step(BEFORE, cache)
    ref.step_embeddings(img.embeddings, cache, causal=arch != "gemma3")
    logits = ref.step(AFTER, cache)[-1]
    for tok in got:
        top2 = np.sort(logits)[-2:]
        if top2[1] - top2[0] < 1e-3:
            break  # a near tie: float32 may break it the other way
        assert tok == int(np.argmax(logits))
        logits = ref.step([tok], cache)[-1]
    assert gen.stats.prompt_tokens == len(BEFORE) + N_IMAGE + len(AFTER)


def test_a_different_image_changes_the_output(tiny_model_factory) -> None:
    path = tiny_model_factory(arch="qwen2", weight_type="Q8_0")
    r = with_embeddings(load_or_build(path))
    a, _ = generate(r, [BEFORE, image(r.hp.n_embd, 1), AFTER])
    b, _ = generate(r, [BEFORE, image(r.hp.n_embd, 2), AFTER])
    assert a != b


def test_a_reused_prefix_never_cuts_an_image(tiny_model_factory) -> None:
    """A slot's cached prefix that ends inside an image is cut back to the image's start
    (its rows are one call's); the output equals a fresh prefill's."""
    path = tiny_model_factory(arch="gemma3", weight_type="Q8_0", sliding_window=8,
                              swa_pattern=2)
    r = with_embeddings(load_or_build(path), causal=False)
    img = image(r.hp.n_embd, 3)
    fresh, _ = generate(r, [BEFORE, img, AFTER])
    prompt, images = assemble([BEFORE, img, AFTER])
    reuse = len(BEFORE) + 5  # inside the image
    assert outside_images(images, reuse) == len(BEFORE)
    gen = Generation(r, 0, prompt, GenerationParams(max_tokens=32, ignore_eos=True),
                     eog=set(), reuse=reuse, images=images)
    assert gen.stats.cached_tokens == len(BEFORE)
    assert decode_all(gen) == fresh


def test_a_chunk_ends_at_an_image_and_holds_it_whole_where_not_causal() -> None:
    _, images = assemble([BEFORE, image(8), AFTER])
    start = len(BEFORE)
    assert chunk_end(images, 0, 64, whole_images=True) == start  # text stops at the image
    assert chunk_end(images, start, start + 4, whole_images=False) == start + 4
    assert chunk_end(images, start, start + 4, whole_images=True) == start + N_IMAGE
    assert chunk_end(images, start + N_IMAGE, 64, whole_images=True) == 64


def test_prompt_calls_evaluate_the_prompt_as_generation_does(tiny_model_factory) -> None:
    """The calls evaluating a whole prompt (embeddings' path): the prompt's tokens in
    order, the image's rows as its embeddings in one call (gemma3: not causal), and the
    last call's logits give Generation's first greedy token."""
    path = tiny_model_factory(arch="gemma3", weight_type="Q8_0", sliding_window=8,
                              swa_pattern=2)
    r = with_embeddings(load_or_build(path), causal=False)
    img = image(r.hp.n_embd, 4)
    want, _ = generate(r, [BEFORE, img, AFTER], max_tokens=1)
    prompt, images = assemble([BEFORE, img, AFTER])
    calls = prompt_calls(r, 0, prompt, images, ())
    assert [t for c in calls for t in c.tokens] == prompt
    [image_call] = [c for c in calls if c.embeds is not None]
    assert image_call.pos == len(BEFORE) and np.array_equal(image_call.embeds, img.embeddings)
    last = [r.forward_batch([c])[0] for c in calls][-1]
    assert int(np.argmax(last.logits[-1])) == want[0]


def test_images_are_refused_by_a_model_without_vision(tiny_model_factory) -> None:
    path = tiny_model_factory(arch="qwen2", weight_type="Q8_0")
    r = ModelRunner(load_or_build(path), n_ctx=512)
    prompt, images = assemble([BEFORE, image(r.hp.n_embd), AFTER])
    with pytest.raises(RequestError, match="--mmproj"):
        Generation(r, 0, prompt, GenerationParams(), eog=set(), images=images)
    r = with_embeddings(load_or_build(path))
    prompt, images = assemble([BEFORE, image(r.hp.n_embd + 8), AFTER])
    with pytest.raises(RequestError, match="does not fit the model"):
        Generation(r, 0, prompt, GenerationParams(), eog=set(), images=images)
    with pytest.raises(RequestError, match="placeholders"):
        Generation(r, 0, prompt, GenerationParams(), eog=set(), images=())
    assert placeholder_id("f" * 64) < 0


# -- speculation after an image ------------------------------------------------------------

# long enough for the tiny model's output to repeat itself (prompt lookup's matches)
MAX_TOKENS = 96
TARGET = {"arch": "qwen3", "weight_type": "Q8_0", "seed": 3, "context_length": 512}


@pytest.fixture(scope="module")
def target_path(tiny_model_factory: Callable[..., Path]) -> Path:
    return tiny_model_factory(**TARGET)


@pytest.fixture(scope="module")
def want(target_path: Path) -> list[int]:
    """Target-only greedy output of the image prompt."""
    r = with_embeddings(load_or_build(target_path))
    return generate(r, [BEFORE, image(r.hp.n_embd), AFTER], max_tokens=MAX_TOKENS)[0]


def _spec_run(built: Any, drafter: Drafter) -> tuple[list[int], Generation]:
    r = with_embeddings(built)
    return generate(r, [BEFORE, image(r.hp.n_embd), AFTER], drafter,
                    draft=DraftParams(n_max=3), max_tokens=MAX_TOKENS)


def test_prompt_lookup_after_an_image(target_path: Path, want: list[int]) -> None:
    got, gen = _spec_run(load_or_build(target_path), NgramDrafter())
    assert got == want
    assert_drafted(gen.stats)


def test_prompt_lookup_sees_the_text_never_an_image() -> None:
    """What followed a match is offered up to an image's first position, and the text
    after an image is found like any other."""
    prompt, _ = assemble([[1, 2, 3], image(8, n=4), [4, 5, 6, 1, 2]])
    d = NgramDrafter()
    d.begin(0, prompt)
    assert d.offer(0, 3, len(prompt), 4).tokens == []  # (1, 2, 3) was followed by the image
    d.process(0, [3, 9, 1, 2, 3, 4])
    assert d.offer(0, 5, len(prompt) + 6, 3).tokens == [6, 1, 2]  # (3, 4, 5) after it


def test_draft_model_after_an_image(target_path: Path, want: list[int]) -> None:
    """The draft (the target's own file, without vision) gets the text around the image
    at its positions and the placeholder's text id over it: it drafts, and its drafts
    are accepted."""
    draft = DraftModelDrafter(ModelRunner(load_or_build(target_path), n_ctx=512))
    got, gen = _spec_run(load_or_build(target_path), draft)
    assert got == want
    assert_speculated(gen.stats)
    draft_hybrid = CompositeDrafter("draft+ngram", [DraftModelDrafter(
        ModelRunner(load_or_build(target_path), n_ctx=512))])
    got, gen = _spec_run(load_or_build(target_path), draft_hybrid)
    assert got == want
    assert_speculated(gen.stats)


@pytest.mark.parametrize("kind", ["dflash", "dspark", "eagle3"])
def test_a_head_after_an_image(target_path: Path, want: list[int], kind: str,
                               tmp_path_factory: pytest.TempPathFactory) -> None:
    """A head gets the target's features over the image's positions too (DFlash/DSpark
    inject them, EAGLE-3 pairs them): it drafts from the first round after the prompt,
    and the output is the target's."""
    head_path = write_tiny_head(tmp_path_factory.mktemp("head") / f"{kind}.gguf",
                                kind=kind, seed=5)
    layers = tuple(sorted(set(read_head(GGUFFile(head_path)).hidden_layers)))
    runner = HeadRunner(load_or_build_head(head_path, target_path), n_ctx=512)
    drafter: Drafter = Eagle3Drafter(runner) if kind == "eagle3" else DFlashDrafter(runner)
    got, gen = _spec_run(load_or_build(target_path, BuildOptions(hidden_layers=layers)),
                         drafter)
    assert got == want
    assert_drafted(gen.stats)
