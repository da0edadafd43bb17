"""daemon.stats: acceptance per draft position and decode rates, as reported."""

from __future__ import annotations

import pytest

from specd.daemon.spec.stats import SpecStats


def test_per_position_acceptance_is_conditional() -> None:
    """8 rounds of 3 drafts whose every position is accepted half the time it is reached
    (accepted 0 x4, 1 x2, 2 x1, 3 x1): 0.5 at each position, not the 0.5 / 0.25 / 0.125
    of P(accepted >= position)."""
    s = SpecStats()
    for k in (0, 0, 0, 0, 1, 1, 2, 3):
        s.record_round(3, k)
    assert s.per_position_acceptance() == [0.5, 0.5, 0.5]
    assert s.mean_acceptance_length == 1 + 7 / 8


def test_positions_of_rounds_of_different_lengths() -> None:
    s = SpecStats()
    s.record_round(1, 1)  # position 0 reached and accepted; position 1 never drafted
    s.record_round(3, 1)  # 0 accepted, 1 reached and rejected, 2 not reached
    s.record_round(2, 2)  # 0 and 1 accepted
    s.record_round(0, 0)  # a plain step: no position
    assert s.reached_at == [3, 2, 0]
    assert s.per_position_acceptance() == [1.0, 0.5, 0.0]
    total = SpecStats()
    total.merge(s)
    total.merge(s)
    assert total.reached_at == [6, 4, 0] and total.per_position_acceptance() == [1.0, 0.5, 0.0]


def test_decode_rate_counts_the_tokens_after_the_first() -> None:
    """The first token comes out of prompt processing, before the decode clock starts."""
    s = SpecStats(generated_tokens=9, decoded_tokens=8, decode_s=2.0)
    assert s.decode_tps == 4.0
    total = SpecStats()
    total.merge(s)
    total.merge(SpecStats(generated_tokens=1, decoded_tokens=0, decode_s=0.0))
    assert total.decode_tps == pytest.approx(4.0)


def test_prefill_rate_counts_only_the_evaluated_prompt_tokens() -> None:
    """399 of 400 prompt tokens came from the cache: the rate is over the one evaluated
    (what `timings.prompt_per_second` beside `prompt_n` means)."""
    s = SpecStats(prompt_tokens=400, cached_tokens=399, prefill_s=0.01)
    assert s.prefill_tps == pytest.approx(100.0)
