"""sampling_op's binding of the sampler's nodes to an IOBinding over several passes: the
inputs a pass overwrites in place decide as freshly bound ones do."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from specd.ort_models import native_ops
from specd.ort_models.graph_builder.sampling import sampler_model
from specd.ort_models.runner import session_options
from specd.ort_models.sampling_op import SampleSpec, bind, pack_inputs, read

pytestmark = pytest.mark.skipif(native_ops.library() is None,
                                reason=f"no specd kernels: {native_ops.unavailable_reason()}")

VOCAB = 500


def test_passes_on_one_binding_decide_as_fresh_runs() -> None:
    sess = ort.InferenceSession(sampler_model(VOCAB).SerializeToString(),
                                session_options(1, native=True),
                                providers=["CPUExecutionProvider"])
    logits = np.random.default_rng(0).standard_normal((2, VOCAB)).astype(np.float32)
    b = sess.io_binding()
    b.bind_cpu_input("logits", logits)
    bound: dict[str, np.ndarray] = {}
    kept = []
    for pos in range(40):
        # calls that come and go, settings that change: some passes reuse the last
        # pass's arrays in place, others bind new ones
        specs: list[SampleSpec | None] = [
            SampleSpec(key=pos % 3, position=pos, temperature=0.5 + (pos % 4) / 4,
                       top_k=pos % 5, logprobs=pos % 2 - 1),
            None if pos % 7 == 0 else SampleSpec(key=9, position=pos, temperature=1.0)]
        bind(b, specs, [0, 1], VOCAB, bound)
        sess.run_with_iobinding(b)
        got = read(b.get_outputs(), 0, specs, [0, 1])
        fresh = sess.run(None, {"logits": logits, **pack_inputs(specs, [0, 1], VOCAB)})
        for i, block in enumerate(got):
            if block is None:
                assert specs[i] is None
                continue
            assert block.tokens == fresh[0][i, :len(block.tokens)].tolist()
        kept.append((got[0].tokens, fresh[0][0, 0]))
    # what earlier passes returned is not overwritten by later ones
    assert all(tokens == [want] for tokens, want in kept)
