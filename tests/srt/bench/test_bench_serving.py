"""bench_serving's figures: the summary and goodput math on hand-made requests, the rate list,
the long-tailed lengths, per-worker deltas, and a short run against a real server on a tiny
model (two rates, the server read as its own worker)."""

from __future__ import annotations

import argparse
import math
import statistics

import pytest

from radixlm.srt.bench.bench_serving import Progress, main, parse_args, parse_rates
from radixlm.srt.bench.datasets import RandomTokens, long_tailed_requests
from radixlm.srt.bench.serving_report import RequestOutput, Slo, summarize, worker_deltas


def _out(ttft: float, tpot: float, n: int, success: bool = True) -> RequestOutput:
    return RequestOutput(
        success=success,
        prompt_len=100,
        output_len=n,
        cached_tokens=25,
        ttft_s=ttft,
        latency_s=ttft + tpot * (n - 1),
        itl_s=[tpot] * (n - 1),
    )


def test_summary_counts_goodput_against_both_slo_limits():
    outs = [
        _out(0.5, 0.040, 10),  # meets both
        _out(1.5, 0.010, 10),  # TTFT over 1 s
        _out(0.2, 0.060, 5),  # TPOT over 50 ms
        _out(0.9, 0.0, 1),  # one token: no TPOT, TTFT met
        _out(0.1, 0.010, 10, success=False),  # failed: never good
    ]
    s = summarize(outs, duration_s=2.0, slo=Slo(ttft_s=1.0, tpot_ms=50.0))
    assert (s["completed"], s["failed"]) == (4, 1)
    assert s["goodput"] == pytest.approx(2 / 2.0)
    assert s["slo_attainment"] == pytest.approx(2 / 5)
    assert s["request_throughput"] == pytest.approx(4 / 2.0)
    assert s["output_throughput"] == pytest.approx((10 + 10 + 5 + 1) / 2.0)
    assert s["hit_rate"] == pytest.approx(0.25)
    assert s["ttft_ms"]["p50"] == pytest.approx(statistics.median([500, 1500, 200, 900]))
    assert s["tpot_ms"]["mean"] == pytest.approx((40 + 10 + 60) / 3)  # one-token output left out
    assert s["itl_ms"]["p99"] == pytest.approx(60, abs=1e-6)
    # a looser SLO admits the slow ones
    assert summarize(outs, 2.0, Slo(ttft_s=2.0, tpot_ms=100.0))["goodput"] == pytest.approx(2.0)


def test_summary_of_nothing_is_nan_not_an_error():
    s = summarize([], 1.0)
    assert s["goodput"] == 0 and s["slo_attainment"] == 0
    assert math.isnan(s["ttft_ms"]["p50"])


def test_request_rates_parse_and_reject_nonpositive():
    assert parse_rates("2, 4,8,inf") == [2.0, 4.0, 8.0, float("inf")]
    for bad in ("0", "2,-1", "nan", "fast", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_rates(bad)


def test_long_tailed_lengths_have_the_asked_mean_and_a_tail():
    reqs = long_tailed_requests(RandomTokens(1000), 3000, 400, 100, 4000, 1000, 1.0, seed=3)
    assert reqs == long_tailed_requests(RandomTokens(1000), 3000, 400, 100, 4000, 1000, 1.0, 3)
    lens = [len(r.input_ids) for r in reqs]
    outs = [r.output_len for r in reqs]
    assert 340 < statistics.mean(lens) < 460 and 85 < statistics.mean(outs) < 115
    assert statistics.median(lens) < 0.75 * statistics.mean(lens)  # most prompts are short
    assert max(lens) > 4 * 400 and max(lens) <= 4000 and min(lens) >= 1
    with pytest.raises(ValueError, match="length-sigma"):
        long_tailed_requests(RandomTokens(1000), 3, 400, 100, 4000, 1000, 0.0)


def test_worker_deltas_give_requests_and_hit_rates():
    keys = ("num_admitted_reqs", "num_prompt_tokens", "num_cached_tokens")
    before = [dict(zip(keys, (3, 300, 0), strict=True)), dict(zip(keys, (0, 0, 0), strict=True))]
    after = [dict(zip(keys, (7, 700, 100), strict=True)), dict(zip(keys, (0, 0, 0), strict=True))]
    rows = worker_deltas(["a", "b"], before, after)
    assert rows[0] == {
        "url": "a",
        "requests": 4,
        "prompt_tokens": 400,
        "cached_tokens": 100,
        "hit_rate": 0.25,
    }
    assert rows[1]["requests"] == 0 and rows[1]["hit_rate"] == 0.0


def test_progress_prints_completed_over_total(capsys):
    p = Progress("rate 4", 20)
    for i in range(20):
        p.done(RequestOutput(success=i != 3))
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("[rate 4] 2/20 done, 0 failed")
    assert lines[-1].startswith("[rate 4] 20/20 done, 1 failed")
    assert len(lines) == 10


@pytest.mark.slow
def test_two_rates_against_a_tiny_model_server(tiny_llama_dir, start_server):
    server = start_server("--model-path", tiny_llama_dir, "--max-total-tokens", "4096")
    summaries = main(
        [
            *("--base-url", server.url, "--worker-urls", server.url),
            *("--dataset-name", "shared-prefix", "--gsp-num-groups", "2"),
            *("--gsp-prompts-per-group", "3", "--gsp-system-prompt-len", "48"),
            *("--gsp-question-len", "8", "--gsp-output-len", "4"),
            *("--request-rates", "50,inf", "--slo-ttft-s", "1000", "--slo-tpot-ms", "1e6"),
            *("--rate-prompts", "4,6"),  # the first 4 prompts at 50 req/s, all 6 at once
        ]
    )
    assert len(summaries) == 2
    for s, n in zip(summaries, (4, 6), strict=True):
        assert (s["completed"], s["failed"]) == (n, 0)
        assert s["output_tokens"] == n * 4
        assert s["goodput"] == pytest.approx(s["request_throughput"])  # every request meets it
        (worker,) = s["workers"]
        assert worker["requests"] == n  # the cache was flushed and the warm-up left out
        assert worker["prompt_tokens"] == s["input_tokens"]
        assert worker["hit_rate"] == pytest.approx(s["hit_rate"])
        assert worker["cached_tokens"] > 0


def test_rate_prompts_give_one_count_per_rate_and_build_the_largest():
    args, _ = parse_args(["--request-rates", "0.5,32", "--rate-prompts", "16,300"])
    assert (args.rate_prompts, args.num_prompts) == ([16, 300], 300)
    for bad in (["--rate-prompts", "16"], ["--rate-prompts", "16,0"], ["--rate-prompts", "a,b"]):
        with pytest.raises(SystemExit):
            parse_args(["--request-rates", "0.5,32", *bad])
    with pytest.raises(SystemExit):  # the search's probes would have no count
        parse_args(["--request-rates", "1,2", "--rate-prompts", "2,2", "--capacity-search", "1"])


def test_slo_attainment_and_goodput_over_the_arrival_window_ignore_the_drain():
    """Goodput over the whole run counts the drain after the last arrival; the SLO attainment
    and the goodput over the arrival window do not: 5 requests 0.25 s apart (4 req/s), every one
    meeting the SLO, finished 2 s after the last arrival."""
    outs = [_out(0.1, 0.01, 10) for _ in range(5)]
    for i, o in enumerate(outs):
        o.arrival_s = 100.0 + 0.25 * i
    s = summarize(outs, duration_s=1.0 + 2.0)
    assert s["goodput"] == pytest.approx(5 / 3.0)  # diluted by the drain
    assert s["slo_attainment"] == 1.0
    assert s["arrival_window_s"] == pytest.approx(1.0)
    assert s["arrival_rate"] == pytest.approx(4.0)
    assert s["goodput_arrivals"] == pytest.approx(4.0)  # the arrival rate: all met the SLO
    outs[0].ttft_s = 5.0  # one misses it
    assert summarize(outs, 3.0)["goodput_arrivals"] == pytest.approx(4.0 * 4 / 5)
    for o in outs:
        o.arrival_s = 7.0  # all at once (rate inf): no arrival window
    assert summarize(outs, 3.0)["goodput_arrivals"] is None
