"""The draft plan of a step that several sequences share: how many tokens each may draft.

In a step every decoding sequence's rows go through one target pass, and a draft model's
steps run for the drafting sequences together, each step a pass: the step lasts the draft
chain it waits for plus the target pass over all its rows. A draft model's chain is a
first pass over what each drafting sequence's cache lacks (its last token, and after plain
steps the skipped tokens it catches up on, `Outlook.catch_up`), then a pass per draft
token over the sequences still drafting, each pass priced at its rows; a head that
proposes a block runs one pass over the blocks. A catch-up buys the drafts of every later
step: a plan is weighed with each catch-up spread over the steps its sequence has left
(whole where they are unknown), its forecast with the whole. Each sequence's own
policy prices its rounds at its share of the passes, which is not what its draft costs
the others. So the step is planned as a whole, to maximise the
tokens it emits per second:

    rate(L, n) = sum_i E_i(n_i) / (chain(L, drafting) + verify(sum_i (n_i + 1)))

over the chain length L and each sequence's n_i <= L (or a lookup's length, which needs no
chain): for each L, each sequence keeps the n_i that adds more tokens than its rows and
its place in the chain cost at the rate found so far (Dinkelbach's iteration of a ratio),
and the best L wins. A sequence whose draft does not pay at this concurrency verifies
nothing extra. E_i comes from the sequence's own policy (its acceptance estimates); the
costs are measured here, a pass at a time, at the sizes the step runs.

Where each sequence's remaining tokens are known (its budget: an upper bound where it may
end sooner), a plan must also not delay the batch's end: `StepCosts.time_to_go` predicts
when the last sequence is done, the sequences decoding together, each at the pace measured
for as many as are left (a plain step's where none was measured). A plan whose step does
not bring that end END_MARGIN nearer, per second it takes, than a plain step does (one
stream's long offer verified in a wide pass while the others, as far from done, wait for
it) gives way to the plan of the search with each sequence's tokens weighed by what a
token more of it brings to that end (`_token_values`), if that one does, else to plain
steps. A draft that lets a stream finish, after which the others decode faster, is kept.

Each sequence's round then drafts as the step's plan says (its policy still learns from
it). While the plan drafts nothing, every `explore_every` steps one sequence that can
draft, in turn, probes PROBE_LENGTH tokens from its source, so that its acceptance
estimates go on being tested at a bounded cost to the others: a probe whose draft chain
(its catch-up on skipped tokens included) costs more than PROBE_SHARE of the plain steps
between probes waits for one that does not.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from .policy import PROBE_LENGTH, CostLine, ExpertPricing, RoundPlan

DECAY = 0.98  # weight kept by older pass timings at each new one
DINKELBACH_ROUNDS = 4  # iterations of the rate each L's choices are made at
START_MARGIN = 1.03  # drafting must be predicted this much faster than no drafting
# where budgets are known, a plan must bring the batch's end this much nearer per second
# than a plain step does (the end's forecast is rough: a near tie is held to plain steps)
END_MARGIN = 1.1
PACE_EVIDENCE = 3.0  # discounted steps at a concurrency before its measured pace is used
# a probe's draft chain may cost at most this share of the plain steps between probes
PROBE_SHARE = 0.01


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
    # rows the source evaluates before drafting: tokens emitted since it last ran (a draft
    # model's catch-up after plain steps) and the rows it left pending (its prompt, before
    # its first draft: Drafter.pending_rows)
    catch_up: int = 0
    # most tokens the sequence may still emit (None: not known)
    remaining: int | None = None


@dataclass(frozen=True)
class StepForecast:
    """What the planner predicted for the step it planned: tokens emitted, and the
    seconds of its draft chains and of its target pass (for the round's debug log)."""

    tokens: float
    draft_s: float
    verify_s: float
    drafts: tuple[tuple[int, bool], ...]  # each sequence's (n, from the lookup offer)
    # the draft seconds the step is charged: its catch-ups at their share (_catch_up_share)
    charged_s: float = 0.0

    @property
    def seconds(self) -> float:
        """What the step is predicted to take."""
        return self.draft_s + self.verify_s

    @property
    def charged(self) -> float:
        """What the step is charged: the seconds its plan is weighed at."""
        return self.charged_s + self.verify_s


@dataclass
class _Choice:
    n: int = 0
    lookup: bool = False


@dataclass
class StepCosts:
    """Measured seconds: the step's target pass (and its verification) against its rows,
    and each draft source's pass against its rows (a steady draft step: one a sequence; a
    head's block: the block's; a catch-up: the skipped tokens too). A mixture-of-experts
    target's pass is priced by the experts its rows wake, once that is fitted: its cost
    grows with the experts read, which grow ever more slowly with the rows."""

    verify: CostLine = field(default_factory=lambda: CostLine(DECAY))
    experts: ExpertPricing = field(default_factory=lambda: ExpertPricing(DECAY))
    draft: dict[int, CostLine] = field(default_factory=dict)  # id(drafter) -> its passes
    # decoding sequences -> [weight, sum of seconds per token each waited] (observe_pace)
    pace: dict[int, list[float]] = field(default_factory=dict)
    # the lines' answers since the last observation ((0, rows): the target pass), as a
    # plan asks for the same sizes many times
    _asked: dict[tuple[int, int], float | None] = field(default_factory=dict)

    def observe_verify(self, rows: int, seconds: float, experts: float = 0.0) -> None:
        """A step's target pass: its rows, seconds and (MoE) distinct experts woken."""
        self.verify.add(rows, seconds)
        if experts > 0:
            self.experts.add(rows, round(experts), seconds)
        self._asked.clear()

    def observe_draft(self, drafter: object, rows: int, seconds: float) -> None:
        self.draft.setdefault(id(drafter), CostLine(DECAY)).add(rows, seconds)
        self._asked.clear()

    def verify_pass(self, rows: int) -> float | None:
        key = (0, rows)
        if key not in self._asked:
            by_experts = self.experts.verify_cost(rows)
            self._asked[key] = self.verify.at(rows) if by_experts is None else by_experts
        return self._asked[key]

    def draft_pass(self, drafter: object, rows: int) -> float | None:
        key = (id(drafter), rows)
        if key not in self._asked:
            line = self.draft.get(id(drafter))
            self._asked[key] = None if line is None else line.at(rows)
        return self._asked[key]

    def observe_pace(self, active: int, tokens: int, seconds: float) -> None:
        """A decoding step of `active` sequences emitted `tokens` in `seconds` (its drafts
        and its target pass): plain rows and model drafts only, the pace the batch keeps
        (a free offer's tokens come once)."""
        if tokens <= 0:
            return
        for acc in self.pace.values():
            acc[0] *= DECAY
            acc[1] *= DECAY
        acc = self.pace.setdefault(active, [0.0, 0.0])
        acc[0] += 1.0
        acc[1] += seconds * active / tokens

    def seconds_per_token(self, active: int) -> float | None:
        """Seconds each of `active` sequences decoding together waits for a token: as
        measured at that many, else a plain step's (None: no pass timed yet)."""
        acc = self.pace.get(active)
        if acc is not None and acc[0] >= PACE_EVIDENCE:
            return acc[1] / acc[0]
        return self.verify_pass(active)

    def time_to_go(self, remaining: Sequence[float]) -> float:
        """Predicted seconds until the last of these sequences (tokens each has left) is
        done: they decode together, each at the pace measured for as many as are left."""
        left = sorted(r for r in remaining if r > 0)
        seconds = done = 0.0
        for j, r in enumerate(left):
            seconds += (r - done) * (self.seconds_per_token(len(left) - j) or 0.0)
            done = r
        return seconds


class BatchDraftPlanner:
    """Plans each decoding sequence's draft for a step they share (module doc)."""

    def __init__(self, explore_every: int = 32):
        self.costs = StepCosts()
        self.explore_every = explore_every
        self._idle_steps = 0  # steps in a row planned with no draft
        self._turn = 0  # the sequence whose turn it is to explore
        self.forecast: StepForecast | None = None  # the last plan's prediction
        # what a plan asks many times, computed once a plan (the costs do not change
        # while it searches): each (outlook, n)'s seat cost, the verify slope
        self._seats: dict[tuple[int, int], float] = {}
        self._slope: float | None = None

    def plans(self, outlooks: Sequence[Outlook]) -> list[RoundPlan] | None:
        """Each sequence's round this step (None: no plan; each sequence's own policy
        plans its round, as a sequence alone does)."""
        self.forecast = None
        if len(outlooks) < 2 or self.costs.verify_pass(len(outlooks)) is None:
            return None
        if any(o.model[1:] and self.costs.draft_pass(o.drafter, 1) is None for o in outlooks):
            return None  # a draft source not timed yet: its sequences' own choices time it
        choices, _ = self.plan(outlooks)
        plans = [RoundPlan(c.n, take_offer=c.lookup, source=o.source)
                 for o, c in zip(outlooks, choices, strict=True)]
        if any(c.n for c in choices):
            self._idle_steps = 0
            self.forecast = self.forecast_of(outlooks, choices)
            return plans
        self._idle_steps += 1
        if self._idle_steps >= self.explore_every:
            probe = self._probe(outlooks)
            if probe is not None:
                self._idle_steps = 0
                i, n = probe
                plans[i] = RoundPlan(n, source=outlooks[i].source)
                choices[i] = _Choice(n)
        self.forecast = self.forecast_of(outlooks, choices)
        return plans

    def _probe(self, outlooks: Sequence[Outlook]) -> tuple[int, int] | None:
        """The next sequence in turn that can draft and whose probe of PROBE_LENGTH tokens
        (its catch-up included) costs at most PROBE_SHARE of the plain steps between
        probes, and that length (None: none can; a probe that re-reads a long skipped
        context costs the others several steps, more than its evidence is worth)."""
        drafting = [i for i, o in enumerate(outlooks) if len(o.model) > 1]
        bound = self._verify_cost(len(outlooks)) * self.explore_every * PROBE_SHARE
        for k in range(1, len(drafting) + 1):
            i = drafting[(self._turn + k) % len(drafting)]
            n = min(PROBE_LENGTH, len(outlooks[i].model) - 1)
            if self._chain_cost([(outlooks[i], n)])[0] <= bound:
                self._turn += k
                return i, n
        return None

    def plan(self, outlooks: Sequence[Outlook]) -> tuple[list[_Choice], float]:
        """The best choices and their predicted tokens per second: plain steps for all
        unless drafting is predicted START_MARGIN faster; where the sequences' remaining
        tokens are known, a plan that would not bring the last of them END_MARGIN nearer
        to its end than a plain step does gives way to the plan that brings it soonest,
        if that one does (module doc)."""
        self._seats.clear()
        self._slope = None
        ones = [1.0] * len(outlooks)
        best = self._search(outlooks, ones)
        remaining = _remaining(outlooks)
        if remaining is None or not any(c.n for c in best):
            return best, self._rate(outlooks, best, ones)
        plain = [_Choice() for _ in outlooks]
        at_plain = self._sooner(outlooks, plain, remaining)
        if self._sooner(outlooks, best, remaining) < at_plain * END_MARGIN:
            valued = self._search(outlooks, self._token_values(outlooks, remaining))
            drafts = any(c.n for c in valued)
            best = valued if drafts and self._sooner(
                outlooks, valued, remaining) > at_plain * END_MARGIN else plain
        return best, self._rate(outlooks, best, ones)

    def _search(self, outlooks: Sequence[Outlook], weights: Sequence[float]
                ) -> list[_Choice]:
        """The choices of most weighted tokens per second (sum of weight * tokens over
        the step's seconds): for each chain length, Dinkelbach's iteration of each
        sequence's choice; plain steps unless drafting is START_MARGIN faster."""
        longest = max(len(o.model) for o in outlooks) - 1
        best = [_Choice() for _ in outlooks]
        best_rate = self._rate(outlooks, best, weights)
        if not any(self._may_pay(o, w, best_rate) for o, w in zip(outlooks, weights,
                                                                    strict=True)):
            return best  # no plan that drafts beats plain steps
        threshold = best_rate * START_MARGIN
        # a higher rate never lengthens a sequence's choice: no chain longer than the
        # longest model draft chosen at the plain rate changes anything
        longest = max(self._choose(o, w, longest, best_rate, offer=False).n
                      for o, w in zip(outlooks, weights, strict=True))
        for chain in range(0, longest + 1):
            rate = best_rate
            choices = best
            for _ in range(DINKELBACH_ROUNDS):
                new = [self._choose(o, w, chain, rate)
                       for o, w in zip(outlooks, weights, strict=True)]
                new_rate = self._rate(outlooks, new, weights)
                if new_rate <= rate * (1 + 1e-9):
                    break
                choices, rate = new, new_rate
            if rate > max(best_rate, threshold):
                best, best_rate = choices, rate
        return best

    def _token_values(self, outlooks: Sequence[Outlook], remaining: Sequence[float]
                      ) -> list[float]:
        """Seconds sooner the batch's last sequence is done for a token more of each
        sequence: those within a draft of the most remaining share what a token of each
        of them brings; one done before them, what its leaving sooner saves the steps
        after it."""
        reach = max(max(len(o.model), len(o.lookup)) for o in outlooks) - 1
        top = max(remaining)
        last = [r >= top - reach for r in remaining]
        now = self.costs.time_to_go(remaining)
        together = now - self.costs.time_to_go(
            [r - 1 if is_last else r for r, is_last in zip(remaining, last, strict=True)])
        values = [together / sum(last) if is_last else
                  now - self.costs.time_to_go([*remaining[:i], r - 1, *remaining[i + 1:]])
                  for i, (r, is_last) in enumerate(zip(remaining, last, strict=True))]
        return [max(v, 1e-9) for v in values]

    def _sooner(self, outlooks: Sequence[Outlook], choices: Sequence[_Choice],
                remaining: Sequence[float]) -> float:
        """Seconds sooner the last sequence is predicted done, per second the step with
        these choices takes (plain steps: about 1)."""
        after = [r - _expected(o, c) for o, c, r in zip(outlooks, choices, remaining,
                                                          strict=True)]
        gained = self.costs.time_to_go(remaining) - self.costs.time_to_go(after)
        return gained / self.forecast_of(outlooks, choices).charged

    def _choose(self, o: Outlook, weight: float, chain: int, rate: float,
                offer: bool = True) -> _Choice:
        """The sequence's draft that adds the most weighted tokens beyond what its extra
        rows and its place in the chain cost at `rate` (a plain step where none adds
        any; `offer`: its free offer is one of the choices)."""
        per_row = self._verify_slope()
        best, best_gain = _Choice(), 0.0
        for m in range(1, len(o.lookup) if offer else 0):
            gain = _gain(weight, o.lookup[m], rate, per_row * m)
            if gain > best_gain:
                best, best_gain = _Choice(m, lookup=True), gain
        for n in range(1, min(chain, len(o.model) - 1) + 1):
            gain = _gain(weight, o.model[n], rate, per_row * n + self._seat_cost(o, n))
            if gain > best_gain:
                best, best_gain = _Choice(n), gain
        return best

    def _may_pay(self, o: Outlook, weight: float, rate: float) -> bool:
        """Whether some draft of the sequence adds weighted tokens at `rate`, each length
        in the shortest chain that carries it (a longer chain's seat costs more): where
        none of the sequences' do, every choice at `rate` is a plain step, and so is the
        plan."""
        return self._choose(o, weight, len(o.model) - 1, rate).n > 0

    def _rate(self, outlooks: Sequence[Outlook], choices: Sequence[_Choice],
              weights: Sequence[float]) -> float:
        """Predicted weighted tokens per second of a step with these choices."""
        f = self.forecast_of(outlooks, choices)
        return sum(w * _expected(o, c) for o, c, w in zip(outlooks, choices, weights,
                                                          strict=True)) / f.charged

    def forecast_of(self, outlooks: Sequence[Outlook], choices: Sequence[_Choice]
                    ) -> StepForecast:
        """Predicted tokens and seconds of a step with these choices: the target pass over
        every row, and each draft source's chain for the sequences drafting with it (its
        catch-ups whole, and at the share the step is charged)."""
        tokens = 0.0
        rows = 0
        drafting: dict[int, list[tuple[Outlook, int]]] = {}  # drafter -> its drafts
        for o, c in zip(outlooks, choices, strict=True):
            tokens += _expected(o, c)
            rows += c.n + 1
            if c.n and not c.lookup:
                drafting.setdefault(id(o.drafter), []).append((o, c.n))
        draft = charged = 0.0
        for group in drafting.values():
            whole, catch_up = self._chain_cost(group)
            draft += whole
            charged += whole - catch_up * (1.0 - _catch_up_share(group))
        return StepForecast(tokens, draft, self._verify_cost(rows),
                            tuple((c.n, c.lookup) for c in choices), charged)

    def _chain_cost(self, group: Sequence[tuple[Outlook, int]]) -> tuple[float, float]:
        """Seconds of one source's drafts, (outlook, tokens) each, and the part of them its
        catch-ups add: a head's blocks in one pass; a draft model's first pass over every
        sequence's catch-up and last token, then a pass a token over the sequences still
        drafting."""
        o = group[0][0]
        if o.one_pass:
            return self.costs.draft_pass(o.drafter, sum(n + 1 for _, n in group)) or 0.0, 0.0
        first = self.costs.draft_pass(o.drafter, len(group)) or 0.0
        caught_up = self.costs.draft_pass(o.drafter, sum(1 + g.catch_up for g, _ in group))
        catch_up = max((caught_up or 0.0) - first, 0.0)
        seconds = first + catch_up
        for step in range(2, max(n for _, n in group) + 1):
            seconds += self.costs.draft_pass(o.drafter,
                                             sum(n >= step for _, n in group)) or 0.0
        return seconds, catch_up

    def _seat_cost(self, o: Outlook, n: int) -> float:
        """What the sequence's draft of n tokens adds to a chain that another sequence's
        draft of n already runs: its rows in each of the passes (its catch-up in the
        first, at the share the step is charged)."""
        key = (id(o), n)
        if key not in self._seats:
            self._seats[key] = self._seat_cost_of(o, n)
        return self._seats[key]

    def _seat_cost_of(self, o: Outlook, n: int) -> float:
        def grown(rows: int, by: int) -> float:
            return ((self.costs.draft_pass(o.drafter, rows + by) or 0.0)
                    - (self.costs.draft_pass(o.drafter, rows) or 0.0))

        if o.one_pass:
            return max(grown(n + 1, n + 1), 0.0)
        catch_up = max(grown(2, o.catch_up), 0.0) * _catch_up_share([(o, n)])
        return max(grown(1, 1) * n + catch_up, 0.0)

    def _verify_cost(self, rows: int) -> float:
        cost = self.costs.verify_pass(rows)
        assert cost is not None
        return cost

    def _verify_slope(self) -> float:
        """Seconds a verified row adds to the target pass, near the step's sizes."""
        if self._slope is None:
            line = self.costs.verify
            lo = min(line.at_size) if line.at_size else 1
            self._slope = max(self._verify_cost(lo + 8) - self._verify_cost(lo), 0.0) / 8
        return self._slope


def _catch_up_share(group: Sequence[tuple[Outlook, int]]) -> float:
    """The share of the drafting sequences' catch-ups a step is charged: a catch-up buys
    the drafts of every later step, so each sequence's is spread over the steps it has
    left at this draft's pace (whole where its remaining tokens are unknown), weighted by
    its skipped tokens."""
    skipped = sum(o.catch_up for o, _ in group)
    if not skipped:
        return 1.0
    return sum(o.catch_up * (1.0 if o.remaining is None
                             else min(1.0, o.model[n] / max(o.remaining, 1)))
               for o, n in group) / skipped


def _remaining(outlooks: Sequence[Outlook]) -> list[float] | None:
    """Tokens each sequence has left (one whose budget is unknown: the most any has;
    None: none is known)."""
    known = [o.remaining for o in outlooks if o.remaining is not None]
    if not known:
        return None
    return [float(max(known) if o.remaining is None else o.remaining) for o in outlooks]


def _expected(o: Outlook, c: _Choice) -> float:
    """Tokens the sequence is expected to emit with this choice."""
    return (o.lookup if c.lookup else o.model)[c.n]


def _gain(weight: float, expected: float, rate: float, seconds: float) -> float:
    """Tokens a draft adds beyond the plain step's one, at `weight` each, less what its
    `seconds` are worth at `rate`."""
    return weight * expected - weight - rate * seconds
