"""The check of whether ORT computes a one-row MatMulNBits call as a row of a larger call."""

from __future__ import annotations

import numpy as np

from specd.ort_models.graph_builder import BuildOptions
from specd.ort_models.model_cache import load_or_build
from specd.ort_models.row_invariance import (
    NBitsConfig,
    graph_nbits_configs,
    min_call_rows,
    nbits_session,
    rows_needed,
)
from specd.ort_models.runner import ModelRunner


def test_the_small_probe_predicts_a_model_sized_product() -> None:
    """What the probe finds on its 512 x 64 product holds for a 1536 x 1024 one: calls of
    rows_needed rows (a filler row after the real one) compute the row as a 9-row call."""
    for cfg in (NBitsConfig(4, 32, 4, False), NBitsConfig(8, 32, 4, False)):
        need = rows_needed(cfg, 2)
        assert need in (1, 2)
        sess = nbits_session(cfg, 2, 1536, 1024, seed=7)
        a = np.random.default_rng(3).standard_normal((9, 1536)).astype(np.float32)
        block = sess.run(None, {"A": a})[0]  # [9, N]
        for i in range(3):
            rows = a[[i] * need]  # the row, then as many copies as filler
            assert np.array_equal(sess.run(None, {"A": rows})[0][0], block[i])


def test_configs_are_read_from_the_built_graph(tiny_model_factory) -> None:
    q4 = load_or_build(tiny_model_factory(arch="qwen2", weight_type="Q4_0"))
    q8 = load_or_build(tiny_model_factory(arch="llama", weight_type="Q8_0"))
    level = BuildOptions().accuracy_level
    assert NBitsConfig(4, 32, level, False) in graph_nbits_configs(q4.model_path)
    assert {c.bits for c in graph_nbits_configs(q8.model_path)} == {8}
    f32 = load_or_build(tiny_model_factory(arch="llama", weight_type="F32"))
    assert graph_nbits_configs(f32.model_path) == frozenset()
    assert min_call_rows(f32.model_path, 2) == 1


def test_a_cpu_runner_pads_single_steps_where_the_probe_says_so(tiny_model_factory) -> None:
    built = load_or_build(tiny_model_factory(arch="qwen2", weight_type="Q4_0"))
    r = ModelRunner(built, n_ctx=256, threads=2)
    assert r.min_rows == min_call_rows(built.model_path, 2)
    assert r.call_rows(0, 1) == r.min_rows
