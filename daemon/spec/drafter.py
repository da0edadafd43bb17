"""The drafter interface: what a drafter declares, proposes and is told.

A round for a batch of sequences (spec/round.py), with `last` each one's newest token (at
position `pos`, not yet evaluated by the target):

    offers = drafter.offers(seq, last, pos, n_max)     # free proposals, the policy
                                                       # picks one (pick_offer)
    proposals = source.propose([DraftRequest(seq, last, pos, n, params), ...])
      # or a model's proposals, for every sequence drafting with that source (one of
      # `model_sources`) at once: a pass per draft step for those still drafting
    ... the target verifies each [last, *proposal.tokens], all in one pass ...
    drafter.accept(seq, n_accepted)                    # roll back rejected drafts
    drafter.process(seq, emitted, features)            # tokens the sequence grew by

`begin(seq, prompt, sampler, features)` starts a sequence (the prompt is already evaluated
by the target; a draft model leaves its own pass over it to its first draft,
`pending_rows`); `end(seq)` frees it. A proposal carries what verification needs (tokens,
q rows) apart from what the draft-length policy learns from it (`DraftEvidence`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field, replace

import numpy as np

from specd.daemon.text.grammar import GrammarState

from .media import PromptImage
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
    # most tokens a free offer (prompt lookup, history) drafts per round: making one costs
    # nothing, so only its verification limits it (the policy prices that); n_max where
    # that is more (`free_limit`)
    free_max: int = 32
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
        if self.free_max < 0:
            raise ValueError(f"free_max must be >= 0, got {self.free_max}")
        return self

    @property
    def free_limit(self) -> int:
        """Most tokens a round may verify of a free offer (0: drafting is off)."""
        return 0 if self.n_max <= 0 else max(self.n_max, self.free_max)


@dataclass(frozen=True)
class DraftEvidence:
    """What a proposal teaches the draft-length policy; verification never reads it."""

    # > 0: found by a free source (no model ran), continuing a context n-gram this long
    lookup_match: int = 0
    # the free source that found it: "" prompt lookup, else its name ("history"); the
    # policy keeps each source's acceptance apart
    lookup_source: str = ""
    # seconds of each proposal step, if the drafter timed them (the first step also feeds
    # the tokens the draft had not seen yet)
    step_seconds: tuple[float, ...] = ()
    # the call first evaluated tokens skipped while the target decoded alone, so its time
    # is not what a steady round costs
    includes_catch_up: bool = False
    # rows of the prompt the call evaluated first (a draft model's first draft), so its
    # time is not what a catch-up of skipped tokens costs either
    prompt_rows: int = 0
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
    # what proposing cost this sequence: its calls' shares of the passes it took part in,
    # and its own work between them
    seconds: float = 0.0

    @property
    def is_lookup(self) -> bool:
        """Found in the context (prompt lookup): no model ran."""
        return self.evidence.lookup_match > 0

    def truncate(self, n: int) -> Proposal:
        """Drop drafts past n, with their q rows."""
        return replace(self, tokens=self.tokens[:n],
                       q_rows=None if self.q_rows is None else self.q_rows[:n])


@dataclass(frozen=True)
class DraftRequest:
    """One sequence's draft to propose: up to n_max tokens to follow `last` (at position
    `pos`, not yet evaluated by the target). `grammar` is a fork of the request's
    constraint state, the drafter's to advance along its proposal (model drafters sample
    under its masks)."""

    seq: int
    last: int
    pos: int
    n_max: int
    params: DraftParams = DraftParams()
    grammar: GrammarState | None = None


# told each pass a drafter runs for a batch: (rows it carried, seconds it took)
PassObserver = Callable[[int, float], None]


class Drafter(ABC):
    """One kind of draft. What it is, it declares in its class attributes; the round
    reads them instead of asking which class it is."""

    name: str = "none"
    #: `propose()` runs a model (a pass per proposal step, which the policy weighs against
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
    #: `propose()` proposes all of a sequence's tokens in one pass (a head's block), whose
    #: cost grows with the block's length far less than a step per token
    one_pass: bool = False

    @property
    def model_sources(self) -> Sequence[Drafter]:
        """The drafters a round may draft with (`propose`), one per round, the policy
        choosing (`RoundPlan.source`): this one, or those a drafter of several sources
        holds (a head and a draft model). Each declares its own `catch_up` and
        `one_pass`; sequences drafting with the same source share its passes."""
        return (self,)

    def place_images(self, seq: int, images: Sequence[PromptImage]) -> None:
        """The images of the prompt the next `begin` of `seq` gives (at its placeholders):
        a drafter whose model rotates by M-RoPE positions places the text after them as
        the target does (media.mrope_positions); a DFlash head of an M-RoPE target skips
        their rows (media.pinned_rows, llama.cpp's rule). Called only for prompts with
        images."""

    def begin(self, seq: int, prompt: Sequence[int], sampler: Sampler | None = None,
              features: Features | None = None) -> None:
        """A new sequence whose prompt the target has evaluated (`features`: the target's
        hidden states of the prompt's tokens, for drafters that declare target layers)."""

    def pending_rows(self, seq: int) -> int:
        """Rows of the sequence's context the drafter has not evaluated and will before its
        next draft, beyond the skipped tokens the policy counts (`catch_up`): a draft
        model's prompt, left for its first draft. The step planner prices them as that
        draft's catch-up."""
        return 0

    def offer(self, seq: int, last: int, pos: int, n_max: int) -> Proposal | None:
        """A proposal found without running a model (prompt lookup), offered before the
        round decides how to draft; None: the drafter has no free source."""
        return None

    def offers(self, seq: int, last: int, pos: int, n_max: int) -> list[Proposal]:
        """Every free source's proposal (`offer`'s, and those of sources put in front of
        the drafter: history); the round's policy picks one (`DraftPolicy.pick_offer`).
        Empty: the drafter has no free source."""
        offer = self.offer(seq, last, pos, n_max)
        return [] if offer is None else [offer]

    @abstractmethod
    def propose(self, requests: Sequence[DraftRequest],
                on_pass: PassObserver | None = None) -> list[Proposal]:
        """A proposal for each request, in order. A model drafter steps the batch together:
        one pass of its model per draft step, for the sequences still drafting (each pass
        told to `on_pass`)."""

    def draft(self, seq: int, last: int, pos: int, n_max: int,
              params: DraftParams = DraftParams(),
              grammar: GrammarState | None = None) -> Proposal:
        """One sequence's proposal of up to n_max tokens to follow `last`."""
        return self.propose([DraftRequest(seq, last, pos, n_max, params, grammar)])[0]

    def batched_updates(self) -> AbstractContextManager[None]:
        """While open, what `begin` and `process` compute for several sequences may wait
        and run in one pass when it closes (a head's injections): the round opens it
        around the rounds it completes together."""
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


class PerSequenceDrafter(Drafter):
    """A drafter without a model pass to share: each request proposed on its own."""

    def propose(self, requests: Sequence[DraftRequest],
                on_pass: PassObserver | None = None) -> list[Proposal]:
        return [self.propose_one(r) for r in requests]

    @abstractmethod
    def propose_one(self, request: DraftRequest) -> Proposal:
        """The request's proposal."""
