"""ModelRunner.forward_batch: the rows of several sequences in one pass (specd's kernels),
each sequence's logits, hidden states and KV exactly those of its calls alone."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from specd.ort_models import native_ops
from specd.ort_models.graph_builder import BuildOptions
from specd.ort_models.model_cache import load_or_build
from specd.ort_models.runner import Call, ModelRunner

pytestmark = pytest.mark.skipif(native_ops.library() is None, reason="specd's kernels are off")

NATIVE = BuildOptions(kernels="gguf", attention="native", kv_dtype="f16", hidden_layers=(1,))
PROMPTS = [[1, *range(10, 40)], [1, *range(50, 57)], [1, *range(90, 150)]]


def _runner(path: Path, n_seq: int) -> ModelRunner:
    return ModelRunner(load_or_build(path, NATIVE), n_ctx=512, n_seq=n_seq)


@pytest.fixture(scope="module")
def model(tiny_model_factory: Callable[..., Path]) -> Path:
    return tiny_model_factory(arch="qwen2", weight_type="Q4_K", value_type="Q6_K",
                              n_embd=256, n_ff=512)


def test_a_batched_pass_equals_each_sequence_alone(model: Path) -> None:
    """Prefill chunks, verify blocks and single steps of three sequences mixed in passes:
    logits and features bit for bit those of one runner per sequence, and so is every
    slot's KV afterwards."""
    batched = _runner(model, 3)
    alone = [_runner(model, 1) for _ in PROMPTS]
    assert batched.packs_sequences
    rounds = [  # per sequence: (tokens, pos) of its call in each pass (None: sits out)
        [(PROMPTS[0], 0), (PROMPTS[1][:4], 0), (PROMPTS[2], 0)],
        [([7], 31), (PROMPTS[1][4:], 4), None],
        [([8, 9, 10, 11], 32), ([3], 7), ([5, 6], 61)],
        [([12], 33), ([4, 5, 6], 8), ([7], 63)],
    ]
    for calls in rounds:
        todo = [(seq, toks, pos) for seq, c in enumerate(calls) if c is not None
                for toks, pos in [c]]
        got = batched.forward_batch([Call(seq, toks, pos, list(range(len(toks))), (1,))
                                     for seq, toks, pos in todo])
        for (seq, toks, pos), out in zip(todo, got, strict=True):
            logits, feats = alone[seq].forward_with_features(0, toks, pos,
                                                             list(range(len(toks))), (1,))
            np.testing.assert_array_equal(out.logits, logits)
            np.testing.assert_array_equal(out.features[1], feats[1])
    for seq, r in enumerate(alone):
        for (k, v), (k1, v1) in zip(batched.kv.layers(seq), r.kv.layers(0), strict=True):
            np.testing.assert_array_equal(k, k1)
            np.testing.assert_array_equal(v, v1)


def test_default_rows_are_each_calls_last(model: Path) -> None:
    r = _runner(model, 2)
    out = r.forward_batch([Call(0, PROMPTS[0], 0), Call(1, PROMPTS[1], 0)])
    assert [o.logits.shape[0] for o in out] == [1, 1]
    np.testing.assert_array_equal(out[1].logits, _runner(model, 1).forward(0, PROMPTS[1], 0))


def test_a_slot_added_later_moves_the_cache_and_keeps_what_it_held(model: Path) -> None:
    """A slot past the arrays' capacity moves every buffer: the rows written before are
    still attended to, through bindings made again."""
    r = _runner(model, 1)
    ref = _runner(model, 1)
    r.prefill(0, PROMPTS[0])
    ref.prefill(0, PROMPTS[0])
    version = r.kv.version
    assert r.add_sequence() == 1 and r.kv.version > version
    got = r.forward_batch([Call(0, [5], len(PROMPTS[0])), Call(1, PROMPTS[1], 0)])
    np.testing.assert_array_equal(got[0].logits, ref.forward(0, [5], len(PROMPTS[0])))


def test_a_batch_names_its_problems(model: Path) -> None:
    r = _runner(model, 2)
    with pytest.raises(ValueError, match="one call per sequence"):
        r.forward_batch([Call(0, [1], 0), Call(0, [2], 1)])
    with pytest.raises(ValueError, match="hidden states of layers"):
        r.forward_batch([Call(0, [1], 0, layers=(0,)), Call(1, [2], 0)])


def test_a_pass_is_shared_out_by_rows(model: Path) -> None:
    """Each call's seconds are its rows' share of the pass: what it cost, whatever else
    ran in it (the draft-length policy prices rounds by them)."""
    r = _runner(model, 2)
    long_call, short_call = r.forward_batch([Call(0, PROMPTS[0], 0), Call(1, [5], 0)])
    assert short_call.seconds > 0
    assert long_call.seconds / short_call.seconds == pytest.approx(len(PROMPTS[0]))
