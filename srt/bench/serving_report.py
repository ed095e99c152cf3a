"""What ``bench_serving`` measures per request, and its summary: latency percentiles, request
and token throughput, goodput under an SLO, and per-worker prefix-cache figures behind a router.

Definitions (as ``sglang.bench_serving``): TTFT is the time from sending a request to its first
streamed token; ITL the gaps between later tokens (an event carrying several tokens spreads its
gap over them); TPOT a request's ``(latency - TTFT) / (output tokens - 1)``. A request meets
the SLO when it succeeded with ``TTFT <= slo.ttft_s`` and ``TPOT <= slo.tpot_ms`` (a one-token
output has no TPOT: only its TTFT counts). Three figures follow from it:

- goodput (SGLang's): requests meeting the SLO per second of the whole run, from the first
  request sent to the last one finished. The run ends with a drain (the requests still running
  after the last arrival), so even when every request meets the SLO this is below the offered
  rate: at 8 req/s, 200 requests arrive in about 25 s and a drain of 6 s caps it near 80%;
- SLO attainment: the share of the requests sent that met the SLO (no time in it);
- goodput over the arrival window: SLO attainment times the measured arrival rate, ``(n - 1) /
  seconds between the first and the last arrival`` of the n requests; it equals the arrival rate
  (about the offered rate) when every request meets the SLO, so it is the figure to hold against
  "goodput >= X% of the offered rate". None for an infinite rate (all arrive at once).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np


@dataclass
class RequestOutput:
    success: bool = False
    error: str = ""
    prompt_len: int = 0
    output_len: int = 0
    cached_tokens: int = 0
    ttft_s: float = 0.0
    latency_s: float = 0.0
    arrival_s: float = 0.0  # when the benchmark issued it (perf_counter), before any wait
    itl_s: list[float] = field(default_factory=list)  # one gap per streamed token after the first

    @property
    def tpot_s(self) -> float | None:
        if self.output_len < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.output_len - 1)


@dataclass(frozen=True)
class Slo:
    ttft_s: float = 1.0
    tpot_ms: float = 50.0

    def met_by(self, o: RequestOutput) -> bool:
        tpot = o.tpot_s
        return (
            o.success
            and o.ttft_s <= self.ttft_s
            and (tpot is None or tpot * 1000.0 <= self.tpot_ms)
        )


def percentiles(values: list[float]) -> dict[str, float]:
    """Mean, p50, p90 and p99 in milliseconds of values in seconds (NaN when empty)."""
    if not values:
        return {"mean": float("nan"), "p50": float("nan"), "p90": float("nan"), "p99": float("nan")}
    a = np.asarray(values) * 1000.0
    return {
        "mean": float(a.mean()),
        "p50": float(np.percentile(a, 50)),
        "p90": float(np.percentile(a, 90)),
        "p99": float(np.percentile(a, 99)),
    }


def summarize(outs: list[RequestOutput], duration_s: float, slo: Slo = Slo()) -> dict[str, Any]:
    ok = [o for o in outs if o.success]
    input_tokens = sum(o.prompt_len for o in ok)
    output_tokens = sum(o.output_len for o in ok)
    good = sum(slo.met_by(o) for o in outs)
    attainment = good / len(outs) if outs else 0.0
    arrivals = [o.arrival_s for o in outs]
    window = max(arrivals) - min(arrivals) if len(outs) > 1 else 0.0
    arrival_rate = (len(outs) - 1) / window if window > 0 else None
    return {
        "completed": len(ok),
        "failed": len(outs) - len(ok),
        "duration_s": duration_s,
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "request_throughput": len(ok) / duration_s,
        "input_throughput": input_tokens / duration_s,
        "output_throughput": output_tokens / duration_s,
        "goodput": good / duration_s,
        "slo_attainment": attainment,
        "arrival_window_s": window,
        "arrival_rate": arrival_rate,
        "goodput_arrivals": None if arrival_rate is None else attainment * arrival_rate,
        "slo": {"ttft_s": slo.ttft_s, "tpot_ms": slo.tpot_ms},
        "hit_rate": sum(o.cached_tokens for o in ok) / input_tokens if input_tokens else 0.0,
        "ttft_ms": percentiles([o.ttft_s for o in ok]),
        "itl_ms": percentiles([x for o in ok for x in o.itl_s]),
        "tpot_ms": percentiles([t for o in ok if (t := o.tpot_s) is not None]),
        "e2e_ms": percentiles([o.latency_s for o in ok]),
    }


# ---------------------------------------------------------------------- workers behind a router
def read_worker_totals(urls: list[str]) -> list[dict[str, int]]:
    """Each worker's cumulative prefix-cache counters (``prefix_cache`` of its scheduler's
    state in ``/get_server_info``): requests admitted, prompt tokens, cached prompt tokens."""
    out = []
    for url in urls:
        info = httpx.get(url.rstrip("/") + "/get_server_info", timeout=30).json()
        state = (info.get("internal_states") or [info.get("kv_pool") or {}])[0]
        if "prefix_cache" not in state:
            raise ValueError(f"{url}/get_server_info has no prefix_cache figures (not radixlm?)")
        out.append(dict(state["prefix_cache"]))
    return out


def worker_deltas(
    urls: list[str], before: list[dict[str, int]], after: list[dict[str, int]]
) -> list[dict[str, Any]]:
    """Per worker: requests it admitted between the two readings and its prefix-cache hit rate
    over their prompts."""
    rows = []
    for url, b, a in zip(urls, before, after, strict=True):
        reqs = a["num_admitted_reqs"] - b["num_admitted_reqs"]
        prompt = a["num_prompt_tokens"] - b["num_prompt_tokens"]
        cached = a["num_cached_tokens"] - b["num_cached_tokens"]
        rows.append(
            {
                "url": url,
                "requests": reqs,
                "prompt_tokens": prompt,
                "cached_tokens": cached,
                "hit_rate": cached / prompt if prompt else 0.0,
            }
        )
    return rows


# ---------------------------------------------------------------------- printing
def print_report(s: dict[str, Any], header: list[tuple[str, Any]], best: float | None) -> None:
    """One rate's table: the run's settings (``header``), throughput, goodput, latencies."""
    slo = s["slo"]
    rows = [
        *header,
        ("Successful requests", s["completed"]),
        ("Failed requests", s["failed"]),
        ("Benchmark duration (s)", f"{s['duration_s']:.2f}"),
        ("Total input tokens", s["input_tokens"]),
        ("Total output tokens", s["output_tokens"]),
        ("Request throughput (req/s)", f"{s['request_throughput']:.2f}"),
        ("Input token throughput (tok/s)", f"{s['input_throughput']:.1f}"),
        ("Output token throughput (tok/s)", f"{s['output_throughput']:.1f}"),
        ("SLO (TTFT / TPOT)", f"{slo['ttft_s']:g} s / {slo['tpot_ms']:g} ms"),
        ("Goodput (req/s, whole run)", f"{s['goodput']:.2f}"),
        ("SLO attainment", f"{s['slo_attainment']:.1%}"),
        ("Arrival rate (req/s, measured)", _num(s.get("arrival_rate"))),
        ("Goodput over arrivals (req/s)", _num(s.get("goodput_arrivals"))),
        (
            "Cache hit rate",
            f"{s['hit_rate']:.1%}" + (f" (best possible {best:.1%})" if best is not None else ""),
        ),
    ]
    print(f"{' Serving benchmark ':=^56}")
    for name, value in rows:
        print(f"{name:<36}{value!s:>20}")
    print(f"{'latency (ms)':<16}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}")
    for label, key in (
        ("TTFT", "ttft_ms"),
        ("ITL", "itl_ms"),
        ("TPOT", "tpot_ms"),
        ("E2E", "e2e_ms"),
    ):
        p = s[key]
        print(f"{label:<16}{p['mean']:>10.1f}{p['p50']:>10.1f}{p['p90']:>10.1f}{p['p99']:>10.1f}")
    for w in s.get("workers", []):
        print(
            f"worker {w['url']}: {w['requests']} requests, "
            f"{w['prompt_tokens']} prompt tokens, hit rate {w['hit_rate']:.1%}"
        )
    print("=" * 56)


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def print_rate_table(rates: list[float], summaries: list[dict[str, Any]]) -> None:
    """One line per request rate: throughput, goodput (whole run), SLO attainment, goodput over
    the arrival window, and the p50 / p99 latencies."""
    cols = ("rate", "req/s", "out tok/s", "goodput", "SLO met", "gp arr", "TTFT p50", "p99")
    cols += ("TPOT p50", "p99", "ITL p50", "p99")
    print(("{:>10}" * len(cols)).format(*cols))
    for rate, s in zip(rates, summaries, strict=True):
        values = [
            f"{rate:g}",
            f"{s['request_throughput']:.2f}",
            f"{s['output_throughput']:.1f}",
            f"{s['goodput']:.2f}",
            f"{s['slo_attainment']:.1%}",
            _num(s.get("goodput_arrivals")),
        ]
        for key in ("ttft_ms", "tpot_ms", "itl_ms"):
            values += [f"{s[key]['p50']:.1f}", f"{s[key]['p99']:.1f}"]
        print(("{:>10}" * len(values)).format(*values))
    print(
        "(latencies in ms; goodput: requests/s meeting the SLO over the whole run, drain "
        "included; SLO met: share of requests meeting it; gp arr: SLO met x the measured "
        "arrival rate, the goodput over the arrival window)"
    )
