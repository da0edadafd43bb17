"""What every drafter that runs a model of its own shares (a draft model, a DFlash-family
head, an EAGLE-3 head): a sequence of its runner per slot, a state per sequence holding
at least the request's draft sampler, and `propose` for a batch as one loop of passes.

Each request becomes a `DraftRun`, the sequence's draft under way. A pass runs the next
call of every run still drafting, in one `forward_batch` of the runner; each run then
takes its output and decides whether it goes on. A run's step costs its call's share of
the pass (`seconds` of the output, as the runner apportions it) and its own host work.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, Generic, Protocol, TypeVar

from specd.daemon.spec.drafter import (
    Drafter,
    DraftEvidence,
    DraftRequest,
    PassObserver,
    Proposal,
)
from specd.daemon.spec.sampling import Sampler
from specd.daemon.text.grammar import GrammarState

from .picking import Pick, QRow, stack_q


class _Runner(Protocol):
    @property
    def n_seq(self) -> int: ...

    def add_sequence(self) -> int: ...

    def forward_batch(self, calls: Any) -> list[Any]: ...


class _HasSampler(Protocol):
    sampler: Sampler | None


_State = TypeVar("_State", bound=_HasSampler)
_R = TypeVar("_R", bound=_Runner)


class DraftRun(ABC):
    """One sequence's draft under way: a call per pass until it is done."""

    def __init__(self, grammar: GrammarState | None = None) -> None:
        self.grammar = grammar  # advanced along the draft
        self.done = False
        self.tokens: list[int] = []
        self.q_rows: list[QRow] = []  # what each token was drawn from (none: argmax picks)
        self.unsure = False  # stopped because the draft's confidence fell below p_min
        self.step_seconds: list[float] = []  # each step's cost to this sequence

    @abstractmethod
    def call(self) -> Any:
        """The runner call of the next step (a draft model's Call, a head's BlockCall or
        StepCall)."""

    @abstractmethod
    def take(self, out: Any) -> None:
        """The step's output: the next draft tokens, if any; `done` once it stops."""

    def add(self, pick: Pick) -> bool:
        """A picked draft token joins the proposal (the grammar advanced past it); whether
        drafting may go on after it."""
        if pick.token is None:
            self.unsure = pick.unsure
            return False
        self.tokens.append(pick.token)
        if pick.q is not None:
            self.q_rows.append(pick.q)
        if self.grammar is not None:
            self.grammar.consume(pick.token)
            return not self.grammar.is_stopped()
        return True

    def evidence(self) -> DraftEvidence:
        """What the policy learns from the run beyond its tokens."""
        return DraftEvidence(step_seconds=tuple(self.step_seconds), stopped_unsure=self.unsure)

    def result(self) -> Proposal:
        return Proposal(list(self.tokens), stack_q(self.q_rows), self.evidence(),
                        sum(self.step_seconds))


class ModelBackedDrafter(Drafter, Generic[_State, _R]):
    runner: _R

    def __init__(self) -> None:
        self._seqs: dict[int, _State] = {}

    def _ensure_sequence(self, seq: int) -> None:
        """The runner holds a sequence for slot `seq`."""
        while self.runner.n_seq <= seq:
            self.runner.add_sequence()

    @abstractmethod
    def start(self, request: DraftRequest) -> DraftRun:
        """The request's draft, ready for its first pass (done at once where it can draft
        nothing)."""

    def propose(self, requests: Sequence[DraftRequest],
                on_pass: PassObserver | None = None) -> list[Proposal]:
        runs = [self.start(r) for r in requests]
        while active := [r for r in runs if not r.done]:
            calls, own = [], []
            for run in active:
                t0 = time.perf_counter()
                calls.append(run.call())
                own.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            outs = self.runner.forward_batch(calls)
            if on_pass is not None:
                on_pass(sum(len(c.tokens) for c in calls), time.perf_counter() - t0)
            for run, out, before in zip(active, outs, own, strict=True):
                t0 = time.perf_counter()
                run.take(out)
                run.step_seconds.append(before + out.seconds + time.perf_counter() - t0)
        return [r.result() for r in runs]

    def end(self, seq: int) -> None:
        """The request's sampler goes; what the runner's cache holds stays for the slot's
        next request to reuse."""
        st = self._seqs.get(seq)
        if st is not None:
            st.sampler = None
