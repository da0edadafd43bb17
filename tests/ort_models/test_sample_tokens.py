"""specd.SampleTokens (ort_models/kernels/sample_tokens.c) against the host reference.

The op decides tokens after the logits as daemon/spec/sampling.py and verify.py do, with
Philox4x32-10 uniforms instead of PCG64. Driven by the same uniforms (a numpy Philox here,
checked against Random123's known answers), the host's sampler and verifiers must give the
same tokens; the draws' distributions are checked by chi-square, and the test is shown to
see the usual mistakes.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from specd.daemon.spec.philox import philox4x32, philox_uniform
from specd.daemon.spec.sampling import (
    NoAllowedToken,
    Sampler,
    SamplerParams,
    sample_from_probs,
    softmax,
    top_probability,
)
from specd.daemon.spec.verify import (
    SparseDraftProbs,
    VerifyResult,
    verify_greedy,
    verify_rejection,
)
from specd.ort_models import native_ops
from specd.ort_models.runner import session_options

from chi_square import FAIL_P, PASS_P, chi2_pvalue

LIB = native_ops.library()
WHY = native_ops.unavailable_reason() or ""
# as test_native_ops: skipped where the kernels cannot be had, failing where they should
EXPECTED_ABSENCE = (native_ops.compiler() is None or "without AVX2" in WHY
                    or "SPECD_NATIVE=0" in WHY)
pytestmark = pytest.mark.skipif(LIB is None and EXPECTED_ABSENCE,
                                reason=f"no specd kernels: {WHY}")

INPUTS = [("logits", TensorProto.FLOAT), ("plan", TensorProto.INT64),
          ("params", TensorProto.DOUBLE), ("keys", TensorProto.INT64),
          ("drafts", TensorProto.INT64), ("q_ids", TensorProto.INT64),
          ("q_probs", TensorProto.FLOAT), ("history", TensorProto.INT64),
          ("bias_ids", TensorProto.INT64), ("bias_values", TensorProto.DOUBLE),
          ("masks", TensorProto.INT32)]
OUTPUTS = [("tokens", TensorProto.INT64), ("counts", TensorProto.INT64),
           ("accept_probs", TensorProto.FLOAT), ("cand_ids", TensorProto.INT64),
           ("cand_probs", TensorProto.FLOAT)]
TEMP_LAST, REJECT, MASKED = 1, 2, 4
OK, DEAD_END, NO_TOKEN = 0, 1, 2


def test_numpy_philox_gives_random123s_known_answers() -> None:
    vectors = [((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
               ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
                (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1))]
    for counter, key, want in vectors:
        got = philox4x32(np.array(counter, dtype=np.uint64), np.array(key, dtype=np.uint64))
        assert [int(v) for v in got] == list(want)


# -- the op in a one-node graph ----------------------------------------------------------


def one_node_model() -> bytes:
    """The op alone, its inputs of unknown rank, so that its own checks see whatever is
    fed."""
    node = helper.make_node("SampleTokens", [n for n, _ in INPUTS], [n for n, _ in OUTPUTS],
                            domain=native_ops.DOMAIN)
    graph = helper.make_graph(
        [node], "sample_tokens", [helper.make_tensor_value_info(n, t, None) for n, t in INPUTS],
        [helper.make_tensor_value_info(n, t, None) for n, t in OUTPUTS])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21),
                                                    helper.make_opsetid(native_ops.DOMAIN, 1)])
    model.ir_version = 10
    return model.SerializeToString()


@pytest.fixture(scope="module")
def sess() -> ort.InferenceSession:
    assert LIB is not None, f"specd's kernels did not build: {WHY}"
    return ort.InferenceSession(one_node_model(), session_options(2, native=True),
                                providers=["CPUExecutionProvider"])


@dataclass
class OpCall:
    """One call (sequence) of a pass: its rows [n + 1, V] and what the plan says of it."""

    rows: np.ndarray
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repeat_penalty: float = 1.0
    presence: float = 0.0
    frequency: float = 0.0
    temperature_last: bool = True
    window: int = 64
    key: int = 0
    position: int = 0
    stream: int = 0
    drafts: Sequence[int] = ()
    q: Sequence[tuple[Sequence[int], Sequence[float]]] = ()  # per draft: (ids, probs)
    reject: bool = False
    history: Sequence[int] = ()
    bias: dict[int, float] = field(default_factory=dict)
    masks: np.ndarray | None = None  # [n + 1, V] bool: row i decided under masks[i]
    stop_after: int = -1
    n_cand: int = 0
    mode: int = 1

    def sampler_params(self) -> SamplerParams:
        return SamplerParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                             min_p=self.min_p, repeat_penalty=self.repeat_penalty,
                             repeat_last_n=self.window, temperature_last=self.temperature_last,
                             presence_penalty=self.presence, frequency_penalty=self.frequency,
                             logit_bias=dict(self.bias))


def pack_mask(mask: np.ndarray) -> np.ndarray:
    """[V] bool -> [ceil(V/32)] int32 words, bit t % 32 of word t / 32."""
    words = -(-mask.shape[0] // 32)
    bits = np.zeros(words * 32, dtype=bool)
    bits[:mask.shape[0]] = mask
    return np.packbits(bits, bitorder="little").view("<u4").astype(np.uint32).view(np.int32)


def op_inputs(calls: Sequence[OpCall]) -> dict[str, np.ndarray]:
    vocab = calls[0].rows.shape[1]
    c_n = len(calls)
    d = max([1, *(len(c.drafts) for c in calls)])
    k = max([1, *(len(ids) for c in calls for ids, _ in c.q)])
    h = max([1, *(len(c.history) for c in calls)])
    nb = max([1, *(len(c.bias) for c in calls)])
    plan = np.zeros((c_n, 10), dtype=np.int64)
    params = np.zeros((c_n, 8))
    drafts = np.full((c_n, d), -1, dtype=np.int64)
    q_ids = np.full((c_n, d, k), -1, dtype=np.int64)
    q_probs = np.zeros((c_n, d, k), dtype=np.float32)
    history = np.full((c_n, h), -1, dtype=np.int64)
    bias_ids = np.full((c_n, nb), -1, dtype=np.int64)
    bias_values = np.zeros((c_n, nb))
    masks: list[np.ndarray] = []
    first = 0
    for i, c in enumerate(calls):
        n = len(c.drafts)
        flags = ((TEMP_LAST if c.temperature_last else 0) | (REJECT if c.reject else 0)
                 | (MASKED if c.masks is not None else 0))
        plan[i] = [c.mode, first, n, c.position, flags, len(masks), c.window, c.stop_after,
                   c.n_cand, c.stream]
        if c.masks is not None:
            masks.extend(pack_mask(m) for m in c.masks)
        first += c.rows.shape[0]
        params[i, :7] = [c.temperature, c.top_k, c.top_p, c.min_p, c.repeat_penalty,
                         c.presence, c.frequency]
        drafts[i, :n] = c.drafts
        for j, (ids, probs) in enumerate(c.q):
            q_ids[i, j, :len(ids)] = ids
            q_probs[i, j, :len(ids)] = probs
        if c.history:
            history[i, h - len(c.history):] = c.history
        bias_ids[i, :len(c.bias)] = list(c.bias)
        bias_values[i, :len(c.bias)] = list(c.bias.values())
    return {
        "logits": np.concatenate([c.rows for c in calls]).astype(np.float32),
        "plan": plan, "params": params,
        "keys": np.array([c.key for c in calls], dtype=np.int64), "drafts": drafts,
        "q_ids": q_ids, "q_probs": q_probs, "history": history, "bias_ids": bias_ids,
        "bias_values": bias_values,
        "masks": (np.stack(masks) if masks
                  else np.zeros((1, -(-vocab // 32)), dtype=np.int32)),
    }


@dataclass
class OpResult:
    tokens: np.ndarray  # [C, D + 1]
    counts: np.ndarray  # [C, 3]
    accept: np.ndarray  # [C, D]
    cand_ids: np.ndarray  # [R, KC]
    cand_probs: np.ndarray  # [R, KC]
    first_rows: list[int]

    def emitted(self, c: int) -> list[int]:
        return [int(t) for t in self.tokens[c, :self.counts[c, 0]]]


def run(sess: ort.InferenceSession, calls: Sequence[OpCall]) -> OpResult:
    tokens, counts, accept, cand_ids, cand_probs = sess.run(None, op_inputs(calls))
    firsts = [0, *np.cumsum([c.rows.shape[0] for c in calls])[:-1].tolist()]
    return OpResult(tokens, counts, accept, cand_ids, cand_probs, firsts)


class PhiloxSampler(Sampler):
    """A host Sampler whose uniforms are the op's: the coin or draw of row i is
    (position + i, stream, 0), the residual (position + i, stream, 1), where i counts the
    tokens emitted in the block so far (accept() is called on each)."""

    def __init__(self, call: OpCall) -> None:
        super().__init__(call.sampler_params(), seed=0, history=call.history)
        self.call, self.emitted = call, 0

    def accept(self, token: int) -> None:
        super().accept(token)
        self.emitted += 1

    def uniform(self, position: int | None = None, draw: int = 0) -> float:
        c = self.call
        return float(philox_uniform(c.key, c.position + self.emitted, c.stream, draw))


class RowMasks:
    """A TokenConstraint whose mask after k tokens is masks[k]; stopped after `stop`."""

    dead_end = False

    def __init__(self, masks: np.ndarray, stop: int = -1) -> None:
        self.masks, self.k, self.stop = masks, 0, stop

    def allowed(self, n_vocab: int) -> np.ndarray:
        return self.masks[self.k]

    def consume(self, token: int) -> None:
        assert self.masks[self.k][token]
        self.k += 1

    def is_stopped(self) -> bool:
        return self.k == self.stop + 1


def host_verify(c: OpCall) -> VerifyResult:
    sampler = PhiloxSampler(c)
    grammar = None if c.masks is None else RowMasks(c.masks, c.stop_after)
    if c.reject and c.temperature > 0:
        ids = np.full((len(c.drafts), max((len(i) for i, _ in c.q), default=1)), -1,
                      dtype=np.int64)
        probs = np.zeros(ids.shape, dtype=np.float32)
        for j, (i, p) in enumerate(c.q):
            ids[j, :len(i)], probs[j, :len(p)] = i, p
        return verify_rejection(c.rows, list(c.drafts), SparseDraftProbs(ids, probs), sampler,
                                grammar)
    return verify_greedy(c.rows, list(c.drafts), sampler, grammar)


# -- random material ----------------------------------------------------------------------


def random_logits(rng: np.random.Generator, n: int, vocab: int, spread: float) -> np.ndarray:
    """[n, vocab] float32 rows: a noisy bulk and a few likely tokens, as a model's are."""
    x = rng.normal(0.0, spread, size=(n, vocab))
    for row in x:
        row[rng.choice(vocab, 8, replace=False)] += rng.uniform(0.5, 2.5, 8) * spread
    return x.astype(np.float32)


def random_call(rng: np.random.Generator, vocab: int, n_rows: int = 1) -> OpCall:
    """A call with random sampler settings, penalties, bias and (sometimes) masks."""
    rows = random_logits(rng, n_rows, vocab, float(rng.choice([0.5, 1.5, 3.0])))
    bias = {int(t): float(rng.choice([-np.inf, -2.0, 1.5, 4.0]))
            for t in rng.choice(vocab, int(rng.integers(0, 5)), replace=False)}
    masks = None
    if rng.random() < 0.3:
        masks = rng.random((n_rows, vocab)) < rng.choice([0.05, 0.5, 0.95])
        masks[:, rng.integers(vocab)] = True
    return OpCall(
        rows, temperature=float(rng.choice([0.3, 0.7, 1.0, 1.6])),
        top_k=int(rng.choice([0, 0, 1, 7, 40, vocab - 1, vocab + 3])),
        top_p=float(rng.choice([1.0, 1.0, 0.95, 0.7, 0.3])),
        min_p=float(rng.choice([0.0, 0.0, 0.02, 0.2])),
        repeat_penalty=float(rng.choice([1.0, 1.3, 0.8])),
        presence=float(rng.choice([0.0, 0.4])), frequency=float(rng.choice([0.0, 0.25])),
        temperature_last=bool(rng.random() < 0.5), window=int(rng.choice([-1, 0, 8, 64])),
        key=int(rng.integers(-2**63, 2**63 - 1)), position=int(rng.integers(0, 2**40)),
        stream=int(rng.integers(0, 2)),
        history=[int(t) for t in rng.integers(0, vocab + 2, int(rng.integers(0, 90)))],
        bias=bias, masks=masks)


# -- greedy --------------------------------------------------------------------------------


def test_greedy_rows_are_the_hosts_argmax(sess: ort.InferenceSession) -> None:
    """Blocks verified greedily (drafts partly the host's own choices, so that later rows
    see them in the penalty window), with bias, penalties and masks: the same tokens,
    counts and alphas as verify_greedy, and the argmax's top probability as candidate."""
    rng = np.random.default_rng(1)
    vocab = 3001
    calls = []
    for _ in range(60):
        c = random_call(rng, vocab, n_rows=int(rng.integers(1, 6)))
        c.temperature, c.n_cand = 0.0, int(rng.integers(0, 3))
        if c.masks is not None:  # the drafts' rows must allow something
            c.masks[:, int(rng.integers(vocab))] = True
        host = Sampler(c.sampler_params(), history=c.history)
        drafts = []
        for i in range(c.rows.shape[0] - 1):  # the host's choice, or now and then not
            mask = None if c.masks is None else c.masks[i]
            tok = host.sample(c.rows[i], mask)
            if rng.random() < 0.15:
                tok = (tok + 1) % vocab
            host.accept(tok)
            drafts.append(tok)
        c.drafts = drafts
        calls.append(c)
    res = run(sess, calls)
    for i, c in enumerate(calls):
        want = host_verify(c)
        assert res.emitted(i) == want.tokens
        assert list(res.counts[i]) == [len(want.tokens), want.n_accepted, OK]
        np.testing.assert_array_equal(res.accept[i, :len(want.accept_probs)],
                                      want.accept_probs)
        if c.n_cand:  # the row that decided the first token
            row, mask = c.rows[0], None if c.masks is None else c.masks[0]
            x = Sampler(c.sampler_params(), history=c.history).penalised_logits(row)
            if mask is not None:
                x[~mask] = -np.inf
            assert res.cand_ids[res.first_rows[i], 0] == want.tokens[0]
            assert res.cand_probs[res.first_rows[i], 0] == pytest.approx(
                top_probability(x), abs=1e-6)
            assert (res.cand_ids[res.first_rows[i], 1:] == -1).all()


def test_greedy_ties_go_to_the_lowest_id_and_penalties_round_in_double(
        sess: ort.InferenceSession) -> None:
    vocab = 40
    row = np.full((1, vocab), -1.0, dtype=np.float32)
    row[0, [9, 17, 30]] = 2.5  # a three-way tie
    calls = [OpCall(row, temperature=0.0)]
    # token 5: 1.0 / 3 in double (0.33333333333333331); token 7: float32(1/3), the larger
    # by 1e-8; float32 arithmetic would round 1.0f / 3 to token 7's value and tie them
    tie = np.full((1, vocab), -1.0, dtype=np.float32)
    tie[0, 5], tie[0, 7] = 1.0, np.float32(1.0 / 3.0)
    calls.append(OpCall(tie, temperature=0.0, repeat_penalty=3.0, history=[5]))
    # token 3 lowered by a presence penalty of 3e-9, token 4 by a bias of 1e-9: token 4 in
    # double, a tie (to token 3) in float32
    near = np.full((1, vocab), -1.0, dtype=np.float32)
    near[0, [3, 4]] = 0.5
    calls.append(OpCall(near, temperature=0.0, presence=3e-9, history=[3], bias={4: -1e-9}))
    calls.append(OpCall(row, temperature=0.0, bias={9: -np.inf, 17: 0.0}))
    res = run(sess, calls)
    for i, c in enumerate(calls):
        assert res.emitted(i) == [Sampler(c.sampler_params(), history=c.history)
                                  .sample(c.rows[0])]
    assert [res.emitted(i)[0] for i in range(4)] == [9, 7, 4, 17]


# -- sampled rows: the host's draw at the same uniform --------------------------------------


def _same_uniform_check(sess: ort.InferenceSession, calls: list[OpCall]) -> int:
    """Runs calls of one vocabulary; returns how many drew the host's token."""
    res = run(sess, calls)
    same = 0
    for i, c in enumerate(calls):
        mask = None if c.masks is None else c.masks[0]
        try:
            p = Sampler(c.sampler_params(), history=c.history).probs(c.rows[0], mask)
        except NoAllowedToken:  # the bias banned what the mask allows
            assert res.counts[i].tolist() == [0, 0, NO_TOKEN]
            same += 1
            continue
        u = float(philox_uniform(c.key, c.position, c.stream, 0))
        want = sample_from_probs(p, u)
        assert res.counts[i].tolist() == [1, 0, OK]
        got = res.emitted(i)[0]
        assert p[got] > 0.0, "a token of probability 0"
        same += got == want
        if c.n_cand:
            ids = res.cand_ids[res.first_rows[i], :c.n_cand]
            probs = res.cand_probs[res.first_rows[i], :c.n_cand]
            nonzero = int((p > 0).sum())
            assert (ids[:min(nonzero, c.n_cand)] >= 0).all()
            assert (ids[min(nonzero, c.n_cand):] == -1).all()
            ids, probs = ids[ids >= 0], probs[ids >= 0]
            np.testing.assert_allclose(probs, p[ids], rtol=1e-6, atol=1e-8)
            order = np.lexsort((np.arange(p.shape[0]), -p))[:ids.shape[0]]
            # the host's n most probable, most probable first (rounding may swap near ties)
            np.testing.assert_allclose(p[order], p[ids], rtol=1e-6, atol=1e-8)
    return same


def test_sampled_rows_draw_the_hosts_token_at_the_same_uniform(
        sess: ort.InferenceSession) -> None:
    """Random rows and settings (temperature, top_k, top_p, min_p, both orders, penalties,
    bias with -inf, masks): the op's token is sample_from_probs(Sampler.probs(row), u) with
    its own uniform, and its candidates are the host's probabilities."""
    rng = np.random.default_rng(2)
    same = total = 0
    for vocab, n in [(37, 150), (1000, 200), (5003, 200)]:
        calls = []
        for _ in range(n):
            c = random_call(rng, vocab)
            c.n_cand = int(rng.choice([0, 1, 5]))
            calls.append(c)
        same += _same_uniform_check(sess, calls)
        total += n
    assert same >= 0.99 * total, f"{same} of {total} draws as the host's"


def test_sampled_rows_of_a_full_vocabulary(sess: ort.InferenceSession) -> None:
    """V = 151936 (the real model's): the vocabulary passes' thresholds (top_p's and the
    candidates' widening, top_k's bound) on model-like rows."""
    rng = np.random.default_rng(3)
    vocab = 151936
    calls = []
    for j in range(16):
        c = random_call(rng, vocab)
        c.masks = None
        c.top_k = [0, 40, 5000, 0][j % 4]
        c.top_p = [1.0, 0.95, 0.9, 0.5][j // 4]
        c.n_cand = 8
        calls.append(c)
    assert _same_uniform_check(sess, calls) >= 15


def test_top_p_ties_keep_the_lowest_ids_and_min_p_follows_what_is_left(
        sess: ort.InferenceSession) -> None:
    """float32 e can tie: top_p then keeps the lowest ids, which may cut the largest logit,
    and min_p and the softmax shift by the largest logit left (the host's max(vals))."""
    row = np.full((1, 10), -1e4, dtype=np.float32)
    row[0, 3], row[0, 7] = 10.0, np.nextafter(np.float32(10.0), np.float32(11.0))
    # T 1000 first: e of tokens 3 and 7 both 1.0f; top_p 0.3 keeps token 3 alone, whose
    # vals is -1e-9, and min_p 1 keeps what lies at the maximum of those kept
    tie = OpCall(row, temperature=1000.0, temperature_last=False, top_p=0.3, min_p=1.0,
                 n_cand=2)
    # T 1e300 first: every e is 1.0f; top_p 0.5 keeps the lowest half of the ids
    rng = np.random.default_rng(11)
    flat = [OpCall(random_logits(rng, 1, 3000, 1.0), temperature=1e300,
                   temperature_last=False, top_p=0.5, key=k, n_cand=1) for k in range(20)]
    res = run(sess, [tie])
    assert res.emitted(0) == [3] == [Sampler(tie.sampler_params()).sample(row[0])]
    assert res.cand_ids[0].tolist() == [3, -1] and res.cand_probs[0, 0] == 1.0
    res = run(sess, flat)
    for i, c in enumerate(flat):
        p = Sampler(c.sampler_params()).probs(c.rows[0])
        assert (p[:1500] > 0).all() and (p[1500:] == 0).all()
        assert res.emitted(i) == [sample_from_probs(p, float(philox_uniform(c.key, 0, 0, 0)))]


# -- verification ---------------------------------------------------------------------------


def _draft_q(rng: np.random.Generator, row: np.ndarray, k: int,
             mask: np.ndarray | None) -> tuple[list[int], list[float], int]:
    """A draft's sparse distribution near the target row (top k of a perturbed softmax,
    renormalised), and a token drawn from it."""
    x = row.astype(np.float64) + rng.normal(0.0, 1.0, row.shape)
    if mask is not None:
        x[~mask] = -np.inf
    ids = np.argsort(-x, kind="stable")[:k]
    ids = ids[np.isfinite(x[ids])]
    p = softmax(x[ids])
    return [int(t) for t in ids], [float(v) for v in p], int(rng.choice(ids, p=p))


def _block(rng: np.random.Generator, vocab: int, n: int, reject: bool, masked: bool,
           temperature: float = 0.8) -> OpCall:
    c = random_call(rng, vocab, n_rows=n + 1)
    c.temperature, c.reject, c.n_cand = temperature, reject, int(rng.choice([0, 3]))
    c.bias = {t: b for t, b in c.bias.items() if b > -np.inf}
    c.masks = (rng.random((n + 1, vocab)) < 0.6) if masked else None
    drafts, q = [], []
    for i in range(n):
        ids, probs, d = _draft_q(rng, c.rows[i], 12, None if c.masks is None else c.masks[i])
        drafts.append(d)
        q.append((ids, probs))
    c.drafts, c.q = drafts, q
    return c


def _check_blocks(sess: ort.InferenceSession, calls: list[OpCall], min_same: float) -> None:
    """Blocks of one vocabulary against the host's verifiers (all but rare rounding)."""
    res = run(sess, calls)
    same = 0
    for i, c in enumerate(calls):
        want = host_verify(c)
        status = DEAD_END if want.grammar_dead_end else OK
        agree = (res.emitted(i) == want.tokens
                 and list(res.counts[i]) == [len(want.tokens), want.n_accepted, status])
        same += agree
        if agree:
            np.testing.assert_allclose(res.accept[i, :len(want.accept_probs)],
                                       want.accept_probs, rtol=1e-6, atol=1e-8)
            assert (res.accept[i, len(want.accept_probs):] == -1).all()
            assert (res.tokens[i, len(want.tokens):] == -1).all()
    assert same >= min_same * len(calls), f"{same} of {len(calls)} blocks as the host's"


def test_rejection_blocks_follow_verify_rejection(sess: ort.InferenceSession) -> None:
    """Blocks of drafts with sparse q (masked or not, penalties over the accepted drafts):
    with the same uniforms, the tokens, n_accepted and alphas of verify_rejection."""
    rng = np.random.default_rng(4)
    for vocab in (50, 2000):
        calls = [_block(rng, vocab, int(rng.integers(0, 5)), True, masked=rng.random() < 0.3)
                 for _ in range(80)]
        _check_blocks(sess, calls, 0.97)


def test_target_choice_blocks_follow_verify_greedy(sess: ort.InferenceSession) -> None:
    """Without the rejection flag the row's own choice is emitted (sampled here; greedy
    in test_greedy_rows_are_the_hosts_argmax), as verify_greedy does; a greedy call with
    the flag is verified greedily."""
    rng = np.random.default_rng(5)
    calls = [_block(rng, 60, int(rng.integers(0, 5)), False, masked=rng.random() < 0.3)
             for _ in range(100)]
    calls += [_block(rng, 60, 3, True, masked=False, temperature=0.0) for _ in range(20)]
    for c in calls[-20:]:  # drafts the greedy target agrees with, now and then
        host = Sampler(c.sampler_params(), history=c.history)
        for i in range(len(c.drafts)):
            if rng.random() < 0.7:
                c.drafts = [*c.drafts[:i], host.sample(c.rows[i]), *c.drafts[i + 1:]]
            host.accept(c.drafts[i])
    _check_blocks(sess, calls, 0.98)


def test_stop_after_dead_end_and_no_token(sess: ort.InferenceSession) -> None:
    rng = np.random.default_rng(6)
    vocab = 64
    rows = random_logits(rng, 4, vocab, 1.0)
    top = [int(np.argmax(r)) for r in rows]
    masks = np.ones((4, vocab), dtype=bool)
    # stop_after 1: drafts 0 and 1 accepted (greedy, the argmax), then the block ends
    stop = OpCall(rows, temperature=0.0, drafts=top[:3], stop_after=1, masks=masks)
    # dead end: the mask of row 2 allows nothing
    dead_masks = masks.copy()
    dead_masks[2] = False
    dead = OpCall(rows, temperature=0.0, drafts=top[:3], masks=dead_masks)
    # no token: the mask of row 0 allows nothing; the bias bans every allowed token
    empty = masks.copy()
    empty[0] = False
    none_row0 = OpCall(rows, temperature=0.7, drafts=top[:3], masks=empty)
    only = masks.copy()
    only[1] = False
    only[1, [3, 5]] = True
    sure = rows.copy()
    sure[0, top[0]] += 60.0  # p(top[0]) = 1 - 1e-26: accepted whatever u0
    banned = OpCall(sure, temperature=0.7, drafts=[top[0], 3, top[2]], masks=only,
                    bias={3: -np.inf, 5: -np.inf}, reject=True,
                    q=[([top[0]], [1.0]), ([3], [1.0]), ([top[2]], [1.0])])
    greedy_banned = OpCall(rows[:1], temperature=0.0, bias={t: -np.inf for t in range(vocab)})
    calls = [stop, dead, none_row0, banned, greedy_banned]
    res = run(sess, calls)
    assert res.emitted(0) == top[:2] and res.counts[0].tolist() == [2, 2, OK]
    want = host_verify(stop)
    assert (want.tokens, want.n_accepted) == (top[:2], 2)
    assert res.emitted(1) == top[:2] and res.counts[1].tolist() == [2, 2, DEAD_END]
    assert host_verify(dead).grammar_dead_end
    assert res.emitted(2) == [] and res.counts[2].tolist() == [0, 0, NO_TOKEN]
    # row 0 accepts top[0]; row 1 allows only banned tokens
    assert res.emitted(3) == [top[0]] and res.counts[3].tolist() == [1, 1, NO_TOKEN]
    assert res.counts[4].tolist() == [0, 0, NO_TOKEN]
    assert (res.tokens[[2, 4]] == -1).all()


def test_mode_0_calls_are_left_alone(sess: ort.InferenceSession) -> None:
    rng = np.random.default_rng(7)
    calls = [random_call(rng, 100) for _ in range(5)]
    for c in calls:
        c.n_cand = 2
    calls[1].mode = calls[3].mode = 0
    calls[1].top_p = 0.0  # not looked at
    res = run(sess, calls)
    for i in (1, 3):
        assert (res.tokens[i] == -1).all() and (res.counts[i] == 0).all()
        assert (res.accept[i] == -1).all()
        assert (res.cand_ids[res.first_rows[i]] == -1).all()
        assert (res.cand_probs[res.first_rows[i]] == 0).all()
    for i in (0, 2, 4):
        assert res.counts[i, 0] == 1
    assert res.cand_ids.shape == (5, 2)


# -- threads: a row decided alone is split across them, the same bits ---------------------


def _thread_cases(rng: np.random.Generator) -> list[list[OpCall]]:
    """Passes of one call (whose rows the op splits across threads) at vocabularies of one
    block to the real model's, with random settings, greedy rows with candidates (their
    sum of exp) and ties across blocks, flat rows (top_p's long bands, kept sets too long
    for a list), draft blocks; and passes of several calls (run in parallel, each row on
    one thread)."""
    passes = []
    for vocab, n in [(37, 25), (1000, 25), (3001, 30), (5003, 30), (20000, 40), (151936, 30)]:
        for _ in range(n):
            c = random_call(rng, vocab)
            c.n_cand = int(rng.choice([0, 1, 5, 8]))
            kind = rng.random()
            if kind < 0.2:  # greedy, the maximum often tied in another block
                c.temperature = 0.0
                if rng.random() < 0.5:
                    c.rows[0, rng.integers(vocab, size=2)] = c.rows[0].max()
            elif kind < 0.4:
                c.rows = (rng.standard_normal(c.rows.shape) * 0.3).astype(np.float32)
                c.top_k = int(rng.choice([0, 0, 5000, vocab // 2]))
                c.top_p = float(rng.choice([0.5, 0.95, 0.99]))
            passes.append([c])
    for vocab in (5003, 151936):
        passes += [[_block(rng, vocab, int(rng.integers(0, 4)), bool(rng.random() < 0.6),
                           masked=bool(rng.random() < 0.3))] for _ in range(12)]
    passes += [[random_call(rng, 3001) for _ in range(int(rng.integers(2, 5)))]
               for _ in range(10)]
    return passes


def test_outputs_are_the_same_bytes_on_1_2_and_4_threads(tmp_path: Path) -> None:
    """Every output (tokens, counts, accept_probs, candidates) byte for byte the same
    whatever the threads: a pass of one call splits its rows' vocabulary passes into tasks
    of whole blocks and combines the blocks' results in block order. The workers are the
    library's, as many as any session asked for, so each thread count gets a copy of the
    library (its own workers) under another name."""
    assert LIB is not None
    model = one_node_model()
    feeds = [op_inputs(calls) for calls in _thread_cases(np.random.default_rng(11))]
    outputs = {}
    for threads in (1, 2, 4):
        lib = tmp_path / f"kernels_{threads}_threads{LIB.suffix}"
        lib.write_bytes(LIB.read_bytes())
        so = session_options(threads)
        native_ops.register(so, lib)
        one = ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])
        outputs[threads] = [one.run(None, f) for f in feeds]
        assert ctypes.CDLL(str(lib)).specd_pool_workers() == threads - 1
    for threads in (2, 4):
        for i, (want, got) in enumerate(zip(outputs[1], outputs[threads], strict=True)):
            for (name, _), w, g in zip(OUTPUTS, want, got, strict=True):
                assert w.dtype == g.dtype and w.shape == g.shape and w.tobytes() == g.tobytes(), \
                    f"pass {i}: {name} differs on {threads} threads"


# -- distributions: chi-square over many keys ------------------------------------------------


N_DRAWS = 20_000
SMALL = np.log(np.array([0.22, 0.16, 0.13, 0.11, 0.09, 0.08, 0.07, 0.06, 0.04, 0.02, 0.015,
                         0.005]))


def _draws(sess: ort.InferenceSession, template: OpCall, n: int = N_DRAWS) -> np.ndarray:
    """The first emitted token of `template` run under n keys and positions: counts [V]."""
    calls = [OpCall(**{**template.__dict__, "key": 1000 + j, "position": 7 * j})
             for j in range(n)]
    res = run(sess, calls)
    assert (res.counts[:, 0] >= 1).all()
    return np.bincount(res.tokens[:, 0], minlength=template.rows.shape[1])


@pytest.mark.parametrize("settings", [
    {"temperature": 0.7},
    {"temperature": 1.3, "top_k": 5},
    {"temperature": 0.9, "top_p": 0.7},
    {"temperature": 1.2, "top_p": 0.8, "temperature_last": False},
    {"temperature": 1.0, "min_p": 0.2},
    {"temperature": 1.0, "repeat_penalty": 1.5, "presence": 0.3, "frequency": 0.2,
     "history": [0, 0, 1, 4, 9]},
    {"temperature": 0.8, "bias": {2: -np.inf, 7: 1.0}},
], ids=["temperature", "top_k", "top_p", "top_p_temperature_first", "min_p", "penalties",
        "bias"])
def test_draws_follow_the_hosts_distribution(sess: ort.InferenceSession,
                                             settings: dict) -> None:
    c = OpCall(SMALL[None].astype(np.float32), **settings)
    counts = _draws(sess, c)
    want = Sampler(c.sampler_params(), history=c.history).probs(c.rows[0])
    assert chi2_pvalue(counts, want) > PASS_P


def test_masked_draws_are_renormalised_and_the_test_sees_when_not(
        sess: ort.InferenceSession) -> None:
    mask = np.ones(12, dtype=bool)
    mask[[0, 3, 8]] = False
    c = OpCall(SMALL[None].astype(np.float32), temperature=1.0, top_p=0.9, masks=mask[None])
    counts = _draws(sess, c)
    want = Sampler(c.sampler_params()).probs(c.rows[0], mask)
    assert chi2_pvalue(counts, want) > PASS_P
    # without renormalisation: the unmasked softmax zeroed off the mask and inverted at
    # the same uniforms as if it summed to 1 (the rest falls on the last allowed token)
    p = softmax(SMALL) * mask
    u = philox_uniform(1000 + np.arange(N_DRAWS), 7 * np.arange(N_DRAWS), 0, 0)
    wrong = np.minimum(np.searchsorted(np.cumsum(p), u, side="right"), 11)
    wrong[~mask[wrong]] = np.flatnonzero(mask)[-1]
    assert chi2_pvalue(np.bincount(wrong, minlength=12), want) < FAIL_P


def _rejection_template(q_ids: list[int], q_probs: list[float], draft: int) -> OpCall:
    rows = np.stack([SMALL, SMALL[::-1]]).astype(np.float32)
    return OpCall(rows, temperature=1.0, top_k=9, reject=True, drafts=[draft],
                  q=[(q_ids, q_probs)])


def test_rejection_sampling_emits_the_targets_distribution(sess: ort.InferenceSession) -> None:
    """One draft from q, verified against p with the residual on rejection: the emitted
    token is distributed as p whatever q is. Feeding an untruncated q for a draft drawn
    from a truncated one is a different, wrong distribution, which the same test sees."""
    rng = np.random.default_rng(8)
    q_full = softmax(np.linspace(1.5, -1.5, 12)[rng.permutation(12)])  # [12]
    top = np.argsort(-q_full, kind="stable")[:5]
    q_trunc = q_full[top] / q_full[top].sum()
    p = Sampler(SamplerParams(temperature=1.0, top_k=9)).probs(SMALL.astype(np.float32))

    def emitted(q_ids: list[int], q_probs: list[float]) -> tuple[np.ndarray, float]:
        drafts = rng.choice(top, size=N_DRAWS, p=q_trunc)  # the draft drew from q_trunc
        calls = [OpCall(**{**_rejection_template(q_ids, q_probs, int(d)).__dict__,
                           "key": 5000 + j, "position": 3 * j}) for j, d in enumerate(drafts)]
        res = run(sess, calls)
        assert (res.counts[:, 2] == OK).all()
        return np.bincount(res.tokens[:, 0], minlength=12), float(res.accept[:, 0].mean())

    counts, alpha = emitted([int(t) for t in top], [float(v) for v in q_trunc])
    assert chi2_pvalue(counts, p) > PASS_P
    q_dense = np.zeros(12)
    q_dense[top] = q_trunc
    assert alpha == pytest.approx(np.minimum(p, q_dense).sum(), rel=1e-6)
    wrong, _ = emitted(list(range(12)), [float(v) for v in q_full])
    assert chi2_pvalue(wrong, p) < FAIL_P


# -- bad input -------------------------------------------------------------------------------


def _bad(sess: ort.InferenceSession, feeds: dict[str, np.ndarray], match: str) -> None:
    with pytest.raises(Exception, match=match):
        sess.run(None, feeds)


def test_bad_inputs_are_errors_that_name_them(sess: ort.InferenceSession) -> None:
    rng = np.random.default_rng(9)
    calls = [random_call(rng, 70), random_call(rng, 70)]
    calls[0].masks = calls[1].masks = None
    good = op_inputs(calls)
    sess.run(None, good)

    def with_(**changes: np.ndarray) -> dict[str, np.ndarray]:
        return {**good, **changes}

    def plan(col: int, value: int, call: int = 0) -> dict[str, np.ndarray]:
        p = good["plan"].copy()
        p[call, col] = value
        return with_(plan=p)

    def params(col: int, value: float) -> dict[str, np.ndarray]:
        p = good["params"].copy()
        p[0, col] = value
        return with_(params=p)

    _bad(sess, with_(logits=good["logits"][0]), "logits is not")
    _bad(sess, with_(plan=good["plan"][:, :9]), "plan is not")
    _bad(sess, with_(params=good["params"][:1]), "params is not")
    _bad(sess, with_(keys=good["keys"][None]), "keys is not")
    _bad(sess, with_(q_probs=good["q_probs"][:, :, :0]), "q_probs")
    _bad(sess, with_(history=np.zeros((2, 0), dtype=np.int64)), "history is not")
    _bad(sess, with_(bias_values=good["bias_values"][:1]), "bias_values")
    _bad(sess, with_(masks=np.zeros((1, 2), dtype=np.int32)), "masks is not")
    _bad(sess, plan(0, 2), "call 0: plan mode")
    _bad(sess, plan(1, 5), "call 0: plan first_row")
    _bad(sess, plan(1, -1, call=1), "call 1: plan first_row")
    _bad(sess, plan(2, 2), "call 0: plan n_draft")
    _bad(sess, plan(3, -4), "plan position")
    _bad(sess, plan(4, 8), "plan flags")
    p = good["plan"].copy()
    p[0, 4], p[0, 5] = MASKED, 1
    _bad(sess, with_(plan=p), "call 0: plan mask_row")
    _bad(sess, plan(6, -2), "plan window")
    _bad(sess, plan(7, 0), "plan stop_after")
    _bad(sess, plan(8, 71), "plan n_cand")
    _bad(sess, plan(9, 2**32), "plan stream")
    _bad(sess, plan(1, 0, call=1), "calls 0 and 1 share logits rows")
    _bad(sess, params(0, -0.5), "temperature")
    _bad(sess, params(0, np.nan), "temperature")
    _bad(sess, params(1, 2.5), "top_k")
    _bad(sess, params(2, 0.0), "top_p")
    _bad(sess, params(3, 1.5), "min_p")
    _bad(sess, params(4, 0.0), "repeat_penalty")
    _bad(sess, params(5, np.inf), "presence_penalty")
    _bad(sess, params(6, np.nan), "frequency_penalty")
    b = good["bias_ids"].copy()
    v = good["bias_values"].copy()
    b[0, 0], v[0, 0] = 3, np.inf
    _bad(sess, with_(bias_ids=b, bias_values=v), "bias_values has NaN or \\+inf")


# -- timing ------------------------------------------------------------------------------------
