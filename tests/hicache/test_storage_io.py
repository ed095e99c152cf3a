"""StorageIO: background writes with bounded memory, reads as futures, failing stores."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from faulty_store import FaultyStore

from radixlm.hicache.disk_store import DiskPageStore
from radixlm.hicache.page_hash import page_keys
from radixlm.hicache.storage_io import StorageIO

PAGE_SIZE = 4
PAYLOAD_BYTES = 1024
FINGERPRINT = {"model": "tiny", "page_size": PAGE_SIZE}

Page = tuple[bytes, list[int], bytes]


def make_pages(n: int, seed: int = 0) -> list[Page]:
    rng = random.Random(seed)
    tokens = [rng.randrange(32_000) for _ in range(n * PAGE_SIZE)]
    return [
        (key, tokens[i * PAGE_SIZE : (i + 1) * PAGE_SIZE], rng.randbytes(PAYLOAD_BYTES))
        for i, key in enumerate(page_keys(tokens, PAGE_SIZE))
    ]


@pytest.fixture
def faulty(tmp_path: Path) -> Iterator[FaultyStore]:
    store = FaultyStore(DiskPageStore(tmp_path, FINGERPRINT, max_bytes=1 << 24))
    yield store
    store.close()  # wakes calls still stalled


def make_io(store: FaultyStore, **kwargs: int) -> StorageIO:
    return StorageIO(store, **kwargs)


def test_writes_then_reads(faulty: FaultyStore) -> None:
    io = make_io(faulty)
    pages = make_pages(8)
    for page in pages:
        assert io.submit_write(*page)
    assert io.flush(timeout_s=5)
    assert io.pending_write_bytes() == 0
    assert all(faulty.exists(key) and io.exists(key) for key, _, _ in pages)
    futures = [io.submit_read(key, tokens) for key, tokens, _ in pages]
    assert [f.result(timeout=5) for f in futures] == [p for _, _, p in pages]
    stats = io.stats()
    assert stats["writes_done"] == 8 and stats["reads_done"] == 8
    assert stats["hits"] == 8 and stats["pages"] == 8  # the store's counters, merged
    faulty.check_integrity()
    io.close()


def test_a_miss_resolves_to_none(faulty: FaultyStore) -> None:
    io = make_io(faulty)
    key, tokens, _ = make_pages(1)[0]
    assert io.submit_read(key, tokens).result(timeout=5) is None
    io.close()


def test_token_ids_may_be_arrays_or_tensors(faulty: FaultyStore) -> None:
    io = make_io(faulty)
    key, tokens, payload = make_pages(1)[0]
    assert io.submit_write(key, torch.tensor(tokens), memoryview(payload))
    assert io.flush(timeout_s=5)
    assert io.submit_read(key, np.array(tokens)).result(timeout=5) == payload
    io.close()


def test_stored_or_queued_keys_are_not_queued_again(faulty: FaultyStore) -> None:
    io = make_io(faulty)
    (key, tokens, payload), (key2, tokens2, payload2) = make_pages(2)
    io.submit_write(key, tokens, payload)
    assert io.flush(timeout_s=5)
    assert io.submit_write(key, tokens, payload)  # already stored
    faulty.mode, faulty.stall_s = "stall", 30.0
    assert io.submit_write(key2, tokens2, payload2)
    assert io.submit_write(key2, tokens2, payload2)  # already queued
    assert io.stats()["writes_queued"] == 2
    faulty.release()
    assert io.flush(timeout_s=5)
    assert faulty.calls["set"] == 2
    io.close()


def test_a_stalled_store_bounds_pending_bytes(faulty: FaultyStore) -> None:
    faulty.mode, faulty.stall_s = "stall", 30.0
    io = make_io(faulty, max_pending_write_bytes=4 * PAYLOAD_BYTES)
    pages = make_pages(50)
    accepted = 0
    for page in pages:
        accepted += io.submit_write(*page)
        assert io.pending_write_bytes() <= 4 * PAYLOAD_BYTES
    assert accepted == 4
    assert io.stats()["writes_skipped"] == 46
    assert not io.flush(timeout_s=0.05)
    faulty.release()
    assert io.flush(timeout_s=5)
    assert faulty.num_pages() == 4 and io.pending_write_bytes() == 0
    assert io.submit_write(*pages[-1])  # room again
    io.close()


def test_a_read_of_a_queued_write_is_answered_from_memory(faulty: FaultyStore) -> None:
    faulty.mode, faulty.stall_s = "stall", 30.0
    io = make_io(faulty)
    key, tokens, payload = make_pages(1)[0]
    io.submit_write(key, tokens, payload)
    assert io.exists(key) and not faulty.inner.exists(key)
    future = io.submit_read(key, tokens)
    assert future.done() and future.result() == payload
    other = io.submit_read(key, [t + 1 for t in tokens])  # other tokens: not served from memory
    faulty.release()
    assert other.result(timeout=5) is None
    io.close()


def test_too_many_pending_reads_resolve_to_none_at_once(faulty: FaultyStore) -> None:
    pages = make_pages(3)
    for page in pages:
        faulty.set(*page)
    faulty.mode, faulty.stall_s = "stall", 30.0
    io = make_io(faulty, num_read_threads=1, max_pending_reads=2)
    first, second = (io.submit_read(k, t) for k, t, _ in pages[:2])
    third = io.submit_read(pages[2][0], pages[2][1])
    assert third.done() and third.result() is None
    assert io.stats()["reads_skipped"] == 1
    faulty.release()
    assert first.result(timeout=5) == pages[0][2] and second.result(timeout=5) == pages[1][2]
    io.close()


@pytest.mark.parametrize("mode", ["fail", "truncate", "flip", "wrong_tokens"])
def test_a_failing_or_corrupt_store_gives_misses(faulty: FaultyStore, mode: str) -> None:
    io = make_io(faulty)
    (key, tokens, payload), (key2, tokens2, payload2) = make_pages(2)
    io.submit_write(key, tokens, payload)
    assert io.flush(timeout_s=5)
    faulty.mode = mode
    assert io.submit_read(key, tokens).result(timeout=5) is None
    assert io.submit_write(key2, tokens2, payload2)  # queued: a failing exists() is a "no"
    assert io.flush(timeout_s=5)
    stats = io.stats()
    if mode == "fail":
        assert not io.exists(key)
        assert stats["reads_failed"] == 1 and stats["writes_failed"] == 1
    else:
        assert stats["corrupt_deleted"] == 1 and not faulty.exists(key)
    faulty.mode = "ok"
    assert io.submit_read(key2, tokens2).result(timeout=5) == (None if mode == "fail" else payload2)
    faulty.check_integrity()
    io.close()


def test_a_full_disk_counts_failed_writes(faulty: FaultyStore) -> None:
    faulty.mode = "disk_full"
    io = make_io(faulty)
    for page in make_pages(3):
        assert io.submit_write(*page)
    assert io.flush(timeout_s=5)
    assert io.stats()["writes_failed"] == 3 and faulty.num_pages() == 0
    io.close()


def test_a_store_that_fails_stats_still_gives_io_stats(faulty: FaultyStore) -> None:
    io = make_io(faulty)

    def broken() -> dict[str, int | float]:
        raise OSError("gone")

    faulty.stats = broken  # type: ignore[method-assign]
    assert io.stats()["pending_writes"] == 0
    io.close()


def test_close_with_a_stalled_store_returns_in_bounded_time(faulty: FaultyStore) -> None:
    faulty.mode, faulty.stall_s = "stall", 30.0
    io = make_io(faulty, num_read_threads=1)
    pages = make_pages(6)
    for page in pages[:3]:
        io.submit_write(*page)
    reads = [io.submit_read(k, t) for k, t, _ in pages[3:]]
    start = time.monotonic()
    io.close(timeout_s=0.3)
    assert time.monotonic() - start < 2.0
    io.close(timeout_s=0.3)  # idempotent
    assert all(f.done() and f.result() is None for f in reads[1:])  # queued ones: resolved
    stats = io.stats()
    assert stats["writes_dropped"] == 2 and io.pending_write_bytes() == PAYLOAD_BYTES
    assert not io.submit_write(*make_pages(1, seed=9)[0])
    assert io.submit_read(pages[1][0], pages[1][1]).result(timeout=0) is None  # dropped
    faulty.release()
    assert reads[0].result(timeout=5) is None  # the stalled read ends as a miss


def test_close_writes_what_is_queued(faulty: FaultyStore) -> None:
    io = make_io(faulty)
    pages = make_pages(5)
    for page in pages:
        io.submit_write(*page)
    io.close()
    assert faulty.num_pages() == 5 and io.stats()["writes_dropped"] == 0


def test_concurrent_submitters(faulty: FaultyStore) -> None:
    io = make_io(faulty, max_pending_write_bytes=8 * PAYLOAD_BYTES)
    pages = make_pages(30)
    wrong: list[bytes] = []

    def submit(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(100):
            key, tokens, payload = rng.choice(pages)
            if rng.random() < 0.5:
                io.submit_write(key, tokens, payload)
            elif io.submit_read(key, tokens).result(timeout=5) not in (None, payload):
                wrong.append(key)
            assert io.pending_write_bytes() <= 8 * PAYLOAD_BYTES

    threads = [threading.Thread(target=submit, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert io.flush(timeout_s=5) and wrong == []
    faulty.check_integrity()
    io.close()


def test_a_payload_function_runs_on_the_writer_and_none_writes_nothing(
    faulty: FaultyStore,
) -> None:
    from radixlm.hicache.host_pool import HostKVPool

    pool = HostKVPool(2 * PAGE_SIZE, PAGE_SIZE, 1, 1, 2, torch.float32)
    slots = pool.alloc(2 * PAGE_SIZE)
    pool.data.copy_(torch.arange(pool.data.numel(), dtype=torch.float32).view_as(pool.data))
    io = make_io(faulty)
    (key_a, tokens_a, _), (key_b, tokens_b, _) = make_pages(2)
    stale = pool.page_generation(1)
    expected = pool.page_bytes(0)
    assert io.submit_write(key_a, tokens_a, lambda: pool.snapshot_page(0, 0), pool.bytes_per_page)
    pool.free(slots[PAGE_SIZE:])  # page 1 freed before the writer copies it: stale
    assert io.submit_write(
        key_b, tokens_b, lambda: pool.snapshot_page(1, stale), pool.bytes_per_page
    )
    assert io.flush(timeout_s=5) and io.pending_write_bytes() == 0
    assert io.submit_read(key_a, tokens_a).result(timeout=5) == expected
    assert not faulty.exists(key_b)
    with pytest.raises(ValueError, match="num_bytes"):
        io.submit_write(key_b, tokens_b, lambda: b"")
    io.close()


def test_reads_into_blocks_and_writes_from_page_views(faulty: FaultyStore) -> None:
    """The zero-copy pair: a write that reads a host pool page in place (skipped once the page
    is freed), a read straight into a page's blocks, also of a page still queued."""
    from radixlm.hicache.host_pool import HostKVPool

    pool = HostKVPool(3 * PAGE_SIZE, PAGE_SIZE, 2, 1, 2, torch.float32)
    slots = pool.alloc(3 * PAGE_SIZE)
    pool.data.copy_(torch.arange(pool.data.numel(), dtype=torch.float32).view_as(pool.data))
    expected = [pool.page_bytes(i) for i in range(3)]
    io = make_io(faulty)
    (key_a, tokens_a, _), (key_b, tokens_b, _) = make_pages(2)
    assert io.submit_write(key_a, tokens_a, lambda: pool.page_view(0, 0), pool.bytes_per_page)
    assert io.flush(timeout_s=5)
    pool.free(slots[PAGE_SIZE : 2 * PAGE_SIZE])
    assert pool.page_view(1, 0) is None  # freed: nothing to write
    pool.data.zero_()
    assert io.submit_read_into(key_a, tokens_a, pool.page_blocks(2)).result(timeout=5) is True
    assert pool.page_bytes(2) == expected[0]
    assert io.submit_read_into(key_b, tokens_b, pool.page_blocks(2)).result(timeout=5) is False
    faulty.mode = "stall"
    faulty.stall_s = 30.0
    pool.data[:, 0] = 5.0
    assert io.submit_write(key_b, tokens_b, lambda: pool.page_view(0, 0), pool.bytes_per_page)
    # key_b waits behind the stalled writer: answered from the pool's page, into page 2
    assert io.submit_read_into(key_b, tokens_b, pool.page_blocks(2)).result(timeout=5) is True
    assert pool.page_bytes(2) == pool.page_bytes(0)
    faulty.release()
    io.close()


def test_concurrent_reads_into_pool_pages_while_the_writer_writes(tmp_path: Path) -> None:
    """Reader threads fill many host pages at once (each page's file read straight into its
    blocks) while the writer writes other pages from the same pool: every page read back is
    byte-identical, and none spills into its neighbours."""
    from radixlm.hicache.host_pool import HostKVPool

    num_pages, page_size = 48, 4
    source = HostKVPool(num_pages * page_size, page_size, 6, 2, 16, torch.bfloat16)
    source.data.view(torch.int16).random_(-(2**15), 2**15 - 1)
    store = DiskPageStore(tmp_path, FINGERPRINT, max_bytes=1 << 30)
    tokens = list(range(num_pages * page_size))
    keys = page_keys(tokens, page_size)
    pages = [(keys[i], tokens[i * page_size : (i + 1) * page_size]) for i in range(num_pages)]
    io = StorageIO(store, num_read_threads=4, max_pending_reads=num_pages)
    half = num_pages // 2
    for i, (key, ids) in enumerate(pages[:half]):
        assert io.submit_write(key, ids, lambda i=i: source.page_view(i, 0), source.bytes_per_page)
    assert io.flush(timeout_s=10)
    into = HostKVPool(num_pages * page_size, page_size, 6, 2, 16, torch.bfloat16)
    into.data.fill_(7.0)
    reads = [
        io.submit_read_into(key, ids, into.page_blocks(i))
        for i, (key, ids) in enumerate(pages[:half])
    ]
    for i, (key, ids) in enumerate(pages[half:], start=half):  # written while the reads run
        assert io.submit_write(key, ids, lambda i=i: source.page_view(i, 0), source.bytes_per_page)
    assert all(f.result(timeout=10) is True for f in reads)
    assert io.flush(timeout_s=10)
    for i in range(half):
        assert into.page_bytes(i) == source.page_bytes(i)
    untouched = into.data[:, half:].reshape(-1)
    assert bool((untouched == 7.0).all())
    reads = [
        io.submit_read_into(key, ids, into.page_blocks(i)) for i, (key, ids) in enumerate(pages)
    ]
    assert all(f.result(timeout=10) is True for f in reads)
    assert all(into.page_bytes(i) == source.page_bytes(i) for i in range(num_pages))
    io.close()
    store.check_integrity()


def test_fill_blocks_copies_across_other_block_boundaries() -> None:
    from radixlm.hicache.storage_base import fill_blocks

    data = bytes(range(200))
    sources = [memoryview(data)[a:b] for a, b in [(0, 7), (7, 7), (7, 120), (120, 200)]]
    into = [memoryview(bytearray(n)) for n in (50, 1, 0, 149)]
    assert fill_blocks(into, sources)
    assert b"".join(bytes(b) for b in into) == data
    into = [memoryview(bytearray(n)) for n in (100, 100)]
    assert fill_blocks(into, data) and b"".join(bytes(b) for b in into) == data
    short = [memoryview(bytearray(99))]
    assert not fill_blocks(short, sources) and bytes(short[0]) == bytes(99)


def test_a_read_of_a_queued_view_that_went_stale_is_a_miss(faulty: FaultyStore) -> None:
    from radixlm.hicache.host_pool import HostKVPool
    from radixlm.hicache.storage_base import PageView

    pool = HostKVPool(2 * PAGE_SIZE, PAGE_SIZE, 2, 1, 2, torch.float32)
    io = make_io(faulty)
    faulty.mode, faulty.stall_s = "stall", 30.0
    (blocker, tokens_0, payload_0), (key, tokens, _) = make_pages(2)
    assert io.submit_write(blocker, tokens_0, payload_0)  # holds the writer
    is_current = [True]
    view = PageView(tuple(pool.page_blocks(0)), lambda: is_current[0])
    assert io.submit_write(key, tokens, lambda: view, pool.bytes_per_page)
    assert io.submit_read_into(key, tokens, pool.page_blocks(1)).result(timeout=5) is True
    is_current[0] = False  # the page was freed: what was copied may be another page's
    assert io.submit_read_into(key, tokens, pool.page_blocks(1)).result(timeout=5) is False
    faulty.release()
    io.close()


def test_starting_lowers_the_gil_switch_interval_and_never_raises_it(faulty, monkeypatch) -> None:
    import sys

    from radixlm.hicache import storage_io

    monkeypatch.setattr(sys, "getswitchinterval", lambda: state["interval"])
    monkeypatch.setattr(sys, "setswitchinterval", lambda s: state.update(interval=s))
    state = {"interval": 0.005}  # Python's default
    io = StorageIO(faulty)
    assert state["interval"] == storage_io.SWITCH_INTERVAL_S
    io.close()
    state["interval"] = 0.0001  # lower already: kept
    StorageIO(faulty).close()
    assert state["interval"] == 0.0001
    state["interval"] = 0.005
    StorageIO(faulty, switch_interval_s=None).close()  # left as it is
    assert state["interval"] == 0.005
