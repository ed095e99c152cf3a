"""Where a decode step's time goes, against the bytes it must move (8B-shaped random model, GPU).

    python -m radixlm.srt.bench.decode_profile --batch-sizes 1,256 --backends triton,flashinfer

For each backend and batch size it runs ``input_len``-token prompts, then times ``steps`` decode
steps end to end (prefill subtracted) and profiles the same steps with ``torch.profiler``:
kernel time per category (GEMM, attention, sampling, norms/rope/activation, copies and
indexing, other), GPU busy time against wall time, the device's idle gaps by size with the
kernels around the long ones, the host's time per step in each part of the step path
(``host_timing.py``; ``--trace-dir`` also writes a host+device chrome trace), and
the limit a step cannot beat: the weight bytes plus every request's KV bytes (read once per
step), over the copy bandwidth measured in the same run. ``--kv-cache-dtype`` compares FP8 KV.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from radixlm.srt.bench.bench_gpu import (
    LLAMA3_8B,
    calibrate,
    make_model_folder,
    prompts,
    release,
    timed,
)
from radixlm.srt.bench.host_timing import HostTimer, gaps_per_step, gpu_gaps, steady_step_s
from radixlm.srt.bench.host_timing import per_step as host_per_step
from radixlm.srt.bench.plots import plot_step_breakdown

CATEGORIES = (  # first match wins; kernel names are lower-cased
    # kernels/fused_moe.py: the expert GEMMs/GEMVs, then routing (top-k kernel, sort by expert)
    ("moe experts", ("gate_up_kernel", "down_kernel")),
    ("moe routing", ("route_kernel", "align_by_expert")),
    ("sampling", ("argmax", "sort", "topk", "softmax", "multinomial", "exponential", "cumsum")),
    (
        "attention",
        (
            "attn",
            "attention",
            "batchdecode",
            "batchprefill",
            "prefillwithkvcache",
            "_fwd_kernel",
            "_extend_kernel",
            "decode_",
        ),
    ),
    ("gemm", ("gemm", "cutlass", "nvjet", "xmma", "cublas", "matmul", "gemv", "splitk")),
    ("norm/rope/act", ("rms", "norm", "rope", "rotary", "silu", "act_and_mul", "fused")),
    ("copy/index", ("copy", "index", "gather", "scatter", "fill", "cat", "elementwise")),
)


def category(kernel_name: str) -> str:
    name = kernel_name.lower()
    for cat, keys in CATEGORIES:
        if any(k in name for k in keys):
            return cat
    return "other"


TOP_KERNELS = 15  # kernel names listed per case, by device time per step


def kernel_times(prof) -> tuple[dict[str, float], dict[str, float], dict[str, int]]:
    """Seconds of device time per category and per kernel name, and launches per name."""
    per_cat: dict[str, float] = {}
    per_kernel: dict[str, float] = {}
    calls: dict[str, int] = {}
    for evt in prof.events():
        if evt.device_type != torch.autograd.DeviceType.CUDA:
            continue
        seconds = evt.device_time / 1e6
        per_cat[category(evt.name)] = per_cat.get(category(evt.name), 0.0) + seconds
        per_kernel[evt.name] = per_kernel.get(evt.name, 0.0) + seconds
        calls[evt.name] = calls.get(evt.name, 0) + 1
    return per_cat, per_kernel, calls


def profile_case(engine, batch: int, args, vocab: int, kv_bytes_per_token: int, bw: float) -> dict:
    from torch.profiler import ProfilerActivity, profile

    ids = prompts(batch, args.input_len, vocab, seed=batch)
    params = {"temperature": 0, "ignore_eos": True}

    def run(n: int) -> float:
        engine.flush_cache()
        return timed(
            lambda: engine.generate(input_ids=ids, sampling_params={**params, "max_new_tokens": n})
        )

    run(4)  # warm-up: graphs, JIT
    # two lengths, one difference: prefill and one-time costs (the last finishes) cancel out
    short, long = 1 + args.steps // 4, 1 + args.steps
    steps = long - short
    t_short = min(run(short) for _ in range(2))
    t_long = min(run(long) for _ in range(2))
    step_s = (t_long - t_short) / steps
    with HostTimer(engine) as host:
        run(short)
        host_short = host.take()
        run(long)
        steady_s = steady_step_s(host.starts)
        host_long = host.take()
    with profile(activities=[ProfilerActivity.CUDA]) as p_short:
        run(short)
    with profile(activities=[ProfilerActivity.CUDA]) as p_long:
        run(long)
    if args.trace_dir:  # host and device on one timeline, for chrome://tracing or Perfetto
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p_trace:
            run(short)
        name = f"trace-{engine.scheduler.runner.attn_backend.name}-b{batch}.json"
        Path(args.trace_dir).mkdir(parents=True, exist_ok=True)
        p_trace.export_chrome_trace(str(Path(args.trace_dir) / name))
    cat_short, ker_short, calls_short = kernel_times(p_short)
    cat_long, ker_long, calls_long = kernel_times(p_long)
    per_step = {c: (cat_long.get(c, 0) - cat_short.get(c, 0)) / steps for c in cat_long}
    kernels = {k: (ker_long[k] - ker_short.get(k, 0)) / steps for k in ker_long}
    calls = {k: (calls_long[k] - calls_short.get(k, 0)) / steps for k in calls_long}
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:TOP_KERNELS]
    busy = sum(per_step.values())
    mean_len = args.input_len + (short + long) / 2
    kv_bytes = batch * mean_len * kv_bytes_per_token
    limit_s = (args.weight_bytes + kv_bytes) / bw
    return {
        "batch": batch,
        "step_ms": step_s * 1e3,
        "tok_s": batch / step_s,
        # the median launch-to-launch time of the long run's overlapped decode steps (None
        # without overlap): no prefill or finish in it, unlike the difference above
        "steady_step_ms": None if steady_s is None else steady_s * 1e3,
        "steady_tok_s": None if steady_s is None else batch / steady_s,
        "limit_ms": limit_s * 1e3,
        "limit_tok_s": batch / limit_s,
        "fraction_of_limit": limit_s / step_s,
        "kv_GB_per_step": kv_bytes / 1e9,
        "gpu_busy_ms": busy * 1e3,
        "cpu_gap_ms": max(step_s - busy, 0.0) * 1e3,
        "category_ms": {c: round(v * 1e3, 4) for c, v in sorted(per_step.items())},
        "top_kernels_ms": [(k[:90], round(v * 1e3, 4)) for k, v in top],
        # launches per step: all kernels, then those of the top entries (inside a CUDA graph
        # too, where the profiler sees the graph's kernels)
        "kernels_per_step": round(sum(calls.values()), 2),
        "top_kernel_calls_per_step": [(k[:90], round(calls[k], 2)) for k, _ in top],
        "host_ms_per_step": host_per_step(host_short, host_long, steps),
        "gpu_idle": gaps_per_step(gpu_gaps(p_short), gpu_gaps(p_long), steps),
    }


def model_bytes(runner) -> tuple[int, int]:
    """Weight bytes, and KV bytes per token (every layer's K and V)."""
    weights = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    row = runner.kv_pool.k_buffers[0][0]  # one token's K in one layer
    return weights, 2 * len(runner.kv_pool.k_buffers) * row.numel() * row.element_size()


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--backends", default="triton,flashinfer")
    ap.add_argument("--batch-sizes", default="1,256")
    ap.add_argument("--kv-cache-dtypes", default="auto")
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=96, help="decode steps of the longer run")
    ap.add_argument("--folder", default="/tmp/radixlm-llama3-8b-shape")
    ap.add_argument("--json", default=None)
    ap.add_argument("--trace-dir", default=None, help="also export a host+device chrome trace")
    ap.add_argument("--plot", default=None, help="also draw where each case's step goes (PNG)")
    ap.add_argument("--from-json", default=None, help="plot an earlier --json file; no GPU run")
    args = ap.parse_args(argv)
    if args.from_json:
        results = json.loads(Path(args.from_json).read_text())
        _plot(results, args.plot)
        return results
    from radixlm.srt import Engine

    shape = dict(LLAMA3_8B)
    folder = make_model_folder(Path(args.folder), shape)
    results: dict = {"device": torch.cuda.get_device_name(), "cases": []}
    calib = None
    for kv_dtype in args.kv_cache_dtypes.split(","):
        for backend in args.backends.split(","):
            engine = Engine(
                model_path=str(folder),
                load_format="dummy",
                attention_backend=backend,
                kv_cache_dtype=kv_dtype,
                max_running_requests=256,
                chunked_prefill_size=-1,  # decode steps only: no prefill mixed into them
                log_level="warning",
            )
            try:
                args.weight_bytes, kv_per_token = model_bytes(engine.scheduler.runner)
                if calib is None:
                    calib = calibrate(args.weight_bytes)
                    results["calib"] = calib
                    print("calib", json.dumps(calib), flush=True)
                bw = calib["copy_bandwidth_TBps"] * 1e12
                pool_tokens = engine.scheduler.runner.max_total_tokens
                results.setdefault("pool", {})[f"{backend}/{kv_dtype}"] = {
                    "max_total_tokens": pool_tokens,
                    # requests of input_len + 256 tokens that fit in the pool at once
                    "largest_batch_at_input_plus_256": pool_tokens // (args.input_len + 256),
                }
                print("pool", backend, kv_dtype, results["pool"][f"{backend}/{kv_dtype}"])
                for batch in (int(b) for b in args.batch_sizes.split(",")):
                    res = profile_case(engine, batch, args, shape["vocab_size"], kv_per_token, bw)
                    res.update(backend=backend, kv_cache_dtype=kv_dtype)
                    results["cases"].append(res)
                    print("case", json.dumps(res), flush=True)
            finally:
                release(engine)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    _plot(results, args.plot)
    return results


def _plot(results: dict, path: str | None) -> None:
    if path:
        title = f"where a decode step goes ({results.get('device', '?')}, Llama-3-8B shape)"
        written = plot_step_breakdown(results["cases"], path, title)
        print(f"plot: {written}" if written else "no plot: matplotlib is not installed")


if __name__ == "__main__":
    main()
