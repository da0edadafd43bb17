"""Drafter heads after a real image, through the engine: a tiny random-weight Gemma 3 VLM
(text model and mmproj converted by llama.cpp's own convert_hf_to_gguf.py,
tests/support/tiny_vlm.py) with a tiny DFlash, DSpark or EAGLE-3 head carrying the
target's tokenizer (as llama.cpp's converter copies it). The image goes through the
engine's vision encoder; greedy output is byte-identical to the target alone, the head
drafted rounds, and its state over the image's positions comes from the image: a DFlash
or DSpark head's injected K/V rows, an EAGLE-3 head's g rows and pairs, differ between
two images at the same positions while the rows of the text before them are equal. On
the tiny Qwen2.5-VL (M-RoPE) a DFlash head skips the image's rows, as llama.cpp's does.
Skipped without torch and transformers (to make the checkpoint) or llama.cpp's source."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tiny_vlm
from image_files import png

from specd.daemon.serving.engine import Engine, EngineConfig
from specd.daemon.spec.drafter import DraftParams
from specd.daemon.spec.generation import GenerationParams
from specd.daemon.spec.media import MEDIA_MARKER, PromptImage

from speculation_checks import assert_drafted, decode_all
from tiny_heads import gemma_features, write_tiny_head

TEXT = "Say it again and again: red blue red blue red blue " + MEDIA_MARKER + " again"
MAX_TOKENS = 32
N_VOCAB = 262144  # the Gemma 3 tokenizer's (a DSpark head's Markov rows are as many)


@pytest.fixture(scope="module")
def vlm() -> tiny_vlm.TinyVlm:
    return tiny_vlm.tiny_vlm_or_skip("gemma3")


def head_for(vlm: tiny_vlm.TinyVlm, kind: str, folder: Path) -> Path:
    """A tiny head of `kind` for the tiny Gemma 3 text model (its 2 layers, n_embd 64,
    vocabulary), carrying the target's tokenizer; a DFlash-family head scales the shared
    embeddings by sqrt(n_embd) as heads of Gemma targets do."""
    extra: dict[str, Any] = {} if kind == "eagle3" else gemma_features(embedding_scale=8.0)
    path = write_tiny_head(folder / f"{kind}.gguf", kind=kind, seed=5, target_arch="gemma3",
                           vocab_size=N_VOCAB, weight_type="F32", **extra)
    tiny_vlm.take_tokenizer(path, vlm.text, keep=["tokenizer.ggml.mask_token_id"])
    return path


def engine(vlm: tiny_vlm.TinyVlm, spec_type: str = "none", head: Path | None = None
           ) -> Engine:
    return Engine(EngineConfig(target=str(vlm.text), mmproj=str(vlm.mmproj),
                               spec_type=spec_type, draft=None if head is None else str(head),
                               n_ctx=512, fetch=False))


def generate(e: Engine, image_seed: int) -> tuple[list[int], Any, tuple[PromptImage, ...]]:
    prompt, images = e.image_prompt(TEXT, [png(seed=image_seed)])
    gen = e.start(0, prompt, GenerationParams(max_tokens=MAX_TOKENS, ignore_eos=True,
                                              draft=DraftParams(n_max=3), adaptive=False),
                  images=images)
    out = decode_all(gen)
    return out, gen.stats, images


@pytest.fixture(scope="module")
def want(vlm: tiny_vlm.TinyVlm) -> list[int]:
    """Target-only greedy output after the first image."""
    return generate(engine(vlm), 5)[0]


def head_rows(e: Engine, kind: str, image: PromptImage) -> tuple[np.ndarray, np.ndarray]:
    """The head's state of slot 0 over the text before the image and over the image: a
    DFlash-family head's K rows of every layer [L, Hkv, n, hd] at those positions; an
    EAGLE-3 head's g rows [n, E] and (its pairs) K rows."""
    assert e.head is not None
    k_rows = np.stack([k[0] for k, _ in e.head.kv.layers(0)])  # [L, Hkv, n_ctx, hd]
    before = k_rows[:, :, :image.start]
    over = k_rows[:, :, image.start:image.end]
    if kind == "eagle3":
        head = e.drafter.model_sources[0]  # type: ignore[union-attr]
        g = head._seqs[0].g  # [n_ctx, E]
        return (np.concatenate([before.ravel(), g[:image.start].ravel()]),
                np.concatenate([over.ravel(), g[image.start:image.end].ravel()]))
    return before.ravel(), over.ravel()


@pytest.mark.parametrize("kind", ["dflash", "dspark", "eagle3"])
def test_a_head_after_an_image_keeps_the_targets_output(
        vlm: tiny_vlm.TinyVlm, want: list[int], kind: str,
        tmp_path_factory: pytest.TempPathFactory) -> None:
    head = head_for(vlm, kind, tmp_path_factory.mktemp(kind))
    e = engine(vlm, f"draft-{kind}", head)
    got, stats, (image,) = generate(e, 5)
    assert got == want
    assert_drafted(stats)
    # the head itself drafted (not only the prompt lookup in front of it)
    assert e.head is not None
    assert (e.head.step_passes if kind == "eagle3" else e.head.block_passes) > 0
    # the head's context covers the prompt, the image's positions included
    source = e.drafter.model_sources[0]  # type: ignore[union-attr]
    st = source._seqs[0]  # type: ignore[attr-defined]
    assert (st.known if kind == "eagle3" else st.injected) >= image.end
    before, over = head_rows(e, kind, image)
    assert np.all(np.isfinite(over)) and np.any(over != 0)
    # another image at the same positions: the rows over it differ, those before do not
    _, stats2, (image2,) = generate(e, 6)
    assert (image2.start, image2.end) == (image.start, image.end)
    before2, over2 = head_rows(e, kind, image2)
    assert np.array_equal(before, before2)
    assert not np.allclose(over, over2)


def test_an_m_rope_head_after_a_real_image_skips_it(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """A DFlash head of the tiny Qwen2.5-VL (an M-RoPE target) after a real image through
    the engine: llama.cpp's rule, the image's rows not injected and the text after it at
    its rope position (tests/daemon/drafters/test_dflash_mrope_images.py checks the rows
    against llama.cpp's positions); output the target's alone, rounds drafted."""
    vlm = tiny_vlm.tiny_vlm_or_skip("qwen25vl")
    head = write_tiny_head(tmp_path_factory.mktemp("qwen25vl") / "dflash.gguf", kind="dflash",
                           seed=5, target_arch="qwen2", vocab_size=151936, weight_type="F32")
    tiny_vlm.take_tokenizer(head, vlm.text, keep=["tokenizer.ggml.mask_token_id"])
    want, _, _ = generate(engine(vlm), 5)
    e = engine(vlm, "draft-dflash", head)
    got, stats, (image,) = generate(e, 5)
    assert got == want
    assert_drafted(stats)
    assert e.head is not None and e.head.takes_rope_positions and e.head.block_passes > 0
    st = e.drafter.model_sources[0]._seqs[0]  # type: ignore[union-attr, attr-defined]
    chunk = image.chunk
    assert chunk.grid is not None and chunk.n_tokens > 1
    assert st.skipped == chunk.n_tokens
    assert st.rope_shift == max(chunk.grid) - chunk.n_tokens
    assert st.injected == st.end - chunk.n_tokens
