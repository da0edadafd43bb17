"""Synthetic acceptance (benchmarks only): acceptance drawn from configured rates.

The drafted tokens are placeholders; after the real verify pass the round asks
`accepts_position(...)` row by row and emits the target's own choices for those rows.
So verify costs are real while acceptance is controlled. Output is marked not valid: rows
after the first are conditioned on placeholders. A drafted end-of-generation token is
never accepted. Rates all 0 reproduce target-only output exactly.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import numpy as np

from specd.daemon.spec.drafter import DraftRequest, PerSequenceDrafter, Proposal


def rates_for_mean_length(mean_len: float, n: int) -> list[float]:
    """Constant per-position rate a with E[accepted+1] = 1 + a + ... + a^n = mean_len."""
    if not 1.0 <= mean_len <= n + 1:
        raise ValueError(f"mean acceptance length must be in [1, {n + 1}], got {mean_len}")
    lo, hi = 0.0, 1.0
    for _ in range(60):
        a = (lo + hi) / 2
        if sum(a ** i for i in range(n + 1)) < mean_len:
            lo = a
        else:
            hi = a
    return [lo] * n


class SyntheticDrafter(PerSequenceDrafter):
    name = "synthetic"
    decides_acceptance = True

    def __init__(self, rates: Sequence[float] | None = None, *, mean_length: float | None = None,
                 n_max: int = 8, seed: int = 0):
        if (rates is None) == (mean_length is None):
            raise ValueError("give exactly one of per-position rates or a mean acceptance length")
        if rates is None:
            rates = rates_for_mean_length(float(mean_length), n_max)  # type: ignore[arg-type]
        rates = [float(r) for r in rates]
        if not rates:
            raise ValueError("synthetic acceptance needs at least one rate")
        for r in rates:
            if not 0.0 <= r <= 1.0:
                raise ValueError(f"acceptance rates must be in [0, 1], got {r}")
        if any(b > a for a, b in zip(rates, rates[1:], strict=False)):
            raise ValueError(f"per-position acceptance rates must not increase: {rates}")
        self.rates = rates
        self.seed = seed
        self._rng = np.random.default_rng(seed)

    def begin(self, seq: int, prompt: Sequence[int], sampler: object = None,
              features: object = None) -> None:
        """Acceptance draws start again from the seed and the prompt: the same request
        drafts the same way, whatever ran before it (one sequence at a time)."""
        digest = zlib.crc32(np.asarray(prompt, dtype=np.int64).tobytes())
        self._rng = np.random.default_rng([self.seed, digest])

    def propose_one(self, request: DraftRequest) -> Proposal:
        return Proposal([request.last] * min(request.n_max, len(self.rates)))

    def accepts_position(self, i: int, target_choice: int, eog: set[int]) -> bool:
        """Whether draft position i (reached) is accepted; the target's choice is kept."""
        if target_choice in eog:
            return False
        return bool(self._rng.random() < self.rates[i])
