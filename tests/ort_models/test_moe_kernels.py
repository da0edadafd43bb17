"""specd's mixture-of-experts kernels (GgufExperts, MoeRouter) against their numpy
contracts, bit for bit, and MXFP4 against ggml's dequantization."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from onnx import TensorProto, helper, numpy_helper

from specd.ort_models import native_ops
from specd.ort_models.gguf_layouts import expert_rows
from specd.ort_models.quant import EXPERT_TYPE_IDS

from numpy_reference import gguf_matmul, quantize_activations
from tiny_gguf import random_kquant_blocks, random_q4_blocks
from tiny_moe import softmax, top_k

pytestmark = pytest.mark.skipif(native_ops.library() is None,
                                reason=f"no specd kernels: {native_ops.unavailable_reason()}")


def _session(nodes: list, inputs: list, outputs: list, weights: list) -> ort.InferenceSession:
    model = helper.make_model(helper.make_graph(nodes, "t", inputs, outputs, weights),
                              opset_imports=[helper.make_opsetid("", 21),
                                             helper.make_opsetid("specd", 1)])
    model.ir_version = 10
    so = ort.SessionOptions()
    so.intra_op_num_threads = 2
    native_ops.register(so)
    return ort.InferenceSession(model.SerializeToString(), so,
                                providers=["CPUExecutionProvider"])


class Experts:
    """Random experts [n_expert, N, K] of one type: the GGUF rows and the contract's
    product of one activation row with one expert."""

    def __init__(self, qtype: str, n_expert: int, n: int, k: int, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.qtype, self.n, self.k = qtype, n, k
        if qtype in ("Q4_K", "Q6_K", "Q4_0"):
            make = random_kquant_blocks if qtype != "Q4_0" else random_q4_blocks
            self.blocks = [make(rng, n, k, qtype, 0.05) for _ in range(n_expert)]
            self.rows = np.stack([b.pack() for b in self.blocks])
        elif qtype == "Q8_0":
            d = (rng.uniform(0.5, 2, (n_expert, n, k // 32, 1)) * 1e-3).astype(np.float16)
            q = rng.integers(-127, 128, (n_expert, n, k // 32, 32)).astype(np.int8)
            self.rows = np.concatenate([d.view(np.uint8), q.view(np.uint8)], axis=-1
                                       ).reshape(n_expert, n, -1)
        elif qtype == "MXFP4":
            e = rng.integers(115, 125, (n_expert, n, k // 32, 1)).astype(np.uint8)
            qs = rng.integers(0, 256, (n_expert, n, k // 32, 16)).astype(np.uint8)
            self.rows = np.concatenate([e, qs], axis=-1).reshape(n_expert, n, -1)
        else:  # F32
            self.rows = rng.normal(0, 0.05, (n_expert, n, k)).astype(np.float32)

    def values(self, e: int) -> np.ndarray:
        """Expert e dequantized by gguf-py [N, K]."""
        if self.qtype == "F32":
            return self.rows[e]
        return dequantize(self.rows[e], GGMLQuantizationType[self.qtype]).reshape(self.n, self.k)

    def product(self, x: np.ndarray, e: int) -> np.ndarray:
        """The contract's x [K] @ expert e^T -> [N] (kernels/gguf_experts.h)."""
        x = np.asarray(x, np.float32)[None]
        if self.qtype in ("Q4_K", "Q6_K", "Q4_0"):
            return gguf_matmul(x, self.blocks[e])[0]
        if self.qtype == "F32":
            return _dot_f32(self.rows[e], x[0])
        nb = -(-self.k // 256)
        xq, da = quantize_activations(np.pad(x, ((0, 0), (0, nb * 256 - self.k))))
        xs = xq.reshape(-1, 32)[:self.k // 32]  # [blocks, 32]
        # per block of 32: its scale (exact in float32) and its integer codes
        blocks = self.rows[e].reshape(self.n, self.k // 32, -1)
        if self.qtype == "Q8_0":
            d = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
            codes = blocks[..., 2:].view(np.int8).astype(np.int64)
        else:
            bits = blocks[..., 0].astype(np.uint32)
            d = np.where(bits < 2, np.uint32(0x00200000) << bits,
                         (bits - 1) << 23).astype(np.uint32).view(np.float32)
            lut = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12])
            qs = blocks[..., 1:]
            codes = np.concatenate([lut[qs & 15], lut[qs >> 4]], axis=-1)
        s = np.einsum("nbl,bl->nb", codes, xs)  # [N, blocks]
        y = np.zeros(self.n, np.float32)
        for i in range(nb):
            t = np.zeros(self.n, np.float32)
            for j in range(8 * i, min(8 * i + 8, self.k // 32)):
                t = t + d[:, j] * s[:, j].astype(np.float32)
            y = y + da[0, i] * t
        return y


def _dot_f32(w: np.ndarray, x: np.ndarray) -> np.ndarray:
    """specd_dot_f32 of every row of w [N, K] with x [K]: 8 lanes over K in order."""
    lanes = np.zeros((w.shape[0], 8), np.float32)
    for i in range(0, w.shape[1], 8):
        chunk = (w[:, i:i + 8] * x[i:i + 8]).astype(np.float32)
        lanes[:, :chunk.shape[1]] = lanes[:, :chunk.shape[1]] + chunk
    l_ = lanes
    return ((l_[:, 0] + l_[:, 1]) + (l_[:, 2] + l_[:, 3])) + ((l_[:, 4] + l_[:, 5])
                                                              + (l_[:, 6] + l_[:, 7]))


def _experts_session(ex: Experts, *, per_slot: bool = False, weighted: bool = False,
                     bias: np.ndarray | None = None, prologue: int = 0
                     ) -> ort.InferenceSession:
    shape = ["S", "top", "Ka"] if per_slot else ["S", "Ka"]  # the kernel checks Ka
    inputs = [helper.make_tensor_value_info("A", TensorProto.FLOAT, shape),
              helper.make_tensor_value_info("ids", TensorProto.INT64, ["S", "top"])]
    names = ["A", "ids", "W", "B" if bias is not None else ""]
    if weighted:
        inputs.append(helper.make_tensor_value_info("P", TensorProto.FLOAT, ["S", "top"]))
        names.append("P")
    weights = [numpy_helper.from_array(expert_rows(ex.qtype, ex.rows, ex.k), "W")]
    if bias is not None:
        weights.append(numpy_helper.from_array(bias, "B"))
    node = helper.make_node("GgufExperts", names, ["Y"], domain="specd",
                            ggml_type=EXPERT_TYPE_IDS[ex.qtype], K=ex.k, N=ex.n,
                            prologue=prologue)
    return _session([node], inputs, [helper.make_tensor_value_info("Y", TensorProto.FLOAT,
                                                                   None)], weights)


TYPES = ["Q4_K", "Q6_K", "Q4_0", "Q8_0", "MXFP4", "F32"]


@pytest.mark.parametrize("qtype", TYPES)
def test_each_row_gets_its_experts_product_bit_for_bit(qtype: str) -> None:
    """Rows shared by a token's slots: every (token, slot) equals the contract's product
    with the expert it chose, whichever experts the other rows chose."""
    k = 512 if qtype in ("Q4_K", "Q6_K") else 96
    ex = Experts(qtype, 6, 40, k)
    rng = np.random.default_rng(1)
    x = rng.normal(0, 1, (5, k)).astype(np.float32)
    ids = np.array([[0, 3], [3, 5], [5, 0], [2, 2], [1, 4]], np.int64)
    y = _experts_session(ex).run(None, {"A": x, "ids": ids})[0]  # [S, top, N]
    assert y.shape == (5, 2, 40)
    for t in range(5):
        for j in range(2):
            np.testing.assert_array_equal(y[t, j], ex.product(x[t], int(ids[t, j])))


@pytest.mark.parametrize("qtype", ["Q4_K", "Q8_0", "F32"])
def test_the_products_are_close_to_the_float_ones(qtype: str) -> None:
    """The contract is the experts' own product: within the int8 activations' rounding."""
    k = 256 if qtype == "Q4_K" else 64
    ex = Experts(qtype, 3, 32, k)
    x = np.random.default_rng(2).normal(0, 1, (4, k)).astype(np.float32)
    ids = np.array([[0], [1], [2], [1]], np.int64)
    y = _experts_session(ex).run(None, {"A": x, "ids": ids})[0][:, 0]
    want = np.stack([ex.values(int(e)) @ x[t] for t, e in enumerate(ids[:, 0])])
    assert np.abs(y - want).max() <= (2e-2 if qtype != "F32" else 1e-5) * np.abs(want).max()


def test_mxfp4_reads_as_ggml_dequantizes_bit_for_bit() -> None:
    """One-hot rows of 127 quantize exactly (da = 1, code 127), so row i of the product is
    127 x column i of the experts: divided by 127, every MXFP4 value equals gguf-py's
    dequantization (ggml's dequantize_row_mxfp4) bit for bit."""
    k, n = 64, 48
    ex = Experts("MXFP4", 2, n, k, seed=3)
    x = 127 * np.eye(k, dtype=np.float32)
    for e in range(2):
        ids = np.full((k, 1), e, np.int64)
        y = _experts_session(ex).run(None, {"A": x, "ids": ids})[0][:, 0]  # [K, N]
        np.testing.assert_array_equal(y.T / np.float32(127), ex.values(e))


def test_weighted_sum_bias_and_swiglu_prologue() -> None:
    """Per-slot rows through the SwiGlu prologue, each expert's bias added, the slots
    summed in order with the router's weights: as the contract composes them."""
    k, n = 64, 24
    ex = Experts("Q8_0", 4, n, k, seed=4)
    rng = np.random.default_rng(5)
    gu = rng.normal(0, 1, (3, 2, 2 * k)).astype(np.float32)  # gate then up
    ids = np.array([[1, 2], [3, 1], [0, 0]], np.int64)
    p = rng.uniform(0, 1, (3, 2)).astype(np.float32)
    bias = rng.normal(0, 1, (4, n)).astype(np.float32)
    sess = _experts_session(ex, per_slot=True, weighted=True, bias=bias, prologue=2)
    y = sess.run(None, {"A": gu, "ids": ids, "P": p})[0]  # [S, N]
    # the SwiGlu op's arithmetic: the plain op on the same rows
    swiglu = _session([helper.make_node("SwiGlu", ["X"], ["H"], domain="specd")],
                      [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["M", 2 * k])],
                      [helper.make_tensor_value_info("H", TensorProto.FLOAT, None)], [])
    h = swiglu.run(None, {"X": gu.reshape(6, 2 * k)})[0].reshape(3, 2, k)
    for t in range(3):
        rows = [ex.product(h[t, j], int(ids[t, j])) + bias[ids[t, j]] for j in range(2)]
        want = rows[0] * p[t, 0]
        want = want + rows[1] * p[t, 1]
        np.testing.assert_array_equal(y[t], want)


@pytest.mark.parametrize("qtype", ["Q4_K", "MXFP4", "F32"])
def test_rows_of_a_block_equal_single_rows(qtype: str) -> None:
    """A token's output is the same bits alone as in a block of tokens choosing other
    experts (a verified row equals a single step)."""
    k = 256 if qtype == "Q4_K" else 64
    ex = Experts(qtype, 8, 64, k, seed=6)
    rng = np.random.default_rng(7)
    x = rng.normal(0, 1, (9, k)).astype(np.float32)
    ids = rng.integers(0, 8, (9, 4)).astype(np.int64)
    p = rng.uniform(0, 1, (9, 4)).astype(np.float32)
    sess = _experts_session(ex, weighted=True)
    block = sess.run(None, {"A": x, "ids": ids, "P": p})[0]
    for t in range(9):
        alone = sess.run(None, {"A": x[t:t + 1], "ids": ids[t:t + 1], "P": p[t:t + 1]})[0]
        np.testing.assert_array_equal(block[t], alone[0])


def test_bad_ids_and_shapes_are_named() -> None:
    ex = Experts("Q8_0", 3, 16, 64)
    sess = _experts_session(ex)
    x = np.ones((2, 64), np.float32)
    with pytest.raises(Exception, match="expert id is outside"):
        sess.run(None, {"A": x, "ids": np.array([[0], [3]], np.int64)})
    with pytest.raises(Exception, match=r"A is not \[S, K\]"):
        sess.run(None, {"A": np.ones((2, 32), np.float32), "ids": np.zeros((2, 1), np.int64)})


def _router_session(n_expert: int, e: int, top: int, gating: int, norm: int,
                    w: np.ndarray, bias: np.ndarray | None = None) -> ort.InferenceSession:
    weights = [numpy_helper.from_array(w, "W")]
    if bias is not None:
        weights.append(numpy_helper.from_array(bias, "B"))
    node = helper.make_node("MoeRouter", ["X", "W", "B"][:len(weights) + 1], ["ids", "P"],
                            domain="specd", top_k=top, gating=gating, norm=norm, scale=0.0)
    return _session([node], [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["S", e])],
                    [helper.make_tensor_value_info("ids", TensorProto.INT64, None),
                     helper.make_tensor_value_info("P", TensorProto.FLOAT, None)], weights)


@pytest.mark.parametrize("gating, norm, biased", [(0, 1, False), (1, 0, True)])
def test_router_picks_as_llama_cpp_does(gating: int, norm: int, biased: bool) -> None:
    """qwen3moe (softmax, top k, renormalised) and gpt-oss (biased logits, top k, softmax
    over those k): the experts and weights of a float64 reference, and a row's bits are
    the same alone as in a block."""
    rng = np.random.default_rng(8)
    n_expert, e, top = 16, 64, 4
    w = rng.normal(0, 0.3, (n_expert, e)).astype(np.float32)
    b = rng.normal(0, 0.5, n_expert).astype(np.float32) if biased else None
    x = rng.normal(0, 1, (7, e)).astype(np.float32)
    sess = _router_session(n_expert, e, top, gating, norm, w, b)
    ids, p = sess.run(None, {"X": x})
    for t in range(7):
        logits = w.astype(np.float64) @ x[t] + (0 if b is None else b)
        if gating == 0:
            probs = softmax(logits)
            want_ids = top_k(probs, top)
            want = probs[want_ids] / probs[want_ids].sum()
        else:
            want_ids = top_k(logits, top)
            want = softmax(logits[want_ids])
        np.testing.assert_array_equal(ids[t], want_ids)
        np.testing.assert_allclose(p[t], want, rtol=1e-5)
        alone = sess.run(None, {"X": x[t:t + 1]})
        np.testing.assert_array_equal(alone[0][0], ids[t])
        np.testing.assert_array_equal(alone[1][0], p[t])
