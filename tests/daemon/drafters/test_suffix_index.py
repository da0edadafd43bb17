"""The suffix index: longest match, frequency-weighted continuations, the ring's bound."""

from __future__ import annotations

import numpy as np

from specd.daemon.drafters.suffix_index import (
    BYTES_PER_TOKEN,
    KEY_LEN,
    MATCH_FACTOR,
    MAX_CANDIDATES,
    MIN_PROBABILITY,
    Candidates,
    Continuation,
    SuffixIndex,
    propose,
)


def _lookup(ix: SuffixIndex, tail: list[int], n_max: int = 8) -> list[int]:
    return propose([ix.candidates(np.asarray(tail), n_max)], n_max).tokens


def test_the_longest_match_wins_over_a_more_frequent_shorter_one() -> None:
    ix = SuffixIndex(256)
    for _ in range(5):  # (2, 3, 4) is followed by 50 five times ...
        ix.add_document([7, 2, 3, 4, 50, 51, 52, 53])
    ix.add_document([1, 2, 3, 4, 60, 61, 62, 63])  # ... but (1, 2, 3, 4) matches longer
    got = propose([ix.candidates(np.asarray([1, 2, 3, 4]), 8)], 8)
    assert got.match == 4 and got.tokens == [60, 61, 62, 63][:4]
    # the shorter tail's continuation is its most frequent one, drafted at most
    # MATCH_FACTOR times as long as the match (here, as far as the document goes)
    got = propose([ix.candidates(np.asarray([9, 2, 3, 4]), 8)], 8)
    assert got.match == 3 and got.tokens == [50, 51, 52, 53][:int(MATCH_FACTOR * 3)]
    assert abs(got.probability - 5 / 6) < 1e-9
    got = propose([ix.candidates(np.asarray([9, 2, 3, 4]), 8)], 2)  # n_max caps it
    assert got.tokens == [50, 51]


def test_continuations_are_weighted_by_how_often_they_followed() -> None:
    ix = SuffixIndex(512)
    for follow in ([10, 11, 12, 13], [10, 11, 12, 13], [10, 11, 12, 13], [10, 20, 21, 22]):
        ix.add_document([5, 6, 7, 8, 9, *follow])
    got = propose([ix.candidates(np.asarray([5, 6, 7, 8, 9]), 4)], 4)
    assert got.tokens == [10, 11, 12, 13] and abs(got.probability - 0.75) < 1e-9
    # a tail whose occurrences disagree on every next token: below MIN_PROBABILITY, none
    ix2 = SuffixIndex(512)
    n_ways = int(1 / MIN_PROBABILITY) + 2
    for t in range(n_ways):
        ix2.add_document([5, 6, 7, 100 + t])
    assert _lookup(ix2, [5, 6, 7]) == []


def test_draft_length_grows_with_the_match() -> None:
    doc = list(range(100, 160))
    ix = SuffixIndex(256)
    ix.add_document(doc)
    for m in (KEY_LEN, 5, 8, 12):
        assert _lookup(ix, doc[20 - m:20], 32) == doc[20:20 + int(MATCH_FACTOR * m)]


def test_matches_and_continuations_stay_within_a_document() -> None:
    ix = SuffixIndex(128)
    ix.add_document([1, 2, 3])
    ix.add_document([4, 5, 6])
    # (2, 3, 4) spans the separator: no key, no match
    assert _lookup(ix, [2, 3, 4]) == []
    # after (1, 2, 3) the document ended: nothing follows
    assert _lookup(ix, [1, 2, 3]) == []


def test_the_current_request_and_the_history_are_pooled() -> None:
    history, current = SuffixIndex(128), SuffixIndex(128)
    history.add_document([1, 2, 3, 40, 41])
    current.append([9, 1, 2, 3, 40, 41, 9, 1, 2, 3, 40, 41, 9])
    tail = np.asarray([1, 2, 3])
    got = propose([history.candidates(tail, 4), current.candidates(tail, 4)], 3)
    assert got.tokens == [40, 41, 9] and got.probability == 2 / 3


def test_the_ring_holds_its_capacity_and_drops_the_oldest() -> None:
    ix = SuffixIndex(1024)
    bound = ix.nbytes
    assert bound <= 1024 * BYTES_PER_TOKEN
    rng = np.random.default_rng(0)
    first = [int(t) for t in rng.integers(0, 1000, 40)]
    ix.add_document(first)
    assert _lookup(ix, first[:10], 4) == first[10:14]
    for _ in range(200):  # 200 requests of 50 tokens: ten times the ring
        ix.add_document(rng.integers(1000, 30000, 50))
        assert ix.nbytes == bound and ix.n_tokens <= ix.capacity
    assert _lookup(ix, first[:10], 4) == []  # the first document was dropped
    newest = ix.live_tokens()[-50:]
    assert _lookup(ix, newest[:10].tolist(), 4) == newest[10:14].tolist()


def test_a_resized_index_keeps_the_newest_tokens_and_their_chains() -> None:
    ix = SuffixIndex(64)
    for i in range(20):
        ix.add_document([i, i + 1, i + 2, i + 3, i + 4])
    big = ix.resized(256)
    assert big.live_tokens().tolist() == ix.live_tokens().tolist()
    assert _lookup(big, [18, 19, 20], 2) == [21, 22]
    small = ix.resized(16)
    assert small.live_tokens().tolist() == ix.live_tokens()[-16:].tolist()
    assert _lookup(small, [19, 20, 21], 2) == [22, 23]


def test_a_lookup_examines_a_bounded_number_of_occurrences() -> None:
    """Lookup cost: however often the key occurred, the walk stops at MAX_CANDIDATES, the
    newest first (the newest continuation wins a tie)."""
    ix = SuffixIndex(1 << 16)
    for i in range(10 * MAX_CANDIDATES):
        ix.add_document([1, 2, 3, 1000 + i])
    found = ix.candidates(np.asarray([1, 2, 3]), 1)
    assert found.match.size == MAX_CANDIDATES
    assert sorted(found.follow[:, 0].tolist()) == list(
        range(1000 + 9 * MAX_CANDIDATES, 1000 + 10 * MAX_CANDIDATES))


def test_appending_in_pieces_equals_appending_at_once() -> None:
    rng = np.random.default_rng(1)
    toks = rng.integers(0, 20, 500)
    whole, pieces = SuffixIndex(256), SuffixIndex(256)
    whole.append(toks)
    i = 0
    while i < toks.size:
        k = int(rng.integers(1, 9))
        pieces.append(toks[i:i + k])
        i += k
    for start in range(0, 480, 7):
        tail = np.asarray(toks[start:start + 6])
        a, b = whole.candidates(tail, 4), pieces.candidates(tail, 4)
        assert a.match.tolist() == b.match.tolist() and a.follow.tolist() == b.follow.tolist()


def test_an_images_placeholders_end_a_match_and_are_never_proposed() -> None:
    """A prompt holding an image (placeholders: 60-bit negative ids, spec/media.py) is
    held with separators there: the text before the image continues only up to it, and
    text after it matches on its own."""
    from specd.daemon.spec.media import placeholder_id

    image = [placeholder_id("ab" * 32)] * 3
    ix = SuffixIndex(256)
    ix.add_document([1, 2, 3, 4, 5, 6, 7, 8, *image, 9, 10, 11, 12, 13, 14, 15, 16])
    assert _lookup(ix, [1, 2, 3, 4, 5]) == [6, 7, 8]
    assert _lookup(ix, [9, 10, 11, 12]) == [13, 14, 15, 16]


def _propose_reference(found: list[Candidates], n_max: int) -> Continuation:
    """The proposal as the module doc defines it, a token at a time over every column."""
    match = np.concatenate([c.match for c in found])
    width = min(n_max, min(c.follow.shape[1] for c in found))
    follow = np.concatenate([c.follow[:, :width] for c in found])
    longest = int(match.max())
    alive = match == longest
    tokens: list[int] = []
    probability = 1.0
    for col in range(min(width, max(int(MATCH_FACTOR * longest), 1))):
        nxt = follow[alive, col]
        going = nxt[nxt >= 0]
        if going.size == 0:
            break
        values, counts = np.unique(going, return_counts=True)
        share = probability * counts.max() / nxt.size
        if share < MIN_PROBABILITY:
            break
        probability = float(share)
        tokens.append(int(values[np.argmax(counts)]))
        alive &= follow[:, col] == tokens[-1]
    return Continuation(tokens, longest, probability if tokens else 0.0)


def test_a_proposal_is_the_token_at_a_time_definitions() -> None:
    """Runs where every longest match agrees are taken at once: over random candidates
    (few distinct tokens, documents ending, pooled indices), the same proposal as the
    definition's column by column."""
    rng = np.random.default_rng(5)
    for _ in range(400):
        found = []
        for _ in range(int(rng.integers(1, 3))):
            m = int(rng.integers(1, 6))
            follow = rng.integers(0, 3, (m, 12)).astype(np.int32)
            follow[:, :int(rng.integers(0, 8))] = follow[0, :1] if rng.random() < 0.5 else 1
            for row in follow:
                if rng.random() < 0.3:
                    row[int(rng.integers(0, 12)):] = -1
            found.append(Candidates(rng.integers(KEY_LEN, KEY_LEN + 3, m), follow))
        n_max = int(rng.integers(1, 13))
        assert propose(found, n_max) == _propose_reference(found, n_max)
