"""Prompt lookup where the context repeats itself, a draft model everywhere else.

Two sources behind one drafter: an n-gram lookup (free: a few dict probes) and a model
drafter (a pass per token). With a fixed draft length a round drafts from the lookup
when it has a match and from the model otherwise. Under the adaptive controller the
generation asks `lookup` for its offer first and lets the controller choose between
verifying it, drafting with the model and a plain step (`AdaptiveDraftLength.
choose_source`); the model then drafts through `model` directly.

Both sources see every token of the sequence (`process`); only the model holds state
that a rejection must roll back (`accept`).
"""

from __future__ import annotations

from collections.abc import Sequence

from specd.daemon.spec.drafter import Draft, Drafter, DraftParams
from specd.daemon.spec.sampling import Sampler
from specd.daemon.text.grammar import GrammarState

from .ngram import NgramDrafter


class HybridDrafter(Drafter):
    name = "draft+ngram"

    def __init__(self, model: Drafter, lookup: NgramDrafter | None = None):
        self.model = model
        self.lookup = lookup if lookup is not None else NgramDrafter()
        self.catch_up = model.catch_up

    def begin(self, seq: int, prompt: Sequence[int], sampler: Sampler | None = None) -> None:
        self.model.begin(seq, prompt, sampler)
        self.lookup.begin(seq, prompt)

    def draft(self, seq: int, last: int, pos: int, n_max: int, params: DraftParams,
              grammar: GrammarState | None = None) -> Draft:
        offered = self.lookup.draft(seq, last, pos, n_max, params)
        if offered.tokens:  # verified greedily even when sampling: exact for any fixed draft
            return offered
        return self.model.draft(seq, last, pos, n_max, params, grammar)

    def accept(self, seq: int, n_accepted: int) -> None:
        self.model.accept(seq, n_accepted)  # a no-op after a lookup round: nothing drafted

    def process(self, seq: int, tokens: Sequence[int]) -> None:
        self.model.process(seq, tokens)
        self.lookup.process(seq, tokens)

    def end(self, seq: int) -> None:
        self.model.end(seq)
        self.lookup.end(seq)
