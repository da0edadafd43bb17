"""A DFlash head drafting for a tiny target through the round: the target's output,
the head's cache as one injection of the sequence leaves it, proposals from the block."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from specd.daemon.drafters.dflash import DFlash2Drafter, DFlashDrafter
from specd.daemon.spec.drafter import DraftParams, head_input_rows
from specd.daemon.spec.generation import Generation, GenerationParams
from specd.daemon.spec.sampling import SamplerParams
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


HEADS = {
    "dflash": {"kind": "dflash"},
    "dspark": {"kind": "dspark"},  # anchor-first, with a confidence head
    "dspark-bonus-anchor-d2t": {"kind": "dspark", "sample_from_anchor": False,
                                "confidence_head": False, "draft_vocab": 100},
    "dflash2": {"kind": "dflash2"},
}


@pytest.fixture(scope="module", params=list(HEADS))
def pair(request: pytest.FixtureRequest, tiny_model_factory: Callable[..., Path],
         tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any, Path, Path]:
    target_path = tiny_model_factory(arch="qwen3", weight_type="Q8_0", seed=3,
                                     context_length=512)
    head_path = write_tiny_head(tmp_path_factory.mktemp("head") / "head.gguf", seed=5,
                                **HEADS[request.param])
    layers = read_head(GGUFFile(head_path)).hidden_layers
    plain = load_or_build(target_path)
    with_features = load_or_build(target_path, BuildOptions(hidden_layers=tuple(layers)))
    return plain, with_features, target_path, head_path


def _run(built: Any, drafter: DFlashDrafter | None, **params: Any) -> tuple[list[int], Any]:
    gen = Generation(ModelRunner(built, n_ctx=512), 0, PROMPT,
                     GenerationParams(max_tokens=48, ignore_eos=True, **params), eog=set(),
                     drafter=drafter)
    out = gen.prefill()
    while not gen.done:
        out += gen.step()
    return out, gen


def _drafter(pair: tuple[Any, Any, Path, Path]) -> DFlashDrafter:
    _, _, target_path, head_path = pair
    runner = HeadRunner(load_or_build_head(head_path, target_path), n_ctx=512)
    return (DFlash2Drafter if runner.built.head.kind == "dflash2" else DFlashDrafter)(runner)


@pytest.mark.parametrize("adaptive", [False, True])
def test_greedy_output_with_a_head_is_the_targets(pair: tuple[Any, Any, Path, Path],
                                                   adaptive: bool) -> None:
    plain, with_features, _, _ = pair
    want, _ = _run(plain, None)
    drafter = _drafter(pair)
    got, gen = _run(with_features, drafter, draft=DraftParams(n_max=3), adaptive=adaptive)
    assert got == want
    assert_drafted(gen.stats)


def test_the_heads_cache_is_one_injection_of_the_sequence(pair: tuple[Any, Any, Path, Path]
                                                          ) -> None:
    """After rounds with rejections (their block rows overwritten), the head's cache holds,
    at every position the target verified, the rows one injection of those tokens'
    features writes."""
    _, with_features, _, _ = pair
    drafter = _drafter(pair)
    _, gen = _run(with_features, drafter, draft=DraftParams(n_max=3))
    assert gen.stats.accepted < gen.stats.drafted  # rejected drafts: their rows overwritten
    tokens = gen.evaluated_tokens
    _, feats = ModelRunner(with_features, n_ctx=512).forward_with_features(0, tokens, 0)
    fresh = HeadRunner(drafter.runner.built, n_ctx=512)
    # the rows the drafter injects
    fresh.inject(0, head_input_rows(feats, drafter.target_layers, len(tokens)), 0)
    n = len(tokens)
    for (k, v), (k2, v2) in zip(drafter.runner.kv.layers(0), fresh.kv.layers(0), strict=True):
        np.testing.assert_allclose(k[0, :, :n], k2[0, :, :n], rtol=1e-5,
                                   atol=1e-5)
        np.testing.assert_allclose(v[0, :, :n], v2[0, :, :n], rtol=1e-5,
                                   atol=1e-5)


def test_proposals_are_the_blocks_rows(pair: tuple[Any, Any, Path, Path]) -> None:
    """Greedy: each row's argmax (DFlash's [last, MASK x 3] rows 1..3, an anchor-first
    DSpark block's [last, MASK x 2] rows 0..2); sampled: q rows are the rows'
    distributions; p_min stops where the row's confidence (DSpark's confidence head),
    else its top probability, falls below it."""
    _, with_features, _, _ = pair
    drafter = _drafter(pair)
    runner = ModelRunner(with_features, n_ctx=512)
    _, feats = runner.forward_with_features(0, PROMPT, 0)
    drafter.begin(0, PROMPT, None, feats)
    mask, first = drafter.mask_id, drafter.first_row
    block = drafter.runner.block(0, [5] + [mask] * (2 + first), len(PROMPT),
                                 [first, first + 1, first + 2])
    if isinstance(drafter, DFlash2Drafter):
        _check_lattice_walk(drafter, block)
        return
    logits = block.logits  # [3, vocab]
    greedy = drafter.draft(0, 5, len(PROMPT), 3, DraftParams(n_max=3))
    assert greedy.tokens == [int(t) for t in logits.argmax(axis=-1)]
    # chosen in the block's graph, where specd's kernels run
    assert drafter.runner.block_samples == (native_ops.library() is not None)
    host = drafter.draft(0, 5, len(PROMPT), 3, DraftParams(n_max=3, backend_sampling=False))
    assert host.tokens == greedy.tokens
    assert greedy.q_rows is None and len(greedy.evidence.step_seconds) == 1  # one pass
    top = np.exp(logits.max(-1)) / np.exp(logits).sum(-1)  # [3]
    judged = top if block.confidence is None else block.confidence
    cut = float(judged[0]) + 1e-6  # above the first row's: stop at once
    stopped = drafter.draft(0, 5, len(PROMPT), 3, DraftParams(n_max=3, p_min=min(cut, 1.0)))
    assert stopped.tokens == [] and stopped.evidence.stopped_unsure
    if len(set(np.round(judged, 6))) > 1:  # a cut between two rows keeps those above it
        cut = float(np.sort(judged)[1])
        kept = drafter.draft(0, 5, len(PROMPT), 3, DraftParams(n_max=3, p_min=cut))
        n_kept = int(np.argmax(judged < cut)) if (judged < cut).any() else 3
        assert kept.tokens == greedy.tokens[:n_kept]
    from specd.daemon.spec.sampling import Sampler

    sp = SamplerParams(temperature=0.8, top_k=10, seed=1)
    drafter.begin(1, PROMPT, Sampler(sp, seed=1), feats)
    # chosen in the block's graph (q as pairs), and on the host (q dense rows)
    for in_graph in (True, False):
        sampled = drafter.draft(1, 5, len(PROMPT), 3,
                                DraftParams(n_max=3, backend_sampling=in_graph))
        q_rows = sampled.q_rows
        assert isinstance(q_rows, SparseDraftProbs) == in_graph
        assert q_rows is not None and len(q_rows) == len(sampled.tokens) == 3
        for i, (row, tok) in enumerate(zip(logits, sampled.tokens, strict=True)):
            q = (q_rows.dense_row(i, row.shape[0]) if isinstance(q_rows, SparseDraftProbs)
                 else q_rows[i])
            np.testing.assert_allclose(q, Sampler(sp).probs(row), atol=1e-6)
            assert q[tok] > 0


def _check_lattice_walk(drafter: DFlash2Drafter, block: Any) -> None:
    """DFlash2: from the anchor, each row's pick is the best successor of the previous
    row's pick; p_min stops where the pick's share of its row's softmax is below it."""
    want, prev, shares = [], 0, []
    for cand, scores in zip(block.candidates, block.scores, strict=True):
        row = scores[prev].astype(np.float64)
        prev = int(np.argmax(row))
        shares.append(1.0 / np.exp(row - row[prev]).sum())
        want.append(int(cand[prev]))
    greedy = drafter.draft(0, 5, len(PROMPT), 3, DraftParams(n_max=3))
    assert greedy.tokens == want and greedy.q_rows is None
    stopped = drafter.draft(0, 5, len(PROMPT), 3,
                            DraftParams(n_max=3, p_min=min(shares[0] + 1e-6, 1.0)))
    assert stopped.tokens == [] and stopped.evidence.stopped_unsure


def test_sampled_output_with_a_head_follows_the_target(pair: tuple[Any, Any, Path, Path]
                                                       ) -> None:
    """Sampled proposals verified by rejection sampling: the second token is distributed
    as the target's own. With a random head and flat distributions this checks the
    plumbing (q rows with their tokens, both outcomes reached) more than the arithmetic,
    which tests/daemon/spec/test_verify.py tests with sharper distributions. A DFlash2
    head's greedy walk is kept only where the target's own draw equals it: rarely, at
    this temperature."""
    _, with_features, _, _ = pair
    n_runs = 3000
    drafter = _drafter(pair)
    p, accepted = second_token_check(ModelRunner(with_features, n_ctx=512), drafter, PROMPT,
                                     n_runs)
    low = 0 if isinstance(drafter, DFlash2Drafter) else 0.05 * n_runs
    assert low < accepted < 0.95 * n_runs  # both outcomes (often, where drafts are sampled)
    assert p > 1e-3
