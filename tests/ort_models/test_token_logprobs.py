"""specd.TokenLogprobs (kernels/token_logprobs.c) in the sampler's graph: the emitted tokens'
logprobs against the host reference (sampling.token_logprob) computed from the same rows."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from specd.daemon.spec.sampling import token_logprob
from specd.ort_models import native_ops
from specd.ort_models.graph_builder.sampling import sampler_model
from specd.ort_models.runner import session_options
from specd.ort_models.sampling_op import SampleSpec, pack_inputs, unpack_outputs

pytestmark = pytest.mark.skipif(native_ops.library() is None,
                                reason=f"no specd kernels: {native_ops.unavailable_reason()}")

VOCAB = 3000


@pytest.fixture(scope="module")
def sess() -> ort.InferenceSession:
    return ort.InferenceSession(sampler_model(VOCAB).SerializeToString(),
                                session_options(1, native=True),
                                providers=["CPUExecutionProvider"])


class _Out:
    def __init__(self, a: np.ndarray) -> None:
        self.a = a

    def numpy(self) -> np.ndarray:
        return self.a


def _run(sess: ort.InferenceSession, logits: np.ndarray, specs: list[SampleSpec | None],
         first_rows: list[int]) -> list:
    feeds = {"logits": logits, **pack_inputs(specs, first_rows, logits.shape[1])}
    return unpack_outputs([_Out(o) for o in sess.run(None, feeds)], specs, first_rows)


def _check(block, rows: np.ndarray, k: int) -> None:
    """Each emitted token's logprob and top k equal the host's for the row it came from."""
    lp = block.logprobs
    assert lp is not None and lp.logprobs.shape == (len(block.tokens),)
    for j, tok in enumerate(block.tokens):
        want = token_logprob(rows[j], tok, k)
        assert lp.logprobs[j] == pytest.approx(want.logprob, abs=1e-6)
        assert lp.top_ids[j].tolist() == [i for i, _ in want.top]
        np.testing.assert_allclose(lp.top_logprobs[j], [v for _, v in want.top], atol=1e-6)


def test_a_drawn_token_and_its_top_logprobs_equal_the_hosts(
        sess: ort.InferenceSession) -> None:
    rng = np.random.default_rng(1)
    logits = (rng.standard_normal((1, VOCAB)) * 4).astype(np.float32)
    for k in (0, 1, 5, 20):
        spec = SampleSpec(key=3, position=10 + k, temperature=0.9, logprobs=k)
        (block,) = _run(sess, logits, [spec], [0])
        _check(block, logits, k)


def test_a_verify_blocks_emitted_tokens_take_their_own_rows(
        sess: ort.InferenceSession) -> None:
    rng = np.random.default_rng(2)
    logits = (rng.standard_normal((9, VOCAB)) * 3).astype(np.float32)
    greedy = logits.argmax(axis=1)
    # two calls: a block of 4 drafts whose first 2 are the target's choice, and a lone row
    drafts = [int(greedy[0]), int(greedy[1]), (int(greedy[2]) + 1) % VOCAB, 5]
    specs: list[SampleSpec | None] = [
        SampleSpec(key=1, position=0, temperature=0.0, drafts=drafts, logprobs=3),
        None,
        SampleSpec(key=1, position=0, temperature=0.0, logprobs=2)]
    blocks = _run(sess, logits, specs, [0, 5, 8])
    assert blocks[0].tokens == [*drafts[:2], int(greedy[2])]
    _check(blocks[0], logits[0:5], 3)
    assert blocks[1] is None
    _check(blocks[2], logits[8:9], 2)


def test_ties_go_to_the_lower_id_and_masked_logits_are_minus_infinity(
        sess: ort.InferenceSession) -> None:
    logits = np.full((1, VOCAB), -5.0, dtype=np.float32)
    logits[0, [7, 3, 2900]] = 2.0
    logits[0, 11] = 1.0
    logits[0, 100:200] = -np.inf
    logits[0, 300] = np.nan
    spec = SampleSpec(key=0, position=0, temperature=0.0, logprobs=5)
    (block,) = _run(sess, logits, [spec], [0])
    assert block.tokens == [3]
    assert block.logprobs.top_ids[0].tolist() == [3, 7, 2900, 11, 0]
    clean = logits.copy()
    clean[0, 300] = -np.inf
    _check(block, clean, 5)


def test_calls_that_ask_for_none_cost_no_outputs(sess: ort.InferenceSession) -> None:
    logits = np.zeros((2, VOCAB), dtype=np.float32)
    specs = [SampleSpec(key=0, position=0, temperature=0.0),
             SampleSpec(key=0, position=0, temperature=0.0, logprobs=0)]
    blocks = _run(sess, logits, specs, [0, 1])
    assert blocks[0].logprobs is None
    assert blocks[1].logprobs.logprobs[0] == pytest.approx(-np.log(VOCAB), abs=1e-9)
    assert blocks[1].logprobs.top_ids.shape == (1, 0)


def test_a_bad_count_is_named(sess: ort.InferenceSession) -> None:
    logits = np.zeros((1, VOCAB), dtype=np.float32)
    feeds = {"logits": logits,
             **pack_inputs([SampleSpec(key=0, position=0, temperature=0.0)], [0], VOCAB)}
    feeds["sample_logprobs"] = np.array([2000], dtype=np.int64)
    with pytest.raises(Exception, match="n_top is above 1024"):
        sess.run(None, feeds)
    with pytest.raises(ValueError, match="above 1024"):
        pack_inputs([SampleSpec(key=0, position=0, temperature=0.0, logprobs=2000)], [0],
                    VOCAB)
