"""A page file read or written in one foreign call, without the GIL (``page_file`` uses it).

Python's path takes the GIL back after every system call and every checksum update of a page
(a ``preadv`` and one ``update`` a block: dozens a page), and a storage thread that gives the GIL
up while another thread runs Python waits for it each time (``bench_disk_path --busy-thread``).
Here one ``ctypes`` call (which gives the GIL up for the whole call) opens the file, reads the
header and token ids and the payload straight into the caller's blocks (short reads and EINTR
completed, one byte past the expected end read to tell a file that is too long), hashes the
token ids then the blocks in order with the xxh3_64 of the installed ``xxhash`` package (its
extension module exports the XXH3 streaming API: the very same function the Python path calls,
so files and checksums are the same), and closes it; a write hashes, then ``open(O_EXCL)`` and
``pwritev``. The checks of the header stay in Python (``page_file``).

The helper is built by ``kernels.cpu_decode.compile_library`` (cached per source) on first use;
where it cannot be (no compiler, no XXH3 symbols, ``RADIXLM_NATIVE_PAGE_IO=0``) :func:`get`
says None, logged once, and ``page_file`` keeps its Python path (as inside :func:`python_only`).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import threading
from array import array
from collections.abc import Iterator, Sequence

logger = logging.getLogger(__name__)

SOURCE = r"""
#include <errno.h>
#include <fcntl.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <sys/uio.h>
#include <unistd.h>
#include <vector>

typedef int (*reset_fn)(void*);
typedef int (*update_fn)(void*, const void*, size_t);
typedef uint64_t (*digest_fn)(const void*);

static reset_fn g_reset;
static update_fn g_update;
static digest_fn g_digest;
static const int kIovMax = 1024;

// Reads into iov[0, cnt) (changed: the caller's copy) at offset until they are full or the
// file ends: the bytes read, or -errno.
static long long read_full(int fd, struct iovec* iov, int cnt, long long offset) {
    long long done = 0;
    while (cnt > 0) {
        ssize_t n = preadv(fd, iov, cnt < kIovMax ? cnt : kIovMax, (off_t)(offset + done));
        if (n < 0) {
            if (errno == EINTR) continue;
            return -(long long)errno;
        }
        if (n == 0) break;
        done += n;
        while (cnt > 0 && (size_t)n >= iov->iov_len) { n -= iov->iov_len; ++iov; --cnt; }
        if (cnt > 0 && n > 0) {
            iov->iov_base = (char*)iov->iov_base + n;
            iov->iov_len -= (size_t)n;
        }
    }
    return done;
}

static void hash_iov(void* state, const struct iovec* iov, int cnt) {
    for (int i = 0; i < cnt; ++i) g_update(state, iov[i].iov_base, iov[i].iov_len);
}

extern "C" void rl_page_io_init(void* reset, void* update, void* digest) {
    g_reset = (reset_fn)reset;
    g_update = (update_fn)update;
    g_digest = (digest_fn)digest;
}

// Reads the file at path: its first head_len bytes into head, then blocks (iov[0, nblocks): the
// payload, in order), in one preadv loop (chunk <= 0) or in chunks of chunk bytes, each hashed
// right after it is read, then one byte past the expected end. The bytes read (head_len + the
// blocks' bytes exactly when the file has that size), or -errno. Only when the file has that
// size is *digest set: xxh3_64 of tokens then the blocks, with state (the caller's).
extern "C" long long rl_read_page(const char* path, void* head, size_t head_len,
                                  const struct iovec* blocks, int nblocks, long long chunk,
                                  void* state, const void* tokens, size_t tokens_len,
                                  uint64_t* digest) {
    size_t payload = 0;
    for (int i = 0; i < nblocks; ++i) payload += blocks[i].iov_len;
    const long long expected = (long long)(head_len + payload);
    unsigned char past_end;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -(long long)errno;
    long long got = 0;
    *digest = 0;
    if (chunk <= 0) {
        std::vector<struct iovec> iov((size_t)nblocks + 2);
        iov[0].iov_base = head;
        iov[0].iov_len = head_len;
        if (nblocks) memcpy(&iov[1], blocks, sizeof(struct iovec) * (size_t)nblocks);
        iov[nblocks + 1].iov_base = &past_end;
        iov[nblocks + 1].iov_len = 1;
        got = read_full(fd, iov.data(), nblocks + 2, 0);
        if (got == expected) {
            g_reset(state);
            g_update(state, tokens, tokens_len);
            hash_iov(state, blocks, nblocks);
            *digest = g_digest(state);
        }
        close(fd);
        return got;
    }
    struct iovec h = {head, head_len};
    got = read_full(fd, &h, 1, 0);
    if (got != (long long)head_len) {
        close(fd);
        return got;
    }
    g_reset(state);
    g_update(state, tokens, tokens_len);
    std::vector<struct iovec> part, scratch;
    int bi = 0;
    size_t bo = 0;
    while (bi < nblocks) {
        part.clear();
        size_t size = 0;
        while (bi < nblocks && size < (size_t)chunk) {
            size_t take = blocks[bi].iov_len - bo;
            if (take > (size_t)chunk - size) take = (size_t)chunk - size;
            struct iovec piece = {(char*)blocks[bi].iov_base + bo, take};
            part.push_back(piece);
            size += take;
            bo += take;
            if (bo == blocks[bi].iov_len) { ++bi; bo = 0; }
        }
        scratch = part;
        long long n = read_full(fd, scratch.data(), (int)scratch.size(), got);
        if (n < 0) { close(fd); return n; }
        got += n;
        if (n < (long long)size) { close(fd); return got; }  // the file ended early
        hash_iov(state, part.data(), (int)part.size());
    }
    struct iovec p = {&past_end, 1};
    long long n = read_full(fd, &p, 1, got);
    close(fd);
    if (n < 0) return n;
    got += n;
    if (got == expected) *digest = g_digest(state);
    return got;
}

// Writes a new file (O_EXCL) at path: head (whose 8 bytes at checksum_at get xxh3_64 of the
// token ids then the blocks, little-endian), the token ids, then the blocks; 0 or -errno.
extern "C" long long rl_write_page(const char* path, void* head, size_t head_len,
                                   size_t checksum_at, const void* tokens, size_t tokens_len,
                                   const struct iovec* blocks, int nblocks, void* state) {
    g_reset(state);
    g_update(state, tokens, tokens_len);
    hash_iov(state, blocks, nblocks);
    uint64_t sum = g_digest(state);
    unsigned char* at = (unsigned char*)head + checksum_at;
    for (int i = 0; i < 8; ++i) at[i] = (unsigned char)(sum >> (8 * i));
    std::vector<struct iovec> iov((size_t)nblocks + 2);
    iov[0].iov_base = head;
    iov[0].iov_len = head_len;
    iov[1].iov_base = (void*)tokens;
    iov[1].iov_len = tokens_len;
    if (nblocks) memcpy(&iov[2], blocks, sizeof(struct iovec) * (size_t)nblocks);
    int fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd < 0) return -(long long)errno;
    struct iovec* left = iov.data();
    int cnt = nblocks + 2;
    long long done = 0;
    while (cnt > 0) {
        ssize_t n = pwritev(fd, left, cnt < kIovMax ? cnt : kIovMax, (off_t)done);
        if (n < 0) {
            if (errno == EINTR) continue;
            int error = errno;
            close(fd);
            return -(long long)error;
        }
        if (n == 0) {
            // nothing written but buffers left: as the Python path, an error
            while (cnt > 0 && left->iov_len == 0) { ++left; --cnt; }
            if (cnt == 0) break;
            close(fd);
            return -(long long)EIO;
        }
        done += n;
        while (cnt > 0 && (size_t)n >= left->iov_len) { n -= left->iov_len; ++left; --cnt; }
        if (cnt > 0 && n > 0) {
            left->iov_base = (char*)left->iov_base + n;
            left->iov_len -= (size_t)n;
        }
    }
    if (close(fd) != 0) return -(long long)errno;
    return 0;
}
"""

FLAGS = ("-O2", "-shared", "-fPIC")
XXH3_SYMBOLS = ("XXH3_createState", "XXH3_freeState", "XXH3_64bits_reset", "XXH3_64bits_digest")

_P = ctypes.c_void_p
_lock = threading.Lock()
_io: NativePageIO | None = None
_tried = False
_python_only = 0  # inside python_only() blocks


class NativePageIO:
    """The loaded helper, and an xxh3 state for each thread that uses it."""

    def __init__(self, lib: ctypes.CDLL, xxh: ctypes.CDLL, update_name: str) -> None:
        self._create = xxh.XXH3_createState
        self._create.restype, self._create.argtypes = _P, []
        self._free = xxh.XXH3_freeState
        self._free.restype, self._free.argtypes = ctypes.c_int, [_P]
        addr = [
            ctypes.cast(getattr(xxh, name), _P).value
            for name in ("XXH3_64bits_reset", update_name, "XXH3_64bits_digest")
        ]
        lib.rl_page_io_init.argtypes, lib.rl_page_io_init.restype = [_P, _P, _P], None
        lib.rl_page_io_init(*addr)
        self._read = lib.rl_read_page
        self._read.restype = ctypes.c_longlong
        self._read.argtypes = [
            ctypes.c_char_p, _P, ctypes.c_size_t, _P, ctypes.c_int, ctypes.c_longlong,
            _P, ctypes.c_char_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_uint64),
        ]  # fmt: skip
        self._write = lib.rl_write_page
        self._write.restype = ctypes.c_longlong
        self._write.argtypes = [
            ctypes.c_char_p, _P, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_char_p,
            ctypes.c_size_t, _P, ctypes.c_int, _P,
        ]  # fmt: skip
        self._local = threading.local()

    def _state(self) -> int:
        """This thread's xxh3 state (freed with the thread's ``threading.local`` entry)."""
        state = getattr(self._local, "state", None)
        if state is None:
            state = self._local.state = _State(self._create, self._free)
        return state.ptr

    def read(
        self,
        path: str | os.PathLike,
        head: bytearray,
        blocks: Sequence[memoryview],
        chunk_bytes: int,
        token_bytes: bytes,
    ) -> tuple[int, int, int] | None:
        """(bytes read, bytes expected, checksum) of the file at ``path`` read into ``head``
        then ``blocks`` (byte views) and one byte past their end, expected ``len(head)`` + the
        blocks' bytes; the checksum (token ids, then the blocks) only when exactly that many
        were there, else 0. None (nothing read) where a block is read-only or not contiguous.
        Raises OSError (with ``path``) when the file cannot be opened or read."""
        try:
            iov, keep = _iovecs(blocks, True)
        except TypeError:
            return None
        head_buf = ctypes.c_char.from_buffer(head)
        digest = ctypes.c_uint64(0)
        got = self._read(
            os.fsencode(path), ctypes.addressof(head_buf), len(head),
            iov.buffer_info()[0], len(blocks), chunk_bytes, self._state(),
            token_bytes, len(token_bytes), ctypes.byref(digest),
        )  # fmt: skip
        if got < 0:
            raise OSError(-got, os.strerror(-got), os.fspath(path))
        return got, len(head) + sum(iov[1::2]), digest.value

    def write(
        self,
        path: str | os.PathLike,
        head: bytearray,
        checksum_at: int,
        token_bytes: bytes,
        blocks: Sequence[memoryview],
    ) -> None:
        """Writes a new file at ``path`` (``O_EXCL``): ``head`` with the checksum of the token ids
        then ``blocks`` put at ``checksum_at`` (8 bytes, little-endian), the token ids, the
        blocks. Raises OSError (with ``path``)."""
        iov, keep = _iovecs(blocks, False)
        head_buf = ctypes.c_char.from_buffer(head)
        error = self._write(
            os.fsencode(path), ctypes.addressof(head_buf), len(head), checksum_at,
            token_bytes, len(token_bytes), iov.buffer_info()[0], len(blocks), self._state(),
        )  # fmt: skip
        if error < 0:
            raise OSError(-error, os.strerror(-error), os.fspath(path))


class _State:
    def __init__(self, create, free) -> None:
        self.ptr, self._free = create(), free
        if not self.ptr:
            raise MemoryError("XXH3_createState failed")

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # at interpreter exit ctypes may be gone
            self._free(self.ptr)


def _iovecs(blocks: Sequence[memoryview], writable: bool) -> tuple[array, list]:
    """``blocks`` (C-contiguous byte views) as an array of ``struct iovec`` (address, length: 64
    bits each) and the objects that hold their buffers while the array is used; TypeError for a
    block that is not contiguous, or read-only where ``writable``."""
    try:  # the usual case, about 0.4 us a block: each writable and not empty
        keep = list(map(ctypes.c_char.from_buffer, blocks))
        addresses = array("Q", map(ctypes.addressof, keep))
    except (TypeError, ValueError):
        return _iovecs_any(blocks, writable)
    iov = array("Q", bytes(16 * len(keep)))
    iov[0::2] = addresses
    iov[1::2] = array("Q", [b.nbytes for b in blocks])
    return iov, keep


def _iovecs_any(blocks: Sequence[memoryview], writable: bool) -> tuple[array, list]:
    """``_iovecs`` where some block is read-only (held through numpy) or empty."""
    keep: list = []
    flat: list[int] = []
    for block in blocks:
        if not block.nbytes:
            flat += (0, 0)
            continue
        if block.readonly:
            if writable:
                raise TypeError("a page is read into writable blocks only")
            import numpy as np

            held = np.frombuffer(block, np.uint8)
            flat += (held.ctypes.data, block.nbytes)
        else:
            held = ctypes.c_char.from_buffer(block)
            flat += (ctypes.addressof(held), block.nbytes)
        keep.append(held)
    return array("Q", flat), keep


@contextlib.contextmanager
def python_only() -> Iterator[None]:
    """Inside the block :func:`get` says None: page files are read and written in Python (a
    benchmark comparing the paths)."""
    global _python_only
    _python_only += 1
    try:
        yield
    finally:
        _python_only -= 1


def get() -> NativePageIO | None:
    """The helper, built and loaded on first use; None where it cannot be (logged once) or
    inside :func:`python_only`."""
    global _io, _tried
    if _tried:
        return None if _python_only else _io
    with _lock:
        if not _tried:
            try:
                _io = _load()
            except Exception as error:  # a missing symbol, a failed load: keep the Python path
                logger.warning("hicache: page files are read in Python (%s)", error)
            _tried = True
    return None if _python_only else _io


def _load() -> NativePageIO | None:
    if os.environ.get("RADIXLM_NATIVE_PAGE_IO", "1") == "0":
        logger.info("hicache: RADIXLM_NATIVE_PAGE_IO=0, page files are read in Python")
        return None
    if ctypes.sizeof(ctypes.c_void_p) != 8 or ctypes.sizeof(ctypes.c_size_t) != 8:
        logger.info("hicache: not a 64-bit platform, page files are read in Python")
        return None
    import xxhash._xxhash as extension

    from radixlm.kernels.cpu_decode import compile_library

    xxh = ctypes.CDLL(extension.__file__)
    missing = [name for name in XXH3_SYMBOLS if not hasattr(xxh, name)]
    # the x86 build's dispatcher picks the widest SIMD (the one its Python API calls); same hash
    update = next(
        (n for n in ("XXH3_64bits_update_dispatch", "XXH3_64bits_update") if hasattr(xxh, n)), None
    )
    if missing or update is None:
        logger.warning(
            "hicache: %s lacks %s: page files are read in Python",
            extension.__file__,
            ", ".join(missing) or "XXH3_64bits_update",
        )
        return None
    lib = compile_library("radixlm_page_io", SOURCE, FLAGS)
    if lib is None:
        logger.warning("hicache: the page file helper could not be built: read in Python")
        return None
    return NativePageIO(lib, xxh, update)
