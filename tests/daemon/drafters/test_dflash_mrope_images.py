"""A DFlash-family head of an M-RoPE target (qwen2vl) after an image, by llama.cpp's rule
(common/speculative.cpp, draft_dflash::process): the image's rows, all at one rope
position, are not injected; the text is injected at its rope position (the target's t),
and the block drafts at the next token's. Greedy output is byte-identical to the target
alone, rounds are drafted, and the head's cache holds exactly the text's rows rotated at
llama.cpp's positions (computed here from mtmd's rule: an image of rows x cols takes
max(rows, cols) positions, server_tokens::pos_next)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from specd.daemon.drafters.dflash import DFlashDrafter
from specd.daemon.models.building import image_options
from specd.daemon.spec.drafter import DraftParams
from specd.daemon.spec.generation import Generation, GenerationParams
from specd.daemon.spec.media import ImageChunk, assemble, mrope_positions, pinned_rows
from specd.ort_models.gguf_file import GGUFFile
from specd.ort_models.graph_builder import BuildOptions
from specd.ort_models.head_runner import HeadRunner, load_or_build_head
from specd.ort_models.heads import read_head
from specd.ort_models.model_cache import load_or_build
from specd.ort_models.runner import Call, ModelRunner
from specd.ort_models.shared_initializers import same_named

from speculation_checks import assert_drafted, decode_all
from tiny_gguf import write_tiny_qwen2vl
from tiny_heads import write_tiny_head

BEFORE = [348, 20, 31, 42, 53]
AFTER = [64, 75, 86, 97, 108, 64, 75, 86, 97, 108, 64, 75]
GRID = (3, 8)  # 24 tokens taking 8 rope positions
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("qwen2vl-head")
    target = write_tiny_qwen2vl(d / "target.gguf", sections=(2, 3, 3, 0), seed=20,
                                weight_type="Q8_0")
    head = write_tiny_head(d / "head.gguf", kind="dflash", seed=5, target_arch="qwen2")
    return target, head


def image(n_embd: int) -> ImageChunk:
    rows = np.random.default_rng(0).normal(0, 1.0, (GRID[0] * GRID[1], n_embd))
    return ImageChunk(rows.astype(np.float32), "0" * 64, GRID)


def target_runner(target: Path, layers: tuple[int, ...]) -> ModelRunner:
    built = load_or_build(target, BuildOptions(hidden_layers=layers))
    r = ModelRunner(built, n_ctx=512)
    emb = load_or_build(target, image_options(built.options, built.hparams.arch))
    r.attach_embeddings(emb, same_named(emb.model_path, built.model_path))
    return r


def llama_cpp_text_positions(n_before: int, n_after: int) -> np.ndarray:
    """pos[0] of the text tokens around one GRID image at position n_before, as
    llama-server gives them: the image takes max(rows, cols) positions."""
    after = n_before + max(GRID)
    return np.concatenate([np.arange(n_before), np.arange(after, after + n_after)])


# the head's graphs on specd's attention where its kernels run (None), and written out
@pytest.mark.parametrize("kernels", [None, "ort"])
def test_an_m_rope_head_skips_the_image_as_llama_cpp(pair: tuple[Path, Path],
                                                      kernels: str | None) -> None:
    target, head_path = pair
    layers = tuple(sorted(set(read_head(GGUFFile(head_path)).hidden_layers)))
    r = target_runner(target, layers)
    prompt, images = assemble([BEFORE, image(r.hp.n_embd), AFTER])
    params: dict[str, Any] = {"max_tokens": MAX_TOKENS, "ignore_eos": True}
    want = decode_all(Generation(r, 0, prompt, GenerationParams(**params), eog=set(),
                                 images=images))

    built_head = load_or_build_head(head_path, target, kernels=kernels)
    runner = HeadRunner(built_head, n_ctx=512)
    assert runner.takes_rope_positions
    drafter = DFlashDrafter(runner)
    gen = Generation(r, 0, prompt, GenerationParams(**params, draft=DraftParams(n_max=3),
                                                    adaptive=False),
                     eog=set(), drafter=drafter, images=images)
    got = decode_all(gen)
    assert got == want
    assert_drafted(gen.stats)
    assert runner.block_passes > 0

    # the head's state: a row per text token, the image's 24 skipped, the text after it
    # max(rows, cols) - rows * cols positions behind its sequence position
    n_img = GRID[0] * GRID[1]
    st = drafter._seqs[0]
    assert st.skipped == n_img and st.rope_shift == max(GRID) - n_img
    assert st.end == len(prompt) + len(got) - 1  # the last emitted token is not in yet
    assert st.injected == st.end - n_img
    # the next block's first row at llama-server's pos_next: tokens less the image's, plus
    # the positions it takes
    rope = st.rope(st.end, 1)
    assert rope is not None and rope.tolist() == [st.end - n_img + max(GRID)]

    # the cache's prompt rows: the target's features of the text tokens only, rotated at
    # llama.cpp's positions (an independent injection of them into a second head)
    features = prompt_features(r, prompt, images, layers)
    text = ~pinned_rows(images, 0, len(prompt))
    assert text.sum() == len(BEFORE) + len(AFTER)
    rows = np.concatenate([features[layer] for layer in drafter.target_layers], axis=-1)
    ref = HeadRunner(built_head, n_ctx=512)
    want_pos = llama_cpp_text_positions(len(BEFORE), len(AFTER))
    ref.inject(0, rows[text], 0, want_pos)
    n = int(text.sum())
    for (k, v), (k_ref, v_ref) in zip(runner.kv.layers(0), ref.kv.layers(0), strict=True):
        assert np.array_equal(k[0, :, :n], k_ref[0, :, :n])
        assert np.array_equal(v[0, :, :n], v_ref[0, :, :n])
    # at the sequence's own positions the keys after the image would differ
    wrong = HeadRunner(built_head, n_ctx=512)
    wrong.inject(0, rows[text], 0, np.flatnonzero(text))
    (k, _), (k_wrong, _) = runner.kv.layers(0)[0], wrong.kv.layers(0)[0]
    assert not np.allclose(k[0, :, len(BEFORE):n], k_wrong[0, :, len(BEFORE):n])


def prompt_features(r: ModelRunner, prompt: list[int], images: Any,
                    layers: tuple[int, ...]) -> dict[int, np.ndarray]:
    """The target's hidden states of `layers` over the prompt [n, E] each: its text
    before the image, the image's rows, the text after, at their M-RoPE positions."""
    (im,) = images
    parts = []
    for start, end, embeds in ((0, im.start, None), (im.start, im.end, im.embeddings),
                               (im.end, len(prompt), None)):
        call = Call(0, prompt[start:end], start, None, layers, embeds=embeds,
                    rope_positions=mrope_positions(images, start, end))
        parts.append(r.forward_batch([call])[0].features)
    return {layer: np.concatenate([p[layer] for p in parts]) for layer in layers}
