"""The graph builder's output, pinned byte for byte on a few tiny models.

Built graphs are cached by (GGUF hash, BUILDER_VERSION, options): a change to the bytes a
build writes must come with a new BUILDER_VERSION, or users keep running stale graphs.
Each case below stands for one kind of matrix (dense float32, MatMulNBits with and
without zero points or a min term, GgufMatMul rows from the GGUF or re-quantized to
Q4_K), pending prologue (RMS norm with and without a shared output, SwiGlu, both also
materialized) or attention (exact with group size 1 and > 1, fused, native with an f32
or f16 cache); the golden hashes were computed by the builder before it was split into
modules.

What is hashed: model.onnx whole (nodes, attributes, inline constants, each
initializer's offset and length in weights.bin), the cache folder's name, and
weights.bin with the rotary tables (rope.cos, rope.sin) zeroed. Those tables are float64
cos / sin / pow from numpy, which picks SIMD routines by CPU, so their last bits may
differ between machines; every other weight byte is a copy of the GGUF's bytes or an
IEEE-exact elementwise function of them (casts, products, division, rint, min / max).
The tiny GGUF files are deterministic for a seed (test_tiny_gguf.py checks it); where
this platform's numpy or gguf writes them differently, there is nothing to compare
against and the test says so (skip).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path

import pytest

from specd.ort_models.graph_builder import BUILDER_VERSION, BuildOptions
from specd.ort_models.model_cache import MODEL_FILE, WEIGHTS_FILE, load_or_build

K_DIMS = {"n_embd": 256, "n_ff": 512}
ROTARY = ("rope.cos", "rope.sin")

# (id, write_tiny_gguf kwargs, options)
CASES = [
    # dense float32 matrices, tied dense embedding, exact attention (group size 2)
    ("dense-exact", {"arch": "llama", "weight_type": "F32"}, BuildOptions()),
    # MatMulNBits re-quantized with per-block zero points, qwen2 biases, fused
    # attention, the output cut to its first rows
    ("q4-fused-cut", {"arch": "qwen2", "weight_type": "Q5_0"},
     BuildOptions(requant="q4", attention="fused", vocab_rows=100)),
    # MatMulNBits with the K-quant min term, qk norms, native attention on split q/k/v,
    # both pending kinds materialized (no GgufMatMul reads Q5_K), a hidden-state output
    ("kquant-native-materialized", {"arch": "qwen3", "weight_type": "Q5_K", **K_DIMS},
     BuildOptions(kernels="gguf", attention="native", hidden_layers=(0,))),
    # GgufMatMul on the GGUF's Q4_K / Q6_K rows: the norm prologue shared by q+k and v
    # (v apart), the SwiGlu prologue, native attention on packed q+k, f16 cache
    ("gguf-prologues-f16", {"arch": "qwen2", "weight_type": "Q4_K", "value_type": "Q6_K",
                            **K_DIMS},
     BuildOptions(kernels="gguf", attention="native", kv_dtype="f16")),
    # GgufMatMul on rows re-quantized to Q4_K, native attention on packed q+k+v
    ("q4k-native-cut", {"arch": "llama", "weight_type": "Q8_0"},
     BuildOptions(kernels="gguf", requant="q4k", attention="native", vocab_rows=100)),
    # GgufMatMul on Q4_0 rows with exact attention of group size 1 (Split after the
    # stacked q/k/v product)
    ("q4_0-gguf-exact-mha", {"arch": "qwen2", "weight_type": "Q4_0", "n_head_kv": 4},
     BuildOptions(kernels="gguf", accuracy_level=1)),
]

# id -> (GGUF sha256, folder name without the GGUF hash, model.onnx, weights.bin less rotary)
GOLDEN: dict[str, tuple[str, str, str, str]] = {
    "dense-exact": (
        "4cd63f69ff541514579502826c0ce2a093aca31069d6840719d087c3fd0a5a0c",
        "b15-hnone_p0_a4",
        "b483804991a606041a57c153993a4bad44f52e9c724c321fa0b59db53e216f7f",
        "4bdac3663cbfe3f82a7c59ce706ab1f4b7179af5f142d3f1e7bbc9e321ca3918",
    ),
    "q4-fused-cut": (
        "4e03951af54ac8dd0019ee38cdabc7a1f84001d2e3b33f544ed04cd21729dc78",
        "b15-hnone_p0_a4_rq4_gqa_v100",
        "f133ada667916e26abbeefd81f7dda352a02dd646d07be0001ce749e1471ded7",
        "b0521ce76ffd6b51540eb3a703ad3792532a0e98c35f4aaeca57726bd042ac30",
    ),
    "kquant-native-materialized": (
        "e9c0fd0c86cac9cc2c6d1095af1b2363daa74bfda93c45f29153cbd4563e8c97",
        "b15-h0_p0_a4_natt_kgguf",
        "8afe1ffb62e0718286141669449c28b85d9b3d11b25288707a8843c1ac09af76",
        "c534e1ce2ea8aa45199e59cc668be2bd0c870744c0a325b1784146ebcc375c94",
    ),
    "gguf-prologues-f16": (
        "a2941371574065b6d9f0c21a72021a85c712898255a1eaeb2eb52e05129caedd",
        "b15-hnone_p0_a4_natt_kgguf_kv16",
        "843cceab50efee97027728d92df0deddbd664d01b82c70092aaebe628494c56c",
        "f27ba9cb4e4fbf4c25002d69b79d0035ae31da1704b464d20cac897b6aa0e2ae",
    ),
    "q4k-native-cut": (
        "d6515a907482c28cb0ed20f12c2fd9e47265e6e5a8ef97c197cce53c95924b02",
        "b15-hnone_p0_a4_rq4k_natt_kgguf_v100",
        "8d56ca2c4c16e46232a576dfe9158bbb44254b0891fc2f0cb69b3eea7c9eac02",
        "d42ea72a53d45c19982c542d465de0c6c76c970d24ca29d1c3305857514e86ca",
    ),
    "q4_0-gguf-exact-mha": (
        "ecefb4ed53b03e1ff25777aaf7c382e5d3bf04a62e11c341e851610040400162",
        "b15-hnone_p0_a1_kgguf",
        "e08961d12dc98dd942118e09196024aa79682343e027bc48927e3009ba49d758",
        "86e0b8769578d89861ba7b4be6c732e404570c622582d779afaaef851efe567a",
    ),
}


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _weights_without_rotary(folder: Path) -> bytes:
    """weights.bin with the rotary tables' bytes zeroed (see the module docstring)."""
    import onnx

    model = onnx.load(str(folder / MODEL_FILE), load_external_data=False)
    data = bytearray((folder / WEIGHTS_FILE).read_bytes())
    for t in model.graph.initializer:
        if t.name in ROTARY:
            ext = {e.key: int(e.value) for e in t.external_data if e.key != "location"}
            data[ext["offset"]:ext["offset"] + ext["length"]] = bytes(ext["length"])
    return bytes(data)


def graph_hashes(path: Path, options: BuildOptions) -> tuple[str, str, str, str]:
    """(GGUF sha256, folder name less the GGUF hash, model.onnx sha256, weights sha256)."""
    built = load_or_build(path, options)
    return (_sha(path.read_bytes()), built.folder.name.split("-", 1)[1],
            _sha((built.folder / MODEL_FILE).read_bytes()),
            _sha(_weights_without_rotary(built.folder)))


def test_builder_version_is_the_one_the_hashes_were_taken_with() -> None:
    assert BUILDER_VERSION == "15"


@pytest.mark.parametrize("case, kwargs, options", CASES, ids=[c[0] for c in CASES])
def test_graph_bytes_are_pinned(tiny_model_factory: Callable[..., Path], tmp_path: Path,
                                monkeypatch: pytest.MonkeyPatch, case: str,
                                kwargs: dict[str, object], options: BuildOptions) -> None:
    monkeypatch.setenv("SPECD_CACHE_DIR", str(tmp_path))
    path = tiny_model_factory(**kwargs)
    gguf, folder, model, weights = graph_hashes(path, options)
    want = GOLDEN[case]
    if gguf != want[0]:
        pytest.skip(f"the tiny GGUF writer gives other bytes here ({gguf[:12]}, golden "
                    f"{want[0][:12]}): no golden graph for this input")
    assert (folder, model, weights) == want[1:], (
        "the graph's bytes changed: a change to what the builder writes needs a new "
        "BUILDER_VERSION (and new golden hashes here)")
