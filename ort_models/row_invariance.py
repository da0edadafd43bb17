"""Does ONNX Runtime compute a one-row MatMulNBits call as it computes that row in a
larger call, on this machine? Checked at run time, not assumed.

Greedy speculation is exact only if a verified row (a row of a multi-token call) equals
the single-token step at its position bit for bit. MLAS picks its kernel for a quantized
product by the CPU's instruction sets and by M, the rows of the call: on some CPUs and
configurations (4-bit without VNNI, for one) the rows of M >= 2 calls agree bit for bit
while an M = 1 call's row differs from them. So where a graph's MatMulNBits computes one
row differently, its runner makes every single-token call two rows (a filler row,
computed and dropped): then all calls take the M >= 2 kernels. The check runs once per
process and configuration, on a small product with random codes.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger("specd.runner")

PROBE_K = 512  # a multiple of every MatMulNBits block size (16 .. 256)
PROBE_N = 64
PROBE_ROWS = 4


@dataclass(frozen=True)
class NBitsConfig:
    """What selects MLAS's kernel for a MatMulNBits node, besides the shapes."""

    bits: int
    block_size: int
    accuracy_level: int
    zero_points: bool  # the node has a zero-point input


def graph_nbits_configs(model_path: Path) -> frozenset[NBitsConfig]:
    """The MatMulNBits configurations in a built graph (its weights are not read)."""
    import onnx

    model = onnx.load(str(model_path), load_external_data=False)
    found = set()
    for node in model.graph.node:
        if node.op_type != "MatMulNBits":
            continue
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        found.add(NBitsConfig(int(attrs.get("bits", 4)), int(attrs["block_size"]),
                              int(attrs.get("accuracy_level", 0)),
                              len(node.input) > 3 and bool(node.input[3])))
    return frozenset(found)


def nbits_session(cfg: NBitsConfig, threads: int, k: int = PROBE_K, n: int = PROBE_N,
                  seed: int = 0) -> Any:
    """A CPU session of one MatMulNBits product [M, k] x [k, n] with random codes."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    rng = np.random.default_rng(seed)
    n_blocks = k // cfg.block_size
    b = rng.integers(0, 256, (n, n_blocks, cfg.block_size * cfg.bits // 8), np.uint8)
    scales = (rng.random(n * n_blocks, np.float32) * 0.02).astype(np.float32)
    inits = [helper.make_tensor("B", TensorProto.UINT8, b.shape, b.tobytes(), raw=True),
             helper.make_tensor("scales", TensorProto.FLOAT, scales.shape, scales.tobytes(),
                                raw=True)]
    inputs = ["A", "B", "scales"]
    if cfg.zero_points:
        zp_bytes = -(-n_blocks * cfg.bits // 8)
        zp = rng.integers(0, 256, (n, zp_bytes), np.uint8)
        inits.append(helper.make_tensor("zp", TensorProto.UINT8, zp.shape, zp.tobytes(),
                                        raw=True))
        inputs.append("zp")
    node = helper.make_node("MatMulNBits", inputs, ["Y"], domain="com.microsoft",
                            K=k, N=n, bits=cfg.bits, block_size=cfg.block_size,
                            accuracy_level=cfg.accuracy_level)
    graph = helper.make_graph(
        [node], "row_invariance",
        [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["M", k])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["M", n])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("com.microsoft", 1)])
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), so,
                                providers=["CPUExecutionProvider"])


@functools.cache
def rows_needed(cfg: NBitsConfig, threads: int = 1) -> int | None:
    """Fewest rows a MatMulNBits call with `cfg` must run, on the CPU EP here, to compute
    each row as a call of PROBE_ROWS rows does: 1, 2, or None when even 2 rows differ
    (no filler makes its rows invariant)."""
    sess = nbits_session(cfg, threads)
    a = np.random.default_rng(1).standard_normal((PROBE_ROWS, PROBE_K)).astype(np.float32)
    block = sess.run(None, {"A": a})[0]  # [PROBE_ROWS, N]
    if not np.array_equal(sess.run(None, {"A": a[:2]})[0], block[:2]):  # [2, N]
        return None
    singles = np.concatenate([sess.run(None, {"A": a[i:i + 1]})[0] for i in range(2)])
    return 1 if np.array_equal(singles, block[:2]) else 2


def min_call_rows(model_path: Path, threads: int) -> int:
    """Rows every CPU call of this graph runs (filler rows past the real ones) so that a
    row is computed the same way whatever the call's size: 2 where a single row is not.
    Where no filler helps, 1, with a warning: verified rows may then differ from single
    steps in the last bits, and greedy speculation from the target alone at near-ties."""
    needed = {c: rows_needed(c, threads) for c in graph_nbits_configs(model_path)}
    bad = [c for c, n in needed.items() if n is None]
    if bad:
        log.warning("%s: ONNX Runtime's MatMulNBits computes rows differently by call size "
                    "on this CPU (%s); speculative output may differ from the target's own "
                    "at near-ties", model_path.parent.name, bad)
    return max((n for n in needed.values() if n is not None), default=1)
