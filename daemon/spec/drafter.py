"""The drafter interface: what a drafter declares, proposes and is told.

A round for sequence `seq`, with `last` the newest token (at position `pos`, not yet
evaluated by the target):

    offer = drafter.offer(seq, last, pos, n_max)          # a free proposal, if it has one
    proposal = drafter.draft(seq, last, pos, n, params)   # or a model's proposal (from one
      of `model_sources`, where a drafter holds several)
      (or, stepwise, `draft_steps`: its model calls yielded one at a time, so that the
      calls of several sequences run in one pass of `step_runner`)
    ... the target verifies [last, *proposal.tokens] in one pass ...
    drafter.accept(seq, n_accepted)                       # roll back rejected drafts
    drafter.process(seq, emitted, features)               # tokens the sequence grew by

`begin(seq, prompt, sampler, features)` starts a sequence (the prompt is already evaluated
by the target); `end(seq)` frees it. A proposal carries what verification needs (tokens,
q rows) apart from what the draft-length policy learns from it (`DraftEvidence`).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Generator, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, TypeVar

import numpy as np

from specd.daemon.text.grammar import GrammarState

from .sampling import Sampler
from .verify import DraftProbs

# the target's hidden states of chosen layers: layer -> [n_tokens, n_embd], one row per
# token the call evaluated, in order
Features = Mapping[int, np.ndarray]


def head_input_rows(features: Features | None, layers: Sequence[int], n: int) -> np.ndarray:
    """A drafter head's input rows [n, L*E]: the features of `layers` concatenated in the
    head's order, one row per token (ValueError where they are missing or miscounted)."""
    if features is None:
        raise ValueError("a drafter head needs the target's features of every token")
    rows = np.concatenate([features[layer] for layer in layers], axis=-1)
    if rows.shape[0] != n:
        raise ValueError(f"{rows.shape[0]} feature rows for {n} tokens")
    return rows


@dataclass(frozen=True)
class DraftParams:
    n_max: int = 8  # most tokens drafted per round
    n_min: int = 0  # drafts shorter than this are not verified
    p_min: float = 0.0  # stop drafting when the draft's top probability falls below
    # sampled requests: sample drafts from q and verify by rejection sampling (False: the
    # draft's argmax, accepted where the target's own draw equals it; the output is then
    # the very tokens target-only decoding draws from the same seed, but accepted less
    # often). Greedy requests draft greedily.
    probabilistic: bool = True
    # a model's draft tokens chosen in its graph where it has a sampler (graph_sampling)
    backend_sampling: bool = True

    def validate(self) -> DraftParams:
        if not 0 <= self.n_min <= max(self.n_max, 0) or self.n_max < 0:
            raise ValueError(f"need 0 <= n_min <= n_max, got n_min={self.n_min} "
                             f"n_max={self.n_max}")
        if not 0.0 <= self.p_min <= 1.0:
            raise ValueError(f"p_min must be in [0, 1], got {self.p_min}")
        return self


@dataclass(frozen=True)
class DraftEvidence:
    """What a proposal teaches the draft-length policy; verification never reads it."""

    # > 0: found by prompt lookup (no model ran), continuing a context n-gram this long
    lookup_match: int = 0
    # seconds of each proposal step, if the drafter timed them (the first step also feeds
    # the tokens the draft had not seen yet)
    step_seconds: tuple[float, ...] = ()
    # the call first evaluated tokens skipped while the target decoded alone, so its time
    # is not what a steady round costs
    includes_catch_up: bool = False
    # (draft position, 0-based; guessed right) for the draft's greedy guesses checked
    # against tokens the target emitted: rows evaluated late are position-0 guesses, and
    # after a round whose n drafts were all accepted the guess for the bonus token is a
    # guess at position n
    guess_checks: tuple[tuple[int, bool], ...] = ()
    # a sampling draft's counterpart of the bonus guess: (n, q [vocab]), the distribution
    # it would have drawn position n from after n accepted drafts
    bonus_q: tuple[int, np.ndarray] | None = None
    # stopped short because the draft's confidence fell below p_min
    stopped_unsure: bool = False


@dataclass
class Proposal:
    """Draft tokens for the target to verify."""

    tokens: list[int]
    # the distributions drafts were sampled from: dense [n, vocab], or sparse pairs
    q_rows: DraftProbs | None = None
    evidence: DraftEvidence = field(default_factory=DraftEvidence)

    @property
    def is_lookup(self) -> bool:
        """Found in the context (prompt lookup): no model ran."""
        return self.evidence.lookup_match > 0

    def truncate(self, n: int) -> Proposal:
        """Drop drafts past n, with their q rows."""
        return replace(self, tokens=self.tokens[:n],
                       q_rows=None if self.q_rows is None else self.q_rows[:n])


_R = TypeVar("_R")

# a draft as a generator: it yields calls of the drafter's model (a ModelRunner's Call, a
# head's BlockCall), is sent each call's output (with its `seconds`), and returns the
# proposal
DraftSteps = Generator[Any, Any, "Proposal"]


class StepRunner(Protocol):
    """What runs a drafter's stepwise calls: the calls of several sequences (one each) in
    one pass where it can, an output (with its `seconds`, the call's share of the pass)
    per call. A ModelRunner (Call -> CallOutput), a HeadRunner (BlockCall ->
    BlockOutput)."""

    def forward_batch(self, calls: Sequence[Any]) -> list[Any]: ...


def run_steps(steps: Generator[Any, Any, _R], runner: StepRunner | None) -> _R:
    """Drive a stepwise draft (or anything yielding model calls) alone: each call it
    yields through `runner`; what it returns."""
    try:
        call = next(steps)
        while True:
            assert runner is not None, "a draft yielded a call with no runner to run it"
            call = steps.send(runner.forward_batch([call])[0])
    except StopIteration as stop:
        result: _R = stop.value
        return result


def timed_steps(steps: Generator[Any, Any, _R]
                ) -> Generator[Any, Any, tuple[_R, float]]:
    """`steps`, passing their calls on, and what they cost this sequence: their own time
    between calls and each call's share of its pass (`CallOutput.seconds`), not the time
    spent waiting while passes shared with other sequences ran."""
    own = 0.0
    t = time.perf_counter()
    to_send: Any = None  # the last call's output (a CallOutput, a BlockOutput)
    thrown: BaseException | None = None
    while True:
        try:
            if thrown is not None:
                call = steps.throw(thrown)
            elif to_send is None:
                call = next(steps)
            else:
                call = steps.send(to_send)
        except StopIteration as stop:
            return stop.value, own + time.perf_counter() - t
        own += time.perf_counter() - t
        thrown = None
        try:
            to_send = yield call
            own += to_send.seconds
        except GeneratorExit:
            steps.close()
            raise
        except BaseException as exc:  # a failed pass: the draft's own handling decides
            thrown = exc
        t = time.perf_counter()


class Drafter(ABC):
    """One kind of draft. What it is, it declares in its class attributes; the round
    reads them instead of asking which class it is."""

    name: str = "none"
    #: `draft()` runs a model (a pass per proposal step, which the policy weighs against
    #: its acceptance); False: the drafter's only proposals are its free offers
    runs_model: bool = True
    #: acceptance is decided by the drafter (`accepts_position`), not by verification
    #: (synthetic rates: the output is then not the target's)
    decides_acceptance: bool = False
    #: layers of the target whose hidden states the drafter reads (`Features`): the target
    #: must be built to output them, and the round passes them with each verified token
    target_layers: tuple[int, ...] = ()
    #: most tokens skipped in target-only rounds that the drafter evaluates before its next
    #: draft (None: all of them; a drafter without a model evaluates none, at no cost)
    catch_up: int | None = None
    #: `draft()` proposes all its tokens in one pass (a head's block), whose cost grows
    #: with the block's length far less than a step per token
    one_pass: bool = False
    #: the runner whose calls `draft_steps` yields (None: it yields none)
    step_runner: StepRunner | None = None

    @property
    def model_sources(self) -> Sequence[Drafter]:
        """The drafters a round may draft with (`draft_steps`), one per round, the policy
        choosing (`RoundPlan.source`): this one, or those a drafter of several sources
        holds (a head and a draft model). Each declares its own `catch_up`, `one_pass`
        and `step_runner`."""
        return (self,)

    def begin(self, seq: int, prompt: Sequence[int], sampler: Sampler | None = None,
              features: Features | None = None) -> None:
        """A new sequence whose prompt the target has evaluated (`features`: the target's
        hidden states of the prompt's tokens, for drafters that declare target layers)."""

    def offer(self, seq: int, last: int, pos: int, n_max: int) -> Proposal | None:
        """A proposal found without running a model (prompt lookup), offered before the
        round decides how to draft; None: the drafter has no free source."""
        return None

    @abstractmethod
    def draft(self, seq: int, last: int, pos: int, n_max: int, params: DraftParams,
              grammar: GrammarState | None = None) -> Proposal:
        """Propose up to n_max tokens to follow `last` (at position `pos`).

        `grammar` is a fork of the request's constraint state, the drafter's to advance
        along its proposals (model drafters sample under its masks)."""

    def draft_steps(self, seq: int, last: int, pos: int, n_max: int, params: DraftParams,
                    grammar: GrammarState | None = None) -> DraftSteps:
        """`draft` as a generator of its model's calls on `step_runner` (each sent back its
        output), returning the proposal: a scheduler runs the calls of several sequences
        in one pass. By default the whole draft happens at the first step, yielding no
        call."""
        return self.draft(seq, last, pos, n_max, params, grammar)
        yield  # unreachable: makes this a generator

    def batched_updates(self) -> AbstractContextManager[None]:
        """While open, what `begin` and `process` compute for several sequences may wait
        and run in one pass when it closes (a head's injections): a scheduler opens it
        around the steps it completes together."""
        return nullcontext()

    def accepts_position(self, i: int, target_choice: int, eog: set[int]) -> bool:
        """Whether draft position i (reached) is accepted, for a drafter that decides
        acceptance; the target's own choice is what gets emitted."""
        raise NotImplementedError(f"{self.name} does not decide acceptance")

    def accept(self, seq: int, n_accepted: int) -> None:
        """The target accepted the first n_accepted tokens of the last draft; a no-op when
        nothing was drafted since the last call (rounds the target decoded alone)."""

    def process(self, seq: int, tokens: Sequence[int],
                features: Features | None = None) -> None:
        """The sequence grew by these tokens, now in the target's KV cache (`features`:
        their hidden states, for drafters that declare target layers)."""

    def end(self, seq: int) -> None:
        """The sequence is finished; free what it holds."""
