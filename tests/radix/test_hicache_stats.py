"""The tiered cache's recompute estimate: the marginal cost of a prompt token, fitted to the
prefill steps, so that small steps' fixed costs do not make recomputing look expensive."""

from __future__ import annotations

import pytest

from radixlm.radix.hicache_stats import TierStats

FIXED_S = 0.010  # a step's fixed cost (the weights read once, the launches)
TOKEN_S = 25e-6  # and each prompt token's


def step_seconds(n: int) -> float:
    return FIXED_S + n * TOKEN_S


def test_the_slope_leaves_the_fixed_cost_out() -> None:
    stats = TierStats()
    for n in [16, 2048, 48, 512, 16, 4096, 32] * 3:
        stats.on_prefill(n, step_seconds(n))
    assert stats.prefill_s_per_token == pytest.approx(TOKEN_S, rel=1e-6)
    # the moving average of the cost per token (the estimate before) counts the fixed cost
    assert stats._prefill_avg > 5 * TOKEN_S


def test_steps_of_one_size_keep_the_average_cost() -> None:
    stats = TierStats()
    stats.on_prefill(100, 0.1)
    assert stats.prefill_s_per_token == pytest.approx(1e-3)
    stats.on_prefill(100, 0.05)  # no spread, no slope: the moving average
    assert stats.prefill_s_per_token == pytest.approx(0.8 * 1e-3 + 0.2 * 0.5e-3)
    stats.on_prefill(0, 1.0)  # nothing to learn
    stats.on_prefill(10, 0.0)
    assert stats.prefill_s_per_token == pytest.approx(0.9e-3)


def test_a_slope_above_the_average_or_below_zero_is_not_used() -> None:
    stats = TierStats()
    for n, s in [(100, 0.2), (1000, 0.1), (100, 0.2), (1000, 0.1)]:  # bigger steps faster
        stats.on_prefill(n, s)
    assert 0 < stats.prefill_s_per_token == stats._prefill_avg


def test_a_disk_load_slower_than_recomputing_is_skipped() -> None:
    """Disk hits at 60 us a token against recomputing at 25 us a token plus 10 ms a step:
    judged by the average cost of small steps (10 ms over 16 tokens: 650 us a token) the load
    would look 10x cheaper; judged by the marginal cost it is 2.4x dearer."""
    stats = TierStats(disk_s_per_token=60e-6)
    for n in [16, 16, 2048, 16, 512, 16] * 2:
        stats.on_prefill(n, step_seconds(n))
    no_copy = lambda n: 0.0  # noqa: E731 - the copy's estimate is not what is judged here
    judged = [stats.disk_pays_off(1024, 128 * 1024, no_copy) for _ in range(32)]
    assert judged.count(True) == 32 // 16  # only the re-measuring loads (EXPLORE_EVERY)
    assert stats.as_dict()["prefill_s_per_token"] == pytest.approx(TOKEN_S)
    assert "_fit" not in stats.as_dict()
