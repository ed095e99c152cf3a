"""Tile tuning of the fused MoE kernels on this GPU: entries for ``kernels/fused_moe.TILE_TABLE``.

    python -m radixlm.srt.bench.tune_moe --json moe_tiles.json    # the Qwen3-30B-A3B shape
    RADIXLM_MOE_TILES=moe_tiles.json radixlm serve ...            # the table, loaded at import

For each batch bucket it times ``fused_experts`` (one layer, random routing, bf16) with the
heuristic's tiles, then walks the tile fields one at a time over their candidates (coordinate
descent, a few rounds) and keeps the fastest. Every tile computes the same result (tiles only
change speed), so the table cannot make a model wrong; a candidate that fails to compile is
skipped. Buckets up to ``SMALL_BATCH_TOKENS`` tune the small-batch kernels' fields, larger ones
the grouped GEMM's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import torch

from radixlm.kernels import fused_moe
from radixlm.srt.bench.bench_gpu import cuda_ms
from radixlm.srt.bench.bench_moe import QWEN3_30B_A3B

SMALL_FIELDS = {
    "small_n": (4, 8, 16, 32),
    "small_k": (64, 128, 256, 512),
    "small_down_n": (2, 4, 8, 16),
    "small_down_k": (128, 256, 512, 1024),
    "num_stages": (1, 2, 3, 4),
}
GROUPED_FIELDS = {
    "block_m": (16, 32, 64, 128),
    "block_n": (32, 64, 128),
    "block_k": (32, 64, 128),
}


def tune_bucket(shape: dict, bucket: int, reps: int = 20, rounds: int = 2) -> dict:
    """The fastest tiles found for ``bucket`` tokens and their time (ms), with the
    heuristic's time for comparison."""
    h, inter, e = shape["hidden_size"], shape["moe_intermediate_size"], shape["num_experts"]
    k = shape["num_experts_per_tok"]
    dev, bf16 = "cuda", torch.bfloat16
    x = torch.randn(bucket, h, device=dev, dtype=bf16)
    gate_up = torch.randn(e, 2 * inter, h, device=dev, dtype=bf16) * 0.02
    down = torch.randn(e, h, inter, device=dev, dtype=bf16) * 0.02
    weights, ids = torch.rand(bucket, e, device=dev).topk(k, dim=-1)

    def timed(tiles: fused_moe.TileConfig) -> float:
        try:
            return cuda_ms(
                lambda: fused_moe.fused_experts(x, gate_up, down, ids, weights, tiles), reps, 2
            )
        except Exception:  # noqa: BLE001 - a candidate that does not compile is skipped
            return float("inf")

    start = fused_moe.heuristic_tiles(bucket, k, e, h, inter)
    best, best_ms = start, timed(start)
    heuristic_ms = best_ms
    fields = SMALL_FIELDS if bucket <= fused_moe.SMALL_BATCH_TOKENS else GROUPED_FIELDS
    for _ in range(rounds):
        for name, values in fields.items():
            for value in values:
                candidate = dataclasses.replace(best, **{name: value})
                if candidate == best:
                    continue
                ms = timed(candidate)
                if ms < best_ms:
                    best, best_ms = candidate, ms
    key = [e, 2 * inter, h, k, str(bf16), bucket]
    return {
        "key": key,
        "tiles": dataclasses.asdict(best),
        "ms": best_ms,
        "heuristic_ms": heuristic_ms,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--buckets",
        type=lambda s: [int(b) for b in s.split(",")],
        default=[1, 2, 4, 8, 16, 32, 64, 128, 256, 1024, 4096],
    )
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    entries = []
    for bucket in args.buckets:
        if fused_moe.batch_bucket(bucket) != bucket:
            raise SystemExit(f"bucket {bucket} is not a power of two")
        entry = tune_bucket(QWEN3_30B_A3B, bucket)
        entries.append(entry)
        print(json.dumps(entry), flush=True)
    out = {"device": torch.cuda.get_device_name(), "entries": entries}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
