"""Quantised linear layers on a GPU: the Llama-3-8B shape's projections in bf16, FP8 (per-channel
weights, per-token activations: ``torch._scaled_mm``) and int4 AWQ-style (group 128 with
zeros: the dispatch of ``kernels/quant_gemm.py``; variant ``int4_older``: the kernels before
``kernels/int4_mm.py``: the GEMV up to ``GEMV_ROWS`` rows, the tiled kernel up to 128,
dequantise + cuBLAS above), random weights, no download.

    python -m radixlm.srt.bench.bench_quant                      # everything, one run
    python -m radixlm.srt.bench.bench_quant --layers 8 --json quant.json
    python -m radixlm.srt.bench.bench_quant --variants bf16,int4,int4_older

One decode step's weights are the 32 layers' q/k/v, o, gate/up and down projections plus the
bf16 LM head (the same in every variant). Measured in the same run:

- ``copy`` bandwidth (a 4 GiB device copy) and the FP8 matmul rate (an 8192^3 ``_scaled_mm``);
- batch 1: the time of one step's projections, captured in a CUDA graph (no launch gaps),
  against each variant's own roofline: its weight bytes / the copy bandwidth (target <= 1.15x);
- batch 64 and 256: the step's projections -> tokens/s of the linear layers alone;
- prefill (8,192 tokens): tokens/s against the FP8 FLOP limit (``2 * params`` FLOPs per token at
  the measured FP8 rate);
- per variant, the top kernels of one eager batch-1 step by device time (``torch.profiler``):
  where a step's time goes.

Attention, norms and sampling are left out: these figures are the linear layers' share of a
step (at batch 1 and short contexts nearly all of it). Timings on a shared machine are noisy;
each figure is the best of several repetitions.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from radixlm.srt.bench.bench_gpu import graphed

HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, VOCAB, LAYERS = 4096, 14336, 32, 8, 128, 128256, 32
GROUP = 128


def projections() -> list[tuple[int, int]]:
    """``(out, in)`` of one layer's projections (q/k/v and gate/up merged)."""
    qkv = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    return [(qkv, HIDDEN), (HIDDEN, HEADS * HEAD_DIM), (2 * INTER, HIDDEN), (HIDDEN, INTER)]


def best_ms(fn, reps: int = 5, inner: int = 3) -> float:
    """Best of ``reps`` timings of ``inner`` calls (ms per call), after one warm-up."""
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - start) / inner)
    return best * 1e3


def copy_bandwidth() -> float:
    """Bytes/s of a 4 GiB device-to-device copy (read + write counted)."""
    a = torch.empty(2 * 1024**3, dtype=torch.bfloat16, device="cuda")
    b = torch.empty_like(a)
    ms = best_ms(lambda: b.copy_(a), reps=5, inner=1)
    nbytes = 2 * a.numel() * 2
    a = b = None  # freed before the weights are made
    torch.cuda.empty_cache()
    return nbytes / (ms / 1e3)


def fp8_flops() -> float:
    """FLOP/s of an 8192^3 FP8 ``_scaled_mm`` (row-wise scales, bf16 out)."""
    n = 8192
    a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    sa = torch.ones(n, 1, device="cuda")
    sb = torch.ones(1, n, device="cuda")

    def mm():
        return torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)

    ms = best_ms(mm, reps=5, inner=5)
    return 2 * n**3 / (ms / 1e3)


def make_layers(variant: str, layers: int, gen: torch.Generator) -> tuple[list, int]:
    """One callable per projection (``fn(x) -> y``) and the weight bytes they read."""
    from radixlm.kernels import quant_gemm

    fns, nbytes = [], 0
    for _ in range(layers):
        for n, k in projections():
            if variant == "bf16":
                w = (torch.randn(n, k, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
                fns.append(lambda x, w=w: F.linear(x, w))
                nbytes += w.numel() * 2
            elif variant == "fp8":
                w8 = torch.randn(n, k, device="cuda", generator=gen).to(torch.float8_e4m3fn)
                s = torch.rand(n, 1, device="cuda", generator=gen) * 1e-2 + 1e-3
                fns.append(lambda x, w8=w8, s=s: quant_gemm.fp8_linear(x, w8, s, "token"))
                nbytes += w8.numel() + s.numel() * 4
            else:
                q = torch.randint(
                    -(2**31),
                    2**31 - 1,
                    (n, k // 8),
                    dtype=torch.int32,
                    device="cuda",
                    generator=gen,
                )
                s = (torch.rand(n, k // GROUP, device="cuda", generator=gen) * 1e-2).to(
                    torch.bfloat16
                )
                z = torch.randint(0, 16, (n, k // GROUP), device="cuda", generator=gen).to(
                    torch.bfloat16
                )
                fns.append(int4_fn(variant, q, s, z))
                nbytes += q.numel() * 4 + s.numel() * 2 + z.numel() * 2
    head = (torch.randn(VOCAB, HIDDEN, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
    fns.append(lambda x, w=head: F.linear(x, w))  # the LM head stays bf16
    return fns, nbytes + head.numel() * 2


def int4_fn(variant: str, q, s, z):
    """``int4``: the dispatch (``quant_gemm.int4_linear``); ``int4_older``: the older kernels
    (GEMV, tiled, dequantise + cuBLAS above 128 rows), both in one run."""
    from radixlm.kernels import quant_gemm

    if variant == "int4":
        return lambda x: quant_gemm.int4_linear(x, q, s, z)
    n, k = q.shape[0], q.shape[1] * 8
    group = k // s.shape[1]

    def older(x):
        m = x.shape[0]
        if m <= quant_gemm.GEMV_ROWS:
            return quant_gemm.int4_gemv(x, q, s, z)
        if m <= 128:
            cfg = quant_gemm.int4_config(m, n, k, group)
            return quant_gemm.int4_gemm(x, q, s, z, cfg=cfg)
        return F.linear(x, quant_gemm.int4_dequant(q, s, z, x.dtype))

    return older


def step_fn(fns: list, rows: int):
    """One step: every projection on an input of its width (outputs are not chained)."""
    inputs = {
        k: torch.randn(rows, k, device="cuda").to(torch.bfloat16)
        for k in {HIDDEN, HEADS * HEAD_DIM, INTER}
    }
    widths = [k for _ in range(len(fns) // 4) for _, k in projections()] + [HIDDEN]

    def step():
        for fn, k in zip(fns, widths, strict=True):
            fn(inputs[k])

    return step


def kernel_breakdown(step, top: int = 8) -> list[dict]:
    """The top ``top`` device kernels of one eager batch-1 step by total time (torch.profiler):
    where the time goes (a dequantise fallback, activation quantisation, split-K sums)."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None)
        if us is None:
            us = getattr(e, "cuda_time_total", 0)
        if us > 0:
            rows.append({"kernel": e.key[:90], "calls": e.count, "total_ms": us / 1e3})
    rows.sort(key=lambda r: -r["total_ms"])
    return rows[:top]


def bench_variant(variant: str, args, bandwidth: float, fp8_rate: float) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    fns, nbytes = make_layers(variant, args.layers, gen)
    params = sum(n * k for n, k in projections()) * args.layers + VOCAB * HIDDEN
    out: dict = {"weight_GB": nbytes / 1e9}
    roofline_ms = nbytes / bandwidth * 1e3
    itl = best_ms(graphed(step_fn(fns, 1)), reps=10, inner=5)
    out.update(batch1_ms=itl, roofline_ms=roofline_ms, batch1_vs_roofline=itl / roofline_ms)
    out["batch1_kernels"] = kernel_breakdown(step_fn(fns, 1))
    for rows in args.batch_sizes:
        ms = best_ms(graphed(step_fn(fns, rows)), reps=5, inner=3)
        out[f"batch{rows}_tok_s"] = rows / (ms / 1e3)
    ms = best_ms(step_fn(fns, args.prefill_tokens), reps=3, inner=1)
    prefill = args.prefill_tokens / (ms / 1e3)
    limit = fp8_rate / (2 * params)
    out.update(prefill_tok_s=prefill, fp8_flop_limit_tok_s=limit, prefill_vs_limit=prefill / limit)
    del fns
    torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", default="bf16,fp8,int4")
    parser.add_argument("--layers", type=int, default=LAYERS)
    parser.add_argument("--batch-sizes", default="64,256")
    parser.add_argument("--prefill-tokens", type=int, default=8192)
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    args = parser.parse_args(argv)
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b]
    if not torch.cuda.is_available():
        raise SystemExit("bench_quant needs a CUDA device")
    bandwidth, fp8_rate = copy_bandwidth(), fp8_flops()
    results = {
        "device": torch.cuda.get_device_name(),
        "copy_bandwidth_TBps": bandwidth / 1e12,
        "fp8_TFLOPs": fp8_rate / 1e12,
        "layers": args.layers,
    }
    print(
        f"{results['device']}: copy {bandwidth / 1e12:.2f} TB/s, FP8 matmul "
        f"{fp8_rate / 1e12:.0f} TFLOP/s, {args.layers} layers + LM head"
    )
    header = ["variant", "weights GB", "b1 ms", "roofline ms", "ratio"]
    header += [f"b{b} tok/s" for b in args.batch_sizes] + ["prefill tok/s", "vs FP8 limit"]
    print(" | ".join(header))
    for variant in args.variants.split(","):
        r = results[variant] = bench_variant(variant, args, bandwidth, fp8_rate)
        row = [
            variant,
            f"{r['weight_GB']:.2f}",
            f"{r['batch1_ms']:.3f}",
            f"{r['roofline_ms']:.3f}",
            f"{r['batch1_vs_roofline']:.2f}x",
        ]
        row += [f"{r[f'batch{b}_tok_s']:.0f}" for b in args.batch_sizes]
        row += [f"{r['prefill_tok_s']:.0f}", f"{r['prefill_vs_limit']:.2f}"]
        print(" | ".join(row), flush=True)
    for variant in args.variants.split(","):
        print(f"{variant}, batch 1, top kernels of one eager step (ms, calls):")
        for k in results[variant]["batch1_kernels"]:
            print(f"  {k['total_ms']:8.3f} {k['calls']:5d}  {k['kernel']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
