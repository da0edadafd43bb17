"""A MoE target's passes report the experts their rows woke: the graph outputs every
layer's router ids and the runner counts the distinct (layer, expert) pairs of each call's
rows, checked against the float64 reference's router on a tiny qwen3moe file."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from specd.ort_models import native_ops
from specd.ort_models.graph_builder import EXPERT_IDS, BuildOptions
from specd.ort_models.model_cache import load_or_build
from specd.ort_models.runner import Call, ModelRunner

from tiny_gguf import write_tiny_gguf
from tiny_moe import ReferenceMoeModel, write_tiny_qwen3moe

pytestmark = pytest.mark.skipif(native_ops.library() is None,
                                reason=f"no specd kernels: {native_ops.unavailable_reason()}")

PROMPT = [5, 17, 42, 100, 7, 3, 99, 12, 250, 31, 64, 128]
BLOCK = [77, 78, 79, 80, 81]
NATIVE_F32 = BuildOptions(kernels="gguf", attention="native")


def _reference_woken(ref: ReferenceMoeModel, first: int, end: int) -> int:
    """Distinct (layer, expert) pairs the reference's routers chose for tokens first..end
    of its last forward (one feed_forward call per layer, in layer order)."""
    layers = ref.chosen[-ref.n_layer:]
    return sum(len(np.unique(np.stack(ids[first:end]))) for ids in layers)


@pytest.mark.parametrize("seed", [1, 5])
def test_the_experts_a_pass_wakes_match_the_reference_router(tmp_path: Path, seed: int
                                                             ) -> None:
    path = write_tiny_qwen3moe(tmp_path / "m.gguf", expert_type="F32", seed=seed,
                               n_layer=3, n_expert=16, n_used=2)
    ref = ReferenceMoeModel(path)
    ref.forward(PROMPT + BLOCK)
    r = ModelRunner(load_or_build(path, NATIVE_F32), n_ctx=256)
    assert r.call_rows(0, len(PROMPT)) == len(PROMPT)  # no filler rows in these calls
    prompt = r.forward_batch([Call(0, PROMPT, 0)])[0]
    assert prompt.experts_woken == _reference_woken(ref, 0, len(PROMPT))
    woken = []
    for i, t in enumerate(BLOCK[:2]):  # single steps wake exactly top_k in every layer
        woken.append(r.forward_batch([Call(0, [t], len(PROMPT) + i)])[0].experts_woken)
    assert woken == [3 * 2] * 2
    block = r.forward_batch([Call(0, BLOCK[2:], len(PROMPT) + 2)])[0]
    want = _reference_woken(ref, len(PROMPT) + 2, len(PROMPT) + len(BLOCK))
    assert block.experts_woken == want
    assert 3 * 2 < want <= 3 * 2 * len(BLOCK[2:])  # the block's rows chose differently


def test_a_dense_graph_has_no_expert_output(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "d.gguf", arch="qwen3", weight_type="F32")
    r = ModelRunner(load_or_build(path, NATIVE_F32), n_ctx=256)
    assert EXPERT_IDS not in {o.name for o in r.session.get_outputs()}
    assert r.forward_batch([Call(0, PROMPT, 0)])[0].experts_woken == 0


def test_a_packed_pass_shares_out_the_experts_it_woke_in_all(tmp_path: Path) -> None:
    """Two sequences' calls in one pass: each call still counts its own rows' experts,
    and the calls' shares of the pass add up to the distinct pairs of all their rows (the
    experts the pass read once for both), fewer than the two counts together where the
    sequences' rows chose some of the same experts."""
    path = write_tiny_qwen3moe(tmp_path / "m.gguf", expert_type="F32", seed=1,
                               n_layer=3, n_expert=16, n_used=2)
    ref = ReferenceMoeModel(path)
    r = ModelRunner(load_or_build(path, NATIVE_F32), n_ctx=256, n_seq=4)
    assert r.packs_sequences
    a, b = r.forward_batch([Call(0, PROMPT[:6], 0), Call(1, PROMPT[6:], 0)])
    own = [r.forward_batch([Call(2, PROMPT[:6], 0)])[0].experts_woken,
           r.forward_batch([Call(3, PROMPT[6:], 0)])[0].experts_woken]
    assert [a.experts_woken, b.experts_woken] == own
    first, second = _chosen_alone(ref, PROMPT[:6]), _chosen_alone(ref, PROMPT[6:])
    union = sum(len(np.unique(np.concatenate([x, y]))) for x, y in zip(first, second,
                                                                       strict=True))
    assert a.pass_experts_share + b.pass_experts_share == pytest.approx(union)
    assert union < sum(own)


def _chosen_alone(ref: ReferenceMoeModel, tokens: list[int]) -> list[np.ndarray]:
    """The reference router's choices for `tokens` as a sequence of their own: per layer,
    every token's expert ids, flat."""
    ref.forward(tokens)
    return [np.stack(ids).ravel() for ids in ref.chosen[-ref.n_layer:]]
