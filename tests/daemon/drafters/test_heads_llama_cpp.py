"""llama.cpp as the oracle of every head kind it runs: a tiny llama target (4 layers,
float32) and a tiny head of each kind, decoded greedily by llama.cpp's
llama-speculative-simple and by specd's round, propose the same drafts round after round
and accept as many. Skipped where llama.cpp is not built (bench/build_llama_cpp.sh)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from specd.daemon.drafters.dflash import DFlashDrafter
from specd.daemon.drafters.eagle3 import Eagle3Drafter
from specd.daemon.spec.drafter import Drafter, DraftParams
from specd.daemon.spec.generation import Generation, GenerationParams
from specd.daemon.text.tokenizer import Tokenizer
from specd.ort_models.gguf_file import GGUFFile
from specd.ort_models.graph_builder import BuildOptions
from specd.ort_models.head_runner import HeadRunner, load_or_build_head
from specd.ort_models.heads import read_head
from specd.ort_models.model_cache import load_or_build
from specd.ort_models.runner import ModelRunner

import llama_cpp_oracle
from tiny_gguf import write_tiny_gguf
from tiny_heads import write_tiny_head

TEXT = "hello world, this is a test"
N_PREDICT = 24
HEADS: dict[str, dict[str, Any]] = {
    "dflash": {"kind": "dflash", "target_layers": (1, 3)},
    "dspark": {"kind": "dspark", "target_layers": (1, 3)},
    "dspark-bonus-anchor": {"kind": "dspark", "target_layers": (1, 3),
                            "sample_from_anchor": False, "confidence_head": False},
    "eagle3": {"kind": "eagle3", "target_layers": (1, 2, 3)},
}


def _specd_rounds(target: Path, head: Path, prompt: list[int]) -> list[tuple[list[int], int]]:
    """Each round's drafts and accepted count, specd's greedy round with 3-token drafts."""
    params = read_head(GGUFFile(head))
    built = load_or_build(target, BuildOptions(hidden_layers=tuple(sorted(set(
        params.hidden_layers)))))
    # float32 products, as llama.cpp computes an F32 head (specd's default re-quantizes a
    # head's matrices to Q4_K, which moves a random head's near-tied drafts)
    runner = HeadRunner(load_or_build_head(head, target, accuracy_level=1, kernels="ort"),
                        n_ctx=256)
    drafter: Drafter = (Eagle3Drafter(runner) if params.kind == "eagle3"
                        else DFlashDrafter(runner))
    rounds: list[tuple[list[int], int]] = []
    draft, accept = drafter.draft, drafter.accept

    def record_draft(*args: Any, **kwargs: Any) -> Any:
        proposal = draft(*args, **kwargs)
        rounds.append((list(proposal.tokens), -1))
        return proposal

    def record_accept(seq: int, n: int) -> None:
        if rounds and rounds[-1][1] < 0:
            rounds[-1] = (rounds[-1][0], n)
        accept(seq, n)

    drafter.draft, drafter.accept = record_draft, record_accept  # type: ignore[method-assign]
    gen = Generation(ModelRunner(built, n_ctx=256), 0, prompt, GenerationParams(
        max_tokens=N_PREDICT + 8, draft=DraftParams(n_max=3), adaptive=False), eog=set(),
        drafter=drafter)
    gen.prefill()
    while not gen.done:
        gen.step()
    return rounds


@pytest.mark.parametrize("name", list(HEADS))
def test_drafts_are_llama_cpps(tmp_path: Path, name: str) -> None:
    if reason := llama_cpp_oracle.missing("llama-speculative-simple"):
        pytest.skip(reason)
    target = write_tiny_gguf(tmp_path / "target.gguf", arch="llama", weight_type="F32", seed=3,
                             n_layer=4, context_length=512)
    head = write_tiny_head(tmp_path / "head.gguf", seed=5, target_arch="llama",
                           weight_type="F32", **HEADS[name])
    kind = HEADS[name]["kind"]
    want = llama_cpp_oracle.speculative_rounds(target, head, TEXT, spec_type=f"draft-{kind}",
                                               n_predict=N_PREDICT, n_max=3)
    prompt = Tokenizer.from_metadata(GGUFFile(target).metadata).encode(TEXT)
    got = _specd_rounds(target, head, prompt)
    # llama-speculative-simple evaluates the prompt but its last token and drafts its first
    # round from that token; specd's first round drafts from the token after the prompt,
    # as llama.cpp's second does; and its last round may be cut short by its token limit
    want = want[1:-1]
    assert len(want) >= 8
    ties = 0
    for (tokens, accepted), theirs in zip(got, want, strict=False):
        assert len(tokens) == len(theirs.drafts)
        for token, top in zip(tokens, theirs.candidates, strict=True):
            # a near tie (top two within 2%) may fall either way in float32 arithmetic
            near_tie = len(top) > 1 and top[1][1] > 0.98 * top[0][1]
            ties += near_tie
            assert token == top[0][0] or (near_tie and token == top[1][0]), (tokens, theirs)
            if token != top[0][0]:  # DSpark's chain and EAGLE-3's steps follow the choice
                break
        if tokens == theirs.drafts:
            assert accepted == theirs.accepted
    assert ties < len(want)  # most positions compared exactly
