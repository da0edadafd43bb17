"""Coupled sampling: a draft that proposes with the target's noise, so that a seeded
request emits the very tokens target-only decoding draws.

Target-only decoding draws the token at position t by inverting the CDF of p_t (ascending
ids) at one uniform u_t: on the host the t-th draw of the target sampler's PCG64 stream
after the prompt, in a graph the counter-based uniform keyed by the target's key and t
(spec/philox.py). A coupled draft draws its proposal for position t from q_t at that same
u_t, and the round verifies by the target's own draw (`verify_greedy`, or the graph's
verification without a q): every emitted token is target-only's draw at its position,
whatever was drafted, how long the drafts were, which source drafted them and what shared
the passes. A draft is accepted where both inversions land on the same token, which for
q near p is most of the time (less often than rejection sampling accepts: its price).
"""

from __future__ import annotations

import copy

import numpy as np

from specd.ort_models.sampling_op import TARGET_STREAM

from .philox import philox_uniform
from .sampling import Sampler, SamplerParams


class CoupledSampler(Sampler):
    """A draft's sampler (its own distribution q: params, penalties) whose draws are the
    target sampler's uniforms at the drafted positions. `start_round(first)` before each
    draft: `first` is the position of its first token."""

    def __init__(self, params: SamplerParams, target: Sampler, *, graph_noise: bool):
        """graph_noise: the target draws in its graph (counter-based uniforms keyed by
        position), else on the host from its PCG64 stream."""
        super().__init__(params, seed=0, history=target.history)
        self.target = target
        self.key = target.key  # the graph's draws of a coupled pick are the target's
        self.graph_noise = graph_noise
        self._first = 0  # position of the round's first draft token
        self._ahead: list[float] = []  # the target stream's next uniforms (host noise)
        self._stream: np.random.Generator | None = None

    def start_round(self, first: int) -> None:
        """A new draft whose first token is at `first`; on the host the target's stream
        is copied as it stands, its next draws being the next positions'."""
        self._first = first
        self._ahead = []
        self._stream = None if self.graph_noise else copy.deepcopy(self.target._rng)

    def uniform(self, position: int | None = None) -> float:
        """The target's uniform for the token at `position` (which a coupled draw must
        name)."""
        if position is None:
            raise ValueError("a coupled draft's draw needs the token's position")
        if self.graph_noise:
            return float(philox_uniform(self.key, position, TARGET_STREAM, 0))
        i = position - self._first
        if i < 0 or self._stream is None:
            raise ValueError(f"position {position} is before the round's first draft "
                             f"({self._first})")
        while len(self._ahead) <= i:
            self._ahead.append(float(self._stream.random()))
        return self._ahead[i]
