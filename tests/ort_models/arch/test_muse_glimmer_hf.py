"""muse-glimmer checkpoints converted by llama.cpp's own convert_hf_to_gguf.py: a tiny
random transformers `MuseGlimmerForConditionalGeneration` (Q/K un-permuted to NORM rope,
`weight + 1` norms, the synthesized q/k norms carrying the qk scale) read and run by
specd as transformers and llama.cpp compute it. Skipped without torch and transformers
(the converter's needs) or without llama.cpp's source / binaries, with the reason."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from specd.ort_models.graph_builder import BuildOptions
from specd.ort_models.model_cache import load_or_build
from specd.ort_models.runner import ModelRunner

import llama_cpp_convert
import llama_cpp_oracle

PROMPT = [5, 17, 42, 100, 7, 3, 99, 12, 250, 31, 64, 128, 9, 33]


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the checkpoint folder, llama.cpp's float32 GGUF of it)."""
    if reason := llama_cpp_convert.missing():
        pytest.skip(reason)
    from tiny_hf_muse_glimmer import write_checkpoint

    root = tmp_path_factory.mktemp("muse_hf")
    model = write_checkpoint(root / "hf", seed=0)
    return model, llama_cpp_convert.convert(model, root / "muse.gguf")


def _specd_logits(path: Path, tokens: list[int]) -> np.ndarray:
    """specd's float32 graph's logits [len(tokens), vocab] at every position."""
    r = ModelRunner(load_or_build(path, BuildOptions(accuracy_level=1)), n_ctx=256)
    return r.forward(0, tokens, 0, list(range(len(tokens))))


@pytest.mark.needs_torch
@pytest.mark.needs_transformers
def test_logits_are_transformers(converted: tuple[Path, Path]) -> None:
    """The converted file on specd computes what transformers computes from the
    checkpoint (float32 both; the sliding window crossed, the NoPE global layer seen)."""
    import torch
    from transformers import MuseGlimmerForConditionalGeneration

    model_dir, gguf = converted
    model = MuseGlimmerForConditionalGeneration.from_pretrained(
        model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        want = model(input_ids=torch.tensor([PROMPT])).logits[0].numpy()  # [T, vocab]
    got = _specd_logits(gguf, PROMPT)[:, :want.shape[1]]
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-4


@pytest.mark.llama_cpp_oracle
@pytest.mark.needs_torch
@pytest.mark.needs_transformers
def test_greedy_continuation_is_llama_cpps(converted: tuple[Path, Path]) -> None:
    """llama-server on the same file: specd's log probabilities of its likely tokens
    along its greedy path agree within its float32 rounding, and the continuations are
    the same up to specd's first near tie."""
    if reason := llama_cpp_oracle.missing("llama-server"):
        pytest.skip(reason)
    _, gguf = converted
    theirs = llama_cpp_oracle.greedy_with_logprobs(gguf, PROMPT, 24)
    tokens = [t for t, _ in theirs]
    exact = _specd_logits(gguf, PROMPT + tokens[:-1])[len(PROMPT) - 1:]  # [24, vocab]
    logp = exact - exact.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    compared = 0
    for i, (_, top) in enumerate(theirs):
        for tid, lp in top.items():
            if lp > -5:
                assert abs(logp[i, tid] - lp) < 0.05, (i, tid, logp[i, tid], lp)
                compared += 1
    assert compared >= len(tokens)
    ours, margins = llama_cpp_oracle.greedy_with_margins(
        ModelRunner(load_or_build(gguf, BuildOptions(accuracy_level=1)), n_ctx=256),
        PROMPT, 24)
    assert llama_cpp_oracle.agreed_until_near_tie(ours, margins, tokens, near=0.05) >= 8
