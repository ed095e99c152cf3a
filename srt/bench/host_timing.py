"""Where a step's host time goes, and where the GPU sits idle: instrumentation for the benches.

``HostTimer(engine)`` wraps the in-process Engine's step path (scheduling, launch, the wait for
the step in flight, output building, detokenizing, dispatch) with wall-clock counters while it
is active; ``snapshot()`` returns seconds and calls per part, ``starts`` the times of the
overlapped decode launches (``steady_step_s``: the step time without prefill). The parts nest (``scheduler.step``
holds ``launch_decode``, which holds ``runner.forward``...), so they are not to be summed.

``gpu_gaps(prof)`` reads a ``torch.profiler`` run: the device's busy intervals (kernels, copies,
memsets) merged, the idle gaps between them by size, and the kernels on either side of the
long gaps (which tells gaps inside a CUDA graph from gaps between steps).
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

GAP_BUCKETS_US = (5.0, 50.0, 500.0, float("inf"))  # upper bounds of the gap size classes
LONG_GAP_US = 100.0


class HostTimer:
    def __init__(self, engine):
        from radixlm.srt.scheduler import overlap
        from radixlm.srt.scheduler import scheduler as scheduler_module

        sched = engine.scheduler
        runner = sched.runner
        self._targets: list[tuple[str, Any, str]] = [
            ("engine.run_once", engine.driver, "run_once"),
            ("scheduler.step", sched, "step"),
            ("schedule_decode", sched, "_schedule_decode"),
            ("kv.alloc_for_batch", sched.kv, "alloc_for_batch"),
            ("launch_decode", scheduler_module, "launch_decode"),
            ("runner.forward", runner, "forward"),
            ("sample_on_device", sched.sampling, "sample_on_device"),
            ("resolve_inflight", sched, "_resolve_inflight"),
            ("read_back (waiting for the GPU)", overlap.InflightDecode, "read_back"),
            ("build_batch_output", scheduler_module, "build_batch_output"),
            ("detokenizer.handle", engine.driver.detokenizer, "handle"),
            ("engine.dispatch", engine.driver, "dispatch"),
        ]
        if runner.graph_runner is not None:
            self._targets.append(("graphs.replay", runner.graph_runner, "replay"))
        self.starts: list[float] = []  # when each launch_decode began (steady-state pacing)
        self.seconds: dict[str, float] = {name: 0.0 for name, _, _ in self._targets}
        self.calls: dict[str, int] = {name: 0 for name, _, _ in self._targets}
        self._saved: list[tuple[Any, str, Any, bool]] = []

    def _wrap(self, name: str, fn):
        seconds, calls = self.seconds, self.calls

        starts = self.starts if name == "launch_decode" else None

        def timed(*args, **kwargs):
            start = time.perf_counter()
            if starts is not None:
                starts.append(start)
            try:
                return fn(*args, **kwargs)
            finally:
                seconds[name] += time.perf_counter() - start
                calls[name] += 1

        return timed

    def __enter__(self) -> HostTimer:
        for name, owner, attr in self._targets:
            own = attr in vars(owner)  # an instance's own attribute, or a class/module one
            original = getattr(owner, attr) if not isinstance(owner, type) else vars(owner)[attr]
            self._saved.append((owner, attr, vars(owner).get(attr), own))
            setattr(owner, attr, self._wrap(name, original))
        return self

    def __exit__(self, *exc) -> None:
        for owner, attr, original, own in reversed(self._saved):
            if own:
                setattr(owner, attr, original)
            else:
                delattr(owner, attr)  # the instance falls back to its class's method
        self._saved.clear()

    def snapshot(self) -> dict[str, tuple[float, int]]:
        return {name: (self.seconds[name], self.calls[name]) for name in self.seconds}

    def take(self) -> dict[str, tuple[float, int]]:
        """The snapshot, then every counter and the launch times start again from zero."""
        snap = self.snapshot()
        for name in self.seconds:
            self.seconds[name], self.calls[name] = 0.0, 0
        self.starts.clear()
        return snap


def steady_step_s(starts: list[float], skip: int = 3) -> float | None:
    """The median time between consecutive overlapped decode launches, the first ``skip``
    intervals left out: with overlap scheduling the host launches step k+2 as soon as step k
    has been read back, so in steady state this is the device's time per step (or the host's,
    if the host is slower) with no prefill or finish in it."""
    gaps = sorted(b - a for a, b in zip(starts[skip:], starts[skip + 1 :], strict=False))
    return gaps[len(gaps) // 2] if gaps else None


def per_step(
    short: dict[str, tuple[float, int]], long: dict[str, tuple[float, int]], steps: int
) -> dict[str, dict[str, float]]:
    """Milliseconds and calls per step of the parts, from a short and a long run's snapshots."""
    out = {}
    for name, (sec, calls) in long.items():
        s_sec, s_calls = short.get(name, (0.0, 0))
        out[name] = {
            "ms": round((sec - s_sec) / steps * 1e3, 4),
            "calls": round((calls - s_calls) / steps, 3),
        }
    return out


def _short(name: str) -> str:
    return name if len(name) <= 60 else name[:57] + "..."


def gpu_gaps(prof) -> dict[str, Any]:
    """Idle gaps of the device in a profiled run: count and total per size class, and the
    kernel pairs around the gaps of at least ``LONG_GAP_US``."""
    import torch

    spans = []
    for evt in prof.events():
        if evt.device_type != torch.autograd.DeviceType.CUDA:
            continue
        spans.append((evt.time_range.start, evt.time_range.end, evt.name))
    spans.sort()
    buckets = {f"<{b:g}us": [0, 0.0] for b in GAP_BUCKETS_US}
    pairs: Counter = Counter()
    pair_us: Counter = Counter()
    busy = 0.0
    end, last_name = None, None
    for start, stop, name in spans:
        if end is not None and start > end:
            gap = start - end
            for b in GAP_BUCKETS_US:
                if gap < b:
                    buckets[f"<{b:g}us"][0] += 1
                    buckets[f"<{b:g}us"][1] += gap
                    break
            if gap >= LONG_GAP_US:
                key = f"{_short(last_name)} -> {_short(name)}"
                pairs[key] += 1
                pair_us[key] += gap
        if end is None or start > end:
            busy += stop - start
            end, last_name = stop, name
        elif stop > end:
            busy += stop - end
            end, last_name = stop, name
    return {
        "busy_us": busy,
        "buckets": {k: {"count": v[0], "us": round(v[1], 1)} for k, v in buckets.items()},
        "long_gap_pairs": [
            {"pair": k, "count": n, "us": round(pair_us[k], 1)} for k, n in pairs.most_common(8)
        ],
    }


def gaps_per_step(short: dict, long: dict, steps: int) -> dict[str, Any]:
    """The long run's gap classes minus the short run's, per step."""
    out = {}
    for k, v in long["buckets"].items():
        s = short["buckets"].get(k, {"count": 0, "us": 0.0})
        out[k] = {
            "count": round((v["count"] - s["count"]) / steps, 2),
            "ms": round((v["us"] - s["us"]) / steps / 1e3, 4),
        }
    return {"per_step": out, "long_gap_pairs_long_run": long["long_gap_pairs"]}
