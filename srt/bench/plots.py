"""PNG plots the benchmarks write beside their tables (matplotlib: the ``[plots]`` extra).

Every function returns the path it wrote, or None when matplotlib is not installed (the
benchmark then prints its tables only). Figures are small (about 800 x 450 px at 100 dpi).

- :func:`plot_ttft_per_round` (bench_multiturn): mean TTFT per round, one line per KV tier mode
- :func:`plot_step_breakdown` (decode_profile): where a decode step's time goes, per case
- :func:`plot_baseline_history` (baseline): each measurement's cost over the stored runs
- :func:`plot_serving_rates` (bench_serving): TTFT, TPOT and goodput against the offered rate
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

STEP_PARTS = ("gemm", "attention", "norm/rope/act", "copy/index", "sampling", "other", "cpu_gap")


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    fig.clear()
    return path


def plot_ttft_per_round(
    ttft_s: dict[str, list[float]],
    path: str | Path,
    hits: dict[str, dict[str, float | None]] | None = None,
    title: str = "TTFT per round",
) -> Path | None:
    """``ttft_s``: mode -> mean TTFT of each round (seconds); ``hits``: mode -> share of the
    queried tokens each tier served (device, host, disk), drawn as stacked bars beside."""
    plt = _pyplot()
    if plt is None:
        return None
    ncols = 2 if hits else 1
    fig, axes = plt.subplots(1, ncols, figsize=(8 if hits else 6, 4.5), squeeze=False)
    ax = axes[0][0]
    for mode, values in ttft_s.items():
        ax.plot(range(1, len(values) + 1), [v * 1e3 for v in values], marker="o", label=mode)
    ax.set_xticks(range(1, max((len(v) for v in ttft_s.values()), default=0) + 1))
    ax.set_xlabel("round")
    ax.set_ylabel("mean TTFT (ms)")
    ax.set_title(title)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    if hits:
        ax = axes[0][1]
        modes = list(hits)
        bottom = [0.0] * len(modes)
        for tier in ("device", "host", "disk"):
            values = [(hits[m].get(tier) or 0.0) * 100 for m in modes]
            ax.bar(modes, values, bottom=bottom, label=tier)
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
        ax.set_ylabel("queried tokens served (%)")
        ax.set_title("hits per tier")
        ax.set_ylim(0, 100)
        ax.legend()
    return _save(fig, path)


def plot_step_breakdown(
    cases: list[dict[str, Any]], path: str | Path, title: str = "where a decode step goes"
) -> Path | None:
    """``cases``: decode_profile's results (``category_ms``, ``cpu_gap_ms``, ``limit_ms`` and a
    label from ``batch``, ``backend``, ``kv_cache_dtype``): one stacked bar per case, with the
    bytes limit the step cannot beat as a tick."""
    plt = _pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(8, 4.5))
    labels = [
        f"b{c.get('batch')} {c.get('backend', '')} {c.get('kv_cache_dtype', '')}".strip()
        for c in cases
    ]
    bottom = [0.0] * len(cases)
    for part in STEP_PARTS:
        values = [
            c.get("cpu_gap_ms", 0.0) if part == "cpu_gap" else c["category_ms"].get(part, 0.0)
            for c in cases
        ]
        if any(values):
            ax.bar(labels, values, bottom=bottom, label=part.replace("_", " "))
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    limits = [c.get("limit_ms") for c in cases]
    if any(v is not None for v in limits):
        ax.scatter(labels, limits, marker="_", s=900, color="black", label="bytes limit")
    ax.set_ylabel("ms per decode step")
    ax.set_title(title)
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_baseline_history(runs: list[dict[str, Any]], path: str | Path) -> Path | None:
    """``runs``: the baseline store's runs of one machine, oldest first; one line per set and
    measurement, its cost relative to that set's first stored run (1.0), labelled by commit."""
    plt = _pyplot()
    if plt is None or not runs:
        return None
    fig, ax = plt.subplots(figsize=(8, 4.5))
    lines = sorted({(r["set"], n) for r in runs for n in r["results"] if n != "trace_hooks_off"})
    for set_name, name in lines:
        points = [
            (i, r["results"][name]["cost"])
            for i, r in enumerate(runs)
            if r["set"] == set_name and name in r["results"]
        ]
        first = points[0][1]
        ax.plot(
            [i for i, _ in points],
            [c / first for _, c in points],
            marker="o",
            label=f"{set_name}: {name}",
        )
    ax.set_xticks(range(len(runs)))
    ax.set_xticklabels(
        [f"{r['commit']}\n{r.get('set', '')}" for r in runs], fontsize=7, rotation=30
    )
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_ylabel("cost / the set's first stored run")
    ax.set_title("performance baseline history (lower is better)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_serving_rates(
    points: list[tuple[float, dict[str, Any]]], capacity_share: float, path: str | Path
) -> Path | None:
    """TTFT and TPOT (p50, p99, log scale) and goodput against the offered rate, from
    bench_serving's ``(rate, summary)`` pairs in rate order; the dashed line is the share of the
    offered rate that counts as served (the capacity rule)."""
    plt = _pyplot()
    if plt is None:
        return None
    xs = [r for r, _ in points]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, key, title in ((axes[0], "ttft_ms", "TTFT (ms)"), (axes[1], "tpot_ms", "TPOT (ms)")):
        for q in ("p50", "p99"):
            ax.plot(xs, [s[key][q] for _, s in points], marker="o", label=q)
        ax.set(xlabel="offered rate (req/s)", title=title)
        ax.set_yscale("log")
        ax.legend()
    ax = axes[2]
    ax.plot(xs, [s["goodput"] for _, s in points], marker="o", label="goodput")
    ax.plot(xs, [s["request_throughput"] for _, s in points], marker=".", label="throughput")
    ax.plot(xs, [capacity_share * x for x in xs], "--", label=f"{capacity_share:.0%} of offered")
    ax.set(xlabel="offered rate (req/s)", ylabel="req/s", title="goodput")
    ax.legend()
    made = _save(fig, path)
    plt.close(fig)
    return made
