"""CachedAttention's non-causal mode (causal=0), a drafter head's block: each row of a
segment attends over its sequence's keys up to the segment's last row, later rows of the
block included; against a numpy reference, and packed segments against each alone."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from specd.ort_models import native_ops

from packed_attention import assert_segments_equal_alone

LIB = native_ops.library()
WHY = native_ops.unavailable_reason() or ""
EXPECTED_ABSENCE = (native_ops.compiler() is None or "without AVX2" in WHY
                    or "SPECD_NATIVE=0" in WHY)
pytestmark = pytest.mark.skipif(LIB is None and EXPECTED_ABSENCE,
                                reason=f"no specd kernels: {WHY}")

HEADS, KV, HD, N_CTX, RD = 6, 2, 32, 64, 32


def _session(causal: int, segments: bool, window: int = 0) -> ort.InferenceSession:
    assert LIB is not None, WHY
    extra = {"causal": causal} if causal != 1 else {}
    node = helper.make_node("CachedAttention", ["q", "k", "v", "pk", "pv", "pos", "cos", "sin"],
                            ["Y", "K", "V"], domain="specd", num_heads=HEADS, kv_num_heads=KV,
                            scale=1.0 / np.sqrt(HD), rotary_dim=RD, interleaved=0,
                            **extra, **({"window": window} if window else {}))
    cache = ["slots", KV, "n_ctx", HD]
    f = TensorProto.FLOAT
    graph = helper.make_graph(
        [node], "block",
        [helper.make_tensor_value_info("q", f, ["S", HEADS * HD]),
         helper.make_tensor_value_info("k", f, ["S", KV * HD]),
         helper.make_tensor_value_info("v", f, ["S", KV * HD]),
         helper.make_tensor_value_info("pk", f, cache),
         helper.make_tensor_value_info("pv", f, cache),
         helper.make_tensor_value_info("pos", TensorProto.INT64, ["B", 3] if segments else [1]),
         helper.make_tensor_value_info("cos", f, ["P", RD // 2]),
         helper.make_tensor_value_info("sin", f, ["P", RD // 2])],
        [helper.make_tensor_value_info("Y", f, ["S", HEADS * HD]),
         helper.make_tensor_value_info("K", f, cache),
         helper.make_tensor_value_info("V", f, cache)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21),
                                                    helper.make_opsetid("specd", 1)])
    so = ort.SessionOptions()
    so.register_custom_ops_library(str(LIB))
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _tables() -> tuple[np.ndarray, np.ndarray]:
    ang = np.arange(N_CTX)[:, None] * 10000.0 ** (-np.arange(0, RD, 2) / RD)[None, :]
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def _rotate(x: np.ndarray, heads: int, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """[S, heads*HD] rotated (non-interleaved) at the rows' angles [S, RD/2]."""
    y = x.reshape(len(x), heads, HD).astype(np.float64)
    a, b = y[:, :, :RD // 2].copy(), y[:, :, RD // 2:RD].copy()
    c, s = cos[:, None, :], sin[:, None, :]
    y[:, :, :RD // 2], y[:, :, RD // 2:RD] = a * c - b * s, b * c + a * s
    return y


@pytest.mark.parametrize("window", [0, 8])
def test_not_causal_rows_see_their_whole_block(window: int) -> None:
    """Every row of the block at pos..pos+S-1 attends to keys 0..pos+S-1 (the cache's
    earlier rows and the whole block), against softmax attention in float64; with a
    sliding window, as llama.cpp masks one, only keys less than `window` positions before
    the row itself (the block's later rows stay in view)."""
    rng = np.random.default_rng(3)
    cos, sin = _tables()
    s, pos = 5, 20
    feed = {"q": rng.normal(0, 1, (s, HEADS * HD)).astype(np.float32),
            "k": rng.normal(0, 1, (s, KV * HD)).astype(np.float32),
            "v": rng.normal(0, 1, (s, KV * HD)).astype(np.float32),
            "pk": rng.normal(0, 1, (1, KV, N_CTX, HD)).astype(np.float32),
            "pv": rng.normal(0, 1, (1, KV, N_CTX, HD)).astype(np.float32),
            "pos": np.array([pos]), "cos": cos, "sin": sin}
    y, pk, _ = _session(0, False, window=window).run(None, feed)
    rows = slice(pos, pos + s)
    q = _rotate(feed["q"], HEADS, cos[rows], sin[rows])  # [S, H, HD]
    keys = pk[0].astype(np.float64)[:, :pos + s]  # [Hkv, T, HD], the block's rows written
    np.testing.assert_allclose(keys[:, pos:], _rotate(feed["k"], KV, cos[rows], sin[rows])
                               .transpose(1, 0, 2), rtol=1e-6, atol=1e-6)
    vals = feed["pv"][0].astype(np.float64)[:, :pos + s]
    vals[:, pos:] = feed["v"].reshape(s, KV, HD).transpose(1, 0, 2)
    for r in range(s):
        first = 0 if not window else pos + r - window + 1  # the oldest key the row sees
        for h in range(HEADS):
            sc = keys[h // 3, first:] @ q[r, h] / np.sqrt(HD)  # [T - first]
            w = np.exp(sc - sc.max())
            want = (w / w.sum()) @ vals[h // 3, first:]
            np.testing.assert_allclose(y[r, h * HD:(h + 1) * HD], want, rtol=2e-5, atol=2e-6)
    if window:
        return
    causal = _session(1, False).run(None, feed)[0]
    np.testing.assert_array_equal(causal[-1], y[-1])  # the last row sees the same keys
    assert not np.array_equal(causal[0], y[0])


def test_not_causal_segments_each_equal_their_block_alone() -> None:
    """Blocks of three sequences packed in one call: every row, and every slot's cache,
    equals that block alone, bit for bit."""
    rng = np.random.default_rng(7)
    cos, sin = _tables()
    caches = [rng.normal(0, 1, (3, KV, N_CTX, HD)).astype(np.float32) for _ in range(2)]
    segs = [(2, 30, 4), (0, 5, 1), (1, 17, 6)]  # slot, pos, rows
    s = sum(n for _, _, n in segs)
    proj = {name: rng.normal(0, 1, (s, w * HD)).astype(np.float32)
            for name, w in (("q", HEADS), ("k", KV), ("v", KV))}
    y, pk, pv = _session(0, True).run(None, {**proj, "pk": caches[0], "pv": caches[1],
                                             "pos": np.array(segs), "cos": cos, "sin": sin})
    alone = _session(0, False)
    assert_segments_equal_alone((y, pk, pv), alone, proj, caches, segs, cos, sin)
