"""A suffix index over a token stream: what followed the longest match of a context's tail,
weighted by how often it followed.

The structure is a hashed n-gram pool with hash chains, as LZ77 compressors keep one:
the stream lives in a ring of `capacity` tokens (documents separated by SEP, so no match
or continuation crosses from one request into another), and every position i whose last
KEY_LEN tokens lie inside one document is linked into the chain of its key's bucket:

    heads[bucket]  the newest position whose key hashes to `bucket` (+ 1; 0: none)
    prev[i % cap]  how far back the previous position of the same bucket is (0: none)

A lookup walks the chain of the context's last KEY_LEN tokens from the newest position
back (at most MAX_CANDIDATES positions, all still inside the ring), measures how far
back each one matches the context (at most MAX_MATCH tokens, vectorised), and keeps the
positions of the longest match. What followed them is the proposal, built a token at a
time: the most frequent next token among the positions still agreeing, its share of
them multiplying a running probability; drafting stops where that probability falls
below MIN_PROBABILITY, where no position goes on, or at MATCH_FACTOR times the match
length (SuffixDecoding's rule: a longer match earns a longer draft). The candidates of
several indices (an identity's history and the current request) are pooled before the
longest match is chosen (`propose`).

Why chains and not a suffix tree or automaton: the oldest tokens must go as new ones come,
and a ring needs no deletion at all (a position older than the ring's start ends every
walk), while a suffix tree or automaton of a sliding window is much more involved. The
cost is that only the newest MAX_CANDIDATES occurrences of a key are counted, a recency
bias a daemon's history welcomes.

Memory: `nbytes` is every array the index holds: the ring (int32), the chain links
(int32) and the heads table (int64, a power of two not above the capacity), at most
BYTES_PER_TOKEN bytes per token of capacity. Appending n tokens costs O(n log n) numpy
work (a sort of their buckets); a lookup costs at most MAX_CANDIDATES chain steps and a
[MAX_CANDIDATES, MAX_MATCH] comparison, whatever the index's size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

SEP = -1  # between documents: no match, key or continuation spans it
KEY_LEN = 3  # tokens a chain key hashes: the shortest match a lookup finds
MAX_CANDIDATES = 64  # newest occurrences of the context's key a lookup examines
MAX_MATCH = 32  # longest match measured (a longer one counts as this long)
MIN_PROBABILITY = 0.1  # drafting stops where the continuation's share falls below this
MATCH_FACTOR = 2.0  # a draft is at most this many times the match length
MIN_CAPACITY = 1 << 10  # tokens of a new index's ring
BYTES_PER_TOKEN = 16  # the most `nbytes` grows by per token of capacity
_MULT = np.uint64(0x9E3779B97F4A7C15)  # Fibonacci hashing


@dataclass(frozen=True)
class Candidates:
    """Occurrences of a context's tail: how many tokens each matches back from its end
    ([m]), and the tokens that followed it ([m, n], SEP past the end of its document)."""

    match: np.ndarray  # [m] int
    follow: np.ndarray  # [m, n] int32

    @staticmethod
    def empty(n: int) -> Candidates:
        return Candidates(np.zeros(0, np.int64), np.full((0, n), SEP, np.int32))


@dataclass(frozen=True)
class Continuation:
    """A proposal: the tokens, the match length it continues, and the share of the
    matched occurrences that went on with all of them."""

    tokens: list[int]
    match: int
    probability: float


def _table_size(capacity: int) -> int:
    """The heads table's buckets: the largest power of two not above the capacity."""
    return 1 << (max(capacity, 1).bit_length() - 1)


class SuffixIndex:
    """A ring of tokens with hash chains (module doc). Not thread-safe: its owner locks."""

    def __init__(self, capacity: int = MIN_CAPACITY):
        if capacity < KEY_LEN + 1:
            raise ValueError(f"a suffix index needs a capacity of at least {KEY_LEN + 1} "
                             f"tokens, got {capacity}")
        self.capacity = capacity
        self._ring = np.full(capacity, SEP, np.int32)  # [capacity] tokens, position % cap
        self._prev = np.zeros(capacity, np.int32)  # [capacity] distance to the previous
        self._bits = _table_size(capacity).bit_length() - 1
        self._heads = np.zeros(1 << self._bits, np.int64)  # [table] newest position + 1
        self.end = 0  # absolute position after the newest token
        self._first = 0  # absolute position of the first token it was given

    # -- size -----------------------------------------------------------------------------
    @property
    def start(self) -> int:
        """The oldest position still in the ring."""
        return max(self.end - self.capacity, self._first)

    @property
    def n_tokens(self) -> int:
        """Tokens (and separators) held."""
        return self.end - self.start

    @property
    def nbytes(self) -> int:
        """Bytes of every array the index holds."""
        return self._ring.nbytes + self._prev.nbytes + self._heads.nbytes

    def live_tokens(self) -> np.ndarray:
        """The held stream, oldest first ([n_tokens] int32, SEP between documents)."""
        return self._ring[np.arange(self.start, self.end) % self.capacity]

    def resized(self, capacity: int) -> SuffixIndex:
        """A new index of `capacity` holding the newest tokens of this one (all of them
        where they fit), its chains rebuilt."""
        out = SuffixIndex(capacity)
        live = self.live_tokens()
        out.end = out._first = self.end - len(live)
        out.append(live)
        return out

    # -- adding ---------------------------------------------------------------------------
    def add_document(self, tokens: Sequence[int] | np.ndarray) -> None:
        """A new document (a finished request's tokens), after a separator."""
        if self.end > 0:
            self.append([SEP])
        self.append(tokens)

    def append(self, tokens: Sequence[int] | np.ndarray) -> None:
        """Tokens continuing the newest document (SEP starts another). An image's
        placeholders (negative ids, spec/media.py) are held as SEP: text never matches
        across an image, and no continuation proposes one."""
        new = np.asarray(tokens, dtype=np.int64)  # [n]
        new = np.where(new < 0, SEP, new).astype(np.int32)
        if new.size == 0:
            return
        if new.size > self.capacity:  # only the newest fit
            self.end += new.size - self.capacity
            new = new[-self.capacity:]
        first = self.end
        n = new.size
        # the key of each new position reads the KEY_LEN - 1 tokens before it (read
        # before the new tokens may overwrite them; none where the new ones fill the ring)
        need = KEY_LEN - 1
        before = first if n == self.capacity else max(first - need, self.start)
        prior = self._ring[np.arange(before, first) % self.capacity]
        window = np.concatenate([np.full(need - prior.size, SEP, np.int32), prior, new])
        self._ring[np.arange(first, first + n) % self.capacity] = new
        self.end = first + n
        self._link(first, window)

    def _link(self, first: int, window: np.ndarray) -> None:
        """Chain the positions first.. whose keys (the last KEY_LEN tokens of `window`'s
        slices, window = KEY_LEN - 1 tokens before them, then theirs) hold no SEP."""
        n = window.size - (KEY_LEN - 1)
        grams = np.lib.stride_tricks.sliding_window_view(window, KEY_LEN)  # [n, KEY_LEN]
        ok = (grams >= 0).all(axis=1)  # [n]
        if not ok.any():
            self._prev[np.arange(first, first + n) % self.capacity] = 0
            return
        buckets = _buckets(grams, self._bits)  # [n]
        pos = np.arange(first, first + n, dtype=np.int64)
        self._prev[pos % self.capacity] = 0
        pos, buckets = pos[ok], buckets[ok]
        order = np.argsort(buckets, kind="stable")  # positions ascend within a bucket
        b_s, p_s = buckets[order], pos[order]
        same = np.zeros(b_s.size, bool)
        same[1:] = b_s[1:] == b_s[:-1]
        earlier = np.where(same, np.roll(p_s, 1), self._heads[b_s] - 1)  # -1: none
        dist = p_s - earlier
        keep = (earlier >= 0) & (earlier >= self.start) & (dist < self.capacity)
        self._prev[p_s % self.capacity] = np.where(keep, dist, 0).astype(np.int32)
        last = np.ones(b_s.size, bool)
        last[:-1] = b_s[1:] != b_s[:-1]
        self._heads[b_s[last]] = p_s[last] + 1

    # -- looking up -----------------------------------------------------------------------
    def candidates(self, tail: np.ndarray, n: int) -> Candidates:
        """The newest occurrences of `tail`'s last KEY_LEN tokens (tail: the context's
        newest tokens, oldest first), each with its match length against `tail` (at most
        MAX_MATCH) and the n tokens that followed it. Occurrences nothing followed yet
        are left out."""
        if tail.size < KEY_LEN or n <= 0 or self.end == 0:
            return Candidates.empty(max(n, 0))
        key = tail[-KEY_LEN:]
        if (key < 0).any():
            return Candidates.empty(n)
        bucket = int(_buckets(key[None, :], self._bits)[0])
        start, cap = self.start, self.capacity
        found: list[int] = []
        p = int(self._heads[bucket]) - 1
        prev = self._prev
        while p >= start and len(found) < MAX_CANDIDATES:
            if p + 1 < self.end:  # something followed it
                found.append(p)
            d = int(prev[p % cap])
            if d == 0:
                break
            p -= d
        if not found:
            return Candidates.empty(n)
        ends = np.asarray(found, np.int64)  # [m]
        depth = min(tail.size, MAX_MATCH)
        back = ends[:, None] - np.arange(depth)[None, :]  # [m, depth]
        inside = back >= start
        seen = np.where(inside, self._ring[back % cap], SEP)  # [m, depth]
        want = tail[::-1][:depth]  # [depth] newest first
        agree = (seen == want[None, :]) & inside
        match = np.cumprod(agree, axis=1).sum(axis=1)  # [m]
        keyed = match >= KEY_LEN  # not a bucket collision
        ends, match = ends[keyed], match[keyed]
        ahead = ends[:, None] + 1 + np.arange(n)[None, :]  # [m, n]
        follow = np.where(ahead < self.end, self._ring[ahead % cap], SEP)
        # nothing after the document's end counts
        follow = np.where(np.cumprod(follow >= 0, axis=1) > 0, follow, SEP).astype(np.int32)
        return Candidates(match, follow)


def _buckets(grams: np.ndarray, bits: int) -> np.ndarray:
    """Each row's bucket among 2**bits ([m, KEY_LEN] tokens -> [m])."""
    h = np.zeros(grams.shape[0], np.uint64)
    with np.errstate(over="ignore"):
        for j in range(grams.shape[1]):
            h = (h ^ grams[:, j].astype(np.uint64)) * _MULT
    return (h >> np.uint64(64 - bits)).astype(np.int64) if bits else np.zeros_like(h, np.int64)


def propose(found: Sequence[Candidates], n_max: int) -> Continuation:
    """The most frequent continuation after the longest match among the candidates of
    every index (module doc): empty where nothing matched."""
    pooled = [c for c in found if c.match.size]
    if not pooled or n_max <= 0:
        return Continuation([], 0, 0.0)
    match = np.concatenate([c.match for c in pooled])  # [m]
    width = min(n_max, min(c.follow.shape[1] for c in pooled))
    follow = np.concatenate([c.follow[:, :width] for c in pooled])  # [m, width]
    longest = int(match.max())
    alive = match == longest
    limit = min(width, max(int(MATCH_FACTOR * longest), 1))
    # the leading columns where every occurrence of the longest match goes on with the
    # same token are taken at once (each one's share is 1: nothing changes)
    rows = follow[alive, :limit]  # [alive, limit]
    same = (rows == rows[:1]).all(axis=0) & (rows[0] >= 0)  # [limit]
    agreed = limit if same.all() else int(np.argmin(same))
    tokens = [int(t) for t in rows[0, :agreed]]
    probability = 1.0
    for col in range(agreed, limit):
        nxt = follow[alive, col]  # [alive]
        going = nxt[nxt >= 0]
        if going.size == 0:
            break
        values, counts = np.unique(going, return_counts=True)
        best = int(np.argmax(counts))
        share = probability * counts[best] / nxt.size
        if share < MIN_PROBABILITY:
            break
        probability = float(share)
        token = int(values[best])
        tokens.append(token)
        alive &= follow[:, col] == token
    return Continuation(tokens, longest, probability if tokens else 0.0)
