"""All-reduce latency and bandwidth across N ranks, the figures a tensor-parallel roofline needs.

    python -m radixlm.srt.bench.collective_calib --world-sizes 2,4,8          # GPUs: NCCL
    python -m radixlm.srt.bench.collective_calib --device cpu --world-sizes 2  # CPUs: gloo

One process per rank (spawned), joined on a free local port. For each message size it times
``repeats`` back-to-back all-reduces after a warm-up and reports the median time per call, the
algorithm bandwidth (bytes / time) and the bus bandwidth (``2 (N-1) / N`` bytes / time, the
figure comparable across rank counts). The decode message of a model is ``batch x hidden``
values in the model's dtype, sent twice per layer (after attention and after the MLP), so a
tensor-parallel decode step cannot beat::

    weights / (N x copy bandwidth) + 2 x layers x allreduce_latency(batch x hidden)

``tp_roofline_ms`` computes that from the table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import queue
import statistics
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from radixlm.srt.managers.tp_ranks import free_local_port

DEFAULT_SIZES = (8192, 65536, 1 << 20, 16 << 20, 256 << 20)  # bytes: decode b1 (hidden 4096) up


def _rank_main(rank: int, world: int, port: int, device: str, sizes, repeats: int, out) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    backend = "nccl" if device == "cuda" else "gloo"
    dist.init_process_group(
        backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120)
    )
    try:
        dev = torch.device(f"cuda:{rank}") if device == "cuda" else torch.device("cpu")
        if device == "cuda":
            torch.cuda.set_device(dev)
        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        rows = []
        for size in sizes:
            x = torch.ones(max(size // torch.empty((), dtype=dtype).element_size(), 1), dtype=dtype)
            x = x.to(dev)
            for _ in range(3):
                dist.all_reduce(x)
            times = []
            for _ in range(repeats):
                if device == "cuda":
                    torch.cuda.synchronize(dev)
                start = time.perf_counter()
                dist.all_reduce(x)
                if device == "cuda":
                    torch.cuda.synchronize(dev)
                times.append(time.perf_counter() - start)
            t = statistics.median(times)
            nbytes = x.numel() * x.element_size()
            rows.append(
                {
                    "bytes": nbytes,
                    "latency_us": t * 1e6,
                    "algo_GBps": nbytes / t / 1e9,
                    "bus_GBps": 2 * (world - 1) / world * nbytes / t / 1e9,
                }
            )
        if rank == 0:
            out.put(rows)
            out.close()
            out.join_thread()  # the table is in the pipe before this process leaves
        dist.barrier()
    except BaseException:
        traceback.print_exc()
        os._exit(1)
    # leave without tearing gloo/NCCL down: a rank whose peer has already gone can abort in
    # the group's destructor ("terminate called without an active exception")
    os._exit(0)


def measure(world: int, device: str, sizes=DEFAULT_SIZES, repeats: int = 20) -> list[dict]:
    """The all-reduce table for ``world`` ranks (spawned processes; rank r uses cuda:r)."""
    if device == "cuda" and torch.cuda.device_count() < world:
        raise ValueError(f"{world} ranks need {world} GPUs, found {torch.cuda.device_count()}")
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_local_port()
    procs = [
        ctx.Process(target=_rank_main, args=(r, world, port, device, sizes, repeats, out))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    try:
        rows = None
        while rows is None:
            try:
                rows = out.get(timeout=1.0)
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in procs):
                    raise RuntimeError(
                        f"a rank failed: exit codes {[p.exitcode for p in procs]}"
                    ) from None
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    if any(p.exitcode for p in procs):
        raise RuntimeError(f"a rank failed: exit codes {[p.exitcode for p in procs]}")
    return rows


def latency_at(rows: list[dict], nbytes: int) -> float:
    """Seconds per all-reduce of ``nbytes``, interpolated in the measured table."""
    pts = sorted((r["bytes"], r["latency_us"] * 1e-6) for r in rows)
    if nbytes <= pts[0][0]:
        return pts[0][1]
    for (b0, t0), (b1, t1) in zip(pts, pts[1:], strict=False):
        if nbytes <= b1:
            return t0 + (t1 - t0) * (nbytes - b0) / (b1 - b0)
    b, t = pts[-1]
    return t * nbytes / b  # beyond the table: bandwidth-bound


def tp_roofline_ms(
    weight_bytes: int, copy_Bps: float, world: int, layers: int, message_bytes: int, rows
) -> float:
    """The batch-1 decode limit of ``world`` ranks: each reads its share of the weights, and
    two all-reduces per layer cannot overlap with the layer that needs their result."""
    reduce_s = 0.0 if world == 1 else 2 * layers * latency_at(rows, message_bytes)
    return (weight_bytes / (world * copy_Bps) + reduce_s) * 1e3


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--world-sizes", default="2")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES)), help="bytes")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    results = {}
    for world in (int(w) for w in args.world_sizes.split(",")):
        rows = measure(world, args.device, sizes, args.repeats)
        results[world] = rows
        for r in rows:
            print(
                f"ranks {world}  {r['bytes']:>12,} B  {r['latency_us']:10.1f} us  "
                f"algo {r['algo_GBps']:8.2f} GB/s  bus {r['bus_GBps']:8.2f} GB/s",
                flush=True,
            )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
