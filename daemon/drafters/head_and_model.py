"""A drafter head and a draft model side by side: each round drafts with one of them.

Both follow the whole sequence (`begin`, `process`): the head injects the target's
features of every verified token as it always does; the draft model keeps the history
and catches up on the tokens it skipped before it drafts again (`DraftModelDrafter`'s
bounded catch-up). The round's policy chooses the source per round (`RoundPlan.source`,
an index into `model_sources`) from each one's measured acceptance and cost: a head is
cheap and a draft model accurate, and which wins changes with the text.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager

from specd.daemon.spec.drafter import Drafter, DraftParams, DraftSteps, Features, Proposal
from specd.daemon.spec.sampling import Sampler
from specd.daemon.text.grammar import GrammarState


class HeadAndModelDrafter(Drafter):
    name = "head+draft"

    def __init__(self, head: Drafter, model: Drafter):
        self.head, self.model = head, model
        self.target_layers = head.target_layers
        # a round's calls run on its source's runner; a draft naming no source, the head's
        self.step_runner = head.step_runner

    @property
    def model_sources(self) -> Sequence[Drafter]:
        return (self.head, self.model)

    def begin(self, seq: int, prompt: Sequence[int], sampler: Sampler | None = None,
              features: Features | None = None) -> None:
        self.head.begin(seq, prompt, sampler, features)
        self.model.begin(seq, prompt, sampler, features)

    def draft(self, seq: int, last: int, pos: int, n_max: int, params: DraftParams,
              grammar: GrammarState | None = None) -> Proposal:
        """The head's draft (a round that names no source drafts with the first)."""
        return self.head.draft(seq, last, pos, n_max, params, grammar)

    def draft_steps(self, seq: int, last: int, pos: int, n_max: int, params: DraftParams,
                    grammar: GrammarState | None = None) -> DraftSteps:
        return self.head.draft_steps(seq, last, pos, n_max, params, grammar)

    @contextmanager
    def batched_updates(self) -> Iterator[None]:
        with ExitStack() as stack:
            for source in self.model_sources:
                stack.enter_context(source.batched_updates())
            yield

    def accept(self, seq: int, n_accepted: int) -> None:
        # only the source that drafted has drafts to drop; the other's accept is a no-op
        self.head.accept(seq, n_accepted)
        self.model.accept(seq, n_accepted)

    def process(self, seq: int, tokens: Sequence[int],
                features: Features | None = None) -> None:
        self.head.process(seq, tokens, features)
        self.model.process(seq, tokens, features)

    def end(self, seq: int) -> None:
        self.head.end(seq)
        self.model.end(seq)
