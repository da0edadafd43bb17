"""The one drafter interface.

A round for sequence `seq`, with `last` the newest token (at position `pos`, not yet
evaluated by the target):

    draft = drafter.draft(seq, last, pos, n_max, params)   # propose up to n_max tokens
    ... target verifies [last, *draft.tokens] in one pass ...
    drafter.accept(seq, n_accepted)                        # roll back rejected drafts
    drafter.process(seq, emitted)                          # tokens the sequence grew by

`begin(seq, prompt, sampler)` starts a sequence (the prompt is already evaluated by the
target); `end(seq)` frees it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from specd.daemon.text.grammar import GrammarState

from .sampling import Sampler


@dataclass(frozen=True)
class DraftParams:
    n_max: int = 8  # most tokens drafted per round
    n_min: int = 0  # drafts shorter than this are not verified
    p_min: float = 0.0  # stop drafting when the draft's top probability falls below
    # sampled requests: sample drafts from q and verify by rejection sampling (False: the
    # draft's argmax, accepted where the target's own draw equals it: the output is then
    # the very tokens target-only decoding draws from the same seed, but a draft token is
    # accepted with probability p(argmax q) instead of sum(min(p, q)): on the Qwen pair's
    # prose at T 0.7, 0.52 / 0.63 against 0.61 / 0.72). Greedy requests draft greedily.
    probabilistic: bool = True

    def validate(self) -> DraftParams:
        if not 0 <= self.n_min <= max(self.n_max, 0) or self.n_max < 0:
            raise ValueError(f"need 0 <= n_min <= n_max, got n_min={self.n_min} "
                             f"n_max={self.n_max}")
        if not 0.0 <= self.p_min <= 1.0:
            raise ValueError(f"p_min must be in [0, 1], got {self.p_min}")
        return self


@dataclass
class Draft:
    tokens: list[int]
    probs: np.ndarray | None = None  # [n, vocab] q rows when drafted probabilistically
    valid: bool = True  # False: synthetic acceptance (benchmark only), output not the target's
    # seconds of each proposal step, if the drafter timed them (the first step also feeds
    # what the draft has not seen yet: the last token, after a full acceptance two)
    step_s: tuple[float, ...] = ()
    # the call also caught up on tokens the drafter skipped while the target decoded alone,
    # so its time is not what a steady round costs
    caught_up: bool = False
    # the drafter's greedy guesses checked against tokens the target emitted, as (draft
    # position, 0-based; guessed right): free acceptance measurements, or None. Rows the
    # draft evaluates late (tokens skipped while it was idle) are position-0 guesses
    # (teacher forcing); after a round whose n drafts were all accepted, the guess for
    # the target's bonus token is a sample of position n given n accepted.
    forced: tuple[tuple[int, bool], ...] | None = None
    # a prompt lookup's proposal (no model ran): the length of the context n-gram it
    # continues, the evidence behind it (a 4-token match is accepted far more often than
    # a 2-token one); 0 for a model's draft
    match: int = 0
    unsure: bool = False  # stopped short because the draft's confidence fell below p_min
    # a sampling draft's counterpart of the bonus guess in `forced`: (n, q), after a round
    # whose n drafts were all accepted, q [vocab] the distribution it would have drawn
    # position n from; against the target's distribution p there, sum(min(p, q)) is a
    # free sample of position n's acceptance given n accepted
    bonus_q: tuple[int, np.ndarray] | None = None

    @property
    def lookup(self) -> bool:
        """Found in the context (prompt lookup), no model ran."""
        return self.match > 0

    def truncate(self, n: int) -> Draft:
        """Drop drafts past n, with their q rows."""
        return replace(self, tokens=self.tokens[:n],
                       probs=None if self.probs is None else self.probs[:n])


class Drafter(ABC):
    name: str = "none"
    #: True when acceptance is decided by the drafter (synthetic), not by verification
    decides_acceptance: bool = False
    #: most tokens skipped in target-only rounds that the drafter evaluates before its next
    #: draft (None: all of them; a drafter without a model evaluates none, at no cost)
    catch_up: int | None = None

    def begin(self, seq: int, prompt: Sequence[int], sampler: Sampler | None = None) -> None:
        """A new sequence whose prompt the target has evaluated."""

    @abstractmethod
    def draft(self, seq: int, last: int, pos: int, n_max: int, params: DraftParams,
              grammar: GrammarState | None = None) -> Draft:
        """Propose up to n_max tokens to follow `last` (at position `pos`).

        `grammar` is a fork of the request's constraint state, the drafter's to advance
        along its proposals (model drafters sample under its masks)."""

    def accept(self, seq: int, n_accepted: int) -> None:
        """The target accepted the first n_accepted tokens of the last draft; a no-op when
        nothing was drafted since the last call (rounds the target decoded alone)."""

    def process(self, seq: int, tokens: Sequence[int]) -> None:
        """The sequence grew by these tokens (accepted drafts and the target's token)."""

    def end(self, seq: int) -> None:
        """The sequence is finished; free what it holds."""
