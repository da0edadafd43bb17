"""History speculation: the store's identities and bound, the free source, and rounds
drafted from an earlier request's output on a real (tiny) model."""

from __future__ import annotations

import time

import numpy as np
import pytest

from specd.daemon.drafters.history import (
    HISTORY,
    HistoryDrafter,
    HistoryStore,
    WithHistory,
    match_key,
    principal_of,
)
from specd.daemon.drafters.ngram import NgramDrafter
from specd.daemon.drafters.registry import DrafterInputs, make_drafter
from specd.daemon.drafters.suffix_index import BYTES_PER_TOKEN, MATCH_FACTOR, MIN_CAPACITY
from specd.daemon.spec.drafter import DraftParams
from specd.daemon.spec.generation import Generation, GenerationParams
from specd.daemon.spec.sampling import SamplerParams
from specd.ipc.security import cache_identity
from specd.ort_models.model_cache import load_or_build
from specd.ort_models.runner import ModelRunner

from speculation_checks import assert_speculated

EOG = {349}
PROMPT = [348, 20, 31, 42, 53, 64, 75, 86, 97, 108, 119, 130]
ALICE, BOB = "uid:1000", "uid:1001"


def test_principal_is_the_identity_before_its_cache_key() -> None:
    assert principal_of(cache_identity(ALICE, "conversation 7")) == ALICE
    assert principal_of(ALICE) == ALICE
    assert [match_key(m) for m in (3, 4, 5, 7, 8, 15, 16, 31, 32)] == [3, 4, 4, 4, 8, 8,
                                                                          16, 16, 32]


def _offer(d: HistoryDrafter, seq: int, identity: str | None, context: list[int],
           n_max: int = 8) -> list[int]:
    d.bind(seq, identity)
    d.begin(seq, context[:-1])
    got = d.offer(seq, context[-1], len(context) - 1, n_max)
    d.end(seq)
    if got.tokens:
        assert got.evidence.lookup_source == HISTORY and got.is_lookup
    return got.tokens


def test_an_identity_drafts_only_from_its_own_history() -> None:
    store = HistoryStore(1 << 14)
    secret = [900 + i for i in range(30)]
    store.add(ALICE, [1, 2, 3, 4, *secret])
    store.add(cache_identity(ALICE, "k"), [5, 6, 7, 8, 777, 778])
    d = HistoryDrafter(store)
    # a match of 4: MATCH_FACTOR times as many tokens
    assert _offer(d, 0, ALICE, [1, 2, 3, 4]) == secret[:int(MATCH_FACTOR * 4)]
    # Bob's requests, with the same context, any cache key, or none: nothing of Alice's
    for who in (BOB, cache_identity(BOB, "k"), "token", None):
        assert _offer(d, 1, who, [1, 2, 3, 4]) == []
        for tail in ([2, 3, 4], [*secret[:10]], [5, 6, 7, 8]):
            assert _offer(d, 1, who, tail) == []
    # Alice's conversation with its own cache key sees its own history only
    assert _offer(d, 0, cache_identity(ALICE, "k"), [1, 2, 3, 4]) == []
    assert _offer(d, 0, cache_identity(ALICE, "k"), [5, 6, 7, 8]) == [777, 778]
    # the request's own tokens draft for it, whoever it is
    assert _offer(d, 1, BOB, [40, 41, 42, 43, 44, 40, 41, 42]) == [43, 44, 40, 41]


def test_a_request_holding_an_image_joins_the_history() -> None:
    """A finished request's tokens with an image's placeholders (60-bit negative ids)
    are kept, the text on each side of the image matching on its own."""
    from specd.daemon.spec.media import placeholder_id

    store = HistoryStore(1 << 14)
    store.add(ALICE, [1, 2, 3, 4, 5, 6, *[placeholder_id("cd" * 32)] * 4,
                      11, 12, 13, 14, 15, 16])
    d = HistoryDrafter(store)
    assert _offer(d, 0, ALICE, [1, 2, 3, 4]) == [5, 6]
    assert _offer(d, 0, ALICE, [11, 12, 13, 14]) == [15, 16]


def test_the_bound_holds_per_principal_under_a_long_stream() -> None:
    """Thousands of requests of several identities: each principal's indices stay within
    max_tokens of capacity (BYTES_PER_TOKEN each), whatever the others did."""
    bound = 1 << 13
    store = HistoryStore(bound)
    rng = np.random.default_rng(0)
    keys = [ALICE, cache_identity(ALICE, "a"), cache_identity(ALICE, "b"), BOB]
    for _ in range(3000):
        who = keys[int(rng.integers(len(keys)))]
        store.add(who, rng.integers(0, 5000, int(rng.integers(1, 600))))
        for principal in (ALICE, BOB):
            assert store.nbytes_of(principal) <= bound * BYTES_PER_TOKEN
        assert store.nbytes <= 2 * bound * BYTES_PER_TOKEN
    assert store.n_tokens <= 2 * bound
    # the newest request is still found
    last = rng.integers(6000, 7000, 40)
    store.add(BOB, last)
    d = HistoryDrafter(store)
    assert _offer(d, 0, BOB, [int(t) for t in last[:10]]) == [int(t) for t in last[10:18]]


def test_one_principals_history_never_evicts_anothers() -> None:
    store = HistoryStore(MIN_CAPACITY * 4)
    kept = [100 + i for i in range(40)]
    store.add(BOB, kept)
    before = store.nbytes_of(BOB)
    rng = np.random.default_rng(1)
    for _ in range(200):
        store.add(cache_identity(ALICE, str(rng.integers(50))), rng.integers(0, 99, 300))
    assert store.nbytes_of(BOB) == before
    assert _offer(HistoryDrafter(store), 0, BOB, kept[:8]) == kept[8:16]


def test_clear_forgets_only_the_principals_history() -> None:
    store = HistoryStore(1 << 12)
    store.add(ALICE, list(range(50)))
    store.add(cache_identity(ALICE, "x"), list(range(50)))
    store.add(BOB, list(range(50)))
    assert store.clear(ALICE) == 100
    assert store.identities() == [BOB]
    assert store.clear() == 50 and store.nbytes == 0 and store.n_tokens == 0


def test_history_is_offered_beside_every_drafter(tiny_model_factory) -> None:
    store = HistoryStore(1 << 12)
    history = HistoryDrafter(store)
    draft = load_or_build(tiny_model_factory(arch="qwen2", weight_type="Q8_0", seed=3))
    for spec_type in ("ngram", "draft", "draft+ngram"):
        runner = ModelRunner(draft, n_ctx=256) if "draft" in spec_type else None
        d = make_drafter(spec_type, DrafterInputs(draft_runner=runner, history=history))
        assert isinstance(d, WithHistory)
        free = 1 if spec_type != "draft" else 0  # prompt lookup's offer, where it has one
        d.begin(0, [1, 2, 3])
        assert len(d.offers(0, 4, 3, 4)) == free + 1
        d.end(0)
    assert make_drafter("none", DrafterInputs(history=history)) is None
    assert not isinstance(make_drafter("ngram", DrafterInputs()), WithHistory)


@pytest.fixture(scope="module")
def target(tiny_model_factory):
    return load_or_build(tiny_model_factory(arch="qwen2", weight_type="Q8_0", seed=3,
                                            context_length=1024))


def _generate(target, drafter, identity: str | None, prompt: list[int], **kw):
    runner = ModelRunner(target, n_ctx=512)
    if isinstance(drafter, WithHistory):
        drafter.history.bind(0, identity)
    gen = Generation(runner, 0, prompt, GenerationParams(
        max_tokens=48, ignore_eos=True, draft=DraftParams(n_max=8), **kw), eog=EOG,
        drafter=drafter)
    out = gen.prefill()
    while not gen.done:
        out += gen.step()
    gen.close()
    return out, gen


@pytest.mark.parametrize("adaptive", [False, True])
def test_a_repeated_request_is_drafted_from_history(target, adaptive, monkeypatch) -> None:
    """Greedy: the second time a prompt is asked, the history source drafts the first
    answer and the target accepts it; the output is target-only decoding's both times.
    Another identity asking the same gets nothing from it."""
    ticks = iter(range(10**9))  # a steady clock: the adaptive choices do not follow load
    monkeypatch.setattr(time, "perf_counter", lambda: next(ticks) * 1e-3)
    want, _ = _generate(target, None, None, PROMPT)
    store = HistoryStore(1 << 14)
    drafter = WithHistory(NgramDrafter(), HistoryDrafter(store))
    first, g1 = _generate(target, drafter, ALICE, PROMPT, adaptive=adaptive)
    assert first == want
    store.add(ALICE, PROMPT + first)
    again, g2 = _generate(target, drafter, ALICE, PROMPT, adaptive=adaptive)
    assert again == want
    s = g2.stats
    assert s.offer_rounds.get(HISTORY, 0) > 0 and s.offer_accepted[HISTORY] > 0, s.as_dict()
    assert_speculated(s)
    assert s.offer_accepted[HISTORY] >= len(want) // 2, s.as_dict()
    other, g3 = _generate(target, drafter, BOB, PROMPT, adaptive=adaptive)
    assert other == want
    assert g3.stats.offer_accepted.get(HISTORY, 0) <= g1.stats.offer_accepted.get(HISTORY, 0)


def test_a_sampled_request_verifies_history_as_point_masses(target) -> None:
    """At temperature > 0 a history offer is a fixed draft, verified as prompt lookup's
    (the target's own draw kept where it equals the draft): the output is the target's
    for the seed, drafted or not."""
    sp = SamplerParams(temperature=0.7, seed=5)
    want, _ = _generate(target, None, None, PROMPT, sampling=sp)
    store = HistoryStore(1 << 14)
    store.add(ALICE, PROMPT + want)
    drafter = WithHistory(NgramDrafter(), HistoryDrafter(store))
    got, gen = _generate(target, drafter, ALICE, PROMPT, sampling=sp)
    assert got == want
    assert gen.stats.offer_accepted.get(HISTORY, 0) > 0, gen.stats.as_dict()
