"""GgufMatMul's Q4_K / Q6_K products through AVX-512 VNNI (vpdpbusd) against the builds
without it, bit for bit: the native build's 512-bit VNNI kernels, the 256-bit VNNI ones
(AVX-512 VL without BW) and the AVX2 ones (maddubs sums in 16 bits) compute the same
integer sums, and the float combination is the contract's in every build."""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper
from test_native_ops import EXPECTED_ABSENCE, LIB, WHY, _graph_session, _inputs

from specd.ort_models import native_ops
from specd.ort_models.gguf_layouts import regroup

from numpy_reference import gguf_matmul
from tiny_gguf import KQuantBlocks, random_kquant_blocks

TYPES = {"Q4_K": 12, "Q6_K": 14}
# the builds compared with the native one: the same sources with fewer instructions
BUILDS = {
    "vnni256": ("-march=native", "-mno-avx512bw"),  # vpdpbusd on 256 bits
    "no-vnni": ("-march=native", "-mno-avx512vnni"),  # AVX2's maddubs + madd
}
ROWS = (1, 3, 8, 9, 13, 16)  # one row; verify blocks; uneven chunks of rows


def _native_macros() -> set[str]:
    """The instruction-set macros the compiler defines for -march=native."""
    cc = native_ops.compiler()
    if cc is None:
        return set()
    out = subprocess.run([cc, "-march=native", "-dM", "-E", "-x", "c", "/dev/null"],
                         capture_output=True, text=True).stdout
    return {line.split()[1] for line in out.splitlines() if line.startswith("#define")}


MACROS = _native_macros()
HAS_VNNI = {"__AVX512F__", "__AVX512BW__", "__AVX512VL__", "__AVX512VNNI__"} <= MACROS
pytestmark = [
    pytest.mark.skipif(LIB is None and EXPECTED_ABSENCE, reason=f"no specd kernels: {WHY}"),
    pytest.mark.skipif(not HAS_VNNI, reason="this CPU (as -march=native sees it) lacks "
                       "AVX-512 VNNI, VL or BW: the native build is the AVX2 one, which "
                       "test_native_ops already checks against the others"),
]


@pytest.fixture(scope="module")
def libs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The native library and the builds without (512-bit) VNNI, by name."""
    assert LIB is not None, f"specd's kernels did not build: {WHY}"
    out = {"native": LIB}
    for name, flags in BUILDS.items():
        out[name] = native_ops.build(flags=flags, out_dir=tmp_path_factory.mktemp(name))
    return out


def _session(w: np.ndarray, qtype: str, k: int, n: int, lib: Path, threads: int = 2):
    node = helper.make_node("GgufMatMul", ["A", "W"], ["Y"], domain="specd",
                            ggml_type=TYPES[qtype], K=k, N=n)
    graph = helper.make_graph(
        [node], "t", [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["M", k])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["M", n])],
        [numpy_helper.from_array(w, "W")])
    return _graph_session(graph, lib, threads)


def _extreme_blocks(qtype: str, n: int, k: int, rng: np.random.Generator) -> KQuantBlocks:
    """Blocks at the ends of the integer ranges: every code and scale at its largest
    magnitude, so the sums of products reach the bounds the 16-bit maddubs sums of the
    AVX2 path are kept within (30480 for Q4_K, 32004 for Q6_K)."""
    nb = n * k // 256
    d = rng.uniform(0.5, 1.5, nb).astype(np.float16)
    if qtype == "Q6_K":
        sc = rng.choice(np.array([-128, 127], np.int8), size=(nb, 16))
        q = rng.choice(np.array([-32, 31], np.int16), size=(nb, 256))
        return KQuantBlocks(qtype, n, k, d, None, sc, None, q)
    sc = np.full((nb, 8), 63, np.uint8)
    m = np.full((nb, 8), 63, np.uint8)
    q = np.full((nb, 256), 15, np.int16)
    dmin = rng.uniform(0.5, 1.5, nb).astype(np.float16)
    return KQuantBlocks(qtype, n, k, d, dmin, sc, m, q)


def _extreme_inputs(m: int, k: int) -> np.ndarray:
    """Rows quantizing to +-127 everywhere: all +, all -, alternating blocks of 4."""
    x = np.ones((m, k), np.float32)
    x[1::3] = -1.0
    x[2::3] = np.where(np.arange(k) // 4 % 2, 1.0, -1.0)
    return x


@pytest.mark.parametrize("qtype", list(TYPES))
@pytest.mark.parametrize("k, n", [(1536, 40), (896, 33)])  # 896: the last superblock trimmed
def test_builds_with_and_without_vnni_agree_bitwise(libs: dict[str, Path], qtype: str,
                                                    k: int, n: int) -> None:
    rng = np.random.default_rng(k * 7 + n)
    k_rows = -(-k // 256) * 256
    for blocks in (random_kquant_blocks(rng, n, k_rows, qtype, std=0.05),
                   _extreme_blocks(qtype, n, k_rows, rng)):
        w = regroup(qtype, blocks.pack(), n, k)
        sessions = {name: _session(w, qtype, k, n, lib) for name, lib in libs.items()}
        for m in ROWS:
            for x in (_inputs(rng, m, k), _extreme_inputs(m, k)):
                want = gguf_matmul(x, blocks)
                for name, sess in sessions.items():
                    got = sess.run(None, {"A": x})[0]
                    np.testing.assert_array_equal(got, want, err_msg=f"{name}, {m} rows")


def test_rows_equal_single_rows_in_every_build(libs: dict[str, Path]) -> None:
    """A row of a 16-row call (two chunks of 8 rows) equals the same row alone."""
    rng = np.random.default_rng(36)
    k, n = 1024, 48
    for qtype in TYPES:
        blocks = random_kquant_blocks(rng, n, k, qtype, std=0.05)
        w = regroup(qtype, blocks.pack(), n, k)
        x = _inputs(rng, 16, k)
        for name, lib in libs.items():
            sess = _session(w, qtype, k, n, lib, threads=1)
            block = sess.run(None, {"A": x})[0]
            singles = np.concatenate([sess.run(None, {"A": x[i:i + 1]})[0] for i in range(16)])
            np.testing.assert_array_equal(block, singles, err_msg=f"{qtype}, {name}")
