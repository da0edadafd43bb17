"""Drafters on their own: the n-gram index against a scan, the hybrid's two sources."""

from __future__ import annotations

import random

import pytest

from specd.daemon.drafters.composite import CompositeDrafter
from specd.daemon.drafters.draft_model import DraftModelDrafter
from specd.daemon.drafters.ngram import NgramDrafter
from specd.daemon.spec.drafter import DraftParams
from specd.ort_models.model_cache import load_or_build
from specd.ort_models.runner import ModelRunner


def scan_lookup(history: list[int], last: int, n_max: int, min_ngram: int, max_ngram: int,
                max_history: int) -> tuple[list[int], int]:
    """Prompt lookup by scanning: what follows the latest earlier occurrence of the
    longest tail, and that tail's length (0: no match)."""
    ctx = history[-max_history:] + [last]
    for n in range(min(max_ngram, len(ctx) - 1), min_ngram - 1, -1):
        tail = ctx[-n:]
        for start in range(len(ctx) - n - 1, -1, -1):
            if ctx[start:start + n] == tail:
                return ctx[start + n:start + n + n_max], n
    return [], 0


@pytest.mark.parametrize("min_ngram,max_ngram,max_history", [
    (2, 4, 8192), (1, 3, 8192), (2, 4, 24), (3, 3, 40)])
def test_ngram_index_finds_what_a_scan_finds(min_ngram, max_ngram, max_history) -> None:
    rng = random.Random(min_ngram * 100 + max_ngram * 10 + max_history)
    d = NgramDrafter(min_ngram=min_ngram, max_ngram=max_ngram, max_history=max_history)
    history = [rng.randrange(4) for _ in range(rng.randrange(1, 30))]
    d.begin(0, history)
    found = 0
    for _ in range(300):
        last = rng.randrange(4) if rng.random() < 0.7 else rng.randrange(4, 6)
        n_max = rng.randrange(1, 9)
        want, match = scan_lookup(history, last, n_max, min_ngram, max_ngram, max_history)
        got = d.offer(0, last, len(history), n_max)
        assert got.tokens == want
        assert got.is_lookup == bool(want) and got.evidence.lookup_match == (match if want else 0)
        found += bool(want)
        grown = [last] + [rng.randrange(6) for _ in range(rng.randrange(0, 5))]
        history += grown
        d.process(0, grown)
    assert 0 < found < 300  # both outcomes were exercised


def test_ngram_sequences_are_apart() -> None:
    d = NgramDrafter()
    d.begin(0, [1, 2, 3, 9, 1, 2])
    d.begin(1, [5, 6, 7])
    assert d.draft(0, 3, 6, 4, DraftParams()).tokens == [9, 1, 2, 3]
    assert d.draft(1, 3, 3, 4, DraftParams()).tokens == []
    d.end(0)
    assert d.draft(0, 3, 6, 4, DraftParams()).tokens == []


@pytest.fixture(scope="module")
def draft_runner(tiny_model_factory):
    built = load_or_build(tiny_model_factory(arch="qwen2", weight_type="Q8_0", seed=3,
                                             context_length=1024))
    return ModelRunner(built, n_ctx=256)


def test_hybrid_offers_the_lookup_and_drafts_with_the_model(draft_runner) -> None:
    model = DraftModelDrafter(draft_runner)
    h = CompositeDrafter("draft+ngram", [model])
    assert h.runs_model and not NgramDrafter.runs_model
    prompt = [348, 20, 31, 42, 53, 64, 20, 31]
    h.begin(0, prompt)
    params = DraftParams(n_max=3)
    # the tail (31, 42)'s earlier occurrence is followed by 53, 64, 20
    d = h.offer(0, 42, len(prompt), 3)
    assert d.tokens == [53, 64, 20] and d.is_lookup
    assert d.evidence.lookup_match == 3  # the tail (20, 31, 42) occurred before
    h.accept(0, 3)
    h.process(0, [42, 53, 64, 20])
    # nothing repeats the tail (20, 99): no offer; the model drafts, as it would alone
    pos = len(prompt) + 4
    assert h.offer(0, 99, pos, 3).tokens == []
    d = h.draft(0, 99, pos, 3, params)
    assert not d.is_lookup and len(d.tokens) == 3
    alone = DraftModelDrafter(draft_runner)
    alone.begin(1, prompt + [42, 53, 64, 20])
    assert alone.draft(1, 99, pos, 3, params).tokens == d.tokens
