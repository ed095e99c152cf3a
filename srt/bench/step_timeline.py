"""Summary of a scheduler step timeline (``RADIXLM_STEP_TIMELINE``, srt/scheduler/timeline.py).

    python -m radixlm.srt.bench.step_timeline /tmp/steps.jsonl

Per file (or per slice of one, as ``bench_serving --step-timeline`` reads it rate by rate): the
share of steps that are mixed (decode rows and a prefill piece), prefill-only and decode-only;
the idle share (host time between steps over the whole span: time the loop ran no step, so the
device had nothing queued by this loop); the mean decode batch (decode rows over steps that
decode) and its mean over decode-only steps; prefill tokens per prefill step, and per mixed step
(mean, most) with the mixed steps' mean time; prefill tokens per second of step time in
prefill-only and in mixed steps (what mixing costs per prefill token); retractions and
preemptions.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import orjson


def read_records(path: str | Path, offset: int = 0) -> tuple[list[dict], int]:
    """The records from byte ``offset`` on, and the offset after the last whole line."""
    with open(path, "rb") as f:
        f.seek(offset)
        data = f.read()
    end = data.rfind(b"\n") + 1
    records = [orjson.loads(line) for line in data[:end].splitlines() if line.strip()]
    return records, offset + end


def _rate(steps: list[dict[str, Any]]) -> float:
    seconds = sum(s["step_s"] for s in steps)
    return sum(s["prefill_tokens"] for s in steps) / seconds if seconds > 0 else 0.0


def summarize_steps(records: Iterable[dict[str, Any]]) -> dict[str, Any]:
    steps = list(records)
    n = len(steps)
    if n == 0:
        return {"steps": 0}
    mixed = [s for s in steps if s["decode_rows"] and s["prefill_tokens"]]
    prefill = [s for s in steps if s["prefill_tokens"] and not s["decode_rows"]]
    decode = [s for s in steps if s["decode_rows"] and not s["prefill_tokens"]]
    busy = sum(s["step_s"] for s in steps)
    idle = sum(s["idle_s"] for s in steps[1:])  # the first step's gap precedes the slice
    decoding = mixed + decode
    with_prefill = mixed + prefill
    return {
        "steps": n,
        "mixed_share": len(mixed) / n,
        "prefill_share": len(prefill) / n,
        "decode_share": len(decode) / n,
        "idle_share": idle / (busy + idle) if busy + idle > 0 else 0.0,
        "mean_decode_batch": (
            sum(s["decode_rows"] for s in decoding) / len(decoding) if decoding else 0.0
        ),
        "mean_decode_only_batch": (
            sum(s["decode_rows"] for s in decode) / len(decode) if decode else 0.0
        ),
        "mean_prefill_tokens": (
            sum(s["prefill_tokens"] for s in with_prefill) / len(with_prefill)
            if with_prefill
            else 0.0
        ),
        "mean_mixed_prefill_tokens": (
            sum(s["prefill_tokens"] for s in mixed) / len(mixed) if mixed else 0.0
        ),
        "max_mixed_prefill_tokens": max((s["prefill_tokens"] for s in mixed), default=0),
        "mean_mixed_step_ms": sum(s["step_s"] for s in mixed) / len(mixed) * 1000 if mixed else 0.0,
        # prefill tokens per second of step time: what a mixed step costs per prefill token
        # against a prefill-only one (both run synchronously, so step_s is device time)
        "prefill_rate_mixed": _rate(mixed),
        "prefill_rate_alone": _rate(prefill),
        "mean_step_ms": busy / n * 1000,
        "max_waiting": max(s["waiting"] for s in steps),
        "retractions": sum(s.get("retractions", 0) for s in steps),
        "preemptions": sum(s.get("preemptions", 0) for s in steps),
    }


def print_summary(s: dict[str, Any], label: str = "") -> None:
    if not s["steps"]:
        print(f"step timeline{label}: no steps recorded")
        return
    print(
        f"step timeline{label}: {s['steps']} steps, mixed {s['mixed_share']:.1%} / prefill "
        f"{s['prefill_share']:.1%} / decode {s['decode_share']:.1%}; idle {s['idle_share']:.1%}; "
        f"mean decode batch {s['mean_decode_batch']:.1f} (decode-only steps "
        f"{s['mean_decode_only_batch']:.1f}); prefill {s['mean_prefill_tokens']:.0f} tokens per "
        f"prefill step (mixed steps {s.get('mean_mixed_prefill_tokens', 0):.0f}, at most "
        f"{s.get('max_mixed_prefill_tokens', 0)}, {s.get('mean_mixed_step_ms', 0):.1f} ms); prefill tok/s {s.get('prefill_rate_alone', 0):.0f} "
        f"alone, {s.get('prefill_rate_mixed', 0):.0f} in mixed steps; step "
        f"{s['mean_step_ms']:.1f} ms; most waiting {s['max_waiting']}; "
        f"{s['retractions']} retractions ({s['preemptions']} for priority)",
        flush=True,
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("path", help="a timeline file written with RADIXLM_STEP_TIMELINE")
    args = ap.parse_args(argv)
    summary = summarize_steps(read_records(args.path)[0])
    print_summary(summary)
    return summary


if __name__ == "__main__":
    main()
