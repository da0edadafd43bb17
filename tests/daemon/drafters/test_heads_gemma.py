"""A DFlash head for a tiny gemma3 target, as specd's convert-draft writes it for Gemma
targets (the embedding scale sqrt(n_embd) of the target's shared embeddings) with
sliding-window layers, GELU and post-norms: specd drafts with it, every draft is the
float64 reference's (tests/support/head_decode_oracle.py), and the greedy text is the
target's alone, on ONNX Runtime's float32 products and on specd's own kernels (Q4_K).
llama.cpp cannot be the oracle here: at build 11434 its gemma3 graph does not expose the
layer inputs a head reads (test_heads_llama_cpp.py runs such heads on a llama target)."""

from __future__ import annotations

from pathlib import Path

import pytest

from head_decode_oracle import (
    assert_drafts_follow_the_reference,
    serving_decode,
    target_only,
    text_prompt,
)
from tiny_gguf import write_tiny_gguf
from tiny_heads import gemma_features, write_tiny_head

TEXT = "hello world, this is a test"
N_TOKENS = 40


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("gemma")
    target = write_tiny_gguf(d / "target.gguf", arch="gemma3", weight_type="F32", seed=3,
                             n_layer=4, sliding_window=6, swa_pattern=2, context_length=512)
    head = write_tiny_head(d / "head.gguf", kind="dflash", seed=5, target_arch="gemma3",
                           weight_type="F32", target_layers=(1, 3),
                           **gemma_features(embedding_scale=64 ** 0.5, sliding_window=5,
                                            gelu=True, post_norms=True))
    return target, head


def test_a_gemma3_targets_head_drafts_the_references_drafts(pair: tuple[Path, Path]) -> None:
    target, head = pair
    assert_drafts_follow_the_reference(target, head, TEXT, N_TOKENS)


def test_a_gemma3_targets_head_on_specds_kernels_keeps_the_text(pair: tuple[Path, Path]
                                                                ) -> None:
    """The serving path: the head's matrices re-quantized to Q4_K where specd's kernels
    run (its drafts then near the reference's, not equal); the text stays the target's."""
    target, head = pair
    prompt, eog = text_prompt(target, TEXT)
    tokens, gen = serving_decode(target, head, prompt, eog, max_tokens=N_TOKENS)
    assert gen.stats.drafted >= 3 * 8, gen.stats
    assert tokens == target_only(target, prompt, eog, N_TOKENS)
