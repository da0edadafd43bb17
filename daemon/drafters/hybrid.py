"""Prompt lookup where the context repeats itself, a draft model everywhere else.

Two sources behind one drafter: an n-gram lookup, offered each round for free (a few dict
probes), and a model drafter (a pass per token), which `draft()` runs. The round's policy
chooses between verifying the offer, drafting with the model and a plain step.

Both sources see every token of the sequence (`process`); only the model holds state
that a rejection must roll back (`accept`).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager

from specd.daemon.spec.drafter import Drafter, DraftParams, DraftSteps, Features, Proposal
from specd.daemon.spec.sampling import Sampler
from specd.daemon.text.grammar import GrammarState

from .ngram import NgramDrafter


class HybridDrafter(Drafter):
    name = "draft+ngram"

    def __init__(self, model: Drafter, lookup: NgramDrafter | None = None):
        self.model = model
        self.lookup = lookup if lookup is not None else NgramDrafter()
        self.target_layers = model.target_layers
        self.step_runner = model.step_runner

    @property
    def model_sources(self) -> Sequence[Drafter]:
        return self.model.model_sources

    def begin(self, seq: int, prompt: Sequence[int], sampler: Sampler | None = None,
              features: Features | None = None) -> None:
        self.model.begin(seq, prompt, sampler, features)
        self.lookup.begin(seq, prompt)

    def offer(self, seq: int, last: int, pos: int, n_max: int) -> Proposal:
        # verified greedily even when sampling: exact for any fixed draft
        return self.lookup.offer(seq, last, pos, n_max)

    def draft(self, seq: int, last: int, pos: int, n_max: int, params: DraftParams,
              grammar: GrammarState | None = None) -> Proposal:
        return self.model.draft(seq, last, pos, n_max, params, grammar)

    def draft_steps(self, seq: int, last: int, pos: int, n_max: int, params: DraftParams,
                    grammar: GrammarState | None = None) -> DraftSteps:
        return self.model.draft_steps(seq, last, pos, n_max, params, grammar)

    def batched_updates(self) -> AbstractContextManager[None]:
        return self.model.batched_updates()

    def accept(self, seq: int, n_accepted: int) -> None:
        self.model.accept(seq, n_accepted)  # a no-op after a lookup round: nothing drafted

    def process(self, seq: int, tokens: Sequence[int],
                features: Features | None = None) -> None:
        self.model.process(seq, tokens, features)
        self.lookup.process(seq, tokens)

    def end(self, seq: int) -> None:
        self.model.end(seq)
        self.lookup.end(seq)
