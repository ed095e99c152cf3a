"""One page file of the disk tier: its format, and its bytes moved straight between the file and
the caller's memory (the host KV pool's page blocks), verified, without a copy in Python.

Format (little-endian)
----------------------
======  ==============  ==========================================================
offset  size            field
======  ==============  ==========================================================
0       4               magic ``b"RLKV"``
4       2               format version (``FORMAT_VERSION``)
6       2               reserved, 0
8       4               num_tokens
12      8               payload_len, bytes
20      8               checksum: xxh3_64 over the token-id bytes then the payload
28      16              the page key (the file name says the same)
44      8 * num_tokens  token ids, int64
...     payload_len     payload
======  ==============  ==========================================================

A file is valid only if its size is exactly ``44 + 8 * num_tokens + payload_len``.

How the bytes move: a read is ``open``, ``preadv`` of the header, the token ids, the payload
straight into the caller's blocks and one byte past the expected end (which tells a file that is
too long without an ``fstat``), then ``close``; each block is hashed after the read. A write is
``open``, one ``writev`` of the header, the token ids and the payload straight from the caller's
blocks, then ``close``. One long system call per page because each gives the GIL up, and a
reader that gives it up while the scheduler thread runs Python may wait up to the interpreter's
switch interval (5 ms) to get it back; a checksum update of 64 KiB (one layer of an 8B model's
page) does not give it up, larger ones do. So where it can be built, ``native_page_io`` does a
page's open, reads (or writes), checksum and close in one C call that runs without the GIL (the
same xxh3_64, the same files); the header's checks stay here. The Python path below is the
fallback (no compiler, ``RADIXLM_NATIVE_PAGE_IO=0``) and gives the same results.

``chunk_bytes`` > 0 reads the payload in chunks of that size instead, one ``preadv`` each, each
hashed right after it is read while it is still in the core's cache (hashing a 2 MiB page after
one ``preadv`` reads it from memory a second time): 256 KiB chunks gave 19-28% more bytes/s on
a 2-core CPU, at the price of a GIL hand-off per chunk (``bench_disk_path --read-chunk-kib``;
docs/results/multiturn-hicache.md).
"""

from __future__ import annotations

import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

from radixlm.hicache import native_page_io
from radixlm.hicache.storage_base import Payload

MAGIC = b"RLKV"
FORMAT_VERSION = 1
HEADER = struct.Struct("<4sHHIQQ16s")
HEADER_SIZE = HEADER.size  # 44
CHECKSUM_OFFSET = struct.calcsize("<4sHHIQ")  # where the checksum sits in the header: 20
TOKEN_BYTES = 8  # one token id, int64
IOV_MAX = 1024  # buffers one readv/writev takes at most (POSIX: at least 16; Linux: 1024)


@dataclass(frozen=True)
class PageHeader:
    num_tokens: int
    payload_len: int
    checksum: int
    key: bytes

    @property
    def file_bytes(self) -> int:
        return HEADER_SIZE + TOKEN_BYTES * self.num_tokens + self.payload_len


def parse_header(data: Payload) -> PageHeader | None:
    """The header at the start of ``data``; None if it is short or not a valid header."""
    if memoryview(data).nbytes < HEADER_SIZE:
        return None
    magic, version, reserved, num_tokens, payload_len, checksum, key = HEADER.unpack_from(data)
    if magic != MAGIC or version != FORMAT_VERSION or reserved != 0 or num_tokens == 0:
        return None
    return PageHeader(num_tokens, payload_len, checksum, key)


def write_page(
    path: str | os.PathLike, key: bytes, token_bytes: bytes, blocks: Sequence[Payload]
) -> None:
    """Writes a new page file (``O_EXCL``) at ``path`` straight from the payload ``blocks``: the
    checksum first, then the header, the token ids and the blocks with one ``writev`` (unlike
    reads, writing in cache-sized chunks, each hashed just before, measured no faster, and each
    call is one more GIL hand-off with the scheduler thread). All in one call without the GIL
    where the native helper is built (``native_page_io``), else in Python."""
    views = [memoryview(b).cast("B") for b in blocks]
    payload_len = sum(v.nbytes for v in views)
    num_tokens = len(token_bytes) // TOKEN_BYTES
    native = native_page_io.get()
    if native is not None:
        head = bytearray(HEADER.pack(MAGIC, FORMAT_VERSION, 0, num_tokens, payload_len, 0, key))
        native.write(path, head, CHECKSUM_OFFSET, bytes(token_bytes), views)
        return
    checksum = xxhash.xxh3_64(token_bytes)
    for view in views:
        checksum.update(view)
    head = HEADER.pack(MAGIC, FORMAT_VERSION, 0, num_tokens, payload_len, checksum.intdigest(), key)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        _pwritev_all(fd, [memoryview(head), memoryview(token_bytes), *views], 0)
    finally:
        os.close(fd)


def read_page_into(
    path: str | os.PathLike,
    key: bytes,
    token_bytes: bytes,
    blocks: Sequence[memoryview],
    chunk_bytes: int = 0,
) -> bool:
    """Reads the page file at ``path`` with its payload straight into ``blocks`` (byte views, in
    order), in one ``preadv`` or (``chunk_bytes`` > 0) in chunks of about that size; True only if
    the file is exactly a page of ``key`` for ``token_bytes`` whose payload fills ``blocks`` and
    whose checksum holds (on False the blocks' contents are undefined). Raises OSError when the
    file cannot be opened or read. The reads and the checksum run in one call without the GIL
    where the native helper is built (``native_page_io``), else in Python; the same results."""
    views = [b if b.format == "B" else b.cast("B") for b in blocks]
    native = native_page_io.get()
    if native is not None:
        head = bytearray(HEADER_SIZE + len(token_bytes))
        tokens = token_bytes if type(token_bytes) is bytes else bytes(token_bytes)
        read = native.read(path, head, views, chunk_bytes, tokens)
        if read is not None:  # else a read-only block, say: Python's path tells why
            got, expected, checksum = read
            return _is_page(memoryview(head), got, expected, key, tokens, checksum)
    return _read_page_python(path, key, token_bytes, views, chunk_bytes)


def _read_page_python(
    path: str | os.PathLike,
    key: bytes,
    token_bytes: bytes,
    views: Sequence[memoryview],
    chunk_bytes: int,
) -> bool:
    """``read_page_into`` in Python: a ``preadv`` (or one a chunk), a checksum update a block."""
    head = memoryview(bytearray(HEADER_SIZE + len(token_bytes)))
    past_end = memoryview(bytearray(1))  # filled only if the file is longer than expected
    parts = chunk_groups(views, chunk_bytes)
    expected = head.nbytes + sum(size for _, size in parts)
    # the file's token ids must equal the caller's (checked below), so the caller's are hashed
    checksum = xxhash.xxh3_64(token_bytes)
    got = 0
    fd = os.open(path, os.O_RDONLY)
    try:
        for i, (part, part_bytes) in enumerate(parts):
            first, last = i == 0, i == len(parts) - 1
            part_views = [head, *part] if first else part
            want = part_bytes + (head.nbytes if first else 0)
            n = preadv_into(fd, [*part_views, past_end] if last else part_views, got, want)
            got += n
            if n < want:
                return False  # the file ended early
            for view in part:
                checksum.update(view)
    finally:
        os.close(fd)
    return _is_page(head, got, expected, key, token_bytes, checksum.intdigest())


def _is_page(
    head: memoryview, got: int, expected: int, key: bytes, token_bytes: bytes, checksum: int
) -> bool:
    """Whether a read of ``got`` bytes (``expected`` if the file had the page's size), whose
    header and token ids are ``head`` and whose checksum came to ``checksum``, is the page."""
    header = parse_header(head)
    if got != expected or header is None or header.key != key:
        return False  # shorter or longer than expected, or another key's page
    if header.file_bytes != got or head[HEADER_SIZE:] != token_bytes:
        return False
    return checksum == header.checksum


def chunk_groups(
    views: Sequence[memoryview], chunk_bytes: int
) -> list[tuple[list[memoryview], int]]:
    """``views`` (byte views) in order, as (group, its bytes) of about ``chunk_bytes`` each (a
    view longer than that is sliced; ``chunk_bytes`` <= 0: one group); one empty group when
    there are none."""
    if chunk_bytes <= 0:
        return [(list(views), sum(v.nbytes for v in views))]
    groups: list[tuple[list[memoryview], int]] = []
    group: list[memoryview] = []
    size = 0
    for view in views:
        pieces = [view] if view.nbytes <= chunk_bytes else _slices(view, chunk_bytes)
        for piece in pieces:
            if group and size + piece.nbytes > chunk_bytes:
                groups.append((group, size))
                group, size = [], 0
            group.append(piece)
            size += piece.nbytes
    groups.append((group, size))
    return groups


def _slices(view: memoryview, size: int) -> list[memoryview]:
    return [view[start : start + size] for start in range(0, view.nbytes, size)]


def preadv_into(fd: int, views: Sequence[memoryview], offset: int, min_bytes: int) -> int:
    """Reads into ``views`` (byte views) in order from ``fd`` at ``offset`` until at least
    ``min_bytes`` are in, they are full, or the file ends (one ``preadv`` when the kernel gives
    that much at once); the number of bytes read."""
    done = os.preadv(fd, views[:IOV_MAX], offset)
    if done >= min_bytes or done <= 0:
        return max(done, 0)
    left = list(views)
    _advance(left, done)
    while left and done < min_bytes:
        n = os.preadv(fd, left[:IOV_MAX], offset + done)
        if n <= 0:
            break
        done += n
        _advance(left, n)
    return done


def _pwritev_all(fd: int, views: Sequence[memoryview], offset: int) -> int:
    """Writes ``views`` in order at ``offset`` (one ``pwritev`` when the kernel takes them all at
    once); the bytes written."""
    left = list(views)
    done = 0
    while left:
        n = os.pwritev(fd, left[:IOV_MAX], offset + done)
        if n <= 0:
            raise OSError(f"pwritev wrote nothing at offset {offset + done}")
        done += n
        _advance(left, n)
    return done


def _advance(views: list[memoryview], n: int) -> None:
    """Drops the first ``n`` bytes of ``views`` (done by a vectored read or write)."""
    i = 0
    while i < len(views) and n >= views[i].nbytes:
        n -= views[i].nbytes
        i += 1
    del views[:i]
    if views and n:
        views[0] = views[0][n:]
