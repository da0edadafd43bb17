"""An EAGLE-3 head drafting for a tiny target through the round: the target's output, the
head's cache as a fresh run of the sequence leaves it (drafted pairs overwritten, the
newest pair deferred), proposals step by step from the head's own hidden state."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from specd.daemon.drafters.eagle3 import Eagle3Drafter
from specd.daemon.spec.drafter import DraftParams
from specd.daemon.spec.generation import Generation, GenerationParams
from specd.daemon.spec.sampling import Sampler, SamplerParams
from specd.daemon.spec.verify import SparseDraftProbs
from specd.ort_models import native_ops
from specd.ort_models.gguf_file import GGUFFile
from specd.ort_models.graph_builder import BuildOptions
from specd.ort_models.head_runner import HeadRunner, load_or_build_head
from specd.ort_models.heads import read_head
from specd.ort_models.model_cache import load_or_build
from specd.ort_models.runner import ModelRunner

from speculation_checks import assert_drafted, second_token_check
from tiny_heads import write_tiny_head

PROMPT = [348, 20, 31, 42, 53, 64, 75, 86, 97, 108, 119, 130]
HEADS = {"eagle3": {}, "eagle3-d2t": {"draft_vocab": 100, "norm_before_residual": True}}


@pytest.fixture(scope="module", params=list(HEADS))
def pair(request: pytest.FixtureRequest, tiny_model_factory: Callable[..., Path],
         tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any, Path, Path]:
    target_path = tiny_model_factory(arch="qwen3", weight_type="Q8_0", seed=3,
                                     context_length=512)
    head_path = write_tiny_head(tmp_path_factory.mktemp("head") / "eagle3.gguf",
                                kind="eagle3", seed=5, **HEADS[request.param])
    layers = read_head(GGUFFile(head_path)).hidden_layers
    plain = load_or_build(target_path)
    with_features = load_or_build(target_path,
                                  BuildOptions(hidden_layers=tuple(sorted(set(layers)))))
    return plain, with_features, target_path, head_path


def _drafter(pair: tuple[Any, Any, Path, Path]) -> Eagle3Drafter:
    _, _, target_path, head_path = pair
    return Eagle3Drafter(HeadRunner(load_or_build_head(head_path, target_path), n_ctx=512))


def _run(built: Any, drafter: Eagle3Drafter | None, prompt: list[int] = PROMPT,
         **params: Any) -> tuple[list[int], Generation]:
    gen = Generation(ModelRunner(built, n_ctx=512), 0, prompt,
                     GenerationParams(max_tokens=40, ignore_eos=True, **params), eog=set(),
                     drafter=drafter)
    out = gen.prefill()
    while not gen.done:
        out += gen.step()
    return out, gen


def _fresh_cache(drafter: Eagle3Drafter, built: Any, tokens: list[int], upto: int
                 ) -> tuple[np.ndarray, np.ndarray]:
    """K and V [Hkv, upto, hd] of the pairs of `tokens` written in one step from one
    encoding of their features."""
    _, feats = ModelRunner(built, n_ctx=512).forward_with_features(0, tokens, 0)
    fresh = HeadRunner(drafter.runner.built, n_ctx=512)
    rows = np.concatenate([feats[layer] for layer in drafter.target_layers], axis=-1)
    g = fresh.encode(rows)
    fresh.step(0, tokens[1:upto + 1], g[:upto], 0, [])
    k, v = fresh.kv.layers(0)[0]
    return k[0, :, :upto], v[0, :, :upto]


@pytest.mark.parametrize("adaptive", [False, True])
def test_greedy_output_with_a_head_is_the_targets(pair: tuple[Any, Any, Path, Path],
                                                   adaptive: bool) -> None:
    plain, with_features, _, _ = pair
    want, _ = _run(plain, None)
    got, gen = _run(with_features, _drafter(pair), draft=DraftParams(n_max=3),
                    adaptive=adaptive)
    assert got == want
    assert_drafted(gen.stats)


def test_the_heads_cache_is_a_fresh_run_of_the_sequence(pair: tuple[Any, Any, Path, Path]
                                                        ) -> None:
    """After rounds with rejections (their drafted pairs overwritten by verified ones), the
    cache holds at every written position the pair a fresh run of the sequence writes."""
    _, with_features, _, _ = pair
    drafter = _drafter(pair)
    _, gen = _run(with_features, drafter, draft=DraftParams(n_max=3))
    assert gen.stats.accepted < gen.stats.drafted  # rejections happened
    tokens = gen.evaluated_tokens
    written = drafter._seqs[0].written
    assert written == len(tokens) - 1  # the newest pair waits for the token after it
    k2, v2 = _fresh_cache(drafter, with_features, tokens, written)
    k, v = drafter.runner.kv.layers(0)[0]
    np.testing.assert_allclose(k[0, :, :written], k2, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(v[0, :, :written], v2, rtol=1e-5, atol=1e-5)


def test_a_reused_prefix_pairs_its_next_token_exactly(pair: tuple[Any, Any, Path, Path]
                                                      ) -> None:
    """A second request on the slot reusing the first's prompt as its prefix: the pair at
    the prefix's last position is written with the new token after it, from the g row
    kept of the first request."""
    _, with_features, _, _ = pair
    drafter = _drafter(pair)
    runner = ModelRunner(with_features, n_ctx=512)
    _, feats = runner.forward_with_features(0, PROMPT, 0)
    drafter.begin(0, PROMPT, None, feats)
    drafter.end(0)
    longer = PROMPT + [7, 8, 9]
    _, more = runner.forward_with_features(0, longer[len(PROMPT):], len(PROMPT))
    drafter.begin(0, longer, None, more)
    upto = len(longer) - 1
    k2, v2 = _fresh_cache(drafter, with_features, longer, upto)
    k, v = drafter.runner.kv.layers(0)[0]
    np.testing.assert_allclose(k[0, :, :upto], k2, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(v[0, :, :upto], v2, rtol=1e-5, atol=1e-5)


def test_proposals_are_the_steps_argmax_chain(pair: tuple[Any, Any, Path, Path]) -> None:
    """Greedy: step 0 runs the pending pair (last, g of the prompt's last position), each
    next step the drafted token with the previous step's hidden state; sampled: q rows are
    the steps' distributions; p_min stops where the top probability falls below it."""
    _, with_features, _, _ = pair
    drafter = _drafter(pair)
    runner = ModelRunner(with_features, n_ctx=512)
    _, feats = runner.forward_with_features(0, PROMPT, 0)
    drafter.begin(0, PROMPT, None, feats)
    n = len(PROMPT)
    greedy = drafter.draft(0, 5, n, 3, DraftParams(n_max=3))
    assert len(greedy.evidence.step_seconds) == 3 and greedy.q_rows is None
    check = HeadRunner(drafter.runner.built, n_ctx=512)
    rows = np.concatenate([feats[layer] for layer in drafter.target_layers], axis=-1)
    g = check.encode(rows)
    out = check.step(0, PROMPT[1:] + [5], g, 0, [n - 1])
    want, tops = [], []
    for i in range(3):
        logits = out.logits[0]
        tops.append(float(np.exp(logits.max()) / np.exp(logits[np.isfinite(logits)]).sum()))
        want.append(int(np.argmax(logits)))
        out = check.step(0, [want[-1]], out.hidden, n + i, [0])
    assert greedy.tokens == want
    stopped = drafter.draft(0, 5, n, 3, DraftParams(n_max=3, p_min=min(tops[0] + 1e-6, 1.0)))
    assert stopped.tokens == [] and stopped.evidence.stopped_unsure
    # chosen in the step graph where specd's kernels run, the same as on the host
    assert drafter.runner.step_samples == (native_ops.library() is not None)
    host = drafter.draft(0, 5, n, 3, DraftParams(n_max=3, backend_sampling=False))
    assert host.tokens == greedy.tokens
    sp = SamplerParams(temperature=0.8, top_k=10, seed=1)
    drafter.begin(1, PROMPT, Sampler(sp, seed=1), feats)
    first = Sampler(sp).probs(check.step(0, PROMPT[1:] + [5], g, 0, [n - 1]).logits[0])
    for in_graph in (True, False):
        sampled = drafter.draft(1, 5, n, 3, DraftParams(n_max=3, backend_sampling=in_graph))
        q_rows = sampled.q_rows
        assert q_rows is not None and len(q_rows) == len(sampled.tokens) == 3
        q = (q_rows.dense_row(0, first.shape[0]) if isinstance(q_rows, SparseDraftProbs)
             else q_rows[0])
        assert isinstance(q_rows, SparseDraftProbs) == (in_graph and drafter.runner.step_samples)
        assert q == pytest.approx(first, abs=1e-6)


def test_sampled_output_with_a_head_follows_the_target(pair: tuple[Any, Any, Path, Path]
                                                       ) -> None:
    """Sampled proposals verified by rejection sampling: the second token is distributed
    as the target's own (plumbing more than arithmetic, as for DFlash heads)."""
    _, with_features, _, _ = pair
    n_runs = 3000
    p, accepted = second_token_check(ModelRunner(with_features, n_ctx=512), _drafter(pair),
                                     PROMPT, n_runs)
    assert 0.05 * n_runs < accepted < 0.95 * n_runs
    assert p > 1e-3
