"""The decode step's GEMMs alone, per BLAS choice and weight layout (8B shapes, GPU).

    python -m radixlm.srt.bench.gemm_blas --batch-sizes 1,256

A decode step's projections over all 32 layers (QKV, O, gate/up, down; 14 GB of bf16 weights,
each read from HBM: nothing fits in L2 between two uses) timed with CUDA events, for:

- ``linear``: ``F.linear(x, W)`` with ``W`` as ``[out, in]`` (what the model runs),
- ``linear-lt``: the same with ``torch.backends.cuda.preferred_blas_library("cublaslt")``,
- ``matmul-kn``: ``x @ W_t`` with the weight stored ``[in, out]``.

Beside them, in the same run: the copy bandwidth (bytes read plus written), a read-only rate
(a sum over a large tensor) and the bf16 matmul rate, so each figure is a fraction of a limit
measured on the same card: bytes over bandwidth at batch 1, FLOPs over the matmul rate at 256.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F

from radixlm.srt.bench.bench_gpu import LLAMA3_8B

VARIANTS = ("linear", "linear-lt", "matmul-kn")


def _time(fn, reps: int) -> float:
    """Median seconds of ``fn`` over ``reps`` runs, CUDA events, after two warm-ups."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def limits(reps: int = 10) -> dict:
    n = 1 << 30  # 2 GiB of bf16 per buffer
    src = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    copy_s = _time(lambda: dst.copy_(src), reps)
    read_s = _time(lambda: src.sum(dtype=torch.float32), reps)
    mat = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    mm_s = _time(lambda: mat @ mat, reps)
    return {
        "copy_TBps": 2 * 2 * n / copy_s / 1e12,
        "read_TBps": 2 * n / read_s / 1e12,
        "matmul_TFLOPs": 2 * 8192**3 / mm_s / 1e12,
    }


def shapes(cfg: dict) -> dict[str, tuple[int, int]]:
    """(out, in) of each projection of one layer."""
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    head = h // cfg["num_attention_heads"]
    qkv = h + 2 * cfg["num_key_value_heads"] * head
    return {"qkv": (qkv, h), "o": (h, h), "gate_up": (2 * i, h), "down": (h, i)}


def run(batch_sizes: list[int], reps: int) -> dict:
    cfg = LLAMA3_8B
    layers = cfg["num_hidden_layers"]
    gen = torch.Generator(device="cuda").manual_seed(0)
    weights = {
        name: [
            torch.randn(o, i, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
            for _ in range(layers)
        ]
        for name, (o, i) in shapes(cfg).items()
    }
    out: dict = {"limits": limits(reps), "cases": []}
    weight_bytes = sum(w.numel() * 2 for ws in weights.values() for w in ws)
    for variant in VARIANTS:
        if variant == "matmul-kn":  # one layout at a time: 14 GB each
            for name in weights:
                weights[name] = [w.t().contiguous() for w in weights[name]]
        lib = "cublaslt" if variant == "linear-lt" else "cublas"
        torch.backends.cuda.preferred_blas_library(lib)
        for bs in batch_sizes:
            xs = {
                name: torch.randn(bs, i, device="cuda", dtype=torch.bfloat16, generator=gen)
                for name, (_, i) in shapes(cfg).items()
            }

            def gemm(name: str, w: torch.Tensor, variant=variant, xs=xs) -> torch.Tensor:
                return xs[name] @ w if variant == "matmul-kn" else F.linear(xs[name], w)

            per_shape = {}
            for name, ws in weights.items():
                per_shape[name] = _time(lambda name=name, ws=ws: [gemm(name, w) for w in ws], reps)

            def chain() -> None:
                for layer in range(layers):
                    for name, ws in weights.items():
                        gemm(name, ws[layer])

            total = _time(chain, reps)
            flops = 2 * bs * weight_bytes / 2
            out["cases"].append(
                {
                    "variant": variant,
                    "batch": bs,
                    "step_ms": total * 1e3,
                    "weights_TBps": weight_bytes / total / 1e12,
                    "TFLOPs": flops / total / 1e12,
                    "per_shape_ms": {k: round(v * 1e3, 4) for k, v in per_shape.items()},
                }
            )
    torch.backends.cuda.preferred_blas_library("cublas")
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--batch-sizes", default="1,256")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    res = run([int(b) for b in args.batch_sizes.split(",")], args.reps)
    lim = res["limits"]
    print(
        f"copy {lim['copy_TBps']:.2f} TB/s, read-only {lim['read_TBps']:.2f} TB/s, "
        f"bf16 matmul {lim['matmul_TFLOPs']:.0f} TFLOP/s"
    )
    print("| variant | batch | 32 layers | weights TB/s | TFLOP/s | qkv | o | gate_up | down |")
    print("|---|---|---|---|---|---|---|---|---|")
    for c in res["cases"]:
        ps = c["per_shape_ms"]
        print(
            f"| {c['variant']} | {c['batch']} | {c['step_ms']:.3f} ms | {c['weights_TBps']:.2f} "
            f"| {c['TFLOPs']:.0f} | {ps['qkv']:.3f} | {ps['o']:.3f} | {ps['gate_up']:.3f} "
            f"| {ps['down']:.3f} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()
