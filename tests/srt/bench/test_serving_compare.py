"""serving_compare's table: bench_serving records of several variants, sorted by rate with the
variants in the order they ran, the step-timeline columns only where a timeline was read."""

from __future__ import annotations

import orjson

from radixlm.srt.bench.serving_compare import main


def _record(label: str, rate: float, goodput: float, timeline: bool) -> dict:
    pct = {"p50": 100.0, "p99": 900.0}
    rec = {
        "label": label,
        "request_rate": rate,
        "request_throughput": 7.5,
        "goodput": goodput,
        "goodput_arrivals": goodput * 1.2,
        "slo_attainment": 0.95,
        "ttft_ms": pct,
        "tpot_ms": pct,
    }
    if timeline:
        rec["step_timeline"] = {
            "steps": 10,
            "mixed_share": 0.5,
            "prefill_share": 0.1,
            "mean_prefill_tokens": 1500.0,
            "mean_decode_batch": 60.0,
            "prefill_rate_alone": 40000.0,
            "prefill_rate_mixed": 30000.0,
        }
    return rec


def test_rows_by_rate_then_variant_in_run_order(tmp_path, capsys) -> None:
    path = tmp_path / "mix.jsonl"
    records = [
        _record("default", 8, 6.0, True),
        _record("default", 12, 7.0, True),
        _record("bounded", 8, 7.6, False),
        _record("bounded", 12, 10.0, True),
    ]
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in records))
    rows = main([str(path)])
    assert [(r[0], r[1], r[3]) for r in rows] == [
        ("8", "default", "6.00"),
        ("8", "bounded", "7.60"),
        ("12", "default", "7.00"),
        ("12", "bounded", "10.00"),
    ]
    assert rows[0][4] == "7.20" and rows[0][5] == "95%"  # goodput over arrivals, attainment
    assert rows[0][-6:] == ["50%", "10%", "1500", "60.0", "40.0", "30.0"]
    assert rows[1][-6:] == ["-"] * 6  # no timeline in that run
    assert "gp arr" in capsys.readouterr().out
