"""Launch-parameter sweep of the quantised linear kernels (``kernels/quant_gemm.py`` and
``kernels/quant_gemv.py``) on this GPU, for the Llama-3-8B shape's four projections.

    python -m radixlm.srt.bench.tune_quant --json tune_quant.json
    python -m radixlm.srt.bench.tune_quant --kernels int4_gemv --rows 1,4

For each kernel and row count it times every candidate configuration on each projection shape
over ``--layers`` distinct weight copies (captured in one CUDA graph, so neither launch gaps nor
L2 reuse flatter it: the weights of one layer are not in L2 when the next reads them), and
prints, per shape, the heuristic's time, the best candidate's, and both against the weight-bytes
roofline (bytes / the copy bandwidth measured in the same run). Every configuration computes the
same result (checked against the heuristic's output), so a table built from this cannot make a
model wrong. Reference rows in the same run: bf16 ``F.linear`` and, for int4, dequantise + cuBLAS
(``int4_dequant``; ``int4_dequant_only`` times the dequantisation alone against its own bytes,
the int4 read plus the bf16 write). The GEMVs are swept up to 16 rows and the tiled kernel from
``GEMV_ROWS`` rows, so that the rows where one overtakes the other show in one run.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

import torch
import torch.nn.functional as F

from radixlm.kernels import int4_mm as im
from radixlm.kernels import quant_gemm as qg
from radixlm.kernels import quant_gemv as qv
from radixlm.srt.bench.bench_quant import GROUP, copy_bandwidth, projections

DEADLINE = [float("inf")]  # time.monotonic() after which candidates are skipped
GEMV_MAX_ROWS = 16  # the GEMV kernels' rows (the dispatch uses them up to qg.GEMV_ROWS)

FP8_GEMV_GRID = {
    "BLOCK_N": (2, 4, 8, 16, 32),
    "BLOCK_K": (128, 256, 512, 1024),
    "num_warps": (4, 8),
    "num_stages": (2, 3, 4),
}
INT4_GEMV_GRID = {
    "BLOCK_N": (4, 8, 16, 32),
    "SUB": (32, 128),
    "NC": (2, 4, 8, 16, 32),
    "num_warps": (4, 8),
    "num_stages": (2, 4),
}
# fp32 elements per program at most: FP8 accumulator BLOCK_M * BLOCK_N * BLOCK_K, int4 partial
# sums BLOCK_M * BLOCK_N * NC * SUB / 8 (larger tiles spill)
GEMV_ACC = {"fp8_gemv": 8192, "int4_gemv": 8192}
# int4_mm (kernels/int4_mm.py) by rows (BLOCK_K: the heuristic's, 128 at group 128): up to 16
# rows one 16-row tile, compiled once for all of them (the rows and splits are not specialised)
INT4_MM_GRIDS = {
    16: {
        "BLOCK_N": (64, 128, 256),
        "SPLIT_K": (1, 2, 4, 8, 16),
        "num_warps": (4, 8),
        "num_stages": (3, 4, 6),
    },
    64: {
        "BLOCK_N": (64, 128, 256),
        "SPLIT_K": (1, 2, 4, 8),
        "num_warps": (4, 8),
        "num_stages": (3, 4),
    },
    128: {
        "BLOCK_M": (64, 128, 256),
        "BLOCK_N": (128, 256),
        "SPLIT_K": (1, 2, 4),
        "num_warps": (4, 8),
        "num_stages": (2, 3),
    },
}
TILED_GRID = {
    "BLOCK_M": (16, 32, 64, 128),
    "BLOCK_N": (64, 128),
    "BLOCK_K": (64, 128),
    "SPLIT_K": (1, 2, 4, 8),
    "num_warps": (4, 8),
    "num_stages": (3, 4),
}


def graph_ms(calls, reps: int = 5) -> float:
    """Best-of-``reps`` ms of one replay of a CUDA graph of ``calls`` (each a no-arg callable)."""
    for c in calls:  # warm-up (compiles) outside the capture
        c()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    g.replay()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(reps):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end))
    del g
    return best


def configs(grid: dict) -> list[dict]:
    keys = list(grid)
    return [dict(zip(keys, vals, strict=True)) for vals in itertools.product(*grid.values())]


def make_weights(kind: str, n: int, k: int, layers: int):
    out = []
    for _ in range(layers):
        if kind == "fp8":
            w8 = (torch.randn(n, k, device="cuda") * 0.5).to(qg.FP8_DTYPE)
            out.append((w8, torch.rand(n, 1, device="cuda") * 0.01 + 1e-3))
        elif kind == "int4":
            q = torch.randint(0, 2**31 - 1, (n, k // 8), device="cuda", dtype=torch.int32)
            s = (torch.rand(n, k // GROUP, device="cuda") * 0.01 + 1e-3).to(torch.bfloat16)
            z = torch.full((n, k // GROUP), 8.0, device="cuda", dtype=torch.bfloat16)
            out.append((q, s, z))
        else:
            out.append((torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02,))
    return out


def weight_bytes(kind: str, n: int, k: int) -> int:
    return {"fp8": n * k, "int4": n * k // 2 + 2 * 2 * n * (k // GROUP), "bf16": 2 * n * k}[kind]


def call(kernel: str, x, w, cfg):
    if kernel == "fp8_gemv":
        return lambda: qv.fp8_gemv(x, w[0], w[1], None, cfg=cfg)
    if kernel == "int4_gemv":
        return lambda: qv.int4_gemv(x, w[0], w[1], w[2], cfg=cfg)
    if kernel == "int4_mm":
        return lambda: im.int4_mm(x, w[0], w[1], w[2], cfg=cfg)
    if kernel == "int4_tiled":
        return lambda: qg.int4_gemm(
            x,
            w[0],
            w[1],
            w[2],
            cfg=cfg or qg.int4_config(x.shape[0], w[0].shape[0], x.shape[1], GROUP),
        )
    if kernel == "int4_dequant":
        return lambda: F.linear(x, qg.int4_dequant(w[0], w[1], w[2], x.dtype))
    if kernel == "int4_dequant_only":  # the dequantisation alone: near copy bandwidth
        return lambda: qg.int4_dequant(w[0], w[1], w[2], x.dtype, **(cfg or {}))
    return lambda: F.linear(x, w[0])  # bf16


KIND = {
    "fp8_gemv": "fp8",
    "int4_mm": "int4",
    "int4_gemv": "int4",
    "int4_tiled": "int4",
    "int4_dequant": "int4",
    "int4_dequant_only": "int4",
}
GRIDS = {
    "fp8_gemv": FP8_GEMV_GRID,
    "int4_gemv": INT4_GEMV_GRID,
    "int4_tiled": TILED_GRID,
    "int4_dequant_only": {"block_n": (8, 16, 32, 64)},
}


def grid(kernel: str, rows: int) -> dict | None:
    if kernel == "int4_mm":
        return INT4_MM_GRIDS[next(r for r in (16, 64, 128) if rows <= r or r == 128)]
    return GRIDS.get(kernel)


def fits(kernel: str, cfg: dict, rows: int, k: int) -> bool:
    """Whether a candidate serves this shape and keeps its tile in registers."""
    if kernel == "int4_mm":  # no split without a tile, no row tile over the rows (a power of 2)
        return cfg.get("SPLIT_K", 1) <= k // 128 and cfg.get("BLOCK_M", 16) <= max(
            16, qv.block_m(rows)
        )
    if kernel.endswith("gemv"):
        per_output = cfg.get("NC", 1) * cfg.get("SUB", 8) // 8 * cfg.get("BLOCK_K", 1)
        if qv.block_m(rows) * cfg["BLOCK_N"] * per_output > GEMV_ACC[kernel]:
            return False
    if kernel == "int4_gemv" and GROUP % cfg["SUB"]:
        return False
    if "BLOCK_K" in cfg and k % (cfg["BLOCK_K"] * cfg.get("SPLIT_K", 1)):
        return False
    if kernel == "int4_tiled" and (GROUP % cfg["BLOCK_K"] or cfg["BLOCK_M"] > 4 * rows + 16):
        return False
    return True


def sweep(kernel: str, rows: int, layers: int, bw: float, limit: int) -> list[dict]:
    """Every projection shape: the heuristic's time and, within ``limit`` candidates and
    before the ``--deadline-s`` cut-off, the best candidate's."""
    kind = KIND.get(kernel, "bf16")
    g = grid(kernel, rows)
    cands = configs(g) if g else []
    rows_out = []
    for n, k in projections():
        ws = make_weights(kind, n, k, layers)
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        moved = weight_bytes(kind, n, k) + (2 * n * k if kernel == "int4_dequant_only" else 0)
        roof = layers * moved / bw * 1e3  # the dequantisation alone: its bf16 writes too
        try:
            ref = call(kernel, x, ws[0], None)()
            base = graph_ms([call(kernel, x, w, None) for w in ws])
        except Exception as exc:  # noqa: BLE001 - reported, the sweep goes on
            print(f"  {kernel} rows {rows} {n}x{k}: heuristic failed: {exc!r}"[:400], flush=True)
            continue
        best, best_cfg = base, None
        for cfg in cands[:limit]:
            if time.monotonic() > DEADLINE[0]:
                break
            if not fits(kernel, cfg, rows, k):
                continue
            try:
                y = call(kernel, x, ws[0], cfg)()
                if not torch.allclose(y.float(), ref.float(), rtol=2e-2, atol=2e-2):
                    print(f"  {kernel} {cfg}: result differs, skipped", flush=True)
                    continue
                ms = graph_ms([call(kernel, x, w, cfg) for w in ws], reps=3)
            except Exception as exc:  # noqa: BLE001 - a candidate that fails to compile is skipped
                print(f"  {kernel} {cfg}: {type(exc).__name__}", flush=True)
                continue
            if ms < best:
                best, best_cfg = ms, cfg
        row = {
            "kernel": kernel,
            "rows": rows,
            "n": n,
            "k": k,
            "heuristic_ms": base / layers,
            "best_ms": best / layers,
            "roofline_ms": roof / layers,
            "heuristic_ratio": base / roof,
            "best_ratio": best / roof,
            "best_cfg": best_cfg,
        }
        print(json.dumps(row), flush=True)
        rows_out.append(row)
        del ws
        torch.cuda.empty_cache()
    return rows_out


def timed_at(kernel: str, rows: int) -> bool:
    """The rows each kernel serves: GEMVs up to 16, the tiled kernel from ``GEMV_ROWS``, the
    dequantisation alone once (no activations), int4_mm up to 256 (against dequant + cuBLAS)."""
    if "gemv" in kernel:
        return rows <= GEMV_MAX_ROWS
    if kernel == "int4_tiled":
        return rows >= qg.GEMV_ROWS
    if kernel == "int4_dequant_only":
        return rows == 1
    return True


def summary(results: list[dict]) -> list[str]:
    """One line per kernel and row count: the ranges over the shapes of the heuristic's and the
    best candidate's time against the roofline (the table the docs take)."""
    groups: dict = {}
    for r in results:
        groups.setdefault((r["kernel"], r["rows"]), []).append(r)
    lines = ["kernel | rows | heuristic / roofline | best / roofline"]
    for (kernel, rows), rs in sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        h = [r["heuristic_ratio"] for r in rs]
        b = [r["best_ratio"] for r in rs]
        lines.append(f"{kernel} | {rows} | {min(h):.2f}-{max(h):.2f}x | {min(b):.2f}-{max(b):.2f}x")
    return lines


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--kernels",
        default="bf16,fp8_gemv,int4_mm,int4_gemv,int4_tiled,int4_dequant_only,int4_dequant",
    )
    ap.add_argument("--rows", default="1,4,8,16,64,256")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--limit", type=int, default=1000, help="at most this many candidates")
    ap.add_argument("--sweep", default=None, help="kernels whose candidates are timed (all)")
    ap.add_argument("--deadline-s", type=float, default=None, help="then heuristics only")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.deadline_s:
        DEADLINE[0] = time.monotonic() + args.deadline_s
    bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy {bw / 1e12:.2f} TB/s", flush=True)
    swept = set(args.sweep.split(",")) if args.sweep else None
    results = []
    for rows, kernel in itertools.product(map(int, args.rows.split(",")), args.kernels.split(",")):
        if not timed_at(kernel, rows):
            continue
        limit = args.limit if swept is None or kernel in swept else 0
        results += sweep(kernel, rows, args.layers, bw, limit)
        if args.json:  # written as it goes: a run cut short keeps what it measured
            with open(args.json, "w") as f:
                out = {"device": torch.cuda.get_device_name(), "copy_bw": bw}
                json.dump({**out, "rows": results}, f)
    print("\n".join(summary(results)), flush=True)


if __name__ == "__main__":
    main()
