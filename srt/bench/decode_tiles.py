"""Tile sweep of the triton decode attention kernel (``kernels/attention/triton_decode.py``).

    python -m radixlm.srt.bench.decode_tiles                  # H200 figures: batch 256 x 1,100
    python -m radixlm.srt.bench.decode_tiles --batch 64 --seq-len 4096 --kv fp8

Times one layer's decode attention (the partial and merge kernels) at a fixed shape (Llama-3-8B
heads by default: 32 query and 8 KV heads of 128) for every combination of tokens per tile
(``BLOCK_N``), pipeline stages, warps and KV splits (and, for fp8, each way of feeding the fp8 tiles to the dots:
``FP8_DOT`` 0/1/2, see the kernel), with bf16 and/or fp8 (e4m3) KV in slots
scattered at random over the pool, and prints each one's time, KV bytes per second and largest
difference from the configuration the kernel used before the sweep (64 tokens, 2 stages, 4
warps, 1 split); then the five fastest per KV dtype. ``_decode_config`` holds the choice.
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch

from radixlm.kernels.attention import triton_decode as td
from radixlm.srt.bench.bench_gpu import cuda_ms

BASELINE = dict(BLOCK_N=64, num_stages=2, num_warps=4, splits=1, FP8_DOT=0)
TILE_KEYS = ("BLOCK_N", "num_stages", "num_warps", "FP8_DOT")


def _run(shape: dict, q, k_buf, v_buf, table, cfg: dict) -> torch.Tensor:
    return td.decode_attention(
        q,
        k_buf,
        v_buf,
        *table,
        num_heads=shape["heads"],
        num_kv_heads=shape["kv_heads"],
        head_dim=shape["dim"],
        scaling=shape["dim"] ** -0.5,
        num_splits=cfg["splits"],
        tiles={key: cfg[key] for key in TILE_KEYS},
    )


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--seq-len", type=int, default=1100)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--kv", default="bf16,fp8", help="comma list of bf16, fp8")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--block-n", default="32,64,128", help="comma list of tokens per tile")
    ap.add_argument("--stages", default="1,2,3,4")
    ap.add_argument("--warps", default="4,8")
    ap.add_argument("--splits", default="1,2")
    ap.add_argument("--fp8-dots", default="0,1,2", help="FP8_DOT values tried with fp8 KV")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("decode_tiles needs a CUDA device")
    shape = dict(batch=args.batch, heads=args.heads, kv_heads=args.kv_heads, dim=args.head_dim)
    dev, n = "cuda", args.seq_len
    gen = torch.Generator(device=dev).manual_seed(0)
    slots = args.batch * n + 1
    req_to_token = torch.zeros(args.batch + 1, n, dtype=torch.int64, device=dev)
    perm = torch.randperm(slots - 1, device=dev, generator=gen) + 1
    req_to_token[: args.batch] = perm.view(args.batch, n)
    table = (
        req_to_token,
        torch.arange(args.batch, device=dev),
        torch.full((args.batch,), n, dtype=torch.int64, device=dev),
    )
    q = torch.randn(
        args.batch, args.heads * args.head_dim, dtype=torch.bfloat16, device=dev, generator=gen
    )
    kv_shape = (slots, args.kv_heads, args.head_dim)
    k = torch.randn(kv_shape, dtype=torch.bfloat16, device=dev, generator=gen)
    v = torch.randn(kv_shape, dtype=torch.bfloat16, device=dev, generator=gen)
    buffers = {"bf16": (k, v), "fp8": (k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn))}
    best = {}
    for name in args.kv.split(","):
        k_buf, v_buf = buffers[name]
        reference = _run(shape, q, k_buf, v_buf, table, BASELINE).float()
        kv_bytes = 2 * args.batch * n * args.kv_heads * args.head_dim * k_buf.element_size()
        rows = []
        dots = _ints(args.fp8_dots) if name == "fp8" else [0]
        grid = itertools.product(
            *(_ints(v) for v in (args.block_n, args.stages, args.warps, args.splits)), dots
        )
        for block_n, stages, warps, splits, dot in grid:
            cfg = dict(BLOCK_N=block_n, num_stages=stages, num_warps=warps, splits=splits)
            cfg["FP8_DOT"] = dot
            try:
                err = (_run(shape, q, k_buf, v_buf, table, cfg).float() - reference).abs().max()
                ms = cuda_ms(
                    lambda c=cfg, kb=k_buf, vb=v_buf: _run(shape, q, kb, vb, table, c), args.reps
                )
            except Exception as e:  # e.g. out of shared memory on smaller GPUs
                print(json.dumps({"kv": name, **cfg, "error": str(e)[:120]}), flush=True)
                continue
            row = {
                "kv": name,
                **cfg,
                "ms": round(ms, 4),
                "TBps": round(kv_bytes / ms / 1e9, 3),
                "max_diff": float(err),
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
        rows.sort(key=lambda r: r["ms"])
        best[name] = rows[:5]
        print("fastest", name, json.dumps(rows[:5]), flush=True)
    return best


if __name__ == "__main__":
    main()
