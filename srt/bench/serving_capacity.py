"""What ``bench_serving`` adds around its runs: prompts clipped to the served context, the
``--goodput`` SLO spelling, the capacity search and the plot of latency and goodput against
the offered rate.

Capacity: the highest offered rate (requests/s) whose goodput is at least ``CAPACITY_SHARE``
of it. ``--capacity-search N`` runs N more rates after those of ``--request-rates``, each the
midpoint between the highest rate that met the share and the lowest one above it that did not
(bisection; it assumes goodput falls once the server is saturated).

Priority classes (``--high-priority-share``): a share of the requests sends a high priority,
the rest priority 0, and each class's TTFT is reported apart, to compare a high-priority
request's TTFT under a saturating low-priority load with an idle server's (a low rate).
"""

from __future__ import annotations

import math
import random
from dataclasses import replace
from typing import Any

from radixlm.srt.bench.datasets import BenchRequest
from radixlm.srt.bench.serving_report import percentiles

CAPACITY_SHARE = 0.9
GOODPUT_KEYS = {"ttft": "slo_ttft_s", "tpot": "slo_tpot_ms"}


def priority_classes(
    reqs: list[BenchRequest], share: float, high: int, seed: int
) -> dict[int, int] | None:
    """``id(request) -> priority``: a random ``share`` of the requests (fixed by ``seed``) gets
    ``high``, the others 0; None when ``share`` is 0 (no priorities sent)."""
    if share <= 0:
        return None
    rng = random.Random(seed + 7)
    return {id(r): high if rng.random() < share else 0 for r in reqs}


def ttft_by_priority(
    reqs: list[BenchRequest], outs: list[Any], priorities: dict[int, int]
) -> dict[str, Any]:
    """TTFT percentiles (ms) of each priority class's successful requests; printed."""
    out: dict[str, Any] = {}
    for prio in sorted(set(priorities.values()), reverse=True):
        ttfts = [
            o.ttft_s
            for r, o in zip(reqs, outs, strict=True)
            if priorities[id(r)] == prio and o.success
        ]
        p = percentiles(ttfts)
        out[str(prio)] = {"requests": len(ttfts), "ttft_ms": p}
        print(
            f"priority {prio}: {len(ttfts)} requests, TTFT p50 {p['p50']:.1f} ms, "
            f"p99 {p['p99']:.1f} ms",
            flush=True,
        )
    return out


def parse_goodput(items: list[str]) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` (milliseconds) -> ``{"slo_ttft_s": 0.5, "slo_tpot_ms": 50}``."""
    out: dict[str, float] = {}
    for item in items:
        key, sep, value = item.partition(":")
        if not sep or key not in GOODPUT_KEYS:
            raise ValueError(f"--goodput takes ttft:MS and tpot:MS (milliseconds), got {item!r}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(
                f"--goodput {key} must be a number of milliseconds: {item!r}"
            ) from None
        if not ms > 0:
            raise ValueError(f"--goodput {key} must be > 0 ms, got {item!r}")
        out[GOODPUT_KEYS[key]] = ms / 1000 if key == "ttft" else ms
    return out


def clip_to_context(reqs: list[BenchRequest], max_tokens: int) -> tuple[list[BenchRequest], int]:
    """Each request cut so that prompt + output fit ``max_tokens`` (the served context): the
    prompt first (keeping at least one token), then the output; and how many were cut."""
    out, clipped = [], 0
    for req in reqs:
        if len(req.input_ids) + req.output_len <= max_tokens:
            out.append(req)
            continue
        clipped += 1
        output_len = min(req.output_len, max_tokens - 1)
        prompt = req.input_ids[: max(1, max_tokens - output_len)]
        out.append(
            replace(
                req,
                input_ids=prompt,
                output_len=output_len,
                shared_prefix_len=min(req.shared_prefix_len, len(prompt)),
            )
        )
    return out, clipped


def meets_capacity(rate: float, summary: dict[str, Any], share: float = CAPACITY_SHARE) -> bool:
    return math.isfinite(rate) and summary["goodput"] >= share * rate


def capacity(rates: list[float], summaries: list[dict[str, Any]]) -> float | None:
    """The highest finite rate that met the share (None: none did)."""
    met = [r for r, s in zip(rates, summaries, strict=True) if meets_capacity(r, s)]
    return max(met, default=None)


def next_probe(rates: list[float], summaries: list[dict[str, Any]]) -> float | None:
    """The next rate of the search: halfway between the highest rate that met the share (0
    when none did) and the lowest finite one above it that did not; None when no finite rate
    failed (nothing to search)."""
    best = capacity(rates, summaries) or 0.0
    above = [
        r
        for r, s in zip(rates, summaries, strict=True)
        if math.isfinite(r) and r > best and not meets_capacity(r, s)
    ]
    if not above:
        return None
    return (best + min(above)) / 2


def print_capacity(rates: list[float], summaries: list[dict[str, Any]]) -> None:
    cap = capacity(rates, summaries)
    share = f"goodput >= {CAPACITY_SHARE:.0%} of the offered rate"
    if cap is None:
        print(f"capacity: no rate run met {share}")
    else:
        print(f"capacity: {cap:.2f} req/s (the highest rate run with {share})")


def plot(rates: list[float], summaries: list[dict[str, Any]], path: str) -> bool:
    """A PNG of TTFT and TPOT (p50, p99) and goodput against the offered rate (finite rates
    only, plots.py); False, with a message, when matplotlib is not installed."""
    from radixlm.srt.bench.plots import plot_serving_rates

    points = sorted((r, s) for r, s in zip(rates, summaries, strict=True) if math.isfinite(r))
    if not points:
        print("no plot: no finite request rate was run")
        return False
    made = plot_serving_rates(points, CAPACITY_SHARE, path)
    print(f"plot: {made}" if made else "no plot: matplotlib is not installed (radixlm[plots])")
    return made is not None
