"""Page files read straight into and written straight from host KV pool pages (hicache.page_file):
byte-identical round trips in every chunking, every damaged or mis-sized file refused, short
reads and writes completed."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from radixlm.hicache import page_file
from radixlm.hicache.host_pool import HostKVPool
from radixlm.hicache.page_file import HEADER_SIZE, chunk_groups, read_page_into, write_page
from radixlm.hicache.page_hash import encode_token_ids

KEY = bytes(range(16))


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
