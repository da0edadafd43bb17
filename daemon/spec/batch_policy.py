"""The draft plan of a step that several sequences share: how many tokens each may draft.

In a step every decoding sequence's rows go through one target pass, and a draft model's
steps run for the drafting sequences together, each step a pass: the step lasts the draft
chain it waits for (the longest draft, at the cost of a pass over the drafting sequences
per step; one pass for a head that proposes a block) plus the target pass over all its
rows. Each sequence's own policy prices its rounds at its share of the passes, which is
not what its draft costs the others. So the step is planned as a whole, to maximise the
tokens it emits per second:

    rate(L, n) = sum_i E_i(n_i) / (chain(L, drafting) + verify(sum_i (n_i + 1)))

over the chain length L and each sequence's n_i <= L (or a lookup's length, which needs no
chain): for each L, each sequence keeps the n_i that adds more tokens than its rows and
its place in the chain cost at the rate found so far (Dinkelbach's iteration of a ratio),
and the best L wins. A sequence whose draft does not pay at this concurrency verifies
nothing extra. E_i comes from the sequence's own policy (its acceptance estimates); the
costs are measured here, a pass at a time, at the sizes the step runs.

Each sequence's round then drafts as the step's plan says (its policy still learns from
it). While the plan drafts nothing, every `explore_every` steps one sequence that can
draft, in turn, probes PROBE_LENGTH tokens from its source, so that its acceptance
estimates go on being tested at a bounded cost to the others.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from .policy import PROBE_LENGTH, CostLine, RoundPlan

DECAY = 0.98  # weight kept by older pass timings at each new one
DINKELBACH_ROUNDS = 4  # iterations of the rate each L's choices are made at
START_MARGIN = 1.03  # drafting must be predicted this much faster than no drafting


@dataclass(frozen=True)
class Outlook:
    """What a decoding sequence's draft could bring this step: expected tokens emitted
    (its accepted drafts and the target's own) for each draft length."""

    # E(n) for n = 0..len - 1 drafted by its model source (E(0) = 1)
    model: Sequence[float]
    # that source's drafter (the sequences drafting with one share its passes)
    drafter: object
    # that source (an index into the drafter's model_sources)
    source: int = 0
    # the source proposes a block in one pass (a head), not a pass per token
    one_pass: bool = False
    # E(m) for m = 0..len - 1 tokens of a free lookup offer (none: no offer)
    lookup: Sequence[float] = ()


@dataclass
class _Choice:
    n: int = 0
    lookup: bool = False


@dataclass
class StepCosts:
    """Measured seconds: the step's target pass (and its verification) against its rows,
    and each draft source's pass against its rows (a steady draft step: one a sequence; a
    head's block: the block's; a catch-up: the skipped tokens too)."""

    verify: CostLine = field(default_factory=lambda: CostLine(DECAY))
    draft: dict[int, CostLine] = field(default_factory=dict)  # id(drafter) -> its passes

    def observe_verify(self, rows: int, seconds: float) -> None:
        self.verify.add(rows, seconds)

    def observe_draft(self, drafter: object, rows: int, seconds: float) -> None:
        self.draft.setdefault(id(drafter), CostLine(DECAY)).add(rows, seconds)

    def draft_pass(self, drafter: object, rows: int) -> float | None:
        line = self.draft.get(id(drafter))
        return None if line is None else line.at(rows)


class BatchDraftPlanner:
    """Plans each decoding sequence's draft for a step they share (module doc)."""

    def __init__(self, explore_every: int = 32):
        self.costs = StepCosts()
        self.explore_every = explore_every
        self._idle_steps = 0  # steps in a row planned with no draft
        self._turn = 0  # the sequence whose turn it is to explore

    def plans(self, outlooks: Sequence[Outlook]) -> list[RoundPlan] | None:
        """Each sequence's round this step (None: no plan; each sequence's own policy
        plans its round, as a sequence alone does)."""
        if len(outlooks) < 2 or self.costs.verify.at(len(outlooks)) is None:
            return None
        if any(o.model[1:] and self.costs.draft_pass(o.drafter, 1) is None for o in outlooks):
            return None  # a draft source not timed yet: its sequences' own choices time it
        choices, _ = self.plan(outlooks)
        plans = [RoundPlan(c.n, take_offer=c.lookup, source=o.source)
                 for o, c in zip(outlooks, choices, strict=True)]
        if any(c.n for c in choices):
            self._idle_steps = 0
            return plans
        self._idle_steps += 1
        drafting = [i for i, o in enumerate(outlooks) if len(o.model) > 1]
        if self._idle_steps >= self.explore_every and drafting:
            self._idle_steps = 0
            self._turn += 1
            i = drafting[self._turn % len(drafting)]
            n = min(PROBE_LENGTH, len(outlooks[i].model) - 1)
            plans[i] = RoundPlan(n, source=outlooks[i].source)
        return plans

    def plan(self, outlooks: Sequence[Outlook]) -> tuple[list[_Choice], float]:
        """The best choices and their predicted tokens per second: plain steps for all
        unless drafting is predicted START_MARGIN faster."""
        longest = max(len(o.model) for o in outlooks) - 1
        best = [_Choice() for _ in outlooks]
        best_rate = len(outlooks) / self._verify_cost(len(outlooks))
        if not any(self._may_pay(o, best_rate) for o in outlooks):
            return best, best_rate  # no plan that drafts beats plain steps
        threshold = best_rate * START_MARGIN
        for chain in range(0, longest + 1):
            rate = best_rate
            for _ in range(DINKELBACH_ROUNDS):
                choices = [self._choose(o, chain, rate) for o in outlooks]
                new_rate = self._rate(outlooks, choices)
                if new_rate <= rate * (1 + 1e-9):
                    break
                rate = new_rate
            if rate > max(best_rate, threshold):
                best, best_rate = choices, rate
        return best, best_rate

    def _choose(self, o: Outlook, chain: int, rate: float) -> _Choice:
        """The sequence's draft that adds the most tokens beyond what its extra rows and
        its place in the chain cost at `rate` tokens per second."""
        per_row = self._verify_slope()
        best, best_gain = _Choice(), 0.0
        for m in range(1, len(o.lookup)):
            gain = _gain(o.lookup[m], rate, per_row * m)
            if gain > best_gain:
                best, best_gain = _Choice(m, lookup=True), gain
        if chain:
            seat = self._seat_cost(o, chain)
            for n in range(1, min(chain, len(o.model) - 1) + 1):
                gain = _gain(o.model[n], rate, per_row * n + seat)
                if gain > best_gain:
                    best, best_gain = _Choice(n), gain
        return best

    def _may_pay(self, o: Outlook, rate: float) -> bool:
        """Whether some draft of the sequence adds tokens at `rate`, each length in the
        shortest chain that carries it (a longer chain's seat costs more): where none of
        the sequences' do, every choice at `rate` is a plain step, and so is the plan."""
        per_row = self._verify_slope()
        return (any(_gain(o.lookup[m], rate, per_row * m) > 0 for m in range(1, len(o.lookup)))
                or any(_gain(o.model[n], rate, per_row * n + self._seat_cost(o, n)) > 0
                       for n in range(1, len(o.model))))

    def _rate(self, outlooks: Sequence[Outlook], choices: Sequence[_Choice]) -> float:
        """Predicted tokens per second of a step with these choices."""
        tokens = 0.0
        rows = 0
        drafting: dict[int, tuple[Outlook, int, int]] = {}  # drafter -> (one, count, chain)
        for o, c in zip(outlooks, choices, strict=True):
            tokens += (o.lookup if c.lookup else o.model)[c.n]
            rows += c.n + 1
            if c.n and not c.lookup:
                _, count, chain = drafting.get(id(o.drafter), (o, 0, 0))
                drafting[id(o.drafter)] = (o, count + 1, max(chain, c.n))
        seconds = self._verify_cost(rows)
        for o, count, chain in drafting.values():
            seconds += self._chain_cost(o, count, chain)
        return tokens / seconds

    def _chain_cost(self, o: Outlook, count: int, chain: int) -> float:
        """Seconds of `count` sequences' drafts of up to `chain` tokens from o's source: a
        pass a token of a row each, or one pass of their blocks (a head's)."""
        if o.one_pass:
            return self.costs.draft_pass(o.drafter, count * (chain + 1)) or 0.0
        return (self.costs.draft_pass(o.drafter, count) or 0.0) * chain

    def _seat_cost(self, o: Outlook, chain: int) -> float:
        """What one more sequence in the draft chain adds to it: its share of the passes'
        growth with their sequences."""
        return max(self._chain_cost(o, 2, chain) - self._chain_cost(o, 1, chain), 0.0)

    def _verify_cost(self, rows: int) -> float:
        cost = self.costs.verify.at(rows)
        assert cost is not None
        return cost

    def _verify_slope(self) -> float:
        """Seconds a verified row adds to the target pass, near the step's sizes."""
        line = self.costs.verify
        lo = min(line.at_size) if line.at_size else 1
        return max(self._verify_cost(lo + 8) - self._verify_cost(lo), 0.0) / 8


def _gain(expected: float, rate: float, seconds: float) -> float:
    """Tokens a draft adds beyond the plain step's one, less what its `seconds` are worth
    at `rate` tokens per second."""
    return expected - 1.0 - rate * seconds
