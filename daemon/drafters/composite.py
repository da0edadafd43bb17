"""Several draft sources behind one drafter: model sources (a draft model, a head, or a
head and a draft model side by side) and, in front, a prompt lookup whose proposal is
offered each round for free (a few dict probes).

Every source follows the whole sequence (`begin`, `process`): a head injects the target's
features of every verified token, a draft model keeps the history and catches up on the
tokens it skipped before it drafts again, the lookup indexes them. The round's policy
chooses between verifying the offer, a plain step, and drafting with one model source
(`RoundPlan.source`, an index into `model_sources`) from each one's measured acceptance
and cost: a head is cheap and a draft model accurate, and which wins changes with the
text. Only the source that drafted has drafts to roll back (`accept`: the others' is a
no-op).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager

from specd.daemon.spec.drafter import (
    Drafter,
    DraftRequest,
    Features,
    PassObserver,
    Proposal,
)
from specd.daemon.spec.media import PromptImage
from specd.daemon.spec.sampling import Sampler

from .ngram import NgramDrafter


class CompositeDrafter(Drafter):
    def __init__(self, name: str, models: Sequence[Drafter],
                 lookup: NgramDrafter | None = None):
        if not models:
            raise ValueError("a composite drafter needs a model source")
        self.name = name
        self.models = tuple(models)
        self.lookup = lookup if lookup is not None else NgramDrafter()
        self.target_layers = tuple(sorted({layer for m in self.models
                                           for layer in m.target_layers}))

    @property
    def model_sources(self) -> Sequence[Drafter]:
        return tuple(s for m in self.models for s in m.model_sources)

    @property
    def _followers(self) -> tuple[Drafter, ...]:
        return (*self.models, self.lookup)

    def place_images(self, seq: int, images: Sequence[PromptImage]) -> None:
        for source in self._followers:
            source.place_images(seq, images)

    def begin(self, seq: int, prompt: Sequence[int], sampler: Sampler | None = None,
              features: Features | None = None) -> None:
        for source in self._followers:
            source.begin(seq, prompt, sampler, features)

    def offer(self, seq: int, last: int, pos: int, n_max: int) -> Proposal:
        # verified greedily even when sampling: exact for any fixed draft
        return self.lookup.offer(seq, last, pos, n_max)

    def propose(self, requests: Sequence[DraftRequest],
                on_pass: PassObserver | None = None) -> list[Proposal]:
        """The first model source's proposals (a round names its source and asks it)."""
        return self.models[0].propose(requests, on_pass)

    @contextmanager
    def batched_updates(self) -> Iterator[None]:
        with ExitStack() as stack:
            for source in self.models:
                stack.enter_context(source.batched_updates())
            yield

    def accept(self, seq: int, n_accepted: int) -> None:
        for source in self.models:
            source.accept(seq, n_accepted)

    def process(self, seq: int, tokens: Sequence[int],
                features: Features | None = None) -> None:
        for source in self._followers:
            source.process(seq, tokens, features)

    def end(self, seq: int) -> None:
        for source in self._followers:
            source.end(seq)
