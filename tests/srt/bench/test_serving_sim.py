"""serving_sim: the cost model's arithmetic, and the real scheduler on the virtual clock (every
request completes; a bounded variant's mixed steps stay within the target at the modelled
prefill rate, unbounded ones do not, and chunks alone never mix)."""

from __future__ import annotations

from pathlib import Path

import pytest

from radixlm.srt.bench.bench_gpu import TINY_LLAMA, make_model_folder
from radixlm.srt.bench.datasets import BenchRequest, RandomTokens, long_tailed_requests
from radixlm.srt.bench.serving_report import Slo
from radixlm.srt.bench.serving_sim import (
    CONTEXT,
    CostModel,
    server_config,
    simulate,
    sum_of_parts,
)


def test_the_cost_model_charges_the_weights_once_per_step() -> None:
    m = CostModel(
        prefill_rate=1000.0,
        prefill_fixed=0.5,
        attn=0.0,
        decode_base=2.0,
        decode_row=0.25,
        decode_ctx=0.001,
        mixed_extra=4.0,
        mixed_token=0.001,
    )
    assert m.step_s(0, 0, 0, 0) == 0.0
    assert m.step_s(1000, 0, 0, 0) == pytest.approx(1.5)  # prefill only
    assert m.step_s(0, 0, 4, 1000) == pytest.approx(2.0 + 1.0 + 1.0)  # decode only
    assert m.step_s(1000, 0, 4, 1000) == pytest.approx(1.5 + 1.0 + 1.0 + 4.0 + 1.0)  # mixed


def test_the_default_cost_model_meets_the_h100_decode_figures() -> None:
    """The issue's H100 figures: batch 1 in 5.99 ms (cuBLAS) and 13,090 tok/s at batch 256,
    both over 1,024-token prompts with up to 64 tokens decoded (mean context ~1,056)."""
    m = CostModel()
    assert m.step_s(0, 0, 1, 1056) == pytest.approx(0.00599, rel=0.02)
    assert 256 / m.step_s(0, 0, 256, 256 * 1056) == pytest.approx(13090, rel=0.02)


def test_the_sum_of_parts_adds_the_prompts_and_the_output_at_their_rates() -> None:
    reqs = [BenchRequest([1] * 1000, 100), BenchRequest([1] * 3000, 300)]
    cost = CostModel(prefill_rate=1000.0)
    parts = sum_of_parts(reqs, cost)
    assert parts["prefill_s"] == pytest.approx(4.0)
    assert parts["measured_s"] == pytest.approx(4.0 + 400 / 13090)
    context = (1000 * 100 + 100**2 / 2 + 3000 * 300 + 300**2 / 2) / 400
    assert parts["decode_context"] == pytest.approx(context)
    assert parts["model_req_s"] == pytest.approx(2 / parts["model_s"])


@pytest.mark.slow  # a scheduler over a tiny model, a few hundred steps
def test_a_simulated_run_completes_and_the_bound_holds(tmp_path: Path) -> None:
    folder = make_model_folder(tmp_path / "m", dict(TINY_LLAMA, max_position_embeddings=CONTEXT))
    reqs = long_tailed_requests(RandomTokens(2048), 24, 600, 24, 4000, 64, seed=3)
    cost = CostModel()
    got = {}
    for label, flags in (
        ("alone", "--disable-mixed-chunk"),
        ("mixed", "--enable-mixed-chunk"),
        ("bounded", "--mixed-step-target-ms 50"),
        ("paced", "--disable-mixed-chunk --tpot-target-ms 50"),
    ):
        cfg = server_config(flags, str(folder))
        got[label] = simulate(cfg, reqs, 20.0, cost, Slo(), seed=3)
    for s in got.values():
        assert s["completed"] == 24 and s["failed"] == 0
        assert s["goodput_arrivals"] is not None
    assert got["alone"]["step_timeline"]["mixed_share"] == 0
    bounded = got["bounded"]["step_timeline"]
    assert bounded["mixed_share"] > 0
    assert bounded["retractions"] == 0
    # the measured rate (step time, decode rows included) never beats the modelled prefill rate
    assert 0 < bounded["max_mixed_prefill_tokens"] <= int(cost.prefill_rate * 0.050)
    assert got["mixed"]["step_timeline"]["max_mixed_prefill_tokens"] > cost.prefill_rate * 0.050
    assert got["paced"]["step_timeline"]["mixed_share"] == 0


@pytest.mark.slow  # two runs of a scheduler over a tiny model
def test_a_burst_stalls_running_requests_unless_the_prefill_is_paced(tmp_path: Path) -> None:
    """24 prompts of about 2,000 tokens at once: prefill first runs every chunk before the
    first requests' second token; paced at 50 ms, time per token stays within the target."""
    folder = make_model_folder(tmp_path / "m", dict(TINY_LLAMA, max_position_embeddings=CONTEXT))
    reqs = long_tailed_requests(RandomTokens(2048), 24, 2000, 64, 4000, 128, seed=3)
    cost = CostModel()
    alone, paced = (
        simulate(server_config(f, str(folder)), reqs, 1000.0, cost, Slo(), seed=3)
        for f in ("--disable-mixed-chunk", "--disable-mixed-chunk --tpot-target-ms 50")
    )
    assert alone["completed"] == paced["completed"] == 24
    assert alone["tpot_ms"]["p99"] > 60  # the queue's 1.1 s of prefill in one stall
    assert paced["tpot_ms"]["p99"] <= 50


def test_priorities_reach_the_scheduler_and_each_class_is_reported(tmp_path: Path) -> None:
    """A burst of 24 prompts, every sixth of high priority: with priority scheduling the high
    class is prefilled first (its slowest request before the low class's median); without it,
    the classes are served in arrival order."""
    folder = make_model_folder(tmp_path / "m", dict(TINY_LLAMA, max_position_embeddings=CONTEXT))
    reqs = long_tailed_requests(RandomTokens(2048), 24, 2000, 16, 4000, 32, seed=3)
    priorities = {id(r): 100 if i % 6 == 5 else 0 for i, r in enumerate(reqs)}
    got = {
        on: simulate(
            server_config(flags, str(folder)), reqs, 1000.0, CostModel(), Slo(), 3, priorities
        )["by_priority"]
        for on, flags in ((True, "--enable-priority-scheduling"), (False, ""))
    }
    for by_class in got.values():
        assert (by_class["100"]["requests"], by_class["0"]["requests"]) == (4, 20)
    assert got[True]["100"]["ttft_ms"]["p99"] < got[True]["0"]["ttft_ms"]["p50"]
    assert got[False]["100"]["ttft_ms"]["p50"] > got[True]["100"]["ttft_ms"]["p99"]
