"""One table comparing server variants of ``bench_serving`` runs, rate by rate.

    python -m radixlm.srt.bench.serving_compare /tmp/servemix.jsonl

Reads the records ``bench_serving --output-file`` appends (one per rate; ``--label`` names the
variant, e.g. the server flags that differ) and prints, per rate and variant: requests/s, goodput
over the whole run and over the arrival window, SLO attainment, TTFT and TPOT p50 / p99 and,
when the run had ``--step-timeline``, the step mix (mixed / prefill-only share), prefill tokens
per prefill step, the mean decode batch and the prefill rate of prefill-only and of mixed steps (``serving_report.py`` and ``step_timeline.py`` have
the definitions).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import orjson

COLUMNS = (
    ("rate", 6),
    ("variant", 16),
    ("req/s", 7),
    ("goodput", 8),
    ("gp arr", 7),
    ("SLO met", 8),
    ("TTFT p50", 9),
    ("p99", 7),
    ("TPOT p50", 9),
    ("p99", 7),
    ("mixed", 6),
    ("prefill", 8),
    ("tok/pf", 7),
    ("dec bs", 7),
    ("pf k/s", 7),
    ("mix k/s", 8),
)


def read(paths: list[str]) -> list[dict[str, Any]]:
    records = []
    for path in paths:
        for line in Path(path).read_bytes().splitlines():
            if line.strip():
                records.append(orjson.loads(line))
    return records


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def _num(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def row(r: dict[str, Any]) -> list[str]:
    st = r.get("step_timeline") or {}
    timeline = (
        [
            _pct(st["mixed_share"]),
            _pct(st["prefill_share"]),
            _num(st["mean_prefill_tokens"], 0),
            _num(st["mean_decode_batch"], 1),
            _num(st.get("prefill_rate_alone", 0) / 1000, 1),
            _num(st.get("prefill_rate_mixed", 0) / 1000, 1),
        ]
        if st.get("steps")
        else ["-"] * 6
    )
    return [
        f"{r['request_rate']:g}",
        str(r.get("label") or "-"),
        _num(r["request_throughput"]),
        _num(r["goodput"]),
        _num(r.get("goodput_arrivals")),
        _pct(r["slo_attainment"]),
        _num(r["ttft_ms"]["p50"], 0),
        _num(r["ttft_ms"]["p99"], 0),
        _num(r["tpot_ms"]["p50"], 1),
        _num(r["tpot_ms"]["p99"], 1),
        *timeline,
    ]


def print_comparison(records: list[dict[str, Any]]) -> list[list[str]]:
    """Rows sorted by rate, variants in the order they ran; returns them (for tests)."""
    order = {}
    for r in records:
        order.setdefault(r.get("label"), len(order))
    rows = [
        row(r) for r in sorted(records, key=lambda r: (r["request_rate"], order[r.get("label")]))
    ]
    print("".join(f"{name:>{width}}" for name, width in COLUMNS))
    for values in rows:
        print("".join(f"{v:>{width}}" for v, (_, width) in zip(values, COLUMNS, strict=True)))
    print(
        "(goodput: req/s meeting the SLO over the whole run; gp arr: over the arrival window; "
        "SLO met: share of requests; ms; mixed / prefill: share of steps; tok/pf: prefill "
        "tokens per prefill step; dec bs: mean decode batch; pf / mix k/s: thousands of prefill "
        "tokens per second of prefill-only / mixed steps)"
    )
    return rows


def main(argv: list[str] | None = None) -> list[list[str]]:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("paths", nargs="+", help="bench_serving --output-file JSON lines")
    return print_comparison(read(ap.parse_args(argv).paths))


if __name__ == "__main__":
    main()
