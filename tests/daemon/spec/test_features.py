"""The feature channel: a drafter that declares target layers gets the target's hidden
states of every token the target's KV cache holds, prompt and verified rounds alike."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest

from specd.daemon.spec.drafter import (
    Drafter,
    DraftParams,
    DraftRequest,
    Features,
    PerSequenceDrafter,
    Proposal,
)
from specd.daemon.spec.generation import Generation, GenerationParams
from specd.daemon.spec.sampling import Sampler
from specd.ort_models.graph_builder import BuildOptions
from specd.ort_models.model_cache import load_or_build
from specd.ort_models.runner import ModelRunner

PROMPT = [348, 20, 31, 42, 53, 64, 75, 86, 97, 108, 119, 130]


class RecordingDrafter(PerSequenceDrafter):
    """Proposes the target's own next tokens, the last of them wrong (every round accepts
    some and rejects one), and records every feature row it is given, with the tokens
    they belong to."""

    name = "recording"
    target_layers = (1,)

    def __init__(self, script: Sequence[int] = ()) -> None:
        self.script = list(script)  # the target's output, its first token at len(PROMPT)
        self.tokens: list[int] = []
        self.rows: list[np.ndarray] = []

    def _record(self, tokens: Sequence[int], features: Features | None) -> None:
        assert features is not None and sorted(features) == [1]
        assert features[1].shape == (len(tokens), 64)  # [n_tokens, n_embd]
        self.tokens += tokens
        self.rows.append(features[1].copy())

    def begin(self, seq: int, prompt: Sequence[int], sampler: Sampler | None = None,
              features: Features | None = None) -> None:
        self._record(prompt, features)

    def propose_one(self, request: DraftRequest) -> Proposal:
        j = request.pos - len(PROMPT)  # script[j] is `last`
        right = self.script[j + 1: j + request.n_max]
        return Proposal([*right, (self.script[j + len(right) + 1] + 1) % 300]
                        if j + len(right) + 1 < len(self.script) else right)

    def process(self, seq: int, tokens: Sequence[int],
                features: Features | None = None) -> None:
        self._record(tokens, features)


@pytest.fixture(scope="module")
def target(tiny_model_factory):
    path = tiny_model_factory(arch="qwen2", weight_type="Q8_0", seed=3, context_length=1024)
    return path, load_or_build(path, BuildOptions(hidden_layers=(0, 1)))


def _generate(built, drafter: Drafter | None, n_max: int = 3) -> tuple[list[int], Generation]:
    gen = Generation(ModelRunner(built, n_ctx=512), 0, PROMPT,
                     GenerationParams(max_tokens=40, ignore_eos=True,
                                      draft=DraftParams(n_max=n_max)),
                     eog=set(), drafter=drafter)
    out = gen.prefill()
    while not gen.done:
        out += gen.step()
    return out, gen


def test_a_drafter_receives_the_features_of_every_evaluated_token(target) -> None:
    _, built = target
    want, _ = _generate(built, None)
    drafter = RecordingDrafter(want)
    got, gen = _generate(built, drafter)
    assert got == want  # greedy: the target's own output
    assert gen.stats.rounds > 0 and 0 < gen.stats.accepted < gen.stats.drafted
    # the prompt, then each round's [last, *accepted]: every token the KV cache holds
    assert drafter.tokens == gen.evaluated_tokens
    features = np.concatenate(drafter.rows)  # [n_tokens, n_embd]
    _, ref = ModelRunner(built, n_ctx=512).forward_with_features(0, drafter.tokens, 0)
    np.testing.assert_allclose(features, ref[1], rtol=1e-5, atol=1e-5)


def test_a_drafter_needs_its_layers_in_the_targets_graph(target) -> None:
    path, _ = target
    plain = ModelRunner(load_or_build(path), n_ctx=512)
    with pytest.raises(ValueError, match="reads the target's layers \\[1\\]"):
        Generation(plain, 0, PROMPT, GenerationParams(), eog=set(), drafter=RecordingDrafter())
