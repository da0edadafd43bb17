"""The draft-length policy: how many tokens each round drafts, and from which source.

The round asks the policy for a `RoundPlan` before anything runs and reports one
`RoundRecord` after it. `FixedDraftLength` drafts n_max every round (a free offer first,
where the drafter has one). `AdaptiveDraftLength` chooses n to maximise the predicted
tokens per second, E(n) / T(n), from measured acceptance and measured costs:

    E(n) = 1 + sum_{i=1..n} prod_{j<=i} a_j      (a_j: acceptance at draft position j)
    T(n) = t_draft(n) + t_verify(n + 1) + the round's other time

n = 0 (a plain target step) wins unless drafting is predicted clearly faster, with budgeted
probe rounds so that estimates recover; a free lookup offer is weighed against the model's
best length and a plain step, with acceptance kept per lookup match length. The reasoning
behind each rule is in docs/adaptive-policy.md.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from .drafter import DraftEvidence, Proposal
from .verify import acceptance_probability, to_width

PRIOR_WEIGHT = 2.0  # pseudo-observations of the prior at each draft position
DRAFT_COST_RATE = 0.1  # weight of each new draft timing (a ~10-observation memory)
LOOKUP_PRIOR = 0.5  # acceptance assumed for lookup proposals before any was verified
MIN_EVIDENCE = 8.0  # (discounted) trials at draft position 1 before probes cost budget
MIN_WEIGHT_AT_SIZE = 3.0  # observations of one pass size before its own mean is used
PRIOR_VERIFY_SLOPE = 0.15  # relative cost of each extra verified token before a fit
CATCH_UP_PRIOR = 0.2  # a skipped token's catch-up cost, as a share of a drafting call
START_MARGIN = 1.06  # leaving n = 0 must be predicted this much faster
SWITCH_MARGIN = 1.02  # ... once drafting, or between two lengths or two offers
EXPLORE_MARGIN = 0.95  # a longer draft is explored when predicted within this share
PROBE_LENGTH = 2  # tokens a probe round drafts (at least n_min)


def _ema(old: float | None, new: float) -> float:
    return new if old is None else old + DRAFT_COST_RATE * (new - old)


@dataclass(frozen=True)
class RoundPlan:
    """What a round drafts: n tokens (0: a plain target step), from the free offer or
    from the drafter's model."""

    n: int
    take_offer: bool = False


@dataclass(frozen=True)
class ModelCall:
    """The drafter's model call in a round."""

    n_requested: int
    n_proposed: int
    seconds: float
    evidence: DraftEvidence


@dataclass(frozen=True)
class RoundRecord:
    """One round as the policy learns from it."""

    n_drafted: int  # tokens verified after `last` (the usable part of the proposal)
    n_accepted: int
    emitted: Sequence[int]
    seconds: float  # the whole round
    verify_seconds: float  # the target's pass over n_drafted + 1 tokens
    model_call: ModelCall | None = None  # None: no model ran (a plain step or an offer)
    lookup_match: int = 0  # > 0: the round verified a lookup offer continuing this match
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

    def observe(self, record: RoundRecord) -> None:
        """Learn from a finished round."""


@dataclass
class FixedDraftLength(DraftPolicy):
    """n_max tokens every round: the free offer when it has any, else the model."""

    n_max: int
    n_min: int = 0

    def plan(self, limit: int, offer: Proposal | None, runs_model: bool) -> RoundPlan:
        n = min(self.n_max, limit)
        if n <= 0 or n < self.n_min:
            return RoundPlan(0)
        if offer is not None and offer.tokens:
            return RoundPlan(n, take_offer=True)
        return RoundPlan(n if runs_model else 0)


@dataclass
class _Line:
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
        e, run = 1.0, 1.0
        for a in self.rates()[:n]:
            run *= a
            e += run
        return e


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
    # most skipped tokens the drafter evaluates before drafting (None: all of them)
    catch_up_limit: int | None = None
    # the drafter proposes a whole block in one pass (a head): a call's cost is a line in
    # the block length, fitted as the verify pass's is, not first + (n - 1) * next
    one_pass: bool = False
    _verify: _Line = field(init=False)
    _block: _Line = field(init=False)
    _draft_first: float | None = None  # seconds: a steady drafting call, but its later steps
    _draft_next: float | None = None  # seconds: each proposal step after the first
    _draft_calls: int = 0
    _drafting_rounds: int = 0
    _idle_rounds: int = 0
    _drafting: bool = False  # the last choice drafted (not counting probes)
    _probing: bool = False  # the last choice was a probe
    _elapsed: float = 0.0  # seconds of the rounds observed
    _probe_overhead: float = 0.0  # seconds probes took beyond plain steps for their tokens
    _skipped: int = 0  # tokens emitted since the draft last ran: its next catch-up
    _catch_up: float | None = None  # seconds per skipped token the draft evaluates
    _last_verify: float = 0.0  # seconds of the latest target pass
    # seconds of a round outside the draft call and the target pass (sampling, acceptance,
    # bookkeeping): a drafting round samples more rows (p and q at temperature > 0)
    _rest_plain: float | None = None
    _rest_drafting: float | None = None
    _rest_lookup: float | None = None

    def __post_init__(self) -> None:
        n = max(self.n_max, 0)
        self._verify = _Line(self.decay)
        self._block = _Line(self.decay)
        self._model = _Acceptance(n, self.decay, self.prior_accept)
        self._lookups: dict[int, _Acceptance] = {}  # match length -> its offers' acceptance

    def _source(self, lookup: int) -> _Acceptance:
        """Acceptance of the draft model (lookup 0) or of lookups matching that many tokens."""
        if lookup <= 0:
            return self._model
        acc = self._lookups.get(lookup)
        if acc is None:
            acc = self._lookups[lookup] = _Acceptance(len(self._model.hits), self.decay,
                                                      LOOKUP_PRIOR)
        return acc

    # -- observations ---------------------------------------------------------------------
    def observe_verify(self, n_tokens: int, seconds: float) -> None:
        self._verify.add(n_tokens, seconds)
        self._last_verify = seconds

    def observe_draft(self, seconds: float, later_steps: Sequence[float] = (),
                      n: int = 0) -> None:
        """A steady drafting call for n tokens took `seconds`, of which `later_steps` were
        its second, third, ... proposal steps (a drafter that does not time its steps
        passes none; a one-pass drafter has none). The first call is not used: its passes
        run at shapes and cache states not seen again, and an outlier stays long where
        lengths are rarely tried."""
        self._draft_calls += 1
        if self._draft_calls == 1:
            return
        if self.one_pass:
            self._block.add(n, seconds)
            self._draft_first = _ema(self._draft_first, seconds)
            return
        self._draft_first = _ema(self._draft_first, seconds - sum(later_steps))
        for t in later_steps:
            self._draft_next = _ema(self._draft_next, t)

    def observe_round(self, n_drafted: int, n_emitted: int, seconds: float,
                      draft_seconds: float, lookup: bool = False) -> None:
        """A whole round: `draft_seconds` of its `seconds` were the drafter's call (0 when
        the draft did not run), which first caught up on the tokens skipped before it;
        `lookup`: the round verified a lookup offer (the draft model did not run)."""
        self._elapsed += seconds
        rest = max(seconds - draft_seconds - self._last_verify, 0.0)
        if lookup:
            self._rest_lookup = _ema(self._rest_lookup, rest)
        elif n_drafted > 0:
            self._rest_drafting = _ema(self._rest_drafting, rest)
        elif draft_seconds == 0:
            self._rest_plain = _ema(self._rest_plain, rest)
        if draft_seconds > 0:
            if self._to_catch_up >= 2 and self._draft_first is not None:
                own = self.draft_cost(max(n_drafted, 1)) or 0.0
                per = max(draft_seconds - own, 0.0) / self._to_catch_up
                self._catch_up = _ema(self._catch_up, per)
            self._skipped = 0
        else:
            self._skipped += n_emitted
        if self._probing:
            self._probing = False
            self._probe_overhead += seconds - n_emitted * (self.verify_cost(1) or 0.0)

    def observe_acceptance(self, n_drafted: int, n_accepted: int, lookup: int = 0,
                           probs: Sequence[float] = ()) -> None:
        """The target accepted n_accepted of n_drafted tokens from the draft model (lookup
        0) or from a lookup offer continuing a match of `lookup` context tokens; `probs`:
        the probability each position up to the first rejection was accepted with
        (`VerifyResult.accept_probs`; at temperature > 0 they estimate acceptance with
        less noise than the outcomes, drawn from them)."""
        self._source(lookup).observe(n_drafted, n_accepted, probs)

    def observe_position(self, i: int, hit: float, lookup: int = 0) -> None:
        """A guess at draft position i (0-based), given the positions before it accepted,
        checked without verifying it: a draft's teacher-forced rows, or the guess after a
        fully accepted round for the target's bonus token. Rounds only reach the lengths
        they draft, so without these the acceptance of the next position is a prior
        that is rarely tested. `hit`: whether the guess was right, or (a sampled target)
        the probability it would have been accepted. `lookup` as in `observe_acceptance`."""
        self._source(lookup).observe_at(i, hit)

    # -- estimates ------------------------------------------------------------------------
    @property
    def accept(self) -> list[float]:
        """Estimated conditional acceptance per draft position of the draft model."""
        return self._model.rates()

    def accept_lookup(self, match: int) -> list[float]:
        """Estimated conditional acceptance per position of lookup offers continuing a
        match of `match` context tokens."""
        return self._source(max(match, 1)).rates()

    def verify_cost(self, s: int) -> float | None:
        """Fitted seconds for a target pass over s tokens (None before any data)."""
        return self._verify.at(s)

    def draft_cost(self, n: int) -> float | None:
        """Estimated seconds of a steady drafting call proposing n (None before any data);
        before any later step was seen each one is taken to cost as much as the first."""
        first = self._draft_first
        if first is None:
            return None
        if self.one_pass:
            return self._block.at(n)
        nxt = first if self._draft_next is None else self._draft_next
        return first + (n - 1) * nxt

    @property
    def _to_catch_up(self) -> int:
        """Tokens the draft evaluates before its next proposal (those skipped, at most
        the drafter's limit)."""
        limit = self.catch_up_limit
        return self._skipped if limit is None else min(self._skipped, limit)

    def catch_up_cost(self) -> float:
        """Estimated seconds per skipped token the draft evaluates before it drafts
        (before any was measured: CATCH_UP_PRIOR of a drafting call)."""
        if self._catch_up is not None:
            return self._catch_up
        return CATCH_UP_PRIOR * (self._draft_first or 0.0)

    def probe_cost(self, n: int = 2) -> float:
        """Predicted seconds a probe of n costs beyond plain steps for the same tokens."""
        t1 = self.verify_cost(1) or 0.0
        own = ((self.draft_cost(n) or 0.0) + (self.verify_cost(n + 1) or t1)
               - self.expected_tokens(n) * t1)
        return self.catch_up_cost() * self._to_catch_up + max(own, 0.0)

    def expected_tokens(self, n: int) -> float:
        return self._model.expected_tokens(n)

    def rate(self, n: int) -> float | None:
        """Predicted tokens per second of a round drafting n (None before any data)."""
        t1 = self.verify_cost(1)
        if t1 is None:
            return None
        plain = self._rest_plain or 0.0
        if n == 0:
            return 1.0 / (t1 + plain)
        draft = self.draft_cost(n)
        if draft is None:
            return None
        rest = plain if self._rest_drafting is None else self._rest_drafting
        return self.expected_tokens(n) / (draft + (self.verify_cost(n + 1) or t1) + rest)

    def lookup_rate(self, n: int, match: int) -> float | None:
        """Predicted tokens per second of verifying n tokens of a lookup offer continuing a
        match of `match` context tokens."""
        t1 = self.verify_cost(1)
        if t1 is None:
            return None
        rest = next((r for r in (self._rest_lookup, self._rest_drafting, self._rest_plain)
                     if r is not None), 0.0)
        expected = self._source(max(match, 1)).expected_tokens(n)
        return expected / ((self.verify_cost(n + 1) or t1) + rest)

    @property
    def shortest(self) -> int:
        """The shortest draft worth a call: drafts below n_min are not verified."""
        return max(self.n_min, 1)

    def choose(self, limit: int) -> int:
        """Draft length for the next round, at most `limit`."""
        limit = min(limit, self.n_max)
        shortest = self.shortest
        if limit < shortest:
            return 0
        probe = min(max(PROBE_LENGTH, shortest), limit)
        if self.rate(0) is None:
            return 0  # first measure a plain target step
        if self.draft_cost(1) is None:
            return probe  # then a short probe for the draft and verify costs
        # hysteresis: leaving n = 0 must be predicted clearly faster (a wrong start costs
        # a catch-up on the draft as well); between draft lengths SWITCH_MARGIN decides
        start = SWITCH_MARGIN if self._drafting else START_MARGIN
        base = self.rate(0) or 0.0
        best_n, best_rate = 0, base
        for n in range(shortest, limit + 1):
            r = self.rate(n) or 0.0
            if r > max(best_rate * SWITCH_MARGIN, base * start):
                best_n, best_rate = n, r
        self._drafting = best_n > 0
        if best_n == 0:
            self._idle_rounds += 1
            n = probe
            # a few unlucky first rounds must not settle the request at n = 0 for good:
            # until position 1 has some evidence, probes (cheap then) are not budgeted
            thin = bool(self._model.trials) and self._model.trials[0] < MIN_EVIDENCE
            if self._idle_rounds >= self.probe_every and (thin or self._probe_overhead
                    + self.probe_cost(n) <= self.probe_budget * self._elapsed):
                self._idle_rounds = 0
                self._probing = True
                return n
        else:
            self._idle_rounds = 0
            self._drafting_rounds += 1
            if (best_n < limit and self._drafting_rounds % self.explore_every == 0
                    and (self.rate(best_n + 1) or 0.0) >= EXPLORE_MARGIN * best_rate):
                return best_n + 1
        return best_n

    def choose_source(self, limit: int, offered: int, match: int, *, model: bool = True
                      ) -> tuple[int, bool]:
        """(tokens to verify, from the lookup offer?) for a round where a lookup offers
        `offered` tokens continuing a match of `match` context tokens, at no cost: the
        offer's best length when it is predicted faster than the draft model's choice (a
        plain step included), else `choose(limit)`'s; without a draft `model`, faster
        than a plain step, else (0, False)."""
        n = self.choose(limit) if model else 0
        if offered <= 0 or self.verify_cost(1) is None:
            return n, False
        best_m, best_rate = 0, 0.0
        for m in range(self.shortest, min(offered, limit, self.n_max) + 1):
            r = self.lookup_rate(m, match) or 0.0
            if r > best_rate * SWITCH_MARGIN:
                best_m, best_rate = m, r
        other = (self.rate(0) if self._probing or not model else self.rate(n)) or 0.0
        if best_m == 0 or best_rate <= other:
            return n, False
        if self._probing:  # the probe waits for the next round without an offer
            self._probing = False
            self._idle_rounds = self.probe_every
        return best_m, True

    # -- the round's interface --------------------------------------------------------------
    def plan(self, limit: int, offer: Proposal | None, runs_model: bool) -> RoundPlan:
        if offer is None:
            return RoundPlan(self.choose(limit))
        n, take = self.choose_source(limit, len(offer.tokens), offer.evidence.lookup_match,
                                     model=runs_model)
        return RoundPlan(n, take)

    def observe(self, record: RoundRecord) -> None:
        """Learn from a round, in the order its facts arose: the model call's evidence,
        the target pass, the verified positions, the offer's next token, the whole round."""
        r = record
        if r.model_call is not None:
            self._observe_model_call(r.model_call, r.last_bonus_probs)
        self.observe_verify(r.n_drafted + 1, r.verify_seconds)
        if r.n_drafted:
            self.observe_acceptance(r.n_drafted, r.n_accepted, r.lookup_match, r.accept_probs)
            nxt = r.offer_next
            if r.lookup_match and nxt is not None and r.n_accepted == r.n_drafted < len(r.emitted):
                # the offer's next token against the bonus: the probability the target gave
                # it where it drew the bonus (at temperature > 0), else whether it won
                p = r.bonus_probs
                hit = (float(p[nxt]) if p is not None and nxt < p.shape[0]
                       else float(r.emitted[r.n_accepted] == nxt))
                self.observe_position(r.n_accepted, hit, r.lookup_match)
        self.observe_round(r.n_drafted, len(r.emitted), r.seconds, r.draft_seconds,
                           r.lookup_match > 0)

    def _observe_model_call(self, call: ModelCall, bonus_p: np.ndarray | None) -> None:
        """A draft model's call: its cost (when steady) and its free acceptance samples."""
        ev = call.evidence
        if not ev.includes_catch_up:
            self.observe_draft(call.seconds, ev.step_seconds[1:], call.n_requested)
        for i, hit in ev.guess_checks:
            self.observe_position(i, hit)
        if ev.bonus_q is not None and bonus_p is not None:
            i, q = ev.bonus_q
            self.observe_position(
                i, acceptance_probability(bonus_p, to_width(q, bonus_p.shape[0])))
        if ev.stopped_unsure and call.n_proposed < call.n_requested:
            # stopped short for want of confidence (p_min): position n_proposed yields
            # nothing, as a rejection there would
            self.observe_position(call.n_proposed, False)
