"""The check of whether ORT computes a one-row MatMulNBits call as a row of a larger call."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

from specd.ort_models.graph_builder import BuildOptions
from specd.ort_models.model_cache import load_or_build
from specd.ort_models.row_invariance import (
    NBitsConfig,
    graph_nbits_configs,
    min_call_rows,
    rows_needed,
)
from specd.ort_models.runner import ModelRunner


def _product(cfg: NBitsConfig, k: int, n: int) -> ort.InferenceSession:
    rng = np.random.default_rng(7)
    n_blocks = k // cfg.block_size
    b = rng.integers(0, 256, (n, n_blocks, cfg.block_size * cfg.bits // 8), np.uint8)
    scales = (rng.random(n * n_blocks, np.float32) * 0.02).astype(np.float32)
    node = helper.make_node("MatMulNBits", ["A", "B", "scales"], ["Y"], domain="com.microsoft",
                            K=k, N=n, bits=cfg.bits, block_size=cfg.block_size,
                            accuracy_level=cfg.accuracy_level)
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["M", k])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["M", n])],
        [helper.make_tensor("B", TensorProto.UINT8, b.shape, b.tobytes(), raw=True),
         helper.make_tensor("scales", TensorProto.FLOAT, scales.shape, scales.tobytes(),
                            raw=True)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("com.microsoft", 1)])
    so = ort.SessionOptions()
    so.intra_op_num_threads = 2
    return ort.InferenceSession(model.SerializeToString(), so,
                                providers=["CPUExecutionProvider"])


def test_the_small_probe_predicts_a_model_sized_product() -> None:
    """What the probe finds on its 512 x 64 product holds for a 1536 x 1024 one: calls of
    rows_needed rows (a filler row after the real one) compute the row as a 9-row call."""
    for cfg in (NBitsConfig(4, 32, 4, False), NBitsConfig(8, 32, 4, False)):
        need = rows_needed(cfg, 2)
        assert need in (1, 2)
        sess = _product(cfg, 1536, 1024)
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
