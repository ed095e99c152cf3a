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

``--prefill-tok-s R --decode-ms 1:6.1,64:14.2,200:25.0`` adds the run's sum of parts: what its
steps would cost at the speeds of the parts measured alone (prefill at R tokens/s, the full
chunk; a decode step of B rows at the time measured for B, linear between the measured sizes
and beyond them along the nearest segment), against the span the steps took. With
``--decode-context-len C --kv-bytes-per-token K --bandwidth-gbs W`` a decode step's part is
corrected for the context its rows read (measured with C tokens a row; each token more or less
costs K bytes at W GB/s). A mixed step's part is its prefill plus its decode rows.
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
        "mean_decode_context": (
            sum(s.get("decode_context", 0) for s in decoding)
            / max(1, sum(s["decode_rows"] for s in decoding))
        ),
        "max_waiting": max(s["waiting"] for s in steps),
        "retractions": sum(s.get("retractions", 0) for s in steps),
        "preemptions": sum(s.get("preemptions", 0) for s in steps),
    }


def decode_part_ms(rows: int, measured: dict[int, float]) -> float:
    """The measured decode-step time of ``rows`` rows: linear between the measured batch sizes,
    beyond them along the nearest segment (a single point: that time)."""
    sizes = sorted(measured)
    if len(sizes) == 1:
        return measured[sizes[0]]
    i = 1
    while i < len(sizes) - 1 and rows > sizes[i]:
        i += 1
    b0, b1 = sizes[i - 1], sizes[i]
    t0, t1 = measured[b0], measured[b1]
    return max(0.0, t0 + (t1 - t0) * (rows - b0) / (b1 - b0))


def price_steps(
    records: list[dict[str, Any]],
    prefill_tok_s: float,
    decode_ms: dict[int, float],
    context_len: float | None = None,
    kv_bytes_per_token: float = 0.0,
    bandwidth_gbs: float = 0.0,
) -> dict[str, float]:
    """Seconds the steps would take at the parts' measured speeds, against their span."""
    if not records:
        return {"span_s": 0.0, "parts_s": 0.0, "ratio": 0.0}
    prefill = decode = 0.0
    for s in records:
        prefill += s["prefill_tokens"] / prefill_tok_s
        rows = s["decode_rows"]
        if not rows:
            continue
        t = decode_part_ms(rows, decode_ms) / 1000
        if context_len is not None and bandwidth_gbs > 0 and "decode_context" in s:
            extra = s["decode_context"] - rows * context_len
            t = max(0.0, t + extra * kv_bytes_per_token / (bandwidth_gbs * 1e9))
        decode += t
    first, last = records[0], records[-1]
    span = last["t"] + last["step_s"] - first["t"]
    parts = prefill + decode
    return {
        "span_s": span,
        "parts_s": parts,
        "prefill_part_s": prefill,
        "decode_part_s": decode,
        "ratio": parts / span if span > 0 else 0.0,
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
        f"{s['mean_step_ms']:.1f} ms; {s.get('mean_decode_context', 0):.0f} context tokens a decode "
        f"row; most waiting {s['max_waiting']}; "
        f"{s['retractions']} retractions ({s['preemptions']} for priority)",
        flush=True,
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("path", help="a timeline file written with RADIXLM_STEP_TIMELINE")
    ap.add_argument("--last", type=int, default=None, help="only the last N steps (one rate)")
    ap.add_argument("--prefill-tok-s", type=float, default=None, help="measured full-chunk rate")
    ap.add_argument(
        "--decode-ms", default=None, help="measured decode step times, B:ms,... (e.g. 1:6,64:14)"
    )
    ap.add_argument("--decode-context-len", type=float, default=None)
    ap.add_argument("--kv-bytes-per-token", type=float, default=0.0)
    ap.add_argument("--bandwidth-gbs", type=float, default=0.0)
    args = ap.parse_args(argv)
    records = read_records(args.path)[0]
    if args.last:
        records = records[-args.last :]
    summary = summarize_steps(records)
    print_summary(summary)
    if (args.prefill_tok_s is None) != (args.decode_ms is None):
        ap.error("--prefill-tok-s and --decode-ms go together")
    if args.prefill_tok_s is not None:
        if args.prefill_tok_s <= 0:
            ap.error("--prefill-tok-s must be > 0")
        try:
            pairs = [p.split(":") for p in args.decode_ms.split(",")]
            measured = {int(b): float(ms) for b, ms in pairs}
        except ValueError:
            ap.error(f"--decode-ms wants B:ms,B:ms..., got {args.decode_ms!r}")
        parts = price_steps(
            records,
            args.prefill_tok_s,
            measured,
            args.decode_context_len,
            args.kv_bytes_per_token,
            args.bandwidth_gbs,
        )
        print(
            f"sum of parts: prefill {parts['prefill_part_s']:.2f} s + decode "
            f"{parts['decode_part_s']:.2f} s = {parts['parts_s']:.2f} s of the {parts['span_s']:.2f} s "
            f"the steps spanned: {parts['ratio']:.1%}"
        )
        summary["parts"] = parts
    return summary


if __name__ == "__main__":
    main()
