"""A performance baseline that catches regressions: short, fixed measurements, each a ratio to a
reference measured in the same run, stored per commit and machine and compared with the last
stored run of this machine.

    python -m radixlm.srt.bench.baseline                 # measure, compare, exit 1 past tolerance
    python -m radixlm.srt.bench.baseline --save          # ... and store this run (if it passed)
    python -m radixlm.srt.bench.baseline --set ci        # the small part CI runs

Each measurement is the median, over ``repeats`` rounds, of (the measured time / the time of its
reference in the same round): a loaded or slower machine slows both, so the ratio moves much
less than either time. Costs (lower is better):

==================  ==================================================  =====================
measurement         what is timed                                       reference
==================  ==================================================  =====================
radix_insert_match  RadixCache: insert 64 sequences, match them again   a dict-of-dicts trie
                                                                        doing the same
decode_step         one Scheduler.step of 4 decoding requests (fp32,    a 64 MiB fp32 GEMV
                    CPU, random weights): the default model's shape;    (memory-bound, as
                    the CI set: its layers, 4 of them, 8k vocabulary    decode is)
prefill_256         one Scheduler.step prefilling a 256-token prompt    a 256x1024x4096 GEMM
trace_hooks_off     the tracing hooks of one step with tracing off      the decode step
                                                                        (a share, not a
                                                                        ratio to compare)
gpu_decode_step     decode_step on CUDA (when present), 8 requests      a 256 MiB bf16 GEMV
==================  ==================================================  =====================

A measurement fails when its cost exceeds the stored one by more than ``--tolerance`` (default
15%; the CI set uses 40%, since CI machines are shared; ``radix_insert_match``, a few ms of
pure Python, twice that); ``trace_hooks_off`` fails above 0.1%
of a decode step, whatever was stored. The store (``--store``, default
``~/.cache/radixlm/baseline.json``) keeps every saved run: ``{"runs": [{"commit", "machine",
"time", "set", "results": {name: {"cost", "time_s", "reference_s"}}}]}``; ``--plot PNG`` draws
this machine's history (srt/bench/plots.py). ``--inject-decode-delay-ms`` adds that much busy CPU work to every
decode forward: only to show that the comparison catches a slowdown. Torch runs one thread
(``--threads``): on a shared machine one thread's figures move least.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from radixlm.srt.bench.baseline_store import (
    commit,
    compare,
    load_store,
    machine,
    print_rows,
    stored_baseline,
)

DEFAULT_STORE = Path("~/.cache/radixlm/baseline.json").expanduser()
SETS = {
    "ci": ("radix_insert_match", "decode_step", "trace_hooks_off"),
    "cpu": ("radix_insert_match", "decode_step", "prefill_256", "trace_hooks_off"),
    "gpu": ("gpu_decode_step",),
}
TOLERANCE = {"ci": 0.40, "cpu": 0.15, "gpu": 0.15}
# the CI set's model: SmolLM2-135M's layer shape, 4 layers and a small vocabulary (random
# weights, about 90 MB in fp32: a decode step moves about as much as the GEMV reference)
CI_SHAPE = dict(
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=4,
    num_attention_heads=9,
    num_key_value_heads=3,
    vocab_size=8192,
    max_position_embeddings=2048,
    tie_word_embeddings=True,
)
# the tracing hooks off: at most 0.1% of a decode step
REPEATS = 7


def median_ratio(
    fn: Callable[[], Any],
    ref: Callable[[], Any],
    repeats: int = REPEATS,
    inner: int = 3,
    ref_inner: int = 5,
) -> dict[str, float]:
    """Median over ``repeats`` rounds of (best of ``inner`` runs of fn) / (best of
    ``ref_inner`` runs of ref: references are short, and their best is the steadiest); fn and
    ref alternate, so a change of machine load hits both."""
    ratios, times, refs = [], [], []
    fn(), ref()  # warm up
    for _ in range(repeats):
        r = min(_timed(ref) for _ in range(ref_inner))
        t = min(_timed(fn) for _ in range(inner))
        ratios.append(t / r)
        times.append(t)
        refs.append(r)
    return {
        "cost": statistics.median(ratios),
        "time_s": statistics.median(times),
        "reference_s": statistics.median(refs),
    }


# the clock of the measurements: CPU sets time the thread's CPU time (torch runs one thread, in
# the caller), which a loaded machine's time slicing leaves alone; the GPU set wall time
CLOCK: list[Callable[[], float]] = [time.thread_time]


def _timed(fn: Callable[[], Any]) -> float:
    clock = CLOCK[0]
    start = clock()
    fn()
    if clock is time.perf_counter and torch.cuda.is_available():
        torch.cuda.synchronize()
    return clock() - start


def busy_wait(seconds: float) -> None:
    """Spends ``seconds`` of CPU (the injected slowdown: extra work, not idle time)."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


# ---------------------------------------------------------------------- references
def trie_ref(seqs: list[list[int]]) -> Callable[[], None]:
    """A plain dict-of-dicts trie over the same sequences: insert every one, walk every one
    (the interpreter and memory work a radix tree does, without its bookkeeping)."""

    def run() -> None:
        root: dict = {}
        for s in seqs:
            node = root
            for tok in s:
                node = node.setdefault(tok, {})
        for s in seqs:
            node = root
            for tok in s:
                node = node[tok]

    return run


def gemv_ref(rows: int, cols: int, dtype: torch.dtype, device: str, batch: int = 4):
    w = torch.randn(rows, cols, dtype=dtype, device=device)
    x = torch.randn(batch, rows, dtype=dtype, device=device)
    return lambda: x @ w


def gemm_ref(m: int = 256, k: int = 1024, n: int = 4096):
    a, b = torch.randn(m, k), torch.randn(k, n)
    return lambda: a @ b


# ---------------------------------------------------------------------- measurements
def radix_insert_match() -> dict[str, float]:
    from radixlm.radix.radix_cache import RadixCache

    rng = random.Random(0)
    seqs = [[rng.randrange(1000) for _ in range(200)] for _ in range(64)]
    slots = [torch.arange(len(s)) for s in seqs]

    def run() -> None:
        cache = RadixCache(page_size=1, free_slots=lambda s: None)
        for s, kv in zip(seqs, slots, strict=True):
            cache.insert(s, kv)
        for s in seqs:
            cache.match_prefix(s)

    return median_ratio(run, trie_ref(seqs), repeats=15, inner=5)  # cheap: more rounds


@functools.cache
def model_steps(device: str, model_path: str | None) -> ModelSteps:
    return ModelSteps(device, model_path)


class ModelSteps:
    """A scheduler stepped by hand (the default model unless ``model_path``); one per model and
    device in a process (:func:`model_steps`). ``inject_delay_s`` > 0: every decode forward
    first spends that long busy (the demo's slowdown)."""

    def __init__(self, device: str, model_path: str | None = None) -> None:
        from radixlm.srt.config import config_from_kwargs
        from radixlm.srt.scheduler import Scheduler

        cfg = config_from_kwargs(
            model_path=model_path,
            log_level="warning",
            max_total_tokens=8192,
            device=device,
            grammar_backend="none",
            load_format="dummy",  # random weights of the default shape: the same work, no read
        )
        self.s = Scheduler(cfg)
        self.num = 0
        self.inject_delay_s = 0.0
        forward = self.s.runner.forward

        def forward_maybe_slowed(batch: Any, *args: Any, **kwargs: Any) -> Any:
            if self.inject_delay_s > 0 and batch.mode.value == "decode":
                busy_wait(self.inject_delay_s)
            return forward(batch, *args, **kwargs)

        self.s.runner.forward = forward_maybe_slowed

    def add(self, prompt_len: int, max_new_tokens: int) -> None:
        from radixlm.srt.messages import TokenizedGenerateReq

        self.num += 1
        rng = random.Random(self.num)
        ids = [rng.randrange(2, self.s.runner.vocab_size) for _ in range(prompt_len)]
        params = {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True}
        self.s.handle(
            TokenizedGenerateReq(rid=f"b{self.num}", input_ids=ids, sampling_params=params)
        )

    def finish_all(self) -> None:
        self.s.abort("", abort_all=True)
        while self.s.has_work():
            self.s.step()


def decode_step(
    steps: ModelSteps, batch: int, ref: Callable[[], Any], repeats: int = REPEATS
) -> dict[str, float]:
    for _ in range(batch):
        steps.add(32, 1024)
    for _ in range(1000):
        if len(steps.s.running) == batch and not steps.s.waiting:
            break
        steps.s.step()
    else:
        raise RuntimeError(f"the {batch} requests never all ran (see the scheduler's log)")
    try:
        return median_ratio(steps.s.step, ref, repeats=repeats, inner=2)
    finally:
        steps.finish_all()


def prefill_256(steps: ModelSteps) -> dict[str, float]:
    def run() -> None:
        steps.add(256, 1)
        while steps.s.has_work():  # a fresh random prompt each time: no prefix hit
            steps.s.step()

    return median_ratio(run, gemm_ref(), repeats=5, inner=1)


def trace_hooks_off(steps: ModelSteps, step_s: float) -> dict[str, float]:
    """The tracing hooks of one step (arrival, forward, output), tracing off, as a share of a
    decode step."""
    traces = steps.s.traces
    assert not traces.tracer.enabled, "measured with tracing off"
    fake = type("B", (), {"reqs": [], "starts": [], "extend_lens": []})()
    n = 10000
    start = time.thread_time()
    for _ in range(n):
        traces.on_forward(fake, start)
        traces.on_output([], None)
    per_step = (time.thread_time() - start) / n
    return {"cost": per_step / step_s, "time_s": per_step, "reference_s": step_s}


def run_set(name: str, inject_delay_ms: float = 0.0) -> dict[str, dict[str, float]]:
    results: dict[str, dict[str, float]] = {}
    wanted = SETS[name]
    if "radix_insert_match" in wanted:
        results["radix_insert_match"] = radix_insert_match()
    CLOCK[0] = time.perf_counter if name == "gpu" else time.thread_time
    if name == "gpu":
        steps = model_steps("cuda", None)
        steps.inject_delay_s = inject_delay_ms / 1e3
        ref = gemv_ref(8192, 8192, torch.bfloat16, "cuda", batch=8)
        results["gpu_decode_step"] = decode_step(steps, 8, ref)
        return results
    model_path = None
    if name == "ci":
        from radixlm.srt.bench.bench_gpu import make_model_folder

        folder = Path(tempfile.gettempdir()) / "radixlm-baseline-ci-model"
        model_path = str(make_model_folder(folder, CI_SHAPE))
    steps = model_steps("cpu", model_path)
    steps.inject_delay_s = inject_delay_ms / 1e3
    ref = gemv_ref(2048, 8192, torch.float32, "cpu")
    results["decode_step"] = decode_step(steps, 4, ref, repeats=REPEATS if name == "cpu" else 9)
    if "prefill_256" in wanted:
        results["prefill_256"] = prefill_256(steps)
    if "trace_hooks_off" in wanted:
        results["trace_hooks_off"] = trace_hooks_off(steps, results["decode_step"]["time_s"])
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--set", choices=sorted(SETS), default=None, help="default: cpu (+gpu)")
    ap.add_argument("--store", type=Path, default=DEFAULT_STORE)
    ap.add_argument("--save", action="store_true", help="store this run when it passes")
    ap.add_argument("--against", default=None, help="compare with this commit's stored run")
    ap.add_argument("--tolerance", type=float, default=None, help="default: per set")
    ap.add_argument("--inject-decode-delay-ms", type=float, default=0.0, help="demo only")
    ap.add_argument("--plot", type=Path, default=None, help="write this machine's history PNG")
    ap.add_argument(
        "--threads", type=int, default=1, help="torch threads (1: steadiest on a shared machine)"
    )
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    sets = [args.set] if args.set else ["cpu"] + (["gpu"] if torch.cuda.is_available() else [])
    store = load_store(args.store)
    key, rev = machine(), commit()
    failed = False
    for set_name in sets:
        tolerance = args.tolerance if args.tolerance is not None else TOLERANCE[set_name]
        results = run_set(set_name, args.inject_decode_delay_ms)
        base = stored_baseline(store, key, set_name, args.against)
        print(f"[{set_name}] commit {rev}, baseline: {base['commit'] if base else 'none stored'}")
        rows = compare(results, base, tolerance)
        print_rows(rows, results, tolerance)
        ok = all(row[-1] for row in rows)
        failed = failed or not ok
        if args.save and ok:
            run = {"commit": rev, "machine": key, "time": time.time(), "set": set_name}
            store["runs"].append({**run, "results": results})
    if args.save:
        args.store.parent.mkdir(parents=True, exist_ok=True)
        args.store.write_text(json.dumps(store, indent=1))
    if args.plot is not None:
        from radixlm.srt.bench.plots import plot_baseline_history

        mine = [r for r in store["runs"] if r["machine"] == key]
        print(plot_baseline_history(mine, args.plot) or "no plot: matplotlib is not installed")
    print("FAILED: a measurement regressed past the tolerance" if failed else "passed")
    return 1 if failed else 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
