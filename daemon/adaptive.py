"""Adaptive draft length: choose n per round from measured acceptance and measured costs.

Expected tokens from a round drafting n:  E(n) = 1 + sum_{i=1..n} prod_{j<=i} a_j,
with a_j the (smoothed) conditional acceptance at draft position j. Its time:
T(n) = n * t_draft + t_verify(n + 1), t_verify fitted as a + b*S from observed passes.
The chosen n maximises E(n) / T(n); n = 0 (target-only step) wins whenever drafting does
not pay, so speculation never runs slower than plain decoding. While at n = 0 a short
probe round runs now and then so the estimates can recover.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class AdaptiveDraftLength:
    n_max: int
    alpha: float = 0.15  # EMA weight of new observations
    probe_every: int = 16  # rounds at n=0 between probes
    prior_accept: float = 0.7
    accept: list[float] = field(default_factory=list)
    _verify: dict[int, float] = field(default_factory=dict)  # S -> EMA seconds
    _draft_step: float | None = None
    _idle_rounds: int = 0

    def __post_init__(self) -> None:
        self.accept = [self.prior_accept] * max(self.n_max, 0)
        self._seen = [0] * max(self.n_max, 0)

    def observe_verify(self, n_tokens: int, seconds: float) -> None:
        old = self._verify.get(n_tokens)
        self._verify[n_tokens] = seconds if old is None else old + self.alpha * (seconds - old)

    def observe_draft(self, n_steps: int, seconds: float) -> None:
        if n_steps <= 0:
            return
        per = seconds / n_steps
        old = self._draft_step
        self._draft_step = per if old is None else old + self.alpha * (per - old)

    def observe_acceptance(self, n_drafted: int, n_accepted: int) -> None:
        for i in range(min(n_drafted, len(self.accept))):
            hit = 1.0 if i < n_accepted else 0.0
            if self._seen[i] == 0:  # first observation replaces the extrapolated value
                self.accept[i] = self._rate(i)
            self._seen[i] += 1
            self.accept[i] += self.alpha * (hit - self.accept[i])
            if i >= n_accepted:
                break  # positions past the first rejection were not reached

    def verify_cost(self, s: int) -> float | None:
        """Fitted seconds for a target pass over s tokens (None before any data)."""
        if not self._verify:
            return None
        if s in self._verify:
            return self._verify[s]
        pts = sorted(self._verify.items())
        if len(pts) == 1:
            (s0, t0), = pts
            return t0 * (1.0 + 0.15 * (s - s0))  # prior slope: verify is nearly flat
        # least-squares line through the observed sizes
        n = len(pts)
        mx = sum(p[0] for p in pts) / n
        my = sum(p[1] for p in pts) / n
        var = sum((p[0] - mx) ** 2 for p in pts)
        b = sum((p[0] - mx) * (p[1] - my) for p in pts) / var if var else 0.0
        return max(my + b * (s - mx), 1e-6)

    def _rate(self, i: int) -> float:
        """Acceptance at position i; positions never drafted take the last one observed."""
        while i > 0 and self._seen[i] == 0:
            i -= 1
        return self.accept[i] if self._seen[i] else self.prior_accept

    def expected_tokens(self, n: int) -> float:
        e, run = 1.0, 1.0
        for i in range(n):
            run *= self._rate(i)
            e += run
        return e

    def choose(self, limit: int) -> int:
        """Draft length for the next round, at most `limit`."""
        limit = min(limit, self.n_max)
        if limit <= 0:
            return 0
        if 1 not in self._verify:
            return 0  # first measure a plain target step
        if self._draft_step is None:
            return min(2, limit)  # then a short probe for the draft and verify costs
        t1 = self._verify[1]
        best_n, best_rate = 0, 1.0 / t1
        for n in range(1, limit + 1):
            cost = n * self._draft_step + (self.verify_cost(n + 1) or t1)
            rate = self.expected_tokens(n) / cost
            if rate > best_rate * 1.02:
                best_n, best_rate = n, rate
        if best_n == 0:
            self._idle_rounds += 1
            if self._idle_rounds >= self.probe_every:
                self._idle_rounds = 0
                return min(2, limit)
        else:
            self._idle_rounds = 0
        return best_n
