"""Speculation and speed statistics, per request and in total."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    rounds: int = 0  # verify passes that carried at least one drafted token
    drafted: int = 0
    accepted: int = 0
    accepted_at: list[int] = field(default_factory=list)  # per draft position: accepted
    # per draft position: drafted with every earlier position accepted (the rounds in
    # which the position's own acceptance was decided)
    reached_at: list[int] = field(default_factory=list)
    draft_lengths: dict[int, int] = field(default_factory=dict)  # n -> rounds drafted n
    lookup_rounds: int = 0  # rounds whose draft came from a prompt lookup (no model ran)
    lookup_accepted: int = 0  # drafts of those rounds the target accepted
    # of those, the rounds and accepted drafts of each free source other than prompt
    # lookup ("history")
    offer_rounds: dict[str, int] = field(default_factory=dict)
    offer_accepted: dict[str, int] = field(default_factory=dict)
    # model calls per source (a drafter's name: "draft", "dflash", ...), where a drafter
    # of several sources chose one per round
    source_calls: dict[str, int] = field(default_factory=dict)
    # exceptions drafters raised, by drafter name (each dropped the drafter for the rest of
    # its request, which went on target-only)
    drafter_failures: dict[str, int] = field(default_factory=dict)
    draft_s: float = 0.0
    verify_s: float = 0.0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    decoded_tokens: int = 0  # generated after the first (which prompt processing makes)
    cached_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    valid: bool = True  # False after synthetic acceptance

    def record_round(self, n_drafted: int, n_accepted: int, lookup: bool = False,
                     free: str = "") -> None:
        """A verified round; `lookup`: its draft was a free offer, from free source `free`
        ("": prompt lookup)."""
        self.draft_lengths[n_drafted] = self.draft_lengths.get(n_drafted, 0) + 1
        if n_drafted == 0:
            return
        if lookup:
            self.lookup_rounds += 1
            self.lookup_accepted += n_accepted
            if free:
                self.offer_rounds[free] = self.offer_rounds.get(free, 0) + 1
                self.offer_accepted[free] = self.offer_accepted.get(free, 0) + n_accepted
        self.rounds += 1
        self.drafted += n_drafted
        self.accepted += n_accepted
        while len(self.reached_at) < n_drafted:
            self.accepted_at.append(0)
            self.reached_at.append(0)
        for i in range(n_drafted):
            if i <= n_accepted:
                self.reached_at[i] += 1
            if i < n_accepted:
                self.accepted_at[i] += 1

    def record_source(self, name: str) -> None:
        """A model source drafted this round."""
        self.source_calls[name] = self.source_calls.get(name, 0) + 1

    def record_drafter_failure(self, name: str) -> None:
        self.drafter_failures[name] = self.drafter_failures.get(name, 0) + 1

    @property
    def mean_acceptance_length(self) -> float:
        """1 + accepted / rounds (tokens per verify pass that carried a draft)."""
        return 1.0 + self.accepted / self.rounds if self.rounds else 1.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    def per_position_acceptance(self) -> list[float]:
        """Conditional acceptance per draft position: of the rounds that drafted position
        i with positions < i accepted, the share that accepted it (what a draft-length
        controller or `--spec-synthetic-rates` means by a position's rate)."""
        return [a / r if r else 0.0 for a, r in zip(self.accepted_at, self.reached_at,
                                                     strict=True)]

    @property
    def prefill_tps(self) -> float:
        """Prompt tokens evaluated (not those reused from the cache) per second."""
        evaluated = self.prompt_tokens - self.cached_tokens
        return evaluated / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tps(self) -> float:
        """Tokens after the first over the time after it (the first comes out of prompt
        processing, before the decode clock starts)."""
        return self.decoded_tokens / self.decode_s if self.decode_s > 0 else 0.0

    def merge(self, other: SpecStats) -> None:
        for name in ("rounds", "drafted", "accepted", "lookup_rounds", "lookup_accepted",
                     "draft_s", "verify_s", "prompt_tokens", "generated_tokens",
                     "decoded_tokens", "cached_tokens", "prefill_s", "decode_s"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for i in range(len(other.reached_at)):
            if i >= len(self.reached_at):
                self.accepted_at.append(0)
                self.reached_at.append(0)
            self.accepted_at[i] += other.accepted_at[i]
            self.reached_at[i] += other.reached_at[i]
        for n, c in other.draft_lengths.items():
            self.draft_lengths[n] = self.draft_lengths.get(n, 0) + c
        for counts, more in ((self.source_calls, other.source_calls),
                             (self.drafter_failures, other.drafter_failures),
                             (self.offer_rounds, other.offer_rounds),
                             (self.offer_accepted, other.offer_accepted)):
            for name, c in more.items():
                counts[name] = counts.get(name, 0) + c
        self.valid = self.valid and other.valid

    def as_dict(self) -> dict[str, object]:
        return {
            "rounds": self.rounds, "drafted": self.drafted, "accepted": self.accepted,
            "mean_acceptance_length": round(self.mean_acceptance_length, 4),
            "acceptance_rate": round(self.acceptance_rate, 4),
            "per_position_acceptance": [round(x, 4) for x in self.per_position_acceptance()],
            "draft_lengths": dict(sorted(self.draft_lengths.items())),
            "lookup_rounds": self.lookup_rounds, "lookup_accepted": self.lookup_accepted,
            "offer_rounds": dict(sorted(self.offer_rounds.items())),
            "offer_accepted": dict(sorted(self.offer_accepted.items())),
            "source_calls": dict(sorted(self.source_calls.items())),
            "drafter_failures": dict(sorted(self.drafter_failures.items())),
            "draft_s": round(self.draft_s, 4), "verify_s": round(self.verify_s, 4),
            "prompt_tokens": self.prompt_tokens, "generated_tokens": self.generated_tokens,
            "cached_tokens": self.cached_tokens,
            "prefill_tps": round(self.prefill_tps, 2), "decode_tps": round(self.decode_tps, 2),
            "valid": self.valid,
        }
