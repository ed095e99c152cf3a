"""bench_serving at capacity: clipping to the context, --goodput, the capacity and its search,
the plot, the step timeline and its summary; a CPU run of the issue's command on --dummy-tiny."""

from __future__ import annotations

import importlib.util
import math

import orjson
import pytest

from radixlm.srt.bench.bench_serving import main, parse_args
from radixlm.srt.bench.datasets import BenchRequest
from radixlm.srt.bench.serving_capacity import (
    capacity,
    clip_to_context,
    next_probe,
    parse_goodput,
    plot,
    priority_classes,
    ttft_by_priority,
)
from radixlm.srt.bench.serving_report import RequestOutput
from radixlm.srt.bench.step_timeline import (
    decode_part_ms,
    price_steps,
    read_records,
    summarize_steps,
)
from radixlm.srt.scheduler.timeline import FileTimeline, StepTimeline


def test_requests_longer_than_the_context_are_clipped_prompt_first() -> None:
    reqs = [
        BenchRequest(list(range(10)), 5),
        BenchRequest(list(range(100)), 20, group=1, shared_prefix_len=90),
        BenchRequest(list(range(3)), 500),
    ]
    out, clipped = clip_to_context(reqs, 50)
    assert clipped == 2
    assert out[0] is reqs[0]
    assert (out[1].input_ids, out[1].output_len) == (list(range(30)), 20)
    assert out[1].shared_prefix_len == 30 and out[1].group == 1
    assert (len(out[2].input_ids), out[2].output_len) == (1, 49)
    assert all(len(r.input_ids) + r.output_len <= 50 for r in out)


def test_goodput_flag_sets_the_slo_in_milliseconds() -> None:
    assert parse_goodput(["ttft:500", "tpot:40"]) == {"slo_ttft_s": 0.5, "slo_tpot_ms": 40.0}
    for bad in (["e2e:5"], ["ttft"], ["ttft:x"], ["tpot:0"]):
        with pytest.raises(ValueError, match="--goodput"):
            parse_goodput(bad)
    args, _ = parse_args(["--goodput", "ttft:250", "tpot:20"])
    assert (args.slo_ttft_s, args.slo_tpot_ms) == (0.25, 20.0)
    with pytest.raises(SystemExit):
        parse_args(["--goodput", "itl:3"])


def _s(goodput: float) -> dict:
    pct = {"p50": 1.0, "p99": 2.0}
    return {"goodput": goodput, "request_throughput": goodput, "ttft_ms": pct, "tpot_ms": pct}


def test_capacity_is_the_highest_rate_meeting_90_percent_and_the_search_bisects() -> None:
    rates = [2.0, 4.0, 8.0, math.inf]
    sums = [_s(1.9), _s(3.7), _s(5.0), _s(6.0)]
    assert capacity(rates, sums) == 4.0
    assert next_probe(rates, sums) == 6.0
    assert next_probe([2.0, math.inf], [_s(2.0), _s(3.0)]) is None  # nothing failed
    assert capacity([8.0], [_s(1.0)]) is None
    assert next_probe([8.0], [_s(1.0)]) == 4.0


def test_priority_classes_and_their_ttft(capsys) -> None:
    reqs = [BenchRequest([1], 1) for _ in range(200)]
    assert priority_classes(reqs, 0.0, 100, 1) is None
    classes = priority_classes(reqs, 0.25, 100, 1)
    assert classes == priority_classes(reqs, 0.25, 100, 1)  # fixed by the seed
    high = [r for r in reqs if classes[id(r)] == 100]
    assert 30 <= len(high) <= 70 and set(classes.values()) == {0, 100}
    outs = [RequestOutput(success=True, ttft_s=0.1 if classes[id(r)] else 2.0) for r in reqs]
    got = ttft_by_priority(reqs, outs, classes)
    assert got["100"]["requests"] == len(high) and got["100"]["ttft_ms"]["p50"] == 100.0
    assert got["0"]["ttft_ms"]["p99"] == 2000.0
    assert "priority 100:" in capsys.readouterr().out


def test_plot_writes_a_png_or_says_why_not(tmp_path, capsys) -> None:
    path = tmp_path / "rates.png"
    made = plot([2.0, 4.0, math.inf], [_s(2.0), _s(3.0), _s(3.5)], str(path))
    if importlib.util.find_spec("matplotlib") is None:
        assert not made and "matplotlib is not installed" in capsys.readouterr().out
    else:
        assert made and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


class _Sched:  # what the timeline reads of a scheduler
    def __init__(self) -> None:
        self.running, self.waiting = [], []
        self.num_retractions = self.num_preemptions = 0


class _Req:
    def __init__(self, n: int) -> None:
        self.n = n


class _Batch:
    def __init__(self, reqs, lens, starts=None) -> None:
        self.reqs, self.extend_lens = reqs, lens
        self.starts = starts or [0] * len(reqs)


def test_timeline_records_each_step_and_the_summary_shares(tmp_path) -> None:
    path = tmp_path / "steps.jsonl"
    tl = FileTimeline(open(path, "ab"))
    s = _Sched()
    a, b, c = _Req(1), _Req(2), _Req(3)
    s.waiting = [c]
    steps = [
        ([a], [40], [0], []),
        ([a, b], [1, 30], [40, 0], [a]),
        ([a, b], [1, 1], [41, 30], [a, b]),
        (None, None, None, []),
    ]
    for reqs, lens, starts, running in steps:
        tl.begin(s)
        s.running = running
        tl.batch(s, None if reqs is None else _Batch(reqs, lens, starts))
        if reqs is not None and len(reqs) == 2 and lens == [1, 1]:
            s.num_retractions += 1
        tl.end(s)
    records, offset = read_records(path)
    assert offset == path.stat().st_size and len(records) == 3  # a step without a batch: none
    assert [(r["decode_rows"], r["prefill_tokens"]) for r in records] == [(0, 40), (1, 30), (2, 0)]
    assert [r["decode_context"] for r in records] == [0, 41, 42 + 31]
    assert records[2]["retractions"] == 1 and records[0]["waiting"] == 1
    summ = summarize_steps(records)
    assert summ["steps"] == 3
    assert summ["prefill_share"] == summ["mixed_share"] == summ["decode_share"] == 1 / 3
    assert summ["mean_decode_batch"] == 1.5 and summ["mean_decode_only_batch"] == 2
    assert summ["mean_prefill_tokens"] == 35 and summ["retractions"] == 1
    assert 0 <= summ["idle_share"] < 1
    assert summ["mean_mixed_prefill_tokens"] == summ["max_mixed_prefill_tokens"] == 30
    assert summ["mean_decode_context"] == (41 + 73) / 3
    times = [dict(r, step_s=t) for r, t in zip(records, (0.5, 1.0, 0.1), strict=True)]
    rates = summarize_steps(times)
    assert (rates["prefill_rate_alone"], rates["prefill_rate_mixed"]) == (80, 30)
    assert rates["mean_mixed_step_ms"] == 1000
    assert read_records(path, offset) == ([], offset)
    assert summarize_steps([]) == {"steps": 0}


def test_sum_of_parts_prices_each_step_at_the_measured_speeds() -> None:
    """A step's part: its prefill tokens at the full-chunk rate plus its decode rows at the time
    measured for that batch size (linear between sizes, along the end segment beyond them), the
    context correction in bytes at the bandwidth; the ratio is parts over the span."""
    measured = {1: 6.0, 64: 12.0, 128: 20.0}
    assert decode_part_ms(1, measured) == 6.0 and decode_part_ms(96, measured) == 16.0
    assert decode_part_ms(192, measured) == 28.0  # beyond: the 64-128 slope
    assert decode_part_ms(0, {8: 5.0}) == 5.0
    steps = [
        {"t": 0.0, "step_s": 0.2, "prefill_tokens": 8000, "decode_rows": 0, "decode_context": 0},
        {
            "t": 0.2,
            "step_s": 0.1,
            "prefill_tokens": 4000,
            "decode_rows": 64,
            "decode_context": 64000,
        },
        {
            "t": 0.4,
            "step_s": 0.1,
            "prefill_tokens": 0,
            "decode_rows": 128,
            "decode_context": 128000,
        },
    ]
    parts = price_steps(steps, 40000.0, measured)
    assert parts["span_s"] == 0.5
    assert (
        abs(parts["prefill_part_s"] - 0.3) < 1e-12 and abs(parts["decode_part_s"] - 0.032) < 1e-12
    )
    assert abs(parts["ratio"] - 0.332 / 0.5) < 1e-12
    # rows that read 1,000 tokens each where the measurement read 500: 500 more a row at
    # 1e6 bytes a token over 1,000 GB/s is 0.5 ms more a row
    more = price_steps(steps, 40000.0, measured, 500, 1e6, 1000.0)
    assert abs(more["decode_part_s"] - (0.032 + 192 * 0.0005)) < 1e-12
    assert type(StepTimeline()).__name__ == "StepTimeline"  # off: records nothing


@pytest.mark.slow
def test_the_issue_command_runs_on_the_cpu_with_a_tiny_random_model(tmp_path, capsys) -> None:
    timeline = tmp_path / "steps.jsonl"
    summaries = main(
        [
            *("--dummy-tiny", "--dataset-name", "sharegpt-like", "--num-prompts", "6"),
            *("--random-input-len", "600", "--max-input-len", "16384"),
            *("--random-output-len", "4", "--max-output-len", "8"),
            *("--request-rates", "50,inf", "--max-running-requests", "256"),
            *("--goodput", "ttft:100000", "tpot:100000", "--capacity-search", "1"),
            *("--step-timeline", str(timeline), "--plot", str(tmp_path / "p.png")),
            *("--max-total-tokens", "512"),  # prompts over 512 tokens: clipped
            *("--high-priority-share", "0.5", "--enable-priority-scheduling"),
            *("--parts", "--parts-batch-sizes", "1,4", "--parts-prompt-len", "24"),
            *("--parts-decode-tokens", "8"),
        ]
    )
    out = capsys.readouterr().out
    assert "clipped" in out and "to fit the served context of 512 tokens" in out
    # 6 requests cannot make 50 req/s of goodput: one search step, at 25 req/s
    assert len(summaries) == 3 and "Request rate (req/s)                                25.0" in out
    for s in summaries:
        assert s["failed"] == 0 and s["step_timeline"]["steps"] > 0
        assert sum(c["requests"] for c in s["by_priority"].values()) == 6
    assert "capacity: " in out and (tmp_path / "p.png").exists() == bool(
        importlib.util.find_spec("matplotlib")
    )
    records = [orjson.loads(line) for line in timeline.read_bytes().splitlines()]
    assert sum(r["prefill_reqs"] for r in records) >= 12  # both rates (and the warm-up)
    # --parts: the full-chunk prefill (510 tokens: the context) and 1 and 4 rows decoding
    # together, measured after the rates on the same server; every rate priced at them
    parts = summaries[0]["parts"]
    assert parts["prefill_prompt_len"] == 510 and parts["prefill_tok_s"] > 0
    assert sorted(parts["decode_ms"]) == [1, 4] and all(
        ms > 0 for ms in parts["decode_ms"].values()
    )
    assert "parts (this server, alone): prefill" in out
    for s in summaries:
        priced = s["sum_of_parts"]
        assert priced["span_s"] > 0 and priced["parts_s"] > 0 and 0 < priced["ratio"]
    assert out.count("at the parts' speed") == 3
