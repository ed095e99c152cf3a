"""The all-reduce calibration over real ranks (gloo on the CPU) and the TP roofline math."""

from __future__ import annotations

import pytest

from radixlm.srt.bench.collective_calib import latency_at, measure, tp_roofline_ms


@pytest.mark.slow
def test_two_gloo_ranks_give_a_table_per_message_size() -> None:
    rows = measure(2, "cpu", sizes=[4096, 1 << 20], repeats=3)
    assert [r["bytes"] for r in rows] == [4096, 1 << 20]
    for r in rows:
        assert r["latency_us"] > 0
        # two ranks: the bus moves (2 (N - 1) / N) = 1 times the message
        assert r["bus_GBps"] == pytest.approx(r["algo_GBps"])


def test_latency_interpolates_and_extrapolates_by_bandwidth() -> None:
    rows = [{"bytes": 1000, "latency_us": 10.0}, {"bytes": 3000, "latency_us": 30.0}]
    assert latency_at(rows, 10) == pytest.approx(10e-6)  # below the table: the latency floor
    assert latency_at(rows, 2000) == pytest.approx(20e-6)
    assert latency_at(rows, 6000) == pytest.approx(60e-6)


def test_tp_roofline_splits_the_weights_and_adds_two_reduces_per_layer() -> None:
    rows = [{"bytes": 8192, "latency_us": 10.0}]
    one = tp_roofline_ms(16e9, 4e12, 1, 32, 8192, rows)
    assert one == pytest.approx(4.0)
    two = tp_roofline_ms(16e9, 4e12, 2, 32, 8192, rows)
    assert two == pytest.approx(2.0 + 2 * 32 * 10e-3)
