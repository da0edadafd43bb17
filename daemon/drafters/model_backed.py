"""What every drafter that runs a model of its own shares (a draft model, a DFlash-family
head, an EAGLE-3 head): a sequence of its runner per slot, a state per sequence holding
at least the request's draft sampler, and `draft` as its stepwise `draft_steps` driven
alone through the runner."""

from __future__ import annotations

from abc import abstractmethod
from typing import Any, Generic, Protocol, TypeVar

from specd.daemon.spec.drafter import Drafter, DraftParams, DraftSteps, Proposal, run_steps
from specd.daemon.spec.sampling import Sampler
from specd.daemon.text.grammar import GrammarState


class _Runner(Protocol):
    @property
    def n_seq(self) -> int: ...

    def add_sequence(self) -> int: ...

    def forward_batch(self, calls: Any) -> list[Any]: ...


class _HasSampler(Protocol):
    sampler: Sampler | None


_State = TypeVar("_State", bound=_HasSampler)
_R = TypeVar("_R", bound=_Runner)


class ModelBackedDrafter(Drafter, Generic[_State, _R]):
    runner: _R

    def __init__(self) -> None:
        self._seqs: dict[int, _State] = {}

    def _ensure_sequence(self, seq: int) -> None:
        """The runner holds a sequence for slot `seq`."""
        while self.runner.n_seq <= seq:
            self.runner.add_sequence()

    def draft(self, seq: int, last: int, pos: int, n_max: int, params: DraftParams,
              grammar: GrammarState | None = None) -> Proposal:
        return run_steps(self.draft_steps(seq, last, pos, n_max, params, grammar), self.runner)

    @abstractmethod
    def draft_steps(self, seq: int, last: int, pos: int, n_max: int, params: DraftParams,
                    grammar: GrammarState | None = None) -> DraftSteps:
        """The draft as the runner's calls, yielded one at a time (Drafter.draft_steps)."""

    def end(self, seq: int) -> None:
        """The request's sampler goes; what the runner's cache holds stays for the slot's
        next request to reuse."""
        st = self._seqs.get(seq)
        if st is not None:
            st.sampler = None
