"""The draft-length policy: how many tokens each round drafts, and from which source.

The round asks the policy for a `RoundPlan` before anything runs and reports one
`RoundRecord` after it. `FixedDraftLength` drafts n_max every round (a free offer first,
where the drafter has one). `AdaptiveDraftLength` chooses n to maximise the predicted
tokens per second, E(n) / T(n), from measured acceptance and measured costs:

    E(n) = 1 + sum_{i=1..n} prod_{j<=i} a_j      (a_j: acceptance at draft position j)
    T(n) = t_draft(n) + t_verify(n + 1) + the round's other time

n = 0 (a plain target step) wins unless drafting is predicted clearly faster, with budgeted
probe rounds so that estimates recover; a free lookup offer is weighed against the model's
best length and a plain step, with acceptance kept per lookup match length. A drafter with
several model sources (a head and a draft model) has each one's acceptance and costs kept
apart, and each round drafts from the one predicted fastest, the others probed now and
then. A request may start from what an earlier one of the same drafter learned
(`PolicyMemory`): the machine's costs, and its acceptance as a few observations. The
reasoning behind each rule is in docs/adaptive-policy.md.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from .drafter import DraftEvidence, Proposal
from .verify import acceptance_probability, to_width

PRIOR_WEIGHT = 2.0  # pseudo-observations of the prior at each draft position
DRAFT_COST_RATE = 0.1  # weight of each new draft timing (a ~10-observation memory)
LOOKUP_PRIOR = 0.5  # acceptance assumed for lookup proposals before any was verified
# ... for matches up to this long; a longer match (history's, up to 32 tokens) is assumed
# likelier to go on: 1 - (1 - LOOKUP_PRIOR) * LOOKUP_PRIOR_MATCH / match
LOOKUP_PRIOR_MATCH = 4
MIN_EVIDENCE = 8.0  # (discounted) trials at draft position 1 before probes cost budget
# ... before a free source's offer at a match length is weighed by its estimate alone (an
# offer with fewer is tried where it is the longest); at most CARRIED_WEIGHT, so that
# what an earlier request learned is not explored again
FREE_EVIDENCE = 3.0
MIN_WEIGHT_AT_SIZE = 3.0  # observations of one pass size before its own mean is used
PRIOR_VERIFY_SLOPE = 0.15  # relative cost of each extra verified token before a fit
CATCH_UP_PRIOR = 0.2  # a skipped token's catch-up cost, as a share of a drafting call
START_MARGIN = 1.06  # leaving n = 0 must be predicted this much faster
SWITCH_MARGIN = 1.02  # ... once drafting, or between two lengths or two offers
EXPLORE_MARGIN = 0.95  # a longer draft is explored when predicted within this share
PROBE_LENGTH = 2  # tokens a probe round drafts (at least n_min)
# a model source not in use, still thin on evidence, is probed without budget only while
# predicted at least this share of the plan's rate (a source already clearly slower is
# weighed again within the budget)
THIN_PROBE_MARGIN = 0.8
# observations an estimate carried from an earlier request counts as at most (acceptance
# per position, each cost line): a new request's own rounds soon outweigh it
CARRIED_WEIGHT = 4.0


def lookup_prior(match: int) -> float:
    """Acceptance assumed for a free offer continuing a match of `match` tokens before
    any such offer was verified (LOOKUP_PRIOR_MATCH)."""
    return 1.0 - (1.0 - LOOKUP_PRIOR) * LOOKUP_PRIOR_MATCH / max(match, LOOKUP_PRIOR_MATCH)


def _ema(old: float | None, new: float) -> float:
    return new if old is None else old + DRAFT_COST_RATE * (new - old)


def _carried_share(count: float, weight: float) -> float:
    """The factor that scales `count` observations down to at most `weight`."""
    return weight / count if count > weight else 1.0


@dataclass(frozen=True)
class RoundPlan:
    """What a round drafts: n tokens (0: a plain target step), from the free offer or
    from one of the drafter's model sources."""

    n: int
    take_offer: bool = False
    source: int = 0  # the model source that drafts (Drafter.model_sources)


@dataclass(frozen=True)
class ModelCall:
    """The drafter's model call in a round."""

    n_requested: int
    n_proposed: int
    seconds: float
    evidence: DraftEvidence
    source: int = 0  # the model source that drafted


@dataclass(frozen=True)
class RoundRecord:
    """One round as the policy learns from it."""

    n_drafted: int  # tokens verified after `last` (the usable part of the proposal)
    n_accepted: int
    emitted: Sequence[int]
    seconds: float  # the whole round
    verify_seconds: float  # the target's pass over n_drafted + 1 tokens
    # a mixture-of-experts target: the distinct (layer, expert) pairs that pass woke
    # (CallOutput.experts_woken); 0: a dense target
    verify_experts: int = 0
    model_call: ModelCall | None = None  # None: no model ran (a plain step or an offer)
    lookup_match: int = 0  # > 0: the round verified a lookup offer continuing this match
    lookup_source: str = ""  # the free source of that offer ("": prompt lookup)
    # per verified position up to the first rejection, the probability it was accepted
    accept_probs: Sequence[float] = ()
    offer_next: int | None = None  # the offer's token after those verified, all accepted
    bonus_probs: np.ndarray | None = None  # [vocab] the target's, where it drew the bonus
    last_bonus_probs: np.ndarray | None = None  # the previous round's

    @property
    def draft_seconds(self) -> float:
        return 0.0 if self.model_call is None else self.model_call.seconds


class DraftPolicy(ABC):
    """Chooses each round's draft before it runs; learns from each round after."""

    @abstractmethod
    def plan(self, limit: int, offer: Proposal | None, runs_model: bool) -> RoundPlan:
        """The round's plan, drafting at most `limit` tokens. `offer`: the drafter's free
        proposal (None: it has no free source); `runs_model`: its `draft()` runs a model."""

    @property
    @abstractmethod
    def offer_limit(self) -> int:
        """Most tokens a round verifies of a free offer."""

    def pick_offer(self, offers: Sequence[Proposal]) -> Proposal | None:
        """The free offer a round weighs, of those its free sources made (None: it has no
        free source): the longest."""
        return max(offers, key=lambda o: len(o.tokens), default=None)

    def observe(self, record: RoundRecord) -> None:
        """Learn from a finished round."""

    def carry_from(self, earlier: DraftPolicy) -> bool:
        """Start from what `earlier`, a finished request's policy, learned; whether
        anything was carried (a fixed policy learns nothing)."""
        return False

    def outlook(self, limit: int, offer: Proposal | None
                ) -> tuple[list[float], int, list[float], int] | None:
        """What the next round could emit, for a step planned with other sequences
        (batch_policy): expected tokens for each model draft length 0..limit from the
        source it drafts with now, that source, for each length of the free `offer` up to
        `offer_limit`, and the skipped tokens that source evaluates before it drafts (None:
        the policy keeps no estimates)."""
        return None


@dataclass
class FixedDraftLength(DraftPolicy):
    """n_max tokens every round: the free offer when it has any, else the model."""

    n_max: int
    n_min: int = 0

    @property
    def offer_limit(self) -> int:
        return self.n_max

    def plan(self, limit: int, offer: Proposal | None, runs_model: bool) -> RoundPlan:
        n = min(self.n_max, limit)
        if n <= 0 or n < self.n_min:
            return RoundPlan(0)
        if offer is not None and offer.tokens:
            return RoundPlan(n, take_offer=True)
        return RoundPlan(n if runs_model else 0)


@dataclass
class CostLine:
    """Seconds against tokens per pass: the discounted mean at sizes observed often
    enough (kernels have steps: M = 2 costs about M = 1 here, M = 3 much more), else a
    discounted least-squares line through all observations."""

    decay: float
    w: float = 0.0
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    sxy: float = 0.0
    at_size: dict[int, list[float]] = field(default_factory=dict)  # S -> [weight, sum]

    def add(self, x: int, y: float) -> None:
        d = self.decay
        self.w, self.sx, self.sy = d * self.w + 1, d * self.sx + x, d * self.sy + y
        self.sxx, self.sxy = d * self.sxx + x * x, d * self.sxy + x * y
        for acc in self.at_size.values():
            acc[0] *= d
            acc[1] *= d
        acc = self.at_size.setdefault(x, [0.0, 0.0])
        acc[0] += 1.0
        acc[1] += y

    def carried(self, weight: float = CARRIED_WEIGHT) -> CostLine:
        """A copy whose fit, and each size's mean, count as at most `weight` observations:
        the same estimates, soon outweighed."""
        at_size = {}
        for x, (w, total) in self.at_size.items():
            g = _carried_share(w, weight)
            at_size[x] = [w * g, total * g]
        f = _carried_share(self.w, weight)
        return CostLine(self.decay, self.w * f, self.sx * f, self.sy * f, self.sxx * f,
                     self.sxy * f, at_size)

    def at(self, x: int) -> float | None:
        if self.w == 0:
            return None
        own = self.at_size.get(x)
        if own is not None and own[0] >= MIN_WEIGHT_AT_SIZE:
            return own[1] / own[0]
        mx, my = self.sx / self.w, self.sy / self.w
        var = self.sxx / self.w - mx * mx
        if len(self.at_size) < 2 or var <= 1e-12:
            return my * (1.0 + PRIOR_VERIFY_SLOPE * (x - mx))  # verify is nearly flat
        b = max((self.sxy / self.w - mx * my) / var, 0.0)
        return max(my + b * (x - mx), 1e-6)

    def fitted(self) -> bool:
        """Whether a line is fitted through observations at two or more sizes (not the
        prior slope of `at`)."""
        if self.w == 0 or len(self.at_size) < 2:
            return False
        mx = self.sx / self.w
        return self.sxx / self.w - mx * mx > 1e-12


@dataclass
class ExpertPricing:
    """A mixture-of-experts target's verify pass priced by the experts its rows wake: a
    pass reads each woken expert's matrices once, so its cost follows the distinct
    (layer, expert) pairs its rows chose, which grow with the rows as far as the rows
    disagree. Two lines, measured per pass: the experts woken against the rows, and the
    seconds against the experts woken; a pass of s rows is priced at the experts s rows
    are predicted to wake. Until passes at two expert counts are seen it prices nothing
    (the policy's line against rows stands)."""

    decay: float
    woken: CostLine = field(init=False)  # distinct (layer, expert) pairs against rows
    seconds: CostLine = field(init=False)  # seconds against distinct pairs

    def __post_init__(self) -> None:
        self.woken, self.seconds = CostLine(self.decay), CostLine(self.decay)

    def add(self, rows: int, experts: int, seconds: float) -> None:
        self.woken.add(rows, experts)
        self.seconds.add(experts, seconds)

    def experts(self, rows: int) -> float | None:
        """The distinct (layer, expert) pairs a pass of `rows` rows is predicted to wake."""
        return self.woken.at(rows)

    def verify_cost(self, rows: int) -> float | None:
        """Predicted seconds of a pass over `rows` rows (None: not yet fitted)."""
        experts = self.woken.at(rows)
        if experts is None or not self.seconds.fitted():
            return None
        return self.seconds.at(round(experts))

    def carried(self) -> ExpertPricing:
        out = ExpertPricing(self.decay)
        out.woken, out.seconds = self.woken.carried(), self.seconds.carried()
        return out


@dataclass
class _Acceptance:
    """Discounted hits and trials per draft position of one source of drafts."""

    n: int
    decay: float
    prior: float
    hits: list[float] = field(init=False)
    trials: list[float] = field(init=False)

    def __post_init__(self) -> None:
        self.hits = [0.0] * self.n
        self.trials = [0.0] * self.n

    def observe(self, n_drafted: int, n_accepted: int, probs: Sequence[float] = ()) -> None:
        """A verified round: positions up to the first rejection were reached; `probs`,
        where known, the probability each was accepted with (counted instead of the
        outcome: the same mean, less noise)."""
        for i in range(min(n_drafted, n_accepted + 1)):
            self.observe_at(i, probs[i] if i < len(probs) else float(i < n_accepted))

    def observe_at(self, i: int, hit: float) -> None:
        """One sample of position i alone, given positions before it accepted: whether it
        was accepted (1.0 / 0.0, or a bool), or the probability it was."""
        if 0 <= i < self.n:
            self.hits[i] = self.decay * self.hits[i] + float(hit)
            self.trials[i] = self.decay * self.trials[i] + 1.0

    def carry_from(self, earlier: _Acceptance, weight: float = CARRIED_WEIGHT) -> None:
        """Start from `earlier`'s evidence, each position's counting as at most `weight`
        trials: the same hit rates, soon outweighed."""
        for i in range(min(self.n, earlier.n)):
            f = _carried_share(earlier.trials[i], weight)
            self.hits[i], self.trials[i] = earlier.hits[i] * f, earlier.trials[i] * f

    def thin(self, evidence: float = MIN_EVIDENCE) -> bool:
        """Fewer verified first positions than `evidence` (discounted trials)."""
        return self.trials[0] < evidence if self.trials else False

    def rates(self) -> list[float]:
        """Estimated conditional acceptance per draft position."""
        out: list[float] = []
        prior = self.prior
        for h, t in zip(self.hits, self.trials, strict=True):
            rate = (h + PRIOR_WEIGHT * prior) / (t + PRIOR_WEIGHT)
            out.append(rate)
            prior = rate  # an unexplored position looks like the one before it
        return out

    def expected_tokens(self, n: int) -> float:
        """Tokens a round drafting n emits: the accepted drafts and the target's own."""
        return self.expected_curve(n)[n]

    def expected_curve(self, longest: int) -> list[float]:
        """expected_tokens(n) for n = 0..longest (past the positions kept, no more)."""
        out, e, run = [1.0], 1.0, 1.0
        rates = self.rates()
        for n in range(1, longest + 1):
            if n <= len(rates):
                run *= rates[n - 1]
                e += run
            out.append(e)
        return out


@dataclass(frozen=True)
class SourceTraits:
    """What the policy must know of a model source to price it."""

    # proposes a whole block in one pass (a head): a call's cost is a line in the block
    # length, fitted as the verify pass's is, not first + (n - 1) * next
    one_pass: bool = False
    # most skipped tokens it evaluates before drafting (None: all of them)
    catch_up_limit: int | None = None


@dataclass
class _ModelSource:
    """One model source's measured acceptance and costs: a draft model's, or a head's."""

    traits: SourceTraits
    acceptance: _Acceptance
    block: CostLine
    first: float | None = None  # seconds: a steady drafting call, but its later steps
    next: float | None = None  # seconds: each proposal step after the first
    calls: int = 0
    skipped: int = 0  # tokens emitted since this source last ran: its next catch-up
    catch_up: float | None = None  # seconds per skipped token it evaluates
    idle_rounds: int = 0  # rounds since it last drafted (while another source did)

    def observe_draft(self, seconds: float, later_steps: Sequence[float], n: int) -> None:
        self.calls += 1
        if self.calls == 1:
            return
        if self.traits.one_pass:
            self.block.add(n, seconds)
            self.first = _ema(self.first, seconds)
            return
        self.first = _ema(self.first, seconds - sum(later_steps))
        for t in later_steps:
            self.next = _ema(self.next, t)

    def draft_cost(self, n: int) -> float | None:
        if self.first is None:
            return None
        if self.traits.one_pass:
            return self.block.at(n)
        nxt = self.first if self.next is None else self.next
        return self.first + (n - 1) * nxt

    @property
    def to_catch_up(self) -> int:
        limit = self.traits.catch_up_limit
        return self.skipped if limit is None else min(self.skipped, limit)

    def catch_up_cost(self) -> float:
        if self.catch_up is not None:
            return self.catch_up
        return CATCH_UP_PRIOR * (self.first or 0.0)

    @property
    def thin(self) -> bool:
        """Too few verified first positions to trust its acceptance yet."""
        return self.acceptance.thin()

    def carry_from(self, earlier: _ModelSource) -> None:
        """Start from `earlier`'s costs, and its acceptance and block line as a few
        observations. Its first call here is still not used (observe_draft)."""
        self.acceptance.carry_from(earlier.acceptance)
        self.block = earlier.block.carried()
        self.first, self.next, self.catch_up = earlier.first, earlier.next, earlier.catch_up


@dataclass
class AdaptiveDraftLength(DraftPolicy):
    n_max: int
    n_min: int = 0  # shorter drafts are not verified: never chosen, nor probed
    decay: float = 0.98  # weight kept by older observations at each new one
    probe_every: int = 4  # fewest rounds at n=0 between probes
    probe_budget: float = 0.03  # share of decode time probes may cost beyond plain steps
    prior_accept: float = 0.7
    # every this many drafting rounds, draft one more when that is predicted nearly as
    # fast (EXPLORE_MARGIN): costs seen only at lengths no longer chosen would otherwise
    # never be corrected
    explore_every: int = 8
    # the one model source's traits (SourceTraits), where `sources` names none
    catch_up_limit: int | None = None
    one_pass: bool = False
    # the drafter's model sources, each round drafting from the one predicted fastest (a
    # head and a draft model); empty: one source with the traits above
    sources: tuple[SourceTraits, ...] = ()
    # most tokens a free offer may verify (DraftParams.free_limit; 0: n_max)
    free_max: int = 0
    _verify: CostLine = field(init=False)
    _experts: ExpertPricing = field(init=False)  # a MoE target's verify, by experts woken
    _drafting_rounds: int = 0
    _idle_rounds: int = 0
    _drafting: bool = False  # the last choice drafted (not counting probes)
    _probing: bool = False  # the last choice was a probe
    # tokens per second of the plan a probe of another source displaced (None: a probe
    # from n = 0, priced against plain steps)
    _probe_rate: float | None = None
    _chosen: int = 0  # the model source of the last choice
    _elapsed: float = 0.0  # seconds of the rounds observed
    _probe_overhead: float = 0.0  # seconds probes took beyond plain steps for their tokens
    _last_verify: float = 0.0  # seconds of the latest target pass
    # seconds of a round outside the draft call and the target pass (sampling, acceptance,
    # bookkeeping): a drafting round samples more rows (p and q at temperature > 0)
    _rest_plain: float | None = None
    _rest_drafting: float | None = None
    _rest_lookup: float | None = None

    def __post_init__(self) -> None:
        n = max(self.n_max, 0)
        self._verify = CostLine(self.decay)
        self._experts = ExpertPricing(self.decay)
        traits = self.sources or (SourceTraits(self.one_pass, self.catch_up_limit),)
        self._models = [_ModelSource(t, _Acceptance(n, self.decay, self.prior_accept),
                                     CostLine(self.decay)) for t in traits]
        # (free source, match length) -> its offers' acceptance
        self._lookups: dict[tuple[str, int], _Acceptance] = {}
        self.free_max = max(self.free_max, n)

    def _acceptance(self, lookup: int, source: int = 0, free: str = "") -> _Acceptance:
        """Acceptance of model source `source` (lookup 0) or of free source `free`'s offers
        matching `lookup` tokens."""
        if lookup <= 0:
            return self._models[source].acceptance
        acc = self._lookups.get((free, lookup))
        if acc is None:
            acc = self._lookups[(free, lookup)] = _Acceptance(self.free_max, self.decay,
                                                              lookup_prior(lookup))
        return acc

    @property
    def n_sources(self) -> int:
        return len(self._models)

    @property
    def offer_limit(self) -> int:
        return self.free_max

    def carry_from(self, earlier: DraftPolicy) -> bool:
        """Start from what `earlier` (a finished request of the same drafter) learned: its
        costs of the target pass, of each source's calls and of a round's other work (the
        machine's, much the same from request to request), and its acceptance of each
        source and lookup match as at most CARRIED_WEIGHT observations a position (the
        text changes: this request's own rounds soon outweigh them). So a request starts
        drafting from its first round instead of measuring and probing each source first.
        False (nothing carried) where `earlier` priced other sources."""
        if not isinstance(earlier, AdaptiveDraftLength) or (
                [m.traits for m in earlier._models] != [m.traits for m in self._models]):
            return False
        self._verify = earlier._verify.carried()
        self._experts = earlier._experts.carried()
        for mine, theirs in zip(self._models, earlier._models, strict=True):
            mine.carry_from(theirs)
        for (free, match), acc in earlier._lookups.items():
            self._acceptance(match, free=free).carry_from(acc)
        self._rest_plain = earlier._rest_plain
        self._rest_drafting = earlier._rest_drafting
        self._rest_lookup = earlier._rest_lookup
        return True

    # -- observations ---------------------------------------------------------------------
    def observe_verify(self, n_tokens: int, seconds: float, experts: int = 0) -> None:
        """A target pass over n_tokens rows took `seconds`, waking `experts` distinct
        (layer, expert) pairs (a MoE target; 0: dense)."""
        self._verify.add(n_tokens, seconds)
        if experts > 0:
            self._experts.add(n_tokens, experts, seconds)
        self._last_verify = seconds

    def observe_draft(self, seconds: float, later_steps: Sequence[float] = (),
                      n: int = 0, source: int = 0) -> None:
        """A steady drafting call of model source `source` for n tokens took `seconds`, of
        which `later_steps` were its second, third, ... proposal steps (a drafter that does
        not time its steps passes none; a one-pass drafter has none). A source's first call
        is not used: its passes run at shapes and cache states not seen again, and an
        outlier stays long where lengths are rarely tried."""
        self._models[source].observe_draft(seconds, later_steps, n)

    def observe_round(self, n_drafted: int, n_emitted: int, seconds: float,
                      draft_seconds: float, lookup: bool = False, source: int = 0,
                      prompt_rows: int = 0) -> None:
        """A whole round: `draft_seconds` of its `seconds` were model source `source`'s call
        (0 when no model ran), which first caught up on the tokens skipped before it (and
        on `prompt_rows` of the prompt: then what a skipped token costs is not learnt);
        the other sources skipped the round's tokens; `lookup`: the round verified a
        lookup offer (no model ran)."""
        self._elapsed += seconds
        rest = max(seconds - draft_seconds - self._last_verify, 0.0)
        if lookup:
            self._rest_lookup = _ema(self._rest_lookup, rest)
        elif n_drafted > 0:
            self._rest_drafting = _ema(self._rest_drafting, rest)
        elif draft_seconds == 0:
            self._rest_plain = _ema(self._rest_plain, rest)
        for s, m in enumerate(self._models):
            if draft_seconds > 0 and s == source:
                if m.to_catch_up >= 2 and m.first is not None and not prompt_rows:
                    own = m.draft_cost(max(n_drafted, 1)) or 0.0
                    per = max(draft_seconds - own, 0.0) / m.to_catch_up
                    m.catch_up = _ema(m.catch_up, per)
                m.skipped = 0
            else:
                m.skipped += n_emitted
        if self._probing:
            self._probing = False
            if self._probe_rate is None:
                self._probe_overhead += seconds - n_emitted * (self.verify_cost(1) or 0.0)
            else:
                self._probe_overhead += seconds - n_emitted / self._probe_rate

    def observe_acceptance(self, n_drafted: int, n_accepted: int, lookup: int = 0,
                           probs: Sequence[float] = (), source: int = 0, free: str = ""
                           ) -> None:
        """The target accepted n_accepted of n_drafted tokens from model source `source`
        (lookup 0) or from a lookup offer continuing a match of `lookup` context tokens;
        `probs`: the probability each position up to the first rejection was accepted with
        (`VerifyResult.accept_probs`; at temperature > 0 they estimate acceptance with
        less noise than the outcomes, drawn from them); `free`: the offer's free source."""
        self._acceptance(lookup, source, free).observe(n_drafted, n_accepted, probs)

    def observe_position(self, i: int, hit: float, lookup: int = 0, source: int = 0,
                         free: str = "") -> None:
        """A guess at draft position i (0-based), given the positions before it accepted,
        checked without verifying it: a draft's teacher-forced rows, or the guess after a
        fully accepted round for the target's bonus token. Rounds only reach the lengths
        they draft, so without these the acceptance of the next position is a prior
        that is rarely tested. `hit`: whether the guess was right, or (a sampled target)
        the probability it would have been accepted. `lookup`, `source`, `free` as in
        `observe_acceptance`."""
        self._acceptance(lookup, source, free).observe_at(i, hit)

    # -- estimates ------------------------------------------------------------------------
    @property
    def accept(self) -> list[float]:
        """Estimated conditional acceptance per draft position of the (first) model source."""
        return self.accept_of(0)

    def accept_of(self, source: int) -> list[float]:
        """Estimated conditional acceptance per draft position of model source `source`."""
        return self._models[source].acceptance.rates()

    def accept_lookup(self, match: int, free: str = "") -> list[float]:
        """Estimated conditional acceptance per position of free source `free`'s offers
        continuing a match of `match` context tokens."""
        return self._acceptance(max(match, 1), free=free).rates()

    def verify_cost(self, s: int) -> float | None:
        """Fitted seconds for a target pass over s tokens (None before any data): on a
        MoE target, by the experts s rows are predicted to wake once that is fitted."""
        by_experts = self._experts.verify_cost(s)
        return self._verify.at(s) if by_experts is None else by_experts

    def experts_woken(self, s: int) -> float | None:
        """Predicted distinct (layer, expert) pairs a pass of s rows wakes (None: a dense
        target, or none seen)."""
        return self._experts.experts(s)

    def draft_cost(self, n: int, source: int = 0) -> float | None:
        """Estimated seconds of a steady drafting call of `source` proposing n (None before
        any data); before any later step was seen each one is taken to cost as much as the
        first."""
        return self._models[source].draft_cost(n)

    def catch_up_cost(self, source: int = 0) -> float:
        """Estimated seconds per skipped token `source` evaluates before it drafts (before
        any was measured: CATCH_UP_PRIOR of a drafting call)."""
        return self._models[source].catch_up_cost()

    def probe_cost(self, n: int = 2, source: int = 0, displaced: float | None = None
                   ) -> float:
        """Predicted seconds a probe of n from `source` costs beyond what the plan it
        displaces takes for the same tokens: plain steps, or (`displaced`, tokens per
        second) another source's drafting."""
        m = self._models[source]
        t1 = self.verify_cost(1) or 0.0
        per_token = t1 if displaced is None else 1.0 / displaced
        own = ((m.draft_cost(n) or 0.0) + (self.verify_cost(n + 1) or t1)
               - m.acceptance.expected_tokens(n) * per_token)
        return m.catch_up_cost() * m.to_catch_up + max(own, 0.0)

    def expected_tokens(self, n: int, source: int = 0) -> float:
        return self._models[source].acceptance.expected_tokens(n)

    def rate(self, n: int, source: int = 0) -> float | None:
        """Predicted tokens per second of a round drafting n from model source `source`
        (None before any data). Its catch-up is not counted: it is paid once, not per
        round."""
        t1 = self.verify_cost(1)
        if t1 is None:
            return None
        plain = self._rest_plain or 0.0
        if n == 0:
            return 1.0 / (t1 + plain)
        draft = self.draft_cost(n, source)
        if draft is None:
            return None
        rest = plain if self._rest_drafting is None else self._rest_drafting
        return (self.expected_tokens(n, source)
                / (draft + (self.verify_cost(n + 1) or t1) + rest))

    def lookup_rate(self, n: int, match: int, free: str = "") -> float | None:
        """Predicted tokens per second of verifying n tokens of free source `free`'s offer
        continuing a match of `match` context tokens."""
        t1 = self.verify_cost(1)
        if t1 is None:
            return None
        rest = next((r for r in (self._rest_lookup, self._rest_drafting, self._rest_plain)
                     if r is not None), 0.0)
        expected = self._acceptance(max(match, 1), free=free).expected_tokens(n)
        return expected / ((self.verify_cost(n + 1) or t1) + rest)

    @property
    def shortest(self) -> int:
        """The shortest draft worth a call: drafts below n_min are not verified."""
        return max(self.n_min, 1)

    def choose(self, limit: int) -> int:
        """Draft length for the next round, at most `limit` (its source: `choose_model`)."""
        return self.choose_model(limit)[0]

    def choose_model(self, limit: int) -> tuple[int, int]:
        """(draft length, model source) for the next round, at most `limit` tokens; a
        length of 0 is a plain target step."""
        limit = min(limit, self.n_max)
        shortest = self.shortest
        if limit < shortest:
            return self._choice(0, self._chosen)
        probe = min(max(PROBE_LENGTH, shortest), limit)
        if self.rate(0) is None:
            return self._choice(0, self._chosen)  # first measure a plain target step
        for s, m in enumerate(self._models):
            if m.draft_cost(1) is None:
                return self._choice(probe, s)  # then short probes for each source's costs
        # hysteresis: leaving n = 0 must be predicted clearly faster (a wrong start costs
        # a catch-up on the draft as well); between draft lengths and sources (the current
        # one weighed first) SWITCH_MARGIN decides
        start = SWITCH_MARGIN if self._drafting else START_MARGIN
        base = self.rate(0) or 0.0
        best_n, best_s, best_rate = 0, self._chosen, base
        order = [self._chosen, *(s for s in range(self.n_sources) if s != self._chosen)]
        for s in order:
            for n in range(shortest, limit + 1):
                r = self.rate(n, s) or 0.0
                if r > max(best_rate * SWITCH_MARGIN, base * start):
                    best_n, best_s, best_rate = n, s, r
        self._drafting = best_n > 0
        if best_n == 0:
            self._idle_rounds += 1
            # the source to probe: one still thin on evidence, else the most promising
            s = next((s for s, m in enumerate(self._models) if m.thin),
                     max(range(self.n_sources), key=lambda s: self.rate(probe, s) or 0.0))
            # a few unlucky first rounds must not settle the request at n = 0 for good:
            # until position 1 has some evidence, probes (cheap then) are not budgeted
            if self._idle_rounds >= self.probe_every and (
                    self._models[s].thin or self._probe_overhead + self.probe_cost(probe, s)
                    <= self.probe_budget * self._elapsed):
                self._idle_rounds = 0
                self._probing, self._probe_rate = True, None
                return self._choice(probe, s)
            return self._choice(0, best_s)
        self._idle_rounds = 0
        self._drafting_rounds += 1
        other = self._probe_other(best_s, best_rate, best_n)
        if other is not None:
            return self._choice(best_n, other)
        if (best_n < limit and self._drafting_rounds % self.explore_every == 0
                and (self.rate(best_n + 1, best_s) or 0.0) >= EXPLORE_MARGIN * best_rate):
            return self._choice(best_n + 1, best_s)
        return self._choice(best_n, best_s)

    def _choice(self, n: int, source: int) -> tuple[int, int]:
        self._chosen = source
        return n, source

    def _probe_other(self, best: int, best_rate: float, n: int) -> int | None:
        """A model source other than `best` to probe this round with the n tokens the plan
        drafts (every position it would be chosen for is tested): one that has not drafted
        for `probe_every` rounds, while thin on evidence and predicted close to the plan
        (THIN_PROBE_MARGIN), else four times that within the probe budget (what it is
        predicted to cost against the chosen plan), so that a source found slower early
        is weighed again as the text changes. None: no probe."""
        for s, m in enumerate(self._models):
            if s == best:
                m.idle_rounds = 0
                continue
            m.idle_rounds += 1
            close = m.thin and (self.rate(n, s) or 0.0) >= THIN_PROBE_MARGIN * best_rate
            if m.idle_rounds < self.probe_every * (1 if close else 4):
                continue
            if close or (self._probe_overhead + self.probe_cost(n, s, best_rate)
                         <= self.probe_budget * self._elapsed):
                m.idle_rounds = 0
                self._probing, self._probe_rate = True, best_rate
                return s
        return None

    def choose_source(self, limit: int, offered: int, match: int, *, model: bool = True,
                      free: str = "") -> tuple[int, bool]:
        """(tokens to verify, from the lookup offer?) for a round where a lookup offers
        `offered` tokens continuing a match of `match` context tokens, at no cost: the
        offer's best length when it is predicted faster than the model's choice (a
        plain step included; its source: the last `choose_model`'s), else
        `choose(limit)`'s; without a draft `model`, faster than a plain step, else
        (0, False). `free`: the offer's free source."""
        n, source = self.choose_model(limit) if model else (0, 0)
        if offered <= 0 or self.verify_cost(1) is None:
            return n, False
        best_m, best_rate = 0, 0.0
        for m in range(self.shortest, min(offered, limit, self.free_max) + 1):
            r = self.lookup_rate(m, match, free) or 0.0
            if r > best_rate * SWITCH_MARGIN:
                best_m, best_rate = m, r
        other = (self.rate(0) if self._probing or not model else self.rate(n, source)) or 0.0
        if best_m == 0 or best_rate <= other:
            return n, False
        if self._probing:  # the probe waits for the next round without an offer
            self._probing = False
            self._idle_rounds = self.probe_every
            self._models[source].idle_rounds = self.probe_every
        return best_m, True

    def best_offer_rate(self, offer: Proposal, limit: int) -> float:
        """Predicted tokens per second of verifying the offer's best length (0: none)."""
        ev = offer.evidence
        longest = min(len(offer.tokens), limit, self.free_max)
        return max((self.lookup_rate(m, ev.lookup_match, ev.lookup_source) or 0.0
                    for m in range(self.shortest, longest + 1)), default=0.0)

    # -- the round's interface --------------------------------------------------------------
    def pick_offer(self, offers: Sequence[Proposal]) -> Proposal | None:
        """The free offer predicted fastest at its best length (each free source's
        acceptance per match length kept apart); before the target pass is timed, the
        longest. An offer whose source has fewer than FREE_EVIDENCE trials at its match
        length is tried first where it is the longest (ties: the longer match): no model
        runs for it, and a source never picked would never be learned."""
        if self.verify_cost(1) is None:
            return super().pick_offer(offers)
        made = [o for o in offers if o.tokens]
        longest = max((len(o.tokens) for o in made), default=0)
        untried = [o for o in made if len(o.tokens) == longest and self._acceptance(
            max(o.evidence.lookup_match, 1), free=o.evidence.lookup_source).thin(FREE_EVIDENCE)]
        if untried:
            return max(untried, key=lambda o: o.evidence.lookup_match)
        return max(offers, key=lambda o: self.best_offer_rate(o, self.free_max), default=None)

    def outlook(self, limit: int, offer: Proposal | None
                ) -> tuple[list[float], int, list[float], int] | None:
        if self.rate(0) is None:
            return None  # nothing measured yet: the round's own choice measures
        limit = min(limit, self.n_max)
        s = self._chosen

        def curve(acc: _Acceptance, longest: int) -> list[float]:
            """E(n) for n = 0..longest; a draft below n_min is never verified (E = 1)."""
            return [1.0 if 0 < n < self.shortest else e
                    for n, e in enumerate(acc.expected_curve(longest))]

        lookup: list[float] = []
        if offer is not None and offer.tokens:
            ev = offer.evidence
            lookup = curve(self._acceptance(max(ev.lookup_match, 1), free=ev.lookup_source),
                           min(len(offer.tokens), self.free_max))
        model = self._models[s]
        return curve(model.acceptance, limit), s, lookup, model.to_catch_up

    def plan(self, limit: int, offer: Proposal | None, runs_model: bool) -> RoundPlan:
        if offer is None:
            n, source = self.choose_model(limit)
            return RoundPlan(n, source=source)
        ev = offer.evidence
        n, take = self.choose_source(limit, len(offer.tokens), ev.lookup_match,
                                     model=runs_model, free=ev.lookup_source)
        return RoundPlan(n, take, self._chosen)

    def observe(self, record: RoundRecord) -> None:
        """Learn from a round, in the order its facts arose: the model call's evidence,
        the target pass, the verified positions, the offer's next token, the whole round."""
        r = record
        source = 0 if r.model_call is None else r.model_call.source
        if r.model_call is not None:
            self._observe_model_call(r.model_call, r.last_bonus_probs)
        self.observe_verify(r.n_drafted + 1, r.verify_seconds, r.verify_experts)
        if r.n_drafted:
            self.observe_acceptance(r.n_drafted, r.n_accepted, r.lookup_match, r.accept_probs,
                                    source, free=r.lookup_source)
            nxt = r.offer_next
            if r.lookup_match and nxt is not None and r.n_accepted == r.n_drafted < len(r.emitted):
                # the offer's next token against the bonus: the probability the target gave
                # it where it drew the bonus (at temperature > 0), else whether it won
                p = r.bonus_probs
                hit = (float(p[nxt]) if p is not None and nxt < p.shape[0]
                       else float(r.emitted[r.n_accepted] == nxt))
                self.observe_position(r.n_accepted, hit, r.lookup_match, free=r.lookup_source)
        prompt_rows = 0 if r.model_call is None else r.model_call.evidence.prompt_rows
        self.observe_round(r.n_drafted, len(r.emitted), r.seconds, r.draft_seconds,
                           r.lookup_match > 0, source, prompt_rows)

    def _observe_model_call(self, call: ModelCall, bonus_p: np.ndarray | None) -> None:
        """A model source's call: its cost (when steady) and its free acceptance samples."""
        ev, s = call.evidence, call.source
        if not ev.includes_catch_up:
            self.observe_draft(call.seconds, ev.step_seconds[1:], call.n_requested, s)
        for i, hit in ev.guess_checks:
            self.observe_position(i, hit, source=s)
        if ev.bonus_q is not None and bonus_p is not None:
            i, q = ev.bonus_q
            self.observe_position(
                i, acceptance_probability(bonus_p, to_width(q, bonus_p.shape[0])), source=s)
        if ev.stopped_unsure and call.n_proposed < call.n_requested:
            # stopped short for want of confidence (p_min): position n_proposed yields
            # nothing, as a rejection there would
            self.observe_position(call.n_proposed, False, source=s)


class PolicyMemory:
    """The estimates of the last finished request of each drafter, for the next one to
    start from (`AdaptiveDraftLength.carry_from`): an engine's requests skip relearning
    the machine's costs. Slots share it; each request starts from the last one kept."""

    def __init__(self) -> None:
        self._kept: dict[str, DraftPolicy] = {}
        self._lock = threading.Lock()

    def start(self, drafter: str, policy: DraftPolicy) -> bool:
        """Seed a new request's `policy` from drafter `drafter`'s last kept one; whether
        anything was carried."""
        with self._lock:
            earlier = self._kept.get(drafter)
            return earlier is not None and policy.carry_from(earlier)

    def keep(self, drafter: str, policy: DraftPolicy) -> None:
        """A finished request's policy: the next request of `drafter` starts from it."""
        with self._lock:
            self._kept[drafter] = policy
