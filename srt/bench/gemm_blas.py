"""The decode step's GEMMs alone, per BLAS choice and weight layout (8B shapes, GPU).

    python -m radixlm.srt.bench.gemm_blas --batch-sizes 1,256

A decode step's projections over all 32 layers (QKV, O, gate/up, down; 14 GB of bf16 weights,
each read from HBM: nothing fits in L2 between two uses) timed with CUDA events, for:

- ``linear``: ``F.linear(x, W)`` with ``W`` as ``[out, in]`` (what the model runs),
- ``linear-lt``: the same with ``torch.backends.cuda.preferred_blas_library("cublaslt")``,
- ``triton-gemv``: ``kernels.gemv.gemv(x, W)`` (batch sizes up to ``gemv.MAX_ROWS`` only),
  timed as one CUDA graph per measurement: eager, its Python launches would set the pace,
- ``matmul-kn``: ``x @ W_t`` with the weight stored ``[in, out]``.

Beside them, in the same run: the copy bandwidth (bytes read plus written), a read-only rate
(a sum over a large tensor) and the bf16 matmul rate, so each figure is a fraction of a limit
measured on the same card: bytes over bandwidth at batch 1, FLOPs over the matmul rate at 256.

For batch sizes up to ``gemv.MAX_ROWS``, one more case times the layer's chain of projections
and the small kernels between them, all 32 layers in one CUDA graph each way (attention left
out: the O projection reads the first ``hidden`` columns of the QKV output):

- unfused: ``fused.add_rmsnorm``, ``F.linear`` (QKV), ``F.linear`` (O), ``fused.add_rmsnorm``,
  ``F.linear`` (gate/up), ``fused.silu_and_mul``, ``F.linear`` (down);
- fused: ``gemv_rmsnorm`` (QKV), ``gemv`` with the residual (O), ``gemv_rmsnorm`` (gate/up),
  ``gemv_silu_mul`` with the residual (down);

beside the four projections alone, graphed the same way, with ``F.linear`` and with ``gemv``.

``--sweep`` times, at batch 1, a set of ``cfg`` alternatives for the op the fused chain runs on
each shape (and the LM head's ``gemv_rmsnorm``) and prints the best beside ``gemv.config``'s.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F

from radixlm.kernels import fused, gemv
from radixlm.srt.bench.bench_gpu import LLAMA3_8B

# matmul-kn last: it transposes the weights in place
VARIANTS = ("linear", "linear-lt", "triton-gemv", "matmul-kn")


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


def _graphed(fn):
    """``fn`` captured in a CUDA graph, after a warm-up call on a side stream (which also
    compiles its Triton kernels); returns the graph's replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def _time_graph(fn, reps: int) -> float:
    """:func:`_time` of ``fn`` replayed from a CUDA graph (no host launch cost inside)."""
    return _time(_graphed(fn), reps)


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


def _layer_params(cfg: dict, gen: torch.Generator) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The two RMSNorm weights of each layer."""
    h = cfg["hidden_size"]

    def norm() -> torch.Tensor:
        noise = torch.randn(h, device="cuda", generator=gen)
        return (1 + 0.1 * noise).to(torch.bfloat16)

    return [(norm(), norm()) for _ in range(cfg["num_hidden_layers"])]


def chain_case(cfg: dict, weights: dict, bs: int, reps: int, gen: torch.Generator) -> dict:
    """The layer chain, unfused and fused, and the four projections alone with ``F.linear``
    and with ``gemv``: seconds for all layers, each captured in one CUDA graph."""
    h, eps = cfg["hidden_size"], cfg["rms_norm_eps"]
    norms = _layer_params(cfg, gen)
    h0 = torch.randn(bs, h, device="cuda", dtype=torch.bfloat16, generator=gen)
    names = ("qkv", "o", "gate_up", "down")
    layers = list(zip(norms, *(weights[name] for name in names), strict=True))
    xs = {
        name: torch.randn(bs, ws[0].shape[1], device="cuda", dtype=torch.bfloat16, generator=gen)
        for name, ws in weights.items()
    }
    out: dict = {}

    def unfused() -> None:
        res, delta = h0, torch.zeros_like(h0)
        for (ln1, ln2), w_qkv, w_o, w_gu, w_down in layers:
            normed, res = fused.add_rmsnorm(delta, res, ln1, eps)
            o = F.linear(F.linear(normed, w_qkv)[:, :h], w_o)
            normed, res = fused.add_rmsnorm(o, res, ln2, eps)
            delta = F.linear(fused.silu_and_mul(F.linear(normed, w_gu)), w_down)
        out["unfused"] = res + delta

    def fused_chain() -> None:
        res = h0
        for (ln1, ln2), w_qkv, w_o, w_gu, w_down in layers:
            res = gemv.gemv(gemv.gemv_rmsnorm(res, ln1, eps, w_qkv)[:, :h], w_o, residual=res)
            res = gemv.gemv_silu_mul(gemv.gemv_rmsnorm(res, ln2, eps, w_gu), w_down, residual=res)
        out["fused"] = res

    def projections(op) -> None:
        for layer in range(len(layers)):
            for name, ws in weights.items():
                op(xs[name], ws[layer])

    times = {
        "unfused_ms": _time_graph(unfused, reps),
        "fused_ms": _time_graph(fused_chain, reps),
        "linear_only_ms": _time_graph(lambda: projections(F.linear), reps),
        "gemv_only_ms": _time_graph(lambda: projections(gemv.gemv), reps),
    }
    ref = out["unfused"].float()
    return {
        "batch": bs,
        **{k: v * 1e3 for k, v in times.items()},
        "rel_diff": ((out["fused"].float() - ref).abs().max() / ref.abs().max()).item(),
    }


def sweep_cfgs(n: int, k: int) -> list[dict]:
    """``gemv.config``'s choice for batch 1 and alternatives around it: BLOCK_N 4 to 32, tiles
    of 2048 to 8192 elements, one or three stages, 4 warps (8 for the largest tile)."""
    cfgs = [gemv.config(1, n, k)]
    for block_n in (4, 8, 16, 32):
        for tile in (2048, 4096, 8192):
            block_k = tile // block_n
            if block_k < 64 or block_k > k or k % block_k:
                continue
            for stages in (1, 3):
                for warps in (4, 8) if tile == 8192 else (4,):
                    c = dict(BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages)
                    if c not in cfgs:
                        cfgs.append(c)
    return cfgs


def _print_sweep_row(row: dict) -> None:
    print(
        f"sweep {row['shape']} ({row['n']}, {row['k']}): F.linear {row['linear_ms']:.3f} ms, "
        f"config() {row['default_ms']:.3f} ms, best {row['best_ms']:.3f} ms "
        f"({row['best_TBps']:.2f} TB/s)",
        flush=True,
    )
    for r in row["ranked"][:5]:
        print(f"  {r['ms']:.4f} ms  {r['cfg']}", flush=True)


def sweep(cfg: dict, weights: dict, reps: int, gen: torch.Generator) -> list[dict]:
    """Batch 1: for each shape, every :func:`sweep_cfgs` alternative of the op the fused chain
    runs on it (the LM head: one weight, ``gemv_rmsnorm``), graphed over all layers' weights,
    beside ``F.linear``; sorted fastest first, each shape printed when done."""
    h, eps = cfg["hidden_size"], cfg["rms_norm_eps"]
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    lm_head = torch.randn(cfg["vocab_size"], h, generator=gen, **bf16) * 0.02
    norm_w = torch.ones(h, **bf16)
    ops = {
        "qkv": lambda x, w, c: gemv.gemv_rmsnorm(x, norm_w, eps, w, cfg=c),
        "o": lambda x, w, c: gemv.gemv(x, w, residual=x, cfg=c),
        "gate_up": lambda x, w, c: gemv.gemv_rmsnorm(x, norm_w, eps, w, cfg=c),
        "down": lambda x, w, c: gemv.gemv_silu_mul(x, w, residual=x[:, :h], cfg=c),
        "lm_head": lambda x, w, c: gemv.gemv_rmsnorm(x, norm_w, eps, w, cfg=c),
    }
    rows = []
    for name, ws in {**weights, "lm_head": [lm_head]}.items():
        n, k = ws[0].shape
        x = torch.randn(1, 2 * k if name == "down" else k, generator=gen, **bf16)
        x_lin = x[:, :k].contiguous()
        nbytes = sum(w.numel() * w.element_size() for w in ws)
        linear_s = _time_graph(lambda ws=ws, x_lin=x_lin: [F.linear(x_lin, w) for w in ws], reps)
        timed = []
        for c in sweep_cfgs(n, k):
            op = ops[name]
            s = _time_graph(lambda ws=ws, x=x, c=c, op=op: [op(x, w, c) for w in ws], reps)
            timed.append((s, c))
        timed.sort(key=lambda t: t[0])
        default_s = next(s for s, c in timed if c == gemv.config(1, n, k))
        rows.append(
            {
                "shape": name,
                "n": n,
                "k": k,
                "linear_ms": linear_s * 1e3,
                "default_ms": default_s * 1e3,
                "best_ms": timed[0][0] * 1e3,
                "best_TBps": nbytes / timed[0][0] / 1e12,
                "ranked": [{"ms": s * 1e3, "cfg": c} for s, c in timed],
            }
        )
        _print_sweep_row(rows[-1])
    return rows


def run(batch_sizes: list[int], reps: int, do_sweep: bool = False) -> dict:
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
    out: dict = {"limits": limits(reps), "cases": [], "chain": []}
    weight_bytes = sum(w.numel() * 2 for ws in weights.values() for w in ws)
    gemv_sizes = [bs for bs in batch_sizes if bs <= gemv.MAX_ROWS and gemv.triton is not None]
    for bs in gemv_sizes:
        out["chain"].append(chain_case(cfg, weights, bs, reps, gen))
    if do_sweep:
        out["sweep"] = sweep(cfg, weights, reps, gen)
    for variant in VARIANTS:
        if variant == "matmul-kn":  # one layout at a time: 14 GB each
            for name in weights:
                weights[name] = [w.t().contiguous() for w in weights[name]]
        lib = "cublaslt" if variant == "linear-lt" else "cublas"
        torch.backends.cuda.preferred_blas_library(lib)
        for bs in gemv_sizes if variant == "triton-gemv" else batch_sizes:
            xs = {
                name: torch.randn(bs, i, device="cuda", dtype=torch.bfloat16, generator=gen)
                for name, (_, i) in shapes(cfg).items()
            }

            def gemm(name: str, w: torch.Tensor, variant=variant, xs=xs) -> torch.Tensor:
                if variant == "triton-gemv":
                    return gemv.gemv(xs[name], w)
                return xs[name] @ w if variant == "matmul-kn" else F.linear(xs[name], w)

            timer = _time_graph if variant == "triton-gemv" else _time
            per_shape = {}
            for name, ws in weights.items():
                per_shape[name] = timer(lambda name=name, ws=ws: [gemm(name, w) for w in ws], reps)

            def chain() -> None:
                for layer in range(layers):
                    for name, ws in weights.items():
                        gemm(name, ws[layer])

            total = timer(chain, reps)
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


def _print_gemv(res: dict) -> None:
    if res["chain"]:
        print("\nLayer chain, all layers, one CUDA graph each (ms; rel diff: fused vs unfused)")
        print("| batch | unfused | fused | saved | F.linear only | gemv only | rel diff |")
        print("|---|---|---|---|---|---|---|")
        for c in res["chain"]:
            print(
                f"| {c['batch']} | {c['unfused_ms']:.3f} | {c['fused_ms']:.3f} "
                f"| {c['unfused_ms'] - c['fused_ms']:.3f} | {c['linear_only_ms']:.3f} "
                f"| {c['gemv_only_ms']:.3f} | {c['rel_diff']:.1e} |"
            )


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--batch-sizes", default="1,256")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--json", default=None)
    ap.add_argument(
        "--sweep", action="store_true", help="time gemv cfg alternatives per shape at batch 1"
    )
    args = ap.parse_args(argv)
    res = run([int(b) for b in args.batch_sizes.split(",")], args.reps, args.sweep)
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
    _print_gemv(res)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()
