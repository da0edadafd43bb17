"""Distillation: the target's own replies with the features of every token, in shards a
resumed run extends (no torch needed)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from specd.daemon.models.building import build_options
from specd.daemon.training import TrainError, distill
from specd.daemon.training.distill import DistillSpec, load_split, target_sha
from specd.ort_models.model_cache import load_or_build
from specd.ort_models.runner import ModelRunner

LAYERS = (1, 0)  # the head's order need not be the target's


def test_replies_and_features_in_shards_resumed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                tiny_model_factory: Callable[..., Path]) -> None:
    target = tiny_model_factory(arch="qwen3")
    spec = DistillSpec(target_sha(target), LAYERS, max_prompt=384, max_reply=24, seed=0)
    monkeypatch.setattr(distill, "SHARD_SECONDS", 0.0)  # a shard per reply
    folder = tmp_path / "data"
    m = distill.distill(target, folder, spec, {"train": 3, "eval": 1}, verbose=False)
    assert m["splits"]["train"]["samples"] == 3 and len(m["splits"]["train"]["shards"]) == 3
    m = distill.distill(target, folder, spec, {"train": 5, "eval": 1}, verbose=False)
    assert m["splits"]["train"]["samples"] == 5
    fresh = distill.distill(target, tmp_path / "fresh", spec, {"train": 5, "eval": 1},
                            verbose=False)
    assert fresh["splits"]["train"]["consumed"] == m["splits"]["train"]["consumed"]
    resumed, straight = load_split(folder, "train"), load_split(tmp_path / "fresh", "train")
    assert len(resumed) == 5
    built = load_or_build(target, dataclasses.replace(build_options("target"),
                                                      hidden_layers=(0, 1)))
    runner = ModelRunner(built, n_ctx=512)
    for i in range(5):
        tokens, reply, feats = resumed.get(i)
        assert np.array_equal(tokens, straight.get(i)[0])
        assert 0 < reply < len(tokens) and feats.dtype == np.float16
        assert feats.shape == (len(tokens), 2 * 64) and not feats[-1].any()
        # the rows recorded during decoding are the target's states of those tokens
        _, want = runner.prefill_with_features(0, tokens[:-1].tolist(), 0)
        rows = np.concatenate([want[h] for h in LAYERS], axis=-1)  # [T - 1, F]
        np.testing.assert_allclose(feats[:-1].astype(np.float32), rows, rtol=2e-3,
                                   atol=2e-3)
    other = dataclasses.replace(spec, max_reply=32)
    with pytest.raises(TrainError, match="another --work-dir"):
        distill.distill(target, folder, other, {"train": 6}, verbose=False)


def test_replies_decoded_together_are_those_decoded_one_at_a_time(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        tiny_model_factory: Callable[..., Path]) -> None:
    """Several replies at once (their rows in one pass a step) store the very sequences
    and features of one reply at a time, in the instructions' order, and a run stopped
    part-way resumes after the replies it stored."""
    target = tiny_model_factory(arch="qwen3")
    spec = DistillSpec(target_sha(target), LAYERS, max_prompt=160, max_reply=24, seed=0)
    monkeypatch.setattr(distill, "SHARD_SECONDS", 0.0)
    one = distill.distill(target, tmp_path / "one", spec, {"train": 6}, parallel=1,
                          verbose=False)
    distill.distill(target, tmp_path / "four", spec, {"train": 2}, parallel=4, verbose=False)
    four = distill.distill(target, tmp_path / "four", spec, {"train": 6}, parallel=4,
                           verbose=False)
    assert four["splits"]["train"]["consumed"] == one["splits"]["train"]["consumed"]
    a, b = load_split(tmp_path / "one", "train"), load_split(tmp_path / "four", "train")
    assert len(a) == len(b) == 6
    for i in range(6):
        (ta, ra, fa), (tb, rb, fb) = a.get(i), b.get(i)
        assert np.array_equal(ta, tb) and ra == rb
        assert np.array_equal(fa, fb)


def test_rows_after_the_replys_end_are_dropped_and_missing_ones_named() -> None:
    """A round may verify tokens after the reply's end (an end of generation inside an
    accepted draft, or max_tokens mid-round): their feature rows come last and go with
    them; fewer rows than tokens means the recorder failed."""
    recorder = distill._FeatureRecorder((0,))
    recorder.begin(3, [5, 6, 7], features={0: np.ones((3, 4), np.float32)})
    recorder.process(3, [8, 9], features={0: np.full((2, 4), 2.0, np.float32)})
    feats = recorder.take(3, 4, 4)  # a reply of 2: tokens 5 6 7 8 9, 4 evaluated
    assert feats.shape == (4, 4) and feats.dtype == np.float16
    assert feats[:3].tolist() == [[1.0] * 4] * 3 and feats[3].tolist() == [2.0] * 4
    recorder.begin(3, [5, 6], features={0: np.ones((2, 4), np.float32)})
    with pytest.raises(TrainError, match="2 feature rows for 3 evaluated tokens"):
        recorder.take(3, 3, 4)
