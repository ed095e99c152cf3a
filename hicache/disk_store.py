"""DiskPageStore: one file per page under a folder per model fingerprint, verified on read.

Layout
------
::

    <root_dir>/<fingerprint>/fingerprint.json         the hashed fields, for humans
    <root_dir>/<fingerprint>/<kk>/<key hex>.page      one page (kk: the key's first byte, hex)
    <root_dir>/<fingerprint>/<kk>/<key hex>.<r>.tmp   a page being written (r: random hex)

``<fingerprint>`` is ``model_fingerprint(fingerprint)[0]``: another model, dtype, page size or
layout version reads and writes another folder, so its pages never match.

The page file's format and how its bytes move (one ``preadv`` straight into the caller's
blocks, one ``writev`` straight from them): ``page_file``.

Durability: a page is written to a temp file in its final folder and renamed into place
(``os.replace``), so a reader sees a whole file or none. Nothing is fsynced: after a power
loss a file may hold garbage, which the checks below catch (a cache loses pages, never
serves wrong ones). Start-up checks each file's header and size, deletes invalid files and
leftover temp files, and orders the index by mtime (a hit touches its file's mtime, at most
once in ``TOUCH_EVERY_S`` per page, so a restarted store keeps least-recently-*used* order).
``get`` checks everything: header, key, lengths, token ids and the checksum. One store instance (one process) per folder at a time.

Locking: one lock guards the index and counters; renames into place and deletions run under
it too (so the index and the folder change together); writing a page's bytes and reading a
page run outside it.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

from tqdm import tqdm

from radixlm.hicache import native_page_io, page_file
from radixlm.hicache.page_file import HEADER_SIZE, parse_header
from radixlm.hicache.page_hash import encode_token_ids, model_fingerprint
from radixlm.hicache.storage_base import PageStore, PageView, Payload, check_key

logger = logging.getLogger(__name__)

PAGE_SUFFIX = ".page"
TEMP_SUFFIX = ".tmp"
# a hit sets its file's mtime at most this often: a metadata write on every read halved the
# read path's bytes/s (bench_disk_path), and a restart needs the LRU order only roughly
TOUCH_EVERY_S = 30.0
PROGRESS_MIN_FILES = 10_000  # show a progress bar when indexing more files than this
COUNTERS = (
    "hits",
    "misses",
    "bytes_read",
    "bytes_written",
    "pages_written",
    "write_errors",
    "read_errors",
    "corrupt_deleted",
    "evicted_pages",
    "refused_pages",  # larger than max_bytes
    "stale_skipped",  # a PageView's memory was reused while it was written: not stored
    "invalid_files_removed",  # at start-up: bad headers, wrong sizes, leftover temp files
)


class PageBuffers:
    """Payload buffers reused across reads (taken by reader threads, given back by the reader
    of the payload once copied out); at most ``max_buffers`` kept. A buffer never given back is
    simply garbage collected, so a caller that keeps a payload is always safe."""

    def __init__(self, max_buffers: int = 64) -> None:
        self.max_buffers = max_buffers
        self._free: dict[int, list[bytearray]] = {}
        self._lock = threading.Lock()

    def take(self, num_bytes: int) -> memoryview:
        with self._lock:
            free = self._free.get(num_bytes)
            buf = free.pop() if free else None
        return memoryview(buf if buf is not None else bytearray(num_bytes))

    def give(self, payload: Payload) -> None:
        buf = payload.obj if isinstance(payload, memoryview) else None
        if not isinstance(buf, bytearray) or len(buf) != payload.nbytes:
            return
        with self._lock:
            free = self._free.setdefault(len(buf), [])
            if sum(len(v) for v in self._free.values()) < self.max_buffers:
                free.append(buf)


def _remove(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as error:
        logger.debug("hicache: could not remove %s: %s", path, error)


def _key_of(name: str) -> bytes | None:
    stem, suffix = name[: -len(PAGE_SUFFIX)], name[-len(PAGE_SUFFIX) :]
    if suffix != PAGE_SUFFIX or len(stem) != 32:
        return None
    try:
        return bytes.fromhex(stem)
    except ValueError:
        return None


class DiskPageStore(PageStore):
    """Pages as verified files in ``root_dir/<fingerprint digest>/``, at most ``max_bytes``
    of files (header and token ids included), evicted least-recently-used first."""

    def __init__(
        self,
        root_dir: str | Path,
        fingerprint: Mapping[str, object],
        max_bytes: int,
        read_chunk_bytes: int = 0,
    ):
        """``read_chunk_bytes`` > 0 reads a page's payload in chunks of that size, each hashed
        while in the cache, instead of one ``preadv`` a page (``page_file.read_page_into``)."""
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        self.fingerprint, fields = model_fingerprint(fingerprint)
        self.folder = Path(root_dir) / self.fingerprint
        self._folder_str = str(self.folder)
        self.max_bytes = max_bytes
        self.read_chunk_bytes = read_chunk_bytes
        self._lock = threading.Lock()
        # key -> (file bytes, generation), least recently used first
        self._index: OrderedDict[bytes, tuple[int, int]] = OrderedDict()
        self._writing: set[bytes] = set()  # keys whose files are being written
        self._touched: dict[bytes, float] = {}  # key -> when a hit last set its file's mtime
        self._used_bytes = 0
        self._generation = 0  # distinguishes a re-written entry from the one a reader saw
        self._counters = dict.fromkeys(COUNTERS, 0)
        self._buffers = PageBuffers()
        self._warned: set[str] = set()
        self._is_closed = False
        native_page_io.get()  # the page file helper built now, not by the first read or write
        self.folder.mkdir(parents=True, exist_ok=True)
        self._write_fingerprint(fields)
        self._rebuild()

    # --- the PageStore interface ---------------------------------------------------------

    def exists(self, key: bytes) -> bool:
        check_key(key)
        with self._lock:
            return not self._is_closed and key in self._index

    def get(self, key: bytes, token_ids: Sequence[int]) -> memoryview | None:
        return self._verified_read(key, token_ids, None)

    def get_into(self, key: bytes, token_ids: Sequence[int], blocks: Sequence[memoryview]) -> bool:
        """Reads the page's payload straight into ``blocks`` (``page_file.read_page_into``: one
        ``preadv`` for the whole file, or one a chunk), verified."""
        return self._verified_read(key, token_ids, blocks) is not None

    def _verified_read(
        self, key: bytes, token_ids: Sequence[int], blocks: Sequence[memoryview] | None
    ) -> memoryview | bool | None:
        check_key(key)
        expected = encode_token_ids(token_ids)
        with self._lock:
            entry = None if self._is_closed else self._index.get(key)
            if entry is None:
                self._counters["misses"] += 1
                return None
        size, generation = entry
        path = self._page_file(key)
        try:
            payload = self._read_verified(path, key, expected, size, blocks)
        except OSError as error:
            self._drop_bad(key, generation, "read_errors", f"{path}: {error}")
            return None
        if payload is None:
            self._drop_bad(key, generation, "corrupt_deleted", path)
            return None
        now = time.monotonic()
        with self._lock:
            self._counters["hits"] += 1
            self._counters["bytes_read"] += size
            touch = False
            if self._index.get(key, (0, -1))[1] == generation:
                self._index.move_to_end(key)
                touch = now - self._touched.get(key, -TOUCH_EVERY_S) >= TOUCH_EVERY_S
                if touch:
                    self._touched[key] = now
        if touch:  # the mtime orders the LRU after a restart (to within TOUCH_EVERY_S)
            try:
                os.utime(path)
            except OSError:
                pass
        return payload

    def set(self, key: bytes, token_ids: Sequence[int], payload: Payload | PageView) -> bool:
        check_key(key)
        token_bytes = encode_token_ids(token_ids)
        if not token_bytes:
            raise ValueError("a page holds at least one token")
        if isinstance(payload, PageView):
            blocks, is_current = payload.blocks, payload.is_current
        else:
            blocks, is_current = (memoryview(payload).cast("B"),), None
        size = HEADER_SIZE + len(token_bytes) + sum(b.nbytes for b in blocks)
        with self._lock:
            if self._is_closed:
                return False
            if key in self._index:
                self._index.move_to_end(key)
                return True
            if key in self._writing:
                return True
            if size > self.max_bytes:
                self._counters["refused_pages"] += 1
                return False
            self._writing.add(key)
        try:
            return self._write_page(key, token_bytes, blocks, size, is_current)
        finally:
            with self._lock:
                self._writing.discard(key)

    def delete(self, key: bytes) -> None:
        check_key(key)
        with self._lock:
            entry = self._index.pop(key, None)
            self._touched.pop(key, None)
            if entry is not None:
                self._used_bytes -= entry[0]
                _remove(self.page_path(key))

    def clear(self) -> None:
        with self._lock:
            for key in self._index:
                _remove(self.page_path(key))
            self._index.clear()
            self._touched.clear()
            self._used_bytes = 0

    def num_pages(self) -> int:
        with self._lock:
            return len(self._index)

    def used_bytes(self) -> int:
        with self._lock:
            return self._used_bytes

    def stats(self) -> dict[str, int | float]:
        with self._lock:
            return {
                "pages": len(self._index),
                "used_bytes": self._used_bytes,
                "max_bytes": self.max_bytes,
                **self._counters,
            }

    def check_integrity(self) -> None:
        with self._lock:
            sizes = sum(size for size, _ in self._index.values())
            assert sizes == self._used_bytes, f"index sizes {sizes} != used {self._used_bytes}"
            assert self._used_bytes <= self.max_bytes, f"{self._used_bytes=} > {self.max_bytes}"
            for key, (size, _) in self._index.items():
                path = self.page_path(key)
                assert path.is_file(), f"indexed page {path} has no file"
                assert path.stat().st_size == size, f"{path}: size differs from the index"
            on_disk = {_key_of(entry.name) for entry in self._scan_files()} - {None}
            unindexed = on_disk - set(self._index)
            assert not unindexed, f"{len(unindexed)} page files are not in the index"

    def close(self) -> None:
        with self._lock:
            self._is_closed = True

    # --- files -----------------------------------------------------------------------------

    def page_path(self, key: bytes) -> Path:
        """Where the page ``key`` lives (whether or not it is stored)."""
        return self.folder / key[:1].hex() / (key.hex() + PAGE_SUFFIX)

    def _page_file(self, key: bytes) -> str:
        """``page_path`` as a string, without ``pathlib`` (a read's path is built per page)."""
        name = key.hex()
        return os.path.join(self._folder_str, name[:2], name + PAGE_SUFFIX)

    def _write_page(
        self,
        key: bytes,
        token_bytes: bytes,
        blocks: Sequence[Payload],
        size: int,
        is_current: Callable[[], bool] | None,
    ) -> bool:
        """Writes the page to a temp file straight from ``blocks`` and renames it into place,
        unless ``is_current`` says the blocks' memory was reused meanwhile."""
        path = self.page_path(key)
        temp = path.with_name(f"{key.hex()}.{secrets.token_hex(4)}{TEMP_SUFFIX}")
        try:
            path.parent.mkdir(exist_ok=True)
            page_file.write_page(temp, key, token_bytes, blocks)
            with self._lock:
                if is_current is not None and not is_current():
                    _remove(temp)
                    self._counters["stale_skipped"] += 1
                    return False
                os.replace(temp, path)  # under the lock: the index and the folder change together
                self._insert(key, size)
            return True
        except OSError as error:
            _remove(temp)
            with self._lock:
                self._counters["write_errors"] += 1
            self._warn_once("write_errors", f"writing {path} failed: {error}")
            return False

    def _read_verified(
        self,
        path: str,
        key: bytes,
        expected_tokens: bytes,
        file_bytes: int,
        blocks: Sequence[memoryview] | None = None,
    ) -> memoryview | bool | None:
        """The payload of the file at ``path`` if every check passes (read into ``blocks`` when
        given: True then), else None. Read (``page_file.read_page_into``) straight into the
        caller's blocks, or into a recycled buffer of the size the index holds
        (``recycle``): a fresh 2 MiB ``bytes`` per page cost more in page faults than the read
        itself (``bench_disk_path``)."""
        chunk = self.read_chunk_bytes
        if blocks is not None:
            return page_file.read_page_into(path, key, expected_tokens, blocks, chunk) or None
        payload_len = file_bytes - HEADER_SIZE - len(expected_tokens)
        if payload_len < 0:
            return None
        payload = self._buffers.take(payload_len)
        if page_file.read_page_into(path, key, expected_tokens, (payload,), chunk):
            return payload
        self._buffers.give(payload)
        return None

    def recycle(self, payload: Payload) -> None:
        """A payload ``get`` returned, copied out and no longer referenced by the caller: its
        buffer serves a later read."""
        self._buffers.give(payload)

    def _drop_bad(self, key: bytes, generation: int, counter: str, what: str) -> None:
        """Count a failed read as a miss and delete the entry read, unless it changed since."""
        with self._lock:
            self._counters["misses"] += 1
            entry = self._index.get(key)
            if entry is None or entry[1] != generation:
                return  # evicted or replaced meanwhile: an ordinary miss
            del self._index[key]
            self._touched.pop(key, None)
            self._used_bytes -= entry[0]
            _remove(self.page_path(key))
            self._counters[counter] += 1
        self._warn_once(counter, f"dropped page ({counter}): {what}")

    def _insert(self, key: bytes, size: int) -> None:
        """Index a page just renamed into place and evict down to max_bytes (lock held)."""
        self._generation += 1
        self._index[key] = (size, self._generation)
        self._used_bytes += size
        self._counters["pages_written"] += 1
        self._counters["bytes_written"] += size
        self._evict_to(self.max_bytes)

    def _evict_to(self, max_bytes: int) -> None:
        while self._used_bytes > max_bytes and self._index:
            key, (size, _) = self._index.popitem(last=False)
            self._touched.pop(key, None)
            self._used_bytes -= size
            _remove(self.page_path(key))
            self._counters["evicted_pages"] += 1

    def _warn_once(self, kind: str, message: str) -> None:
        level = logging.DEBUG if kind in self._warned else logging.WARNING
        self._warned.add(kind)
        logger.log(level, "hicache disk store: %s", message)

    # --- start-up --------------------------------------------------------------------------

    def _write_fingerprint(self, fields: dict) -> None:
        path = self.folder / "fingerprint.json"
        if path.exists():
            return
        temp = path.with_name(f"fingerprint.{secrets.token_hex(4)}{TEMP_SUFFIX}")
        try:
            temp.write_text(json.dumps(fields, indent=2, sort_keys=True) + "\n")
            os.replace(temp, path)
        except OSError as error:
            _remove(temp)
            logger.warning("hicache disk store: could not write %s: %s", path, error)

    def _scan_files(self) -> Iterator[os.DirEntry]:
        """Every file in the shard folders (page files, temp files, strangers)."""
        with os.scandir(self.folder) as shards:
            shard_dirs = sorted(s.path for s in shards if len(s.name) == 2 and s.is_dir())
        for shard in shard_dirs:
            with os.scandir(shard) as entries:
                yield from (entry for entry in entries if entry.is_file())

    def _rebuild(self) -> None:
        """Index the pages already in the folder (a restarted server starts warm)."""
        start = time.perf_counter()
        files = list(self._scan_files())
        found: list[tuple[int, bytes, int]] = []  # (mtime_ns, key, size)
        bar = tqdm(
            files,
            desc="hicache: indexing disk pages",
            unit="file",
            file=sys.stderr,
            disable=len(files) <= PROGRESS_MIN_FILES,
        )
        for entry in bar:
            if entry.name.endswith(TEMP_SUFFIX):
                self._remove_invalid(entry)
                continue
            key = _key_of(entry.name)
            if key is None:
                continue  # not a page file: left alone
            in_place = Path(entry.path).parent.name == key[:1].hex()
            stat = self._valid_file_stat(entry, key) if in_place else None
            if stat is None:
                self._remove_invalid(entry)
            else:
                found.append((stat.st_mtime_ns, key, stat.st_size))
        for _, key, size in sorted(found):
            self._generation += 1
            self._index[key] = (size, self._generation)
            self._used_bytes += size
        with self._lock:
            self._evict_to(self.max_bytes)
        logger.info(
            "hicache disk store %s: found %d pages, %d bytes in %.2f s (%d invalid files removed)",
            self.folder,
            len(self._index),
            self._used_bytes,
            time.perf_counter() - start,
            self._counters["invalid_files_removed"],
        )

    @staticmethod
    def _valid_file_stat(entry: os.DirEntry, key: bytes) -> os.stat_result | None:
        """The file's stat if its header is valid, names ``key`` and matches its size."""
        try:
            stat = entry.stat()
            with open(entry.path, "rb") as file:
                header = parse_header(file.read(HEADER_SIZE))
        except OSError:
            return None
        if header is None or header.key != key or header.file_bytes != stat.st_size:
            return None
        return stat

    def _remove_invalid(self, entry: os.DirEntry) -> None:
        _remove(Path(entry.path))
        self._counters["invalid_files_removed"] += 1
