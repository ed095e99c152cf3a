"""The baseline's store and comparison (``baseline.py`` measures): runs keyed by commit and
machine in one JSON file, the last stored run of a machine and set, costs against it."""

from __future__ import annotations

import json
import platform
import subprocess
from pathlib import Path
from typing import Any

import torch

# pure-Python work of a few ms moves most with a neighbour's cache pressure: twice the tolerance
DOUBLE_TOLERANCE = ("radix_insert_match",)
HOOKS_OFF_LIMIT = 0.001  # the tracing hooks off: at most 0.1% of a decode step


def commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).parent,
            check=True,
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).parent,
        ).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def machine() -> str:
    """What the figures depend on: host, CPU, threads, torch, the GPU when present."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no-gpu"
    return (
        f"{platform.node()}|{cpu}|{torch.get_num_threads()} threads|torch {torch.__version__}|{gpu}"
    )


def load_store(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {"runs": []}
    try:
        store = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise SystemExit(
            f"baseline: {path} is not JSON ({e}); move it away to start anew"
        ) from None
    if not isinstance(store, dict) or not isinstance(store.get("runs"), list):
        raise SystemExit(f"baseline: {path} has no 'runs' list")
    return store


def stored_baseline(
    store: dict[str, Any], machine_key: str, set_name: str, against: str | None = None
) -> dict[str, Any] | None:
    """The last saved run of this machine and set (of commit ``against`` when given)."""
    runs = [
        r
        for r in store["runs"]
        if r["machine"] == machine_key
        and r["set"] == set_name
        and (against is None or r["commit"].startswith(against))
    ]
    return runs[-1] if runs else None


def compare(
    results: dict[str, dict[str, float]], base: dict[str, Any] | None, tolerance: float
) -> list[tuple[str, float, float | None, float | None, bool]]:
    """(name, cost, stored cost, change, ok) per measurement."""
    rows = []
    for name, res in results.items():
        cost = res["cost"]
        if name == "trace_hooks_off":
            rows.append((name, cost, None, None, cost <= HOOKS_OFF_LIMIT))
            continue
        old = (base or {}).get("results", {}).get(name, {}).get("cost")
        change = cost / old - 1 if old else None
        limit = tolerance * (2 if name in DOUBLE_TOLERANCE else 1)
        rows.append((name, cost, old, change, change is None or change <= limit))
    return rows


def print_rows(rows: list, results: dict[str, dict[str, float]], tolerance: float) -> None:
    print(f"{'measurement':<20} {'time':>10} {'ref':>10} {'cost':>10} {'stored':>10} {'change':>8}")
    for name, cost, old, change, ok in rows:
        r = results[name]
        old_s = f"{old:10.4g}" if old is not None else f"{'-':>10}"
        ch = f"{change:+8.1%}" if change is not None else f"{'-':>8}"
        flag = "" if ok else "  REGRESSED"
        print(
            f"{name:<20} {r['time_s'] * 1e3:8.4g}ms {r['reference_s'] * 1e3:8.4g}ms "
            f"{cost:10.4g} {old_s} {ch}{flag}"
        )
    print(
        f"tolerance {tolerance:.0%} ({', '.join(DOUBLE_TOLERANCE)}: twice that; "
        f"trace_hooks_off: at most {HOOKS_OFF_LIMIT:.1%} of a step)"
    )
