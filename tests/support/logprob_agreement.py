"""specd against llama-server's greedy path: specd's log probabilities of llama.cpp's
likely tokens, and specd's picks where its top two are clearly apart (the check the
architecture tests with llama.cpp as their oracle share)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from specd.daemon.models.building import build_options
from specd.daemon.spec.generation import Generation
from specd.ort_models.graph_builder import BuildOptions
from specd.ort_models.model_cache import load_or_build
from specd.ort_models.runner import ModelRunner

# specd's kernels with float32 products: what llama.cpp's own products are compared with
NATIVE_F32 = BuildOptions(kernels="gguf", attention="native")


def assert_agrees(path: Path, prompt: list[int], theirs: list[tuple[int, dict[int, float]]],
                  tol: float, *, n_ctx: int = 256, likely: float = -5.0) -> None:
    """`theirs` (llama_cpp_oracle.greedy_with_logprobs after `prompt`): every likely
    token's log probability (above `likely`; a random model's full vocabulary spreads
    them lower) within `tol` of specd's float32 graph's, and the
    serving graph's pick equal to llama.cpp's token wherever its top two are more than
    min(2 tol, 1) apart (at least twice)."""
    tokens = [t for t, _ in theirs]
    rows = list(range(len(prompt) - 1, len(prompt) - 1 + len(tokens)))
    exact = ModelRunner(load_or_build(path, NATIVE_F32), n_ctx=n_ctx).forward(
        0, prompt + tokens[:-1], 0, rows)  # [rows, vocab]
    logp = exact - exact.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    compared = 0
    for i, (_, top) in enumerate(theirs):
        for tid, lp in top.items():
            if lp > likely:
                assert abs(logp[i, tid] - lp) < tol, (i, tid, logp[i, tid], lp)
                compared += 1
    assert compared >= len(tokens)
    picks = ModelRunner(load_or_build(path, build_options("target")), n_ctx=n_ctx).forward(
        0, prompt + tokens[:-1], 0, rows)  # [rows, vocab]
    clear = 0
    for i, token in enumerate(tokens):
        two = np.sort(picks[i])[-2:]
        if two[1] - two[0] > min(2 * tol, 1.0):
            assert int(np.argmax(picks[i])) == token, i
            clear += 1
    assert clear >= 2


def assert_continuation_agrees(path: Path, prompt: list[int], n: int, *, near: float,
                               at_least: int = 8) -> None:
    """specd's serving graph's greedy continuation of `prompt` equals llama-server's for at
    least `at_least` of `n` tokens, up to specd's first near tie (top two within `near`)."""
    import llama_cpp_oracle

    ours, margins = llama_cpp_oracle.greedy_with_margins(
        ModelRunner(load_or_build(path, build_options("target")), n_ctx=256), prompt, n)
    greedy = llama_cpp_oracle.greedy_completion(path, prompt, n)
    assert llama_cpp_oracle.agreed_until_near_tie(ours, margins, greedy, near=near) >= at_least


def assert_generation_agrees(gen: Generation, theirs: list[tuple[int, dict[int, float]]], *,
                             near_tie: float, tol: float, at_least: int = 8) -> int:
    """A finished greedy Generation (logprobs=5) against llama.cpp's tokens and top log
    probabilities (`theirs`): the texts part, if at all, only where llama.cpp's top two
    are within `near_tie`, after at least `at_least` tokens, and up to there every token
    both list agrees within `tol` (two a position at least). Returns where they part."""
    got = gen.tokens
    n = len(theirs)
    margins = [two[0] - two[1] if len(two := sorted(top.values(), reverse=True)) > 1 else 0.0
               for _, top in theirs]
    parted = next((i for i, (a, (b, _)) in enumerate(zip(got, theirs, strict=False))
                   if a != b), n)
    assert parted == n or margins[parted] < near_tie, (parted, margins, got, theirs)
    assert parted >= at_least, (parted, got, theirs)
    compared = 0
    for ours, (_, top) in zip(gen.token_logprobs[:parted], theirs, strict=False):
        for tid, lp in ours.top:
            if tid in top:
                assert abs(lp - top[tid]) < tol, (tid, lp, top[tid])
                compared += 1
    assert compared >= 2 * parted
    return parted
