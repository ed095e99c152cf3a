"""DiskPageStore: round trips, restarts, LRU, corruption on disk, failing writes, threads."""

from __future__ import annotations

import errno
import json
import logging
import os
import random
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from faulty_store import (
    empty_file,
    flip_byte,
    flip_payload_byte,
    leave_temp_file,
    rewrite_token_ids,
    shift_token_ids,
    truncate_file,
)

from radixlm.hicache import disk_store, native_page_io, page_file
from radixlm.hicache.disk_store import DiskPageStore
from radixlm.hicache.page_file import HEADER_SIZE, TOKEN_BYTES
from radixlm.hicache.page_hash import page_keys
from radixlm.hicache.storage_base import NullPageStore

FINGERPRINT = {"model": "tiny", "dtype": "float16", "num_layers": 2, "page_size": 4}
PAGE_SIZE = 4
PAYLOAD_BYTES = 256
FILE_BYTES = HEADER_SIZE + TOKEN_BYTES * PAGE_SIZE + PAYLOAD_BYTES

Page = tuple[bytes, list[int], bytes]  # (key, token ids, payload)


def make_pages(n: int, seed: int = 0, payload_bytes: int = PAYLOAD_BYTES) -> list[Page]:
    """``n`` chained pages of one random sequence, each with a random payload."""
    rng = random.Random(seed)
    tokens = [rng.randrange(32_000) for _ in range(n * PAGE_SIZE)]
    keys = page_keys(tokens, PAGE_SIZE)
    return [
        (key, tokens[i * PAGE_SIZE : (i + 1) * PAGE_SIZE], rng.randbytes(payload_bytes))
        for i, key in enumerate(keys)
    ]


def open_store(root: Path, max_pages: int = 100, **fingerprint: object) -> DiskPageStore:
    return DiskPageStore(root, {**FINGERPRINT, **fingerprint}, max_bytes=max_pages * FILE_BYTES)


def files_in(store: DiskPageStore) -> list[str]:
    return sorted(p.name for p in store.folder.rglob("*") if p.is_file())


def test_round_trip(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    pages = make_pages(5)
    for key, tokens, payload in pages:
        assert not store.exists(key)
        assert store.set(key, tokens, payload)
        assert store.exists(key)
    for key, tokens, payload in pages:
        assert store.get(key, tokens) == payload
    assert store.num_pages() == 5
    assert store.used_bytes() == 5 * FILE_BYTES
    assert store.page_path(pages[0][0]).stat().st_size == FILE_BYTES
    stats = store.stats()
    assert stats["hits"] == 5 and stats["misses"] == 0
    assert stats["pages_written"] == 5 and stats["bytes_written"] == 5 * FILE_BYTES
    assert stats["bytes_read"] == 5 * FILE_BYTES
    store.check_integrity()


def test_read_buffers_are_reused_only_once_given_back(tmp_path: Path) -> None:
    """Reads fill recycled buffers (readinto); a payload the caller keeps is never reused."""
    store = open_store(tmp_path)
    (k0, t0, p0), (k1, t1, p1), (k2, t2, p2) = make_pages(3)
    for key, tokens, payload in ((k0, t0, p0), (k1, t1, p1), (k2, t2, p2)):
        store.set(key, tokens, payload)
    kept = store.get(k0, t0)
    given = store.get(k1, t1)
    assert kept == p0 and given == p1
    store.recycle(given)
    again = store.get(k2, t2)
    assert again.obj is given.obj and again == p2  # the given-back buffer, refilled
    assert kept == p0  # untouched
    store.recycle(b"not a read buffer")  # ignored


def test_a_missing_key_is_a_miss(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    key, tokens, _ = make_pages(1)[0]
    assert store.get(key, tokens) is None
    assert store.stats()["misses"] == 1
    with pytest.raises(ValueError):
        store.get(b"short", tokens)


def test_set_takes_a_memoryview_and_does_not_rewrite(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    key, tokens, _ = make_pages(1)[0]
    array = np.arange(PAYLOAD_BYTES // 2, dtype=np.float16)
    assert store.set(key, np.array(tokens), memoryview(array))
    assert store.get(key, tokens) == array.tobytes()
    assert store.set(key, tokens, b"other bytes")
    assert store.get(key, tokens) == array.tobytes()
    assert store.stats()["pages_written"] == 1


def test_a_restart_finds_every_page(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    pages = make_pages(6)
    first = open_store(tmp_path)
    for key, tokens, payload in pages:
        first.set(key, tokens, payload)
    first.close()
    with caplog.at_level(logging.INFO, logger=disk_store.__name__):
        second = open_store(tmp_path)
    assert "found 6 pages" in caplog.text
    assert second.num_pages() == 6 and second.used_bytes() == 6 * FILE_BYTES
    for key, tokens, payload in pages:
        assert second.exists(key)
        assert second.get(key, tokens) == payload
    second.check_integrity()


def test_another_fingerprint_sees_nothing(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    key, tokens, payload = make_pages(1)[0]
    store.set(key, tokens, payload)
    for change in ({"dtype": "bfloat16"}, {"page_size": 8}, {"model": "other"}):
        other = open_store(tmp_path, **change)
        assert other.folder != store.folder
        assert not other.exists(key) and other.get(key, tokens) is None
    hashed = json.loads((store.folder / "fingerprint.json").read_text())
    assert hashed["model"] == "tiny" and "layout_version" in hashed
    assert open_store(tmp_path).get(key, tokens) == payload


def test_used_bytes_stay_under_the_cap_evicting_least_recently_used(tmp_path: Path) -> None:
    store = open_store(tmp_path, max_pages=3)
    a, b, c, d, e = make_pages(5)
    for key, tokens, payload in (a, b, c):
        store.set(key, tokens, payload)
    assert store.get(a[0], a[1]) == a[2]  # a is now more recent than b
    store.set(*d)
    assert store.used_bytes() <= store.max_bytes
    assert not store.exists(b[0]) and not store.page_path(b[0]).exists()
    assert all(store.exists(p[0]) for p in (a, c, d))
    store.set(*c)  # a set of a stored page refreshes it too
    store.set(*e)
    assert not store.exists(a[0]) and store.exists(c[0])
    assert store.stats()["evicted_pages"] == 2
    store.check_integrity()


def test_random_traffic_never_exceeds_the_cap(tmp_path: Path) -> None:
    store = open_store(tmp_path, max_pages=7)
    pages = make_pages(20)
    rng = random.Random(1)
    for _ in range(200):
        key, tokens, payload = rng.choice(pages)
        if rng.random() < 0.5:
            store.set(key, tokens, payload)
        else:
            assert store.get(key, tokens) in (None, payload)
        assert store.used_bytes() <= store.max_bytes
    store.check_integrity()


def test_a_restart_keeps_least_recently_used_order(tmp_path: Path) -> None:
    pages = make_pages(3)
    store = open_store(tmp_path)
    for age, (key, tokens, payload) in enumerate(pages):
        store.set(key, tokens, payload)
        mtime_ns = 1_000_000_000 * (1_000_000 + age)  # a, b, c written in that order, long ago
        os.utime(store.page_path(key), ns=(mtime_ns, mtime_ns))
    a, b, c = pages
    assert store.get(a[0], a[1]) == a[2]  # a hit touches the file
    store.close()
    smaller = DiskPageStore(tmp_path, FINGERPRINT, max_bytes=2 * FILE_BYTES)
    assert not smaller.exists(b[0]) and not smaller.page_path(b[0]).exists()
    assert smaller.exists(a[0]) and smaller.exists(c[0])
    smaller.check_integrity()


def test_hits_touch_a_file_at_most_once_in_touch_every_s(tmp_path: Path, monkeypatch) -> None:
    from radixlm.hicache import disk_store

    store = open_store(tmp_path)
    key, tokens, payload = make_pages(1)[0]
    store.set(key, tokens, payload)
    old_ns = 1_000_000_000 * 1_000_000
    os.utime(store.page_path(key), ns=(old_ns, old_ns))
    assert store.get(key, tokens) == payload
    touched = store.page_path(key).stat().st_mtime_ns
    assert touched > old_ns  # the first hit touches the file
    os.utime(store.page_path(key), ns=(old_ns, old_ns))
    assert store.get(key, tokens) == payload  # a second hit soon after: no metadata write
    assert store.page_path(key).stat().st_mtime_ns == old_ns
    monkeypatch.setattr(disk_store, "TOUCH_EVERY_S", 0.0)
    assert store.get(key, tokens) == payload
    assert store.page_path(key).stat().st_mtime_ns > old_ns


def test_a_page_larger_than_the_cap_is_refused(tmp_path: Path) -> None:
    store = open_store(tmp_path, max_pages=1)
    key, tokens, _ = make_pages(1)[0]
    assert not store.set(key, tokens, bytes(PAYLOAD_BYTES + 1))
    assert store.stats()["refused_pages"] == 1
    assert files_in(store) == ["fingerprint.json"]
    assert store.set(key, tokens, bytes(PAYLOAD_BYTES))


def test_delete_and_clear_remove_files(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    pages = make_pages(3)
    for page in pages:
        store.set(*page)
    store.delete(pages[0][0])
    assert not store.exists(pages[0][0]) and not store.page_path(pages[0][0]).exists()
    store.delete(pages[0][0])  # deleting a missing key is fine
    store.clear()
    assert store.num_pages() == 0 and store.used_bytes() == 0
    assert files_in(store) == ["fingerprint.json"]
    store.check_integrity()


def test_a_closed_store_stores_nothing(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    key, tokens, payload = make_pages(1)[0]
    store.set(key, tokens, payload)
    store.close()
    assert not store.exists(key)
    assert store.get(key, tokens) is None
    assert not store.set(*make_pages(1, seed=2)[0])


# --- corruption on disk ---------------------------------------------------------------------

HEADER_FIELDS = {"magic": 0, "version": 4, "reserved": 6, "num_tokens": 8, "payload_len": 12}
HEADER_FIELDS |= {"checksum": 20, "key": 28, "key_end": 43}
DAMAGES: dict[str, Callable[[Path], None]] = {
    "truncated": truncate_file,
    "truncated_by_one": lambda p: truncate_file(p, p.stat().st_size - 1),
    "header_only": lambda p: truncate_file(p, HEADER_SIZE),
    "zero_length": empty_file,
    "payload_byte_flipped": flip_payload_byte,
    "token_byte_flipped": lambda p: flip_byte(p, HEADER_SIZE + 1),
    "wrong_token_ids": shift_token_ids,
    "trailing_garbage": lambda p: p.write_bytes(p.read_bytes() + b"\0"),
    **{
        f"header_{name}_flipped": (lambda p, o=o: flip_byte(p, o))
        for name, o in HEADER_FIELDS.items()
    },
}


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_a_damaged_page_is_a_miss_and_is_deleted(tmp_path: Path, damage: str) -> None:
    store = open_store(tmp_path)
    pages = make_pages(2)
    for page in pages:
        store.set(*page)
    (key, tokens, _), healthy = pages
    DAMAGES[damage](store.page_path(key))
    assert store.exists(key)  # the index cannot know yet
    assert store.get(key, tokens) is None
    assert not store.exists(key) and not store.page_path(key).exists()
    assert store.stats()["corrupt_deleted"] == 1
    assert store.get(healthy[0], healthy[1]) == healthy[2]
    store.check_integrity()


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_a_damaged_page_found_at_start_up_is_never_served(tmp_path: Path, damage: str) -> None:
    store = open_store(tmp_path)
    pages = make_pages(2)
    for page in pages:
        store.set(*page)
    (key, tokens, _), healthy = pages
    DAMAGES[damage](store.page_path(key))
    store.close()
    restarted = open_store(tmp_path)  # cheap checks drop some; get catches the rest
    assert restarted.get(key, tokens) is None
    assert not restarted.exists(key) and not restarted.page_path(key).exists()
    assert restarted.get(healthy[0], healthy[1]) == healthy[2]
    restarted.check_integrity()


def test_a_page_under_another_keys_name_is_a_miss(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    (key_a, tokens_a, payload_a), (key_b, tokens_b, _) = make_pages(2)
    store.set(key_a, tokens_a, payload_a)
    store.set(key_b, tokens_b, payload_a)
    store.page_path(key_b).write_bytes(store.page_path(key_a).read_bytes())
    assert store.get(key_b, tokens_b) is None
    assert store.get(key_b, tokens_a) is None
    assert store.get(key_a, tokens_a) == payload_a


def test_other_token_ids_than_stored_are_a_miss(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    key, tokens, payload = make_pages(1)[0]
    store.set(key, tokens, payload)
    rewrite_token_ids(store.page_path(key), tokens)  # no-op rewrite: still valid
    assert store.get(key, tokens) == payload
    assert store.get(key, [t + 1 for t in tokens]) is None
    assert store.get(key, tokens) is None  # the entry was deleted
    assert store.stats()["corrupt_deleted"] == 1


def test_leftover_temp_files_are_removed_at_start_up(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    (key, tokens, payload), (other_key, _, _) = make_pages(2)
    store.set(key, tokens, payload)
    temp = leave_temp_file(store, other_key)
    stranger = store.page_path(key).with_name("notes.txt")
    stranger.write_text("not a page")
    store.close()
    restarted = open_store(tmp_path)
    assert not temp.exists() and stranger.exists()
    assert restarted.stats()["invalid_files_removed"] == 1
    assert restarted.num_pages() == 1 and not restarted.exists(other_key)
    assert restarted.get(key, tokens) == payload


def test_a_vanished_or_unreadable_file_is_a_read_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = open_store(tmp_path)
    (key, tokens, payload), (key2, tokens2, payload2) = make_pages(2)
    store.set(key, tokens, payload)
    store.set(key2, tokens2, payload2)
    os.unlink(store.page_path(key))
    assert store.get(key, tokens) is None and not store.exists(key)

    def failing_read(*args: object, **kwargs: object) -> None:
        raise OSError(errno.EIO, "injected")

    monkeypatch.setattr(page_file, "preadv_into", failing_read)  # either path
    monkeypatch.setattr(native_page_io.NativePageIO, "read", failing_read)
    assert store.get(key2, tokens2) is None
    monkeypatch.undo()
    assert not store.exists(key2) and not store.page_path(key2).exists()
    assert store.stats()["read_errors"] == 2
    store.check_integrity()


def test_a_big_folder_shows_a_progress_bar(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    store = open_store(tmp_path)
    for page in make_pages(3):
        store.set(*page)
    monkeypatch.setattr(disk_store, "PROGRESS_MIN_FILES", 2)
    open_store(tmp_path)
    assert "indexing disk pages" in capsys.readouterr().err


# --- failing writes -------------------------------------------------------------------------


def _disk_full(*args: object, **kwargs: object) -> None:
    raise OSError(errno.ENOSPC, "No space left on device")


def _half_written_then_full(path: str, *args: object) -> None:
    Path(path).write_bytes(b"half a page")
    raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.parametrize("where", ["rename", "write"])
def test_a_full_disk_stores_nothing_and_the_store_stays_usable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    store = open_store(tmp_path)
    (key, tokens, payload), later = make_pages(2)
    if where == "rename":
        monkeypatch.setattr(disk_store.os, "replace", _disk_full)
    else:
        monkeypatch.setattr(page_file, "write_page", _half_written_then_full)
    assert not store.set(key, tokens, payload)
    monkeypatch.undo()
    assert files_in(store) == ["fingerprint.json"]
    assert not store.exists(key) and store.get(key, tokens) is None
    assert store.stats()["write_errors"] == 1 and store.used_bytes() == 0
    assert store.set(*later) and store.get(later[0], later[1]) == later[2]
    assert store.set(key, tokens, payload)  # the failed key can be written again
    store.check_integrity()


# --- threads --------------------------------------------------------------------------------


def test_concurrent_traffic_keeps_the_index_consistent(tmp_path: Path) -> None:
    store = open_store(tmp_path, max_pages=12)
    pages = make_pages(40)
    wrong_hits: list[bytes] = []
    failures: list[BaseException] = []
    checks: list[int] = []
    stop = threading.Event()

    def traffic(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(300):
                key, tokens, payload = rng.choice(pages)
                op = rng.random()
                if op < 0.45:
                    store.set(key, tokens, payload)
                elif op < 0.9:
                    got = store.get(key, tokens)
                    if got not in (None, payload):
                        wrong_hits.append(key)
                elif op < 0.97:
                    store.exists(key)
                else:
                    store.delete(key)
        except BaseException as error:  # surfaced below
            failures.append(error)

    def checker() -> None:
        try:
            while True:
                store.check_integrity()
                checks.append(1)
                if stop.wait(0.002):  # the pause lets traffic take the lock between checks
                    break
        except BaseException as error:
            failures.append(error)

    threads = [threading.Thread(target=traffic, args=(seed,)) for seed in range(4)]
    threads.append(threading.Thread(target=checker))
    for thread in threads:
        thread.start()
    for thread in threads[:-1]:
        thread.join()
    stop.set()
    threads[-1].join()
    assert failures == [] and wrong_hits == [] and len(checks) >= 2
    store.check_integrity()
    assert store.stats()["write_errors"] == 0 and store.stats()["corrupt_deleted"] == 0
    restarted = open_store(tmp_path, max_pages=12)
    assert restarted.num_pages() == store.num_pages()
    restarted.check_integrity()


def test_the_null_store_stores_nothing() -> None:
    store = NullPageStore()
    key, tokens, payload = make_pages(1)[0]
    assert not store.set(key, tokens, payload)
    assert not store.exists(key) and store.get(key, tokens) is None
    assert store.num_pages() == 0 and store.stats() == {"pages": 0, "used_bytes": 0}
    store.check_integrity()
    store.close()


def _split_views(payload: bytes, parts: int) -> tuple[memoryview, ...]:
    size = len(payload) // parts
    return tuple(memoryview(bytearray(payload[i * size : (i + 1) * size])) for i in range(parts))


def test_a_page_view_is_written_from_its_blocks_unless_it_went_stale(tmp_path: Path) -> None:
    from radixlm.hicache.storage_base import PageView

    store = open_store(tmp_path)
    (k0, t0, p0), (k1, t1, p1) = make_pages(2)
    assert store.set(k0, t0, PageView(_split_views(p0, 4), lambda: True))
    assert store.get(k0, t0) == p0  # the same file as from one buffer
    assert not store.set(k1, t1, PageView(_split_views(p1, 4), lambda: False))
    assert not store.exists(k1) and store.stats()["stale_skipped"] == 1
    assert files_in(store) == [store.page_path(k0).name, "fingerprint.json"]
    store.check_integrity()


def test_get_into_reads_a_verified_page_straight_into_blocks(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    (k0, t0, p0), (k1, t1, p1) = make_pages(2)
    store.set(k0, t0, p0)
    store.set(k1, t1, p1)
    blocks = _split_views(bytes(PAYLOAD_BYTES), 4)
    assert store.get_into(k0, t0, blocks)
    assert b"".join(blocks) == p0
    assert not store.get_into(k1, t0, blocks)  # other token ids: a miss
    assert not store.get_into(k1, t1, _split_views(bytes(PAYLOAD_BYTES - 4), 4))  # wrong size
    flip_payload_byte(store.page_path(k0))
    assert not store.get_into(k0, t0, blocks) and not store.exists(k0)  # corrupt: deleted
    assert store.stats()["hits"] == 1


@pytest.mark.parametrize("read_chunk_bytes", [0, 100])
def test_reads_in_chunks_give_the_same_pages_and_refuse_the_same_damage(
    tmp_path: Path, read_chunk_bytes: int
) -> None:
    store = DiskPageStore(tmp_path, FINGERPRINT, 100 * FILE_BYTES, read_chunk_bytes)
    pages = make_pages(3)
    for key, tokens, payload in pages:
        assert store.set(key, tokens, payload)
    (k0, t0, p0), (k1, t1, p1), (k2, t2, p2) = pages
    blocks = _split_views(bytes(PAYLOAD_BYTES), 4)
    assert store.get_into(k0, t0, blocks) and b"".join(blocks) == p0
    assert store.get(k1, t1) == p1
    flip_payload_byte(store.page_path(k2))
    assert store.get(k2, t2) is None and not store.exists(k2)
    assert store.stats()["corrupt_deleted"] == 1
    store.check_integrity()
