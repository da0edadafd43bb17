"""Speculation from a user's own history: a free draft source over the tokens of that
user's earlier requests and of the current one.

`HistoryStore` keeps one `SuffixIndex` (suffix_index.py) per identity: the identity the
scheduler stamps on each request (the OS user, a token or API key holder, narrowed by a
client's `cache_key`: `uid:1000`, `uid:1000|key:<hash>`). A finished request's prompt
and output are added to its identity's index (`add`); a request's drafts are looked up
in its own identity's index only (`candidates`), so one identity's history never
drafts for another. Memory is bounded per principal (the identity before any
`cache_key` narrowing): the capacities of a principal's indices sum to at most
`max_tokens`, the oldest tokens of an index dropped as new ones come (its ring), and the
least recently used of the principal's other identities dropped when one needs room to
grow. Nothing one principal does evicts, grows or slows another's history.

`HistoryDrafter` is the free source: per sequence, the identity it drafts for
(`bind`) and an index of the current request's own tokens; each round it offers the
most frequent continuation after the longest match of the context's tail, over both
indices pooled (`suffix_index.propose`). No model runs: a round with nothing to offer
costs a few dict and array lookups and no target pass. `WithHistory` puts it in front
of any drafter beside that drafter's own free offer (prompt lookup); the round's policy
picks the offer predicted fastest (`DraftPolicy.pick_offer`).

Residual timing channel (see docs/security.md, "History speculation"): another user's
requests never read this user's index, and no principal's memory bound depends on
another's, so what crosses users is only what any drafter already shows: requests of
different users share the scheduler's steps, and a step that verifies a longer draft
for one lasts longer for all. A user can so tell that another user's rounds are
drafting and accepted (their text is predictable) and roughly how much, as with prompt
lookup or a draft model today, but no probe of theirs makes the other's history answer,
so which text it holds is never measured.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass

import numpy as np

from specd.daemon.spec.drafter import (
    Drafter,
    DraftEvidence,
    DraftRequest,
    Features,
    PassObserver,
    Proposal,
)
from specd.daemon.spec.sampling import Sampler

from .suffix_index import (
    BYTES_PER_TOKEN,
    MAX_MATCH,
    MIN_CAPACITY,
    Candidates,
    SuffixIndex,
    propose,
)

HISTORY = "history"  # the free source's name (its offers' `lookup_source`)
DEFAULT_MAX_TOKENS = 1 << 22  # tokens of history per principal (BYTES_PER_TOKEN each)
IDENTITY_NARROWING = "|"  # what ipc/security.cache_identity puts before a cache key


def principal_of(identity: str) -> str:
    """Who an identity belongs to: the identity before a client's `cache_key` narrowing."""
    return identity.split(IDENTITY_NARROWING, 1)[0]


def match_key(match: int) -> int:
    """The match length the policy keys a history offer's acceptance by: 3, then the
    power of two at or below it (4, 8, 16, 32), so that few keys share the evidence."""
    return match if match <= 3 else 1 << (match.bit_length() - 1)


class HistoryStore:
    """Each identity's suffix index, bounded per principal (module doc). Thread-safe:
    the scheduler's worker adds and looks up, the HTTP loop clears and saves."""

    bytes_per_token = BYTES_PER_TOKEN  # the most `nbytes` grows by per token of the bound

    @staticmethod
    def bound_bytes(max_tokens: int = DEFAULT_MAX_TOKENS) -> int:
        """The most bytes one principal's indices hold (`nbytes_of`) under `max_tokens`."""
        return BYTES_PER_TOKEN * max_tokens

    def __init__(self, max_tokens: int = DEFAULT_MAX_TOKENS):
        if max_tokens < MIN_CAPACITY:
            raise ValueError(f"the history needs room for at least {MIN_CAPACITY} tokens, "
                             f"got {max_tokens}")
        self.max_tokens = max_tokens
        self._lock = threading.Lock()
        # identity -> its index, least recently used first
        self._indices: OrderedDict[str, SuffixIndex] = OrderedDict()

    # -- size -----------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        """Bytes of every index's arrays."""
        with self._lock:
            return sum(ix.nbytes for ix in self._indices.values())

    @property
    def n_tokens(self) -> int:
        """Tokens held, over every identity."""
        with self._lock:
            return sum(ix.n_tokens for ix in self._indices.values())

    def nbytes_of(self, principal: str) -> int:
        """Bytes of one principal's indices."""
        with self._lock:
            return sum(ix.nbytes for i, ix in self._indices.items()
                       if principal_of(i) == principal)

    def identities(self) -> list[str]:
        with self._lock:
            return list(self._indices)

    # -- changes --------------------------------------------------------------------------
    def add(self, identity: str, tokens: Sequence[int] | np.ndarray) -> None:
        """A finished request's tokens (prompt and output) join its identity's history
        (an image's placeholders, 60-bit negative ids, as the index holds them)."""
        toks = np.asarray(tokens, np.int64)
        if toks.size == 0:
            return
        with self._lock:
            ix = self._room_for(identity, toks.size + 1)
            ix.add_document(toks)

    def _room_for(self, identity: str, n: int) -> SuffixIndex:
        """The identity's index, grown (within its principal's bound) towards holding n
        more tokens; the caller holds the lock."""
        ix = self._indices.pop(identity, None)
        if ix is None:
            ix = SuffixIndex(min(MIN_CAPACITY, self.max_tokens))
        self._indices[identity] = ix  # the most recently used
        want = ix.n_tokens + n
        target = ix.capacity if want <= ix.capacity else min(
            max(2 * ix.capacity, 1 << (want - 1).bit_length()), self.max_tokens)
        principal = principal_of(identity)
        while True:  # the principal's least recently used other identities make room
            others = [i for i in self._indices
                      if i != identity and principal_of(i) == principal]
            room = self.max_tokens - sum(self._indices[i].capacity for i in others)
            if room >= target or not others:
                break
            del self._indices[others[0]]
        if target != ix.capacity:
            ix = self._indices[identity] = ix.resized(target)
        return ix

    def clear(self, principal: str | None = None) -> int:
        """Forget the history of `principal`'s identities (None: everyone's); the tokens
        forgotten."""
        with self._lock:
            gone = [i for i in self._indices
                    if principal is None or principal_of(i) == principal]
            n = sum(self._indices[i].n_tokens for i in gone)
            for i in gone:
                del self._indices[i]
            return n

    # -- lookups --------------------------------------------------------------------------
    def candidates(self, identity: str, tail: np.ndarray, n: int) -> Candidates:
        """The occurrences of `tail` in `identity`'s history alone (SuffixIndex.candidates)."""
        with self._lock:
            ix = self._indices.get(identity)
            if ix is None:
                return Candidates.empty(n)
            self._indices.move_to_end(identity)
            return ix.candidates(tail, n)

    # -- saving ---------------------------------------------------------------------------
    def snapshot(self) -> dict[str, np.ndarray]:
        """Each identity's held tokens, oldest first (SEP between documents)."""
        with self._lock:
            return {i: ix.live_tokens() for i, ix in self._indices.items()}

    def restore(self, held: Mapping[str, np.ndarray]) -> None:
        """Indices rebuilt from a snapshot (in its order: the last most recently used),
        each within the bound."""
        with self._lock:
            for identity, toks in held.items():
                toks = np.asarray(toks, np.int32)[-self.max_tokens:]
                ix = self._room_for(identity, toks.size)
                ix.append(toks)


@dataclass
class _Sequence:
    """A sequence's history source: whose history it drafts from, and its own tokens."""

    identity: str | None
    own: SuffixIndex


class HistoryDrafter(Drafter):
    """The free source of an identity's history and the current request (module doc)."""

    name = HISTORY
    runs_model = False

    def __init__(self, store: HistoryStore):
        self.store = store
        self._bound: dict[int, str | None] = {}
        self._seqs: dict[int, _Sequence] = {}

    def bind(self, seq: int, identity: str | None) -> None:
        """The identity whose history the sequence's next request drafts from (None: the
        current request's own tokens only)."""
        self._bound[seq] = identity

    def begin(self, seq: int, prompt: Sequence[int], sampler: Sampler | None = None,
              features: Features | None = None) -> None:
        own = SuffixIndex(max(MIN_CAPACITY, 1 << len(prompt).bit_length()))
        own.append(prompt)
        self._seqs[seq] = _Sequence(self._bound.get(seq), own)

    def process(self, seq: int, tokens: Sequence[int],
                features: Features | None = None) -> None:
        s = self._seqs.get(seq)
        if s is None or not tokens:
            return
        if s.own.n_tokens + len(tokens) > s.own.capacity:
            s.own = s.own.resized(2 * s.own.capacity)
        s.own.append(tokens)

    def context(self, seq: int) -> np.ndarray:
        """The sequence's tokens its own index holds (its prompt and what it grew by)."""
        s = self._seqs.get(seq)
        return np.zeros(0, np.int32) if s is None else s.own.live_tokens()

    def identity(self, seq: int) -> str | None:
        """Whose history the sequence drafts from (None: none)."""
        s = self._seqs.get(seq)
        return None if s is None else s.identity

    def offer(self, seq: int, last: int, pos: int, n_max: int) -> Proposal:
        """The most frequent continuation after the longest match of the context's tail
        (its newest tokens, then `last`), in the identity's history and the request."""
        s = self._seqs.get(seq)
        if s is None or n_max <= 0:
            return Proposal([])
        recent = s.own.live_tokens()[-(MAX_MATCH - 1):]
        tail = np.append(recent, np.int32(last))  # [<= MAX_MATCH]
        found = [s.own.candidates(tail, n_max)]
        if s.identity is not None:
            found.append(self.store.candidates(s.identity, tail, n_max))
        got = propose(found, n_max)
        if not got.tokens:
            return Proposal([])
        return Proposal(got.tokens, evidence=DraftEvidence(
            lookup_match=match_key(got.match), lookup_source=HISTORY))

    def propose(self, requests: Sequence[DraftRequest],
                on_pass: PassObserver | None = None) -> list[Proposal]:
        return [self.offer(r.seq, r.last, r.pos, r.n_max) for r in requests]

    def end(self, seq: int) -> None:
        self._seqs.pop(seq, None)
        self._bound.pop(seq, None)


class WithHistory(Drafter):
    """A drafter with the history source's offer beside its own (module doc): every
    call goes to the drafter, the history source follows the sequence too."""

    def __init__(self, inner: Drafter, history: HistoryDrafter):
        self.inner, self.history = inner, history
        self.name = inner.name
        self.runs_model = inner.runs_model
        self.decides_acceptance = inner.decides_acceptance
        self.target_layers = inner.target_layers
        self.catch_up = inner.catch_up
        self.one_pass = inner.one_pass

    @property
    def model_sources(self) -> Sequence[Drafter]:
        return self.inner.model_sources

    def begin(self, seq: int, prompt: Sequence[int], sampler: Sampler | None = None,
              features: Features | None = None) -> None:
        self.inner.begin(seq, prompt, sampler, features)
        self.history.begin(seq, prompt)

    def offer(self, seq: int, last: int, pos: int, n_max: int) -> Proposal | None:
        return self.inner.offer(seq, last, pos, n_max)

    def offers(self, seq: int, last: int, pos: int, n_max: int) -> list[Proposal]:
        return [*self.inner.offers(seq, last, pos, n_max),
                self.history.offer(seq, last, pos, n_max)]

    def propose(self, requests: Sequence[DraftRequest],
                on_pass: PassObserver | None = None) -> list[Proposal]:
        return self.inner.propose(requests, on_pass)

    def batched_updates(self) -> AbstractContextManager[None]:
        return self.inner.batched_updates()

    def accepts_position(self, i: int, target_choice: int, eog: set[int]) -> bool:
        return self.inner.accepts_position(i, target_choice, eog)

    def accept(self, seq: int, n_accepted: int) -> None:
        self.inner.accept(seq, n_accepted)

    def process(self, seq: int, tokens: Sequence[int],
                features: Features | None = None) -> None:
        self.inner.process(seq, tokens, features)
        self.history.process(seq, tokens)

    def end(self, seq: int) -> None:
        try:
            self.inner.end(seq)
        finally:
            self.history.end(seq)
