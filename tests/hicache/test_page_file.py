"""Page files read straight into and written straight from host KV pool pages (hicache.page_file):
byte-identical round trips in every chunking, every damaged or mis-sized file refused, short
reads and writes completed; each on both paths (the native helper's one GIL-free call, Python's
preadv and checksum updates), which agree on every file and read each other's."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from radixlm.hicache import native_page_io, page_file
from radixlm.hicache.host_pool import HostKVPool
from radixlm.hicache.page_file import HEADER_SIZE, chunk_groups, read_page_into, write_page
from radixlm.hicache.page_hash import encode_token_ids

KEY = bytes(range(16))


def native_or_skip() -> native_page_io.NativePageIO:
    native = native_page_io.get()
    if native is None:
        pytest.skip("the native page file helper cannot be built here")
    return native


def python_path(monkeypatch) -> None:
    """``page_file`` takes its Python path from here on (as where the helper cannot be built)."""
    monkeypatch.setattr(native_page_io, "get", lambda: None)


@pytest.fixture(autouse=True, params=["native", "python"])
def io_path(request, monkeypatch) -> str:
    """Every test runs on both paths."""
    if request.param == "native":
        native_or_skip()
    else:
        python_path(monkeypatch)
    return request.param


def make_pool(num_pages: int = 3, page_size: int = 4, layers: int = 5, heads: int = 2):
    """A host pool of random bytes ([layers, pages, 2, page, heads, 8] float16: blocks of
    ``2 * page_size * heads * 16`` bytes)."""
    pool = HostKVPool(num_pages * page_size, page_size, layers, heads, 8, torch.float16)
    pool.data.view(torch.int16).random_(-(2**15), 2**15 - 1)
    return pool


def write_and_read(tmp_path: Path, pool: HostKVPool, into: HostKVPool, chunk: int = 0) -> bool:
    tokens = encode_token_ids(range(pool.page_size))
    path = tmp_path / "page"
    write_page(path, KEY, tokens, pool.page_blocks(1))
    return read_page_into(path, KEY, tokens, into.page_blocks(2), chunk)


@pytest.mark.parametrize("chunk_bytes", [0, 1, 100, 640, 1 << 20])  # blocks are 256 bytes
def test_a_page_reads_back_byte_identical_into_another_pages_blocks(
    tmp_path: Path, chunk_bytes: int
) -> None:
    pool, into = make_pool(), make_pool()
    before = [into.page_bytes(p) for p in (0, 1)]
    assert write_and_read(tmp_path, pool, into, chunk_bytes)
    assert into.page_bytes(2) == pool.page_bytes(1)
    assert torch.equal(into.page_kv(2).view(torch.int16), pool.page_kv(1).view(torch.int16))
    assert [into.page_bytes(p) for p in (0, 1)] == before  # its neighbours untouched
    size = HEADER_SIZE + 8 * pool.page_size + pool.bytes_per_page
    assert (tmp_path / "page").stat().st_size == size


def test_more_blocks_than_one_system_call_takes(tmp_path: Path) -> None:
    pool, into = (
        make_pool(layers=page_file.IOV_MAX + 5, heads=1, page_size=1),
        make_pool(layers=page_file.IOV_MAX + 5, heads=1, page_size=1),
    )
    assert write_and_read(tmp_path, pool, into)
    assert into.page_bytes(2) == pool.page_bytes(1)


@pytest.mark.parametrize("chunk_bytes", [0, 300])
def test_short_reads_and_writes_are_completed(tmp_path: Path, monkeypatch, chunk_bytes) -> None:
    """The kernel may move fewer bytes than asked (signals, some file systems)."""
    real_preadv, real_pwritev = os.preadv, os.pwritev

    def at_most_100(call):
        def short(fd, views, offset):
            views = list(views)
            total, cut = 0, []
            for view in views:
                take = view[: max(0, 100 - total)]
                if take.nbytes:
                    cut.append(take)
                total += take.nbytes
            return call(fd, cut, offset)

        return short

    monkeypatch.setattr(page_file.os, "preadv", at_most_100(real_preadv))
    monkeypatch.setattr(page_file.os, "pwritev", at_most_100(real_pwritev))
    pool, into = make_pool(), make_pool()
    assert write_and_read(tmp_path, pool, into, chunk_bytes)
    monkeypatch.undo()
    assert into.page_bytes(2) == pool.page_bytes(1)


def test_chunk_groups_cover_the_views_in_order_within_the_chunk_size() -> None:
    data = bytes(range(256)) * 8
    views = [memoryview(data)[a:b] for a, b in [(0, 10), (10, 10), (10, 700), (700, 2048)]]
    for chunk in (1, 7, 64, 690, 5000):
        groups = chunk_groups(views, chunk)
        assert b"".join(bytes(v) for group, _ in groups for v in group) == data
        assert all(size == sum(v.nbytes for v in group) for group, size in groups)
        assert all(size <= chunk for group, size in groups)
    assert chunk_groups([], 64) == [([], 0)]
    assert chunk_groups(views, 0) == [(views, 2048)]


# --- files that are not this page -------------------------------------------------------------


def _cut(path: Path, size: int) -> None:
    os.truncate(path, size)


def _flip(offset: int):
    def flip(path: Path, size: int) -> None:
        data = bytearray(path.read_bytes())
        data[offset % size] ^= 0xFF
        path.write_bytes(bytes(data))

    return flip


DAMAGES = {
    "empty": lambda p, n: _cut(p, 0),
    "header_only": lambda p, n: _cut(p, HEADER_SIZE),
    "one_byte_short": lambda p, n: _cut(p, n - 1),
    "half": lambda p, n: _cut(p, n // 2),
    "one_byte_long": lambda p, n: p.write_bytes(p.read_bytes() + b"\0"),
    "magic": _flip(0),
    "version": _flip(4),
    "num_tokens": _flip(8),
    "payload_len": _flip(12),
    "checksum": _flip(20),
    "key": _flip(28),
    "token_id": _flip(HEADER_SIZE + 3),
    "first_payload_byte": _flip(HEADER_SIZE + 32),
    "middle_payload_byte": _flip(-700),
    "last_payload_byte": _flip(-1),
}


@pytest.mark.parametrize("damage", sorted(DAMAGES))
@pytest.mark.parametrize("chunk_bytes", [0, 256])
def test_a_damaged_file_is_refused(tmp_path: Path, damage: str, chunk_bytes: int) -> None:
    pool, into = make_pool(), make_pool()
    tokens = encode_token_ids(range(pool.page_size))
    path = tmp_path / "page"
    write_page(path, KEY, tokens, pool.page_blocks(1))
    assert read_page_into(path, KEY, tokens, into.page_blocks(2), chunk_bytes)
    DAMAGES[damage](path, path.stat().st_size)
    assert not read_page_into(path, KEY, tokens, into.page_blocks(2), chunk_bytes)


def test_another_key_other_tokens_or_another_shape_are_refused(tmp_path: Path) -> None:
    pool = make_pool()
    tokens = encode_token_ids(range(pool.page_size))
    path = tmp_path / "page"
    write_page(path, KEY, tokens, pool.page_blocks(1))
    blocks = make_pool().page_blocks(0)
    assert not read_page_into(path, bytes(16), tokens, blocks)
    assert not read_page_into(path, KEY, encode_token_ids(range(1, pool.page_size + 1)), blocks)
    assert not read_page_into(path, KEY, tokens[:-8], blocks)  # fewer tokens
    assert not read_page_into(path, KEY, tokens, make_pool(layers=4).page_blocks(0))  # smaller
    assert not read_page_into(path, KEY, tokens, make_pool(layers=6).page_blocks(0))  # larger
    assert read_page_into(path, KEY, tokens, blocks)


def test_a_missing_file_raises_and_an_existing_one_is_not_overwritten(tmp_path: Path) -> None:
    pool = make_pool()
    tokens = encode_token_ids(range(pool.page_size))
    with pytest.raises(FileNotFoundError):
        read_page_into(tmp_path / "nothing", KEY, tokens, pool.page_blocks(0))
    write_page(tmp_path / "page", KEY, tokens, pool.page_blocks(0))
    with pytest.raises(FileExistsError):
        write_page(tmp_path / "page", KEY, tokens, pool.page_blocks(1))


# --- the native helper against the Python path ------------------------------------------------


def read_both(monkeypatch, path: Path, tokens: bytes, make_blocks, chunk_bytes: int = 0):
    """(native result, its blocks' bytes), (Python's result, its blocks' bytes) of one read."""
    native_or_skip()
    results = []
    for is_native in (True, False):
        if not is_native:
            python_path(monkeypatch)
        blocks = make_blocks()
        results.append((read_page_into(path, KEY, tokens, blocks, chunk_bytes), blocks))
    monkeypatch.undo()
    return results


@pytest.mark.parametrize("io_path", ["native"], indirect=True)
@pytest.mark.parametrize("damage", [None, *sorted(DAMAGES)])
@pytest.mark.parametrize("chunk_bytes", [0, 256, 1000])
def test_native_and_python_paths_agree_on_every_file(
    tmp_path: Path, monkeypatch, damage: str | None, chunk_bytes: int
) -> None:
    pool = make_pool()
    tokens = encode_token_ids(range(pool.page_size))
    path = tmp_path / "page"
    write_page(path, KEY, tokens, pool.page_blocks(1))
    if damage is not None:
        DAMAGES[damage](path, path.stat().st_size)
    zeros = torch.zeros_like(pool.data)

    def make_blocks():
        into = make_pool()
        into.data.copy_(zeros)
        return into.page_blocks(2)

    (native_ok, native_blocks), (python_ok, python_blocks) = read_both(
        monkeypatch, path, tokens, make_blocks, chunk_bytes
    )
    assert native_ok == python_ok == (damage is None)
    if damage is None:
        assert b"".join(native_blocks) == b"".join(python_blocks) == pool.page_bytes(1)
    elif path.stat().st_size == HEADER_SIZE + 8 * pool.page_size + pool.bytes_per_page:
        # a file of the page's size is read whole by both: the same bytes, refused by the check
        assert b"".join(native_blocks) == b"".join(python_blocks)


@pytest.mark.parametrize("io_path", ["native"], indirect=True)
def test_native_and_python_paths_agree_on_other_keys_tokens_and_shapes(
    tmp_path: Path, monkeypatch
) -> None:
    pool = make_pool()
    tokens = encode_token_ids(range(pool.page_size))
    path = tmp_path / "page"
    write_page(path, KEY, tokens, pool.page_blocks(1))
    cases = [
        (KEY, tokens, lambda: make_pool().page_blocks(0), True),
        (bytes(16), tokens, lambda: make_pool().page_blocks(0), False),
        (
            KEY,
            encode_token_ids(range(1, pool.page_size + 1)),
            lambda: make_pool().page_blocks(0),
            False,
        ),
        (KEY, tokens[:-8], lambda: make_pool().page_blocks(0), False),
        (KEY, tokens, lambda: make_pool(layers=4).page_blocks(0), False),
        (KEY, tokens, lambda: make_pool(layers=6).page_blocks(0), False),
        (KEY, tokens, lambda: [memoryview(bytearray(pool.bytes_per_page))], True),  # one buffer
    ]
    for key, ids, make_blocks, valid in cases:
        got = []
        for is_native in (True, False):
            if not is_native:
                python_path(monkeypatch)
            got.append(read_page_into(path, key, ids, make_blocks()))
        monkeypatch.undo()
        assert got == [valid, valid]


@pytest.mark.parametrize("io_path", ["native"], indirect=True)
def test_either_path_reads_the_others_files_byte_identical(tmp_path: Path, monkeypatch) -> None:
    pool = make_pool()
    tokens = encode_token_ids(range(pool.page_size))
    write_page(tmp_path / "native", KEY, tokens, pool.page_blocks(1))
    write_page(tmp_path / "from_bytes", KEY, tokens, [pool.page_bytes(1)])  # read-only blocks
    python_path(monkeypatch)
    write_page(tmp_path / "python", KEY, tokens, pool.page_blocks(1))
    data = (tmp_path / "python").read_bytes()
    assert (tmp_path / "native").read_bytes() == data
    assert (tmp_path / "from_bytes").read_bytes() == data
    into = make_pool()
    assert read_page_into(tmp_path / "native", KEY, tokens, into.page_blocks(0))  # Python
    monkeypatch.undo()
    assert read_page_into(tmp_path / "python", KEY, tokens, into.page_blocks(2))  # native
    assert into.page_bytes(0) == into.page_bytes(2) == pool.page_bytes(1)


@pytest.mark.parametrize("io_path", ["native"], indirect=True)
def test_the_native_path_is_taken_where_it_is_built(tmp_path: Path, monkeypatch) -> None:
    calls = []
    real = page_file.preadv_into
    monkeypatch.setattr(page_file, "preadv_into", lambda *a: calls.append(1) or real(*a))
    assert write_and_read(tmp_path, make_pool(), make_pool())
    assert calls == []
    monkeypatch.setattr(native_page_io, "get", lambda: None)  # say it could not be built
    (tmp_path / "page").unlink()
    assert write_and_read(tmp_path, make_pool(), make_pool())
    assert calls


@pytest.mark.parametrize("io_path", ["python"], indirect=True)
@pytest.mark.parametrize("why", ["no_compiler", "no_symbol", "switched_off"])
def test_without_the_helper_page_files_are_read_in_python(
    tmp_path: Path, monkeypatch, why: str
) -> None:
    from radixlm.kernels import cpu_decode

    monkeypatch.undo()  # the real get(), its cache emptied
    monkeypatch.setattr(native_page_io, "_io", None)
    monkeypatch.setattr(native_page_io, "_tried", False)
    if why == "no_compiler":
        monkeypatch.setattr(cpu_decode, "compile_library", lambda *args: None)
    elif why == "no_symbol":
        names = (*native_page_io.XXH3_SYMBOLS, "XXH3_no_such_function")
        monkeypatch.setattr(native_page_io, "XXH3_SYMBOLS", names)
    else:
        monkeypatch.setenv("RADIXLM_NATIVE_PAGE_IO", "0")
    assert native_page_io.get() is None
    pool, into = make_pool(), make_pool()
    assert write_and_read(tmp_path, pool, into)
    assert into.page_bytes(2) == pool.page_bytes(1)


@pytest.mark.parametrize("chunk_bytes", [0, 300])
def test_many_threads_read_pages_at_once(tmp_path: Path, chunk_bytes: int) -> None:
    pool = make_pool(num_pages=16, layers=8)
    into = make_pool(num_pages=16, layers=8)
    ids = [encode_token_ids(range(p, p + pool.page_size)) for p in range(16)]
    keys = [bytes([p]) * 16 for p in range(16)]
    for p in range(16):
        write_page(tmp_path / f"{p}", keys[p], ids[p], pool.page_blocks(p))
    _flip(-1)(tmp_path / "3", (tmp_path / "3").stat().st_size)  # one bad page
    start = threading.Barrier(4)

    def read(p: int) -> bool:
        if p < 4:
            start.wait()
        return read_page_into(tmp_path / f"{p}", keys[p], ids[p], into.page_blocks(p), chunk_bytes)

    for _ in range(5):
        into.data.zero_()
        with ThreadPoolExecutor(4) as workers:
            results = list(workers.map(read, range(16)))
        assert results == [p != 3 for p in range(16)]
        assert all(into.page_bytes(p) == pool.page_bytes(p) for p in range(16) if p != 3)


def test_empty_blocks_are_skipped_and_read_only_ones_refused(tmp_path: Path, io_path: str) -> None:
    pool, into = make_pool(), make_pool()
    tokens = encode_token_ids(range(pool.page_size))
    empty = memoryview(bytearray(0))
    write_page(tmp_path / "page", KEY, tokens, [empty, *pool.page_blocks(1), empty])
    assert read_page_into(tmp_path / "page", KEY, tokens, [*into.page_blocks(2), empty])
    assert into.page_bytes(2) == pool.page_bytes(1)
    read_only = [memoryview(pool.page_bytes(1))]
    with pytest.raises(BufferError):  # as os.preadv says, on either path
        read_page_into(tmp_path / "page", KEY, tokens, read_only)
