"""The disk KV tier's read path against a raw read of the same folder, in the same run.

    python -m radixlm.srt.bench.bench_disk_path                 # 8B-shaped pages, 256 MiB
    python -m radixlm.srt.bench.bench_disk_path --num-pages 64 --layers 2 --heads 2 --head-dim 64

Fills a fresh disk page store with random pages of one KV geometry (default: Llama-3-8B, bf16,
16 tokens a page: 2 MiB a page) from a host KV pool (page-locked where CUDA is, as the server's),
then, with the files in the page cache:

* ``raw``: every page file read whole by ``--threads`` threads (``readinto`` into one reused
  buffer per thread, so the buffer stays in the CPU's cache): what the folder gives at most, as
  ``dd`` would read it;
* ``pool``: the same files read by the same threads straight into the blocks of the host KV
  pool's pages by ``preadv`` as the path reads them, without a check: what moving the
  bytes into host pages costs (cold memory, a page's blocks apart), the floor of any path that
  ends in host pages;
* ``path``: what a disk hit does at admission: reads submitted to the storage threads
  (``StorageIO.submit_read_into``, verified: header, token ids, checksum), each page's file read
  by one ``preadv`` straight into the blocks of a reserved host KV pool page (and hashed) in one
  call without the GIL, or in Python with ``--python-path``;
* ``buffered``: what a page read ahead (``prefetch``) costs: read into a recycled buffer, then
  copied into a host pool page (``HostKVPool.write_page_bytes``) and the buffer given back (run
  1 allocates the read buffers, later runs reuse them).

Prints bytes/s of each and the path's ratio to the raw read and to ``pool``. ``--phases``
also splits the path's time on its reader threads (one more path run per repeat): each page's
wall time in the store's read, the thread's CPU time in it (user and kernel: a read from the
page cache is CPU work), and of that wall time the native helper's one call a page (reads and
checksum without the GIL, ``hicache/native_page_io.py``) or, on the Python path
(``--python-path``), its ``preadv`` calls and checksum updates; wall time a thread spends off the CPU inside a read is waiting (for the GIL, on a page cache
that has no free core), not reading. ``--busy-thread``
runs a thread of pure Python beside every measurement, as the scheduler thread is beside the
storage threads in a server: a storage thread that gives the GIL up for a system call may then
wait up to the interpreter's switch interval to get it back. ``raw_read_rate`` is also used by
``bench_multiturn`` to put the disk modes' measured path rate beside a raw read of their folder.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from radixlm.hicache.storage_io import SWITCH_INTERVAL_S


def raw_read_rate(
    folder: str | Path, threads: int = 4, max_bytes: int = 2 << 30
) -> tuple[int, float]:
    """(bytes, seconds) of reading the page files under ``folder`` whole (the most recently
    written first, at most ``max_bytes`` of them), on ``threads`` that each take the next file
    (as the storage threads take the next read: a thread slowed by other work holds no share
    back)."""
    found = [(p.stat().st_mtime_ns, p.stat().st_size, str(p)) for p in Path(folder).rglob("*.page")]
    paths, total_bytes = [], 0
    for _, size, path in sorted(found, reverse=True):
        if total_bytes + size > max_bytes:
            break
        paths.append(path)
        total_bytes += size
    total = [0] * threads
    next_paths = iter(paths)  # shared: each thread takes the next file (next() holds the GIL)

    def work(i: int) -> None:
        buf = bytearray(0)
        for path in next_paths:
            size = os.path.getsize(path)
            if len(buf) < size:
                buf = bytearray(size)
            with open(path, "rb", buffering=0) as f:
                total[i] += f.readinto(memoryview(buf)[:size])

    seconds = _on_threads(work, threads)
    return sum(total), seconds


def _on_threads(work: Callable[[int], None], threads: int) -> float:
    """Seconds ``work(i)`` takes on ``threads`` threads (i = 0 .. threads - 1) at once."""
    started = time.perf_counter()
    workers = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return time.perf_counter() - started


def pool_read_rate(store, pool, pages, threads: int) -> tuple[int, float]:
    """(bytes, seconds) of reading each page's file straight into its host pool page's blocks
    (the header and token ids into a scratch buffer) by ``preadv`` as the store reads (one a
    page, or one a chunk), without a check: the bare copy the path does."""
    from radixlm.hicache.page_file import chunk_groups

    paths = [str(store.page_path(key)) for key, _ in pages]
    head_bytes = os.path.getsize(paths[0]) - pool.bytes_per_page if paths else 0

    next_pages = iter(range(len(paths)))  # shared, as in raw_read_rate

    def work(i: int) -> None:
        head = memoryview(bytearray(head_bytes))
        for page_id in next_pages:
            groups = chunk_groups(pool.page_blocks(page_id), store.read_chunk_bytes)
            fd = os.open(paths[page_id], os.O_RDONLY)
            try:
                offset = os.preadv(fd, [head], 0)
                for group, _ in groups:
                    offset += os.preadv(fd, group, offset)
            finally:
                os.close(fd)

    return len(paths) * pool.bytes_per_page, _on_threads(work, threads)


@contextlib.contextmanager
def busy_python(is_on: bool) -> Iterator[None]:
    """A thread running pure Python (it holds the GIL but for the interpreter's switches) while
    the block runs, when ``is_on``."""
    stop = threading.Event()

    def spin() -> None:
        count = 0
        while not stop.is_set():
            for _ in range(1000):
                count += 1

    thread = threading.Thread(target=spin, daemon=True)
    if is_on:
        thread.start()
    try:
        yield
    finally:
        stop.set()
        if is_on:
            thread.join()


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
        pin_memory=torch.cuda.is_available(),  # page-locked, as the server's pool on a GPU
    )
    pool.data.view(torch.int16).random_(-(2**15), 2**15 - 1)
    store = DiskPageStore(
        folder,
        {"bench": "disk_path"},
        max_bytes=1 << 40,
        read_chunk_bytes=args.read_chunk_kib << 10,
    )
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

    io = StorageIO(
        store, num_read_threads=threads, max_pending_reads=len(pages) + 1, switch_interval_s=None
    )
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


class _TimedHash:
    """An ``xxh3_64`` whose ``update`` calls are timed into ``phases["hash_s"]``."""

    def __init__(self, inner, phases: dict) -> None:
        self.inner, self.phases = inner, phases

    def update(self, data) -> None:
        t = time.perf_counter()
        self.inner.update(data)
        _add(self.phases, "hash_s", time.perf_counter() - t)

    def intdigest(self) -> int:
        return self.inner.intdigest()


_PHASE_LOCK = threading.Lock()


def _add(phases: dict, key: str, value: float) -> None:
    with _PHASE_LOCK:
        phases[key] = phases.get(key, 0.0) + value


@contextlib.contextmanager
def timed_phases(phases: dict) -> Iterator[None]:
    """Times the disk path's parts into ``phases`` while inside: the store's read per page
    (``read_wall_s``, ``read_cpu_s``: this thread's CPU time), and either the native helper's
    one call a page (``native_s``: open, reads, checksum and close without the GIL) or the
    Python path's ``preadv`` calls (``preadv_s``) and checksum updates (``hash_s``); ``pages``."""
    from types import SimpleNamespace

    from radixlm.hicache import disk_store, native_page_io, page_file

    real_get_into, real_preadv, real_xxhash = (
        disk_store.DiskPageStore.get_into,
        page_file.preadv_into,
        page_file.xxhash,
    )
    real_native_read = native_page_io.NativePageIO.read

    def get_into(self, *args, **kwargs):
        wall, cpu = time.perf_counter(), time.thread_time()
        try:
            return real_get_into(self, *args, **kwargs)
        finally:
            _add(phases, "read_wall_s", time.perf_counter() - wall)
            _add(phases, "read_cpu_s", time.thread_time() - cpu)
            _add(phases, "pages", 1)

    def timed(fn, key: str):
        def call(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                _add(phases, key, time.perf_counter() - t)

        return call

    page_file.xxhash = SimpleNamespace(
        xxh3_64=lambda data=b"": _TimedHash(real_xxhash.xxh3_64(data), phases)
    )
    disk_store.DiskPageStore.get_into = get_into
    page_file.preadv_into = timed(real_preadv, "preadv_s")
    native_page_io.NativePageIO.read = timed(real_native_read, "native_s")
    try:
        yield
    finally:
        disk_store.DiskPageStore.get_into = real_get_into
        page_file.preadv_into = real_preadv
        page_file.xxhash = real_xxhash
        native_page_io.NativePageIO.read = real_native_read


def print_phases(phases: dict, wall_s: float, threads: int) -> None:
    n = max(int(phases.get("pages", 0)), 1)
    keys = ("read_wall_s", "read_cpu_s", "preadv_s", "hash_s", "native_s")
    us = {k: phases.get(k, 0.0) / n * 1e6 for k in keys}
    rest = us["read_wall_s"] - us["preadv_s"] - us["hash_s"] - us["native_s"]
    if us["native_s"]:
        parts = f"native read + checksum (one call, no GIL) {us['native_s']:.0f}"
    else:
        parts = f"preadv {us['preadv_s']:.0f}, checksum {us['hash_s']:.0f}"
    print(
        f"     path phases, us a page ({n} pages, {threads} threads, {wall_s:.3f} s): read "
        f"{us['read_wall_s']:.0f} wall / {us['read_cpu_s']:.0f} CPU; {parts}, the rest "
        f"{rest:.0f}; off the CPU inside reads "
        f"{max(us['read_wall_s'] - us['read_cpu_s'], 0.0):.0f}; reader threads busy "
        f"{phases.get('read_wall_s', 0.0) / (wall_s * threads):.0%} of the run"
    )


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
    ap.add_argument(
        "--read-chunk-kib",
        type=int,
        default=0,
        help="read a page in preadv calls of this many KiB, each chunk hashed while in the "
        "cache (default 0: one preadv a page, as the server does)",
    )
    ap.add_argument(
        "--busy-thread",
        action="store_true",
        help="a thread of pure Python runs beside every read, as a server's scheduler thread",
    )
    ap.add_argument("--dir", default=None, help="folder (default: a temp dir, removed after)")
    ap.add_argument("--phases", action="store_true", help="split the path's time (one more run)")
    ap.add_argument(
        "--python-path",
        action="store_true",
        help="read (and write) page files in Python, not with the native helper",
    )
    ap.add_argument(
        "--switch-interval-ms",
        type=float,
        default=SWITCH_INTERVAL_S * 1e3,
        help="the GIL switch interval of the run (default: the one a storage tier sets; "
        "Python's own is 5)",
    )
    args = ap.parse_args(argv)
    from radixlm.hicache import native_page_io

    sys.setswitchinterval(args.switch_interval_ms / 1e3)
    python_only = native_page_io.python_only() if args.python_path else contextlib.nullcontext()
    with python_only, tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        store, pool, pages = fill_store(Path(tmp), args)
        raw_read_rate(tmp, args.threads)  # into the page cache
        print(
            f"{len(pages)} pages of {pool.bytes_per_page / 2**20:.2f} MiB, {args.threads} threads"
            + (", pinned host pool" if pool.is_pinned else "")
            + (f", read in {args.read_chunk_kib} KiB chunks" if args.read_chunk_kib else "")
            + (", a busy Python thread beside" if args.busy_thread else "")
            + (", Python path" if args.python_path else "")
            + f", GIL switch interval {args.switch_interval_ms:g} ms"
        )
        print(
            f"{'run':>4}{'raw GB/s':>10}{'pool GB/s':>11}{'path GB/s':>11}{'buffered GB/s':>15}"
            f"{'path/raw':>10}{'path/pool':>11}"
        )
        for i in range(args.repeats):
            with busy_python(args.busy_thread):
                raw_b, raw_s = raw_read_rate(tmp, args.threads)
                pool_b, pool_s = pool_read_rate(store, pool, pages, args.threads)
                path_b, path_s = path_rate(store, pool, pages, args.threads)
                buf_b, buf_s = path_rate(store, pool, pages, args.threads, buffered=True)
            raw, floor = raw_b / raw_s, pool_b / pool_s
            path, buf = path_b / path_s, buf_b / buf_s
            print(
                f"{i + 1:>4}{raw / 1e9:>10.2f}{floor / 1e9:>11.2f}{path / 1e9:>11.2f}"
                f"{buf / 1e9:>15.2f}{path / raw:>10.2f}{path / floor:>11.2f}"
            )
            if args.phases:
                phases: dict = {}
                with busy_python(args.busy_thread), timed_phases(phases):
                    _, phase_s = path_rate(store, pool, pages, args.threads)
                print_phases(phases, phase_s, args.threads)
        store.close()


if __name__ == "__main__":
    main()
