"""Coupled sampling: a draft that proposes with the target's noise, so that a seeded
request emits the very tokens target-only decoding draws.

Target-only decoding draws the token at position t by inverting the CDF of p_t (ascending
ids) at one uniform u_t, the counter-based uniform keyed by the target's key and t
(spec/philox.py), on the host as in a graph. A coupled draft draws its proposal for
position t from q_t at that same u_t, and the round verifies by the target's own draw
(`verify_greedy`, or the graph's verification without a q): every emitted token is
target-only's draw at its position, whatever was drafted, how long the drafts were, which
source drafted them and what shared the passes. A draft is accepted where both inversions
land on the same token, which for q near p is most of the time (less often than
rejection sampling accepts: its price).
"""

from __future__ import annotations

from .sampling import Sampler, SamplerParams


class CoupledSampler(Sampler):
    """A draft's sampler (its own distribution q: params, penalties) whose draws are the
    target sampler's uniforms at the drafted positions (the target's draws are keyed by
    position). `start_round(first)` before each draft: `first` is the position of its
    first token."""

    def __init__(self, params: SamplerParams, target: Sampler):
        if target.position is None:
            raise ValueError("coupled drafts need a target sampler whose draws are keyed "
                             "by position")
        # draws keyed by position, with the target's key: the graph's of a coupled pick too
        super().__init__(params, seed=0, history=target.history, position=target.position)
        self.key = target.key
        self._first = 0  # position of the round's first draft token

    def start_round(self, first: int) -> None:
        """A new draft whose first token is at `first`."""
        self._first = first

    def uniform(self, position: int | None = None, draw: int = 0) -> float:
        """The target's uniform for the token at `position` (which a coupled draw must
        name, at or after the round's first)."""
        if position is None:
            raise ValueError("a coupled draft's draw needs the token's position")
        if position < self._first:
            raise ValueError(f"position {position} is before the round's first draft "
                             f"({self._first})")
        return super().uniform(position, draw=0)
