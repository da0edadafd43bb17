"""A head's calls of several sequences in one pass (HeadRunner.forward_batch): each DFlash
block's (and EAGLE-3 step's) logits, proposals and cache rows equal that call alone, bit
for bit; DFlash injections waiting together run in one pass."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from specd.ort_models import native_ops
from specd.ort_models.head_runner import (
    BlockCall,
    BlockOutput,
    HeadRunner,
    StepCall,
    load_or_build_head,
)
from specd.ort_models.sampling_op import SampleSpec

from tiny_heads import write_tiny_head

pytestmark = pytest.mark.skipif(native_ops.library() is None,
                                reason=f"no specd kernels: {native_ops.unavailable_reason()}")

CONTEXTS = (12, 20, 7)  # injected rows per slot


@pytest.fixture(scope="module", params=["dflash", "dspark", "dflash2"])
def paths(request: pytest.FixtureRequest, tiny_model_factory: Callable[..., Path],
          tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A DFlash head, a DSpark head (its Markov chain over each block's rows, and a
    confidence head) or a DFlash2 head (convolutions across a block's rows, a candidate
    lattice from its anchor)."""
    target = tiny_model_factory(arch="qwen3", weight_type="Q8_0", seed=3, context_length=512)
    head = write_tiny_head(tmp_path_factory.mktemp("head") / "head.gguf", kind=request.param,
                           seed=5)
    return target, head


def _runner(paths: tuple[Path, Path]) -> HeadRunner:
    """A head over three slots, each with its own random context injected."""
    target, head = paths
    runner = HeadRunner(load_or_build_head(head, target), n_ctx=512, n_seq=3)
    rng = np.random.default_rng(1)
    for seq, n in enumerate(CONTEXTS):
        runner.inject(seq, rng.normal(0, 1, (n, runner.feature_width)).astype(np.float32), 0)
    return runner


def _calls(runner: HeadRunner, lengths: tuple[int, ...]) -> list[BlockCall]:
    """A block of n tokens per slot, its proposing rows read (DSpark's from the anchor)."""
    head = runner.built.head
    assert head.mask_token_id is not None
    first = 0 if head.sample_from_anchor else 1
    return [BlockCall(seq, [100 + seq] + [head.mask_token_id] * (n - 1), CONTEXTS[seq],
                      list(range(first, n))) for seq, n in enumerate(lengths)]


def _same(got: BlockOutput, want: BlockOutput, rows: int) -> None:
    """Every array a block returns, bit for bit (DFlash2: its lattice, no logits)."""
    lattice = got.candidates is not None
    assert got.logits.shape[0] == rows and (got.logits.shape[1] == 0) == lattice
    for name in ("logits", "confidence", "candidates", "scores"):
        a, b = getattr(got, name), getattr(want, name)
        assert (a is None) == (b is None), name
        if a is not None:
            np.testing.assert_array_equal(a, b)


def _kv(runner: HeadRunner, seq: int) -> list[np.ndarray]:
    return [a.copy() for pair in runner.kv.layers(seq) for a in pair]


def test_the_dflash_block_graph_packs_sequences(paths: tuple[Path, Path]) -> None:
    runner = _runner(paths)
    assert runner.packs_blocks
    assert "segments" in {i.name for i in runner.sessions["block"].get_inputs()}


@pytest.mark.parametrize("lengths", [(4, 2, 3), (4, 4)], ids=["three", "two"])
def test_packed_blocks_equal_each_block_alone(paths: tuple[Path, Path],
                                              lengths: tuple[int, ...]) -> None:
    runner = _runner(paths)
    calls = _calls(runner, lengths)
    passes = runner.block_passes
    packed = runner.forward_batch(calls)
    assert runner.block_passes == passes + 1  # one pass for every block
    packed_kv = [_kv(runner, c.seq) for c in calls]
    alone = _runner(paths)
    for c, got, kv in zip(calls, packed, packed_kv, strict=True):
        want = alone.forward_batch([c])[0]
        _same(got, want, len(c.rows))
        for a, b in zip(kv, _kv(alone, c.seq), strict=True):
            np.testing.assert_array_equal(a, b)  # the block's rows, and nothing else's
    # the same blocks again, in another order: the same bits
    again = runner.forward_batch(list(reversed(calls)))
    for got, want, c in zip(reversed(again), packed, calls, strict=True):
        _same(got, want, len(c.rows))


def test_packed_blocks_mix_graph_choices_and_host_rows(paths: tuple[Path, Path]) -> None:
    """A block whose rows the graph chooses (one spec per row) beside one read on the host:
    each as alone."""
    runner = _runner(paths)
    if not runner.block_samples:
        pytest.skip("the block graph has no sampler (DFlash2's lattice)")
    calls = _calls(runner, (4, 3))
    specs = [SampleSpec(key=7, position=CONTEXTS[0] + 1 + i, temperature=0.8)
             for i in range(len(calls[0].rows))]
    calls[0] = BlockCall(calls[0].seq, calls[0].tokens, calls[0].pos, calls[0].rows, specs)
    packed = runner.forward_batch(calls)
    alone = _runner(paths)
    for c, got in zip(calls, packed, strict=True):
        want = alone.forward_batch([c])[0]
        np.testing.assert_array_equal(got.logits, want.logits)
        if c.specs is None:
            assert got.sampled is None and got.logits.shape[1] == runner.hp.n_vocab
        else:
            assert got.sampled is not None and want.sampled is not None
            assert got.logits.shape == (len(c.rows), 0)
            for a, b in zip(got.sampled, want.sampled, strict=True):
                assert a is not None and b is not None
                assert list(a.tokens) == list(b.tokens)


def test_a_batch_holds_one_call_per_sequence(paths: tuple[Path, Path]) -> None:
    runner = _runner(paths)
    call = _calls(runner, (2,))[0]
    with pytest.raises(ValueError, match="one call per sequence"):
        runner.forward_batch([call, call])


def test_deferred_injections_run_in_one_pass_as_each_alone(paths: tuple[Path, Path]) -> None:
    """The injections of three sequences waiting in `deferred_injections` run in one pass
    when it closes, writing the rows each injection alone writes, bit for bit; a block
    first runs those waiting before it."""
    runner, alone = _runner(paths), _runner(paths)
    assert runner.packs_injections
    rng = np.random.default_rng(2)
    more = [rng.normal(0, 1, (n, runner.feature_width)).astype(np.float32) for n in (3, 1, 5)]
    passes = runner.inject_passes
    with runner.deferred_injections():
        for seq, rows in enumerate(more):
            buf = rows.copy()
            runner.inject(seq, buf, CONTEXTS[seq])
            buf[:] = 0.0  # the rows waiting are the runner's own copy
        assert runner.inject_passes == passes
    assert runner.inject_passes == passes + 1
    for seq, rows in enumerate(more):
        alone.inject(seq, rows.astype(np.float64), CONTEXTS[seq])  # converted, as before
    for seq in range(3):
        for a, b in zip(_kv(runner, seq), _kv(alone, seq), strict=True):
            np.testing.assert_array_equal(a, b)
    with runner.deferred_injections():
        runner.inject(0, more[0], CONTEXTS[0] + 3)
        runner.forward_batch(_calls(runner, (2,)))  # runs the injection waiting first
        assert runner.inject_passes == passes + 2


@pytest.fixture(scope="module")
def eagle3_paths(tiny_model_factory: Callable[..., Path],
                 tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    target = tiny_model_factory(arch="qwen3", weight_type="Q8_0", seed=3, context_length=512)
    head = write_tiny_head(tmp_path_factory.mktemp("eagle3") / "head.gguf", kind="eagle3",
                           seed=5, draft_vocab=100)
    return target, head


def _eagle3_runner(paths: tuple[Path, Path]) -> tuple[HeadRunner, list[np.ndarray]]:
    """An EAGLE-3 head over three slots, each with its own random pairs written; the g
    rows of each slot's next position."""
    target, head = paths
    runner = HeadRunner(load_or_build_head(head, target), n_ctx=512, n_seq=3)
    rng = np.random.default_rng(4)
    nexts = []
    for seq, n in enumerate(CONTEXTS):
        g = runner.encode(rng.normal(0, 1, (n + 1, runner.feature_width)).astype(np.float32))
        runner.pair(seq, list(rng.integers(0, 300, n)), g[:n], 0)
        nexts.append(g[n:])
    return runner, nexts


def test_packed_eagle3_steps_equal_each_step_alone(eagle3_paths: tuple[Path, Path]) -> None:
    runner, nexts = _eagle3_runner(eagle3_paths)
    assert runner.packs_steps
    spec = SampleSpec(key=9, position=CONTEXTS[1] + 1, temperature=0.8)
    calls = [StepCall(seq, [40 + seq], g, CONTEXTS[seq], [0], spec if seq == 1 else None)
             for seq, g in enumerate(nexts)]
    passes = runner.step_passes
    packed = runner.forward_batch(calls)
    assert runner.step_passes == passes + 1
    packed_kv = [_kv(runner, c.seq) for c in calls]
    alone, _ = _eagle3_runner(eagle3_paths)
    for c, got, kv in zip(calls, packed, packed_kv, strict=True):
        want = alone.forward_batch([c])[0]
        np.testing.assert_array_equal(got.logits, want.logits)
        np.testing.assert_array_equal(got.hidden, want.hidden)
        assert got.hidden.shape == (1, runner.hp.n_embd)
        if c.spec is None:
            assert got.sampled is None and got.logits.shape == (1, runner.hp.n_vocab)
        else:
            assert got.sampled is not None and want.sampled is not None
            assert got.sampled.tokens == want.sampled.tokens
        for a, b in zip(kv, _kv(alone, c.seq), strict=True):
            np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="blocks or steps"):
        runner.forward_batch([calls[0], BlockCall(1, [1, 2], 5, [1])])


def test_deferred_eagle3_pairs_run_in_one_pass_as_each_alone(
        eagle3_paths: tuple[Path, Path]) -> None:
    """EAGLE-3 pairs of three sequences waiting in `deferred_injections`: one pass, the
    rows each pair call alone writes; a step first writes those waiting before it."""
    runner, nexts = _eagle3_runner(eagle3_paths)
    alone, _ = _eagle3_runner(eagle3_paths)
    assert runner.packs_pairs
    rng = np.random.default_rng(6)
    pairs = [(list(rng.integers(0, 300, n)),
              runner.encode(rng.normal(0, 1, (n, runner.feature_width)).astype(np.float32)))
             for n in (2, 1, 4)]
    passes = runner.inject_passes
    with runner.deferred_injections():
        for seq, (tokens, g) in enumerate(pairs):
            runner.pair(seq, tokens, g, CONTEXTS[seq])
        assert runner.inject_passes == passes
    assert runner.inject_passes == passes + 1
    for seq, (tokens, g) in enumerate(pairs):
        alone.pair(seq, tokens, g, CONTEXTS[seq])
        for a, b in zip(_kv(runner, seq), _kv(alone, seq), strict=True):
            np.testing.assert_array_equal(a, b)
    with runner.deferred_injections():
        runner.pair(0, [5], pairs[0][1][:1], CONTEXTS[0] + 2)
        runner.forward_batch([StepCall(0, [7], nexts[0], CONTEXTS[0] + 3, [0])])
        assert runner.inject_passes == passes + 2  # the pair waiting ran first


def test_slots_added_later_pack_as_well(paths: tuple[Path, Path]) -> None:
    """Sequences added past the cache's first capacity (its arrays move): the packed
    binding follows them, and the blocks still equal each alone."""
    target, head = paths
    grown = HeadRunner(load_or_build_head(head, target), n_ctx=512, n_seq=1)
    while grown.n_seq < 3:
        grown.add_sequence()
    rng = np.random.default_rng(1)
    for seq, n in enumerate(CONTEXTS):
        grown.inject(seq, rng.normal(0, 1, (n, grown.feature_width)).astype(np.float32), 0)
    calls = _calls(grown, (3, 4, 2))
    alone = _runner(paths)
    for c, got in zip(calls, grown.forward_batch(calls), strict=True):
        _same(got, alone.forward_batch([c])[0], len(c.rows))


def test_without_specds_kernels_blocks_run_one_by_one(paths: tuple[Path, Path]) -> None:
    """A head built on ONNX Runtime's ops (as on CUDA) does not pack: forward_batch runs a
    pass per block, each the block alone."""
    target, head = paths
    runner = HeadRunner(load_or_build_head(head, target, kernels="ort"), n_ctx=512, n_seq=2)
    assert not (runner.packs_blocks or runner.packs_injections)
    rng = np.random.default_rng(1)
    for seq, n in enumerate(CONTEXTS[:2]):
        runner.inject(seq, rng.normal(0, 1, (n, runner.feature_width)).astype(np.float32), 0)
    calls = _calls(runner, (4, 2))
    passes = runner.block_passes
    together = runner.forward_batch(calls)
    assert runner.block_passes == passes + 2
    for c, got in zip(calls, together, strict=True):
        _same(got, runner.forward_batch([c])[0], len(c.rows))
