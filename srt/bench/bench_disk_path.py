"""The disk KV tier's read path against a raw read of the same folder, in the same run.

    python -m radixlm.srt.bench.bench_disk_path                 # 8B-shaped pages, 256 MiB
    python -m radixlm.srt.bench.bench_disk_path --num-pages 64 --layers 2 --heads 2 --head-dim 64

Fills a fresh disk page store with random pages of one KV geometry (default: Llama-3-8B, bf16,
16 tokens a page: 2 MiB a page), then, with the files in the page cache:

* ``raw``: every page file read whole by ``--threads`` threads (``readinto`` into one reused
  buffer per thread): what the folder gives at most;
* ``path``: what a disk hit does at admission: reads submitted to the storage threads
  (``StorageIO.submit_read_into``, verified: header, token ids, checksum), each page's file read
  by one ``preadv`` straight into the blocks of a reserved host KV pool page;
* ``buffered``: what a page read ahead (``prefetch``) costs: read into a recycled buffer, then
  copied into a host pool page (``HostKVPool.write_page_bytes``) and the buffer given back (run
  1 allocates the read buffers, later runs reuse them).

Prints bytes/s of the three and the path's ratio to the raw read. ``raw_read_rate`` is also used by ``bench_multiturn``
to put the disk modes' measured path rate beside a raw read of their folder.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time
from pathlib import Path

import torch


def raw_read_rate(
    folder: str | Path, threads: int = 4, max_bytes: int = 2 << 30
) -> tuple[int, float]:
    """(bytes, seconds) of reading the page files under ``folder`` whole (the most recently
    written first, at most ``max_bytes`` of them), on ``threads``."""
    found = [(p.stat().st_mtime_ns, p.stat().st_size, str(p)) for p in Path(folder).rglob("*.page")]
    paths, total_bytes = [], 0
    for _, size, path in sorted(found, reverse=True):
        if total_bytes + size > max_bytes:
            break
        paths.append(path)
        total_bytes += size
    total = [0] * threads

    def work(i: int) -> None:
        buf = bytearray(0)
        for path in paths[i::threads]:
            size = os.path.getsize(path)
            if len(buf) < size:
                buf = bytearray(size)
            with open(path, "rb", buffering=0) as f:
                total[i] += f.readinto(memoryview(buf)[:size])

    started = time.perf_counter()
    workers = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return sum(total), time.perf_counter() - started


def fill_store(folder: Path, args: argparse.Namespace):
    """A DiskPageStore of ``args.num_pages`` random pages, and their (key, token ids)."""
    from radixlm.hicache.disk_store import DiskPageStore
    from radixlm.hicache.host_pool import HostKVPool
    from radixlm.hicache.page_hash import page_keys

    pool = HostKVPool(
        args.num_pages * args.page_size,
        args.page_size,
        args.layers,
        args.heads,
        args.head_dim,
        torch.bfloat16,
    )
    pool.data.view(torch.int16).random_(-(2**15), 2**15 - 1)
    store = DiskPageStore(folder, {"bench": "disk_path"}, max_bytes=1 << 40)
    tokens = list(range(args.num_pages * args.page_size))
    keys = page_keys(tokens, args.page_size)
    pages = []
    for i, key in enumerate(keys):
        ids = tokens[i * args.page_size : (i + 1) * args.page_size]
        assert store.set(key, ids, pool.page_bytes(i))
        pages.append((key, ids))
    return store, pool, pages


def path_rate(store, pool, pages, threads: int, buffered: bool = False) -> tuple[int, float]:
    """(bytes, seconds) of the disk-hit path: verified reads on the storage threads straight
    into host pool pages (``buffered``: into read buffers, then copied into the pages)."""
    from radixlm.hicache.storage_io import StorageIO

    io = StorageIO(store, num_read_threads=threads, max_pending_reads=len(pages) + 1)
    try:
        started = time.perf_counter()
        if buffered:
            futures = [io.submit_read(key, ids) for key, ids in pages]
        else:
            futures = [
                io.submit_read_into(key, ids, pool.page_blocks(page_id))
                for page_id, (key, ids) in enumerate(pages)
            ]
        for page_id, fut in enumerate(futures):
            payload = fut.result()
            assert payload, "a page of the bench store did not read back"
            if buffered:
                pool.write_page_bytes(page_id, payload)
                io.recycle(payload)  # as the tree does once a page is in its host pool
        return len(pages) * pool.bytes_per_page, time.perf_counter() - started
    finally:
        io.close()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--num-pages", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--heads", type=int, default=8, help="KV heads")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--threads", type=int, default=4, help="reader threads (both reads)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None, help="folder (default: a temp dir, removed after)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        store, pool, pages = fill_store(Path(tmp), args)
        raw_read_rate(tmp, args.threads)  # into the page cache
        print(
            f"{len(pages)} pages of {pool.bytes_per_page / 2**20:.2f} MiB, {args.threads} threads"
        )
        print(f"{'run':>4}{'raw GB/s':>10}{'path GB/s':>11}{'buffered GB/s':>15}{'path/raw':>10}")
        for i in range(args.repeats):
            raw_b, raw_s = raw_read_rate(tmp, args.threads)
            path_b, path_s = path_rate(store, pool, pages, args.threads)
            buf_b, buf_s = path_rate(store, pool, pages, args.threads, buffered=True)
            raw, path, buf = raw_b / raw_s, path_b / path_s, buf_b / buf_s
            print(
                f"{i + 1:>4}{raw / 1e9:>10.2f}{path / 1e9:>11.2f}{buf / 1e9:>15.2f}"
                f"{path / raw:>10.2f}"
            )
        store.close()


if __name__ == "__main__":
    main()
