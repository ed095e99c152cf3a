"""outlines-core index builds in child processes that can be stopped.

Building an outlines-core ``Index`` cannot be interrupted, and some regexes take minutes and
gigabytes. ``auto`` gives outlines-core a budget; in a thread, an over-budget build could only be
left running, where it held memory, took CPU time and cache from decoding (mask rows of other
requests slowed to milliseconds while two such builds ran on the 2-core dev CPU) and took the GIL
in its Python steps. In a child process it is killed instead.

``IndexWorkerPool.start(regex)`` hands the regex to an idle child (started on demand, about
0.1 s: the child imports only outlines-core) and returns an ``IndexJob``: ``wait(timeout)``
gives the ``Index``, None while the build goes on, or raises ``GrammarCompileError``;
``cancel()`` kills the child. A child that finished a build goes back to the pool.
``start_schema(schema, whitespace_pattern, max_regex_chars)`` also turns a JSON schema into its
regex in the child: that step alone grew the scheduler to 23.6 GB on a schema of 2 MB of
optional properties (outlines-core writes every order of the optional properties).

Memory: each child runs under an address-space limit (``RLIMIT_AS``, default
``DEFAULT_MAX_MEMORY_BYTES`` = 4 GiB; the largest jsonschemabench index builds stay far below
it). A build past it fails to allocate and the child dies (or raises MemoryError); the job
reports "outlines-core ran out of memory", the child is not reused, and the parent is untouched.

This file is also the child's program (run by path, so the child imports no radixlm module
except ``regex_text.py``, loaded from its file): it reads the pickled vocabulary, then pickled
requests (``("index", regex)`` or ``("schema", schema, whitespace, max_chars)``), and answers
each with ``(True, index)`` or ``(False, reason)``; messages are pickles behind an 8-byte
length.
"""

from __future__ import annotations

import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import threading
from pathlib import Path

_HEADER = struct.Struct("<Q")
DEFAULT_MAX_MEMORY_BYTES = 4 << 30  # address space of one child (RLIMIT_AS)


def _write_message(fd: int, obj: object) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    view = memoryview(_HEADER.pack(len(data)) + data)
    while view:
        view = view[os.write(fd, view) :]


def _read_exactly(fd: int, size: int) -> bytes:
    chunks, remaining = [], size
    while remaining:
        chunk = os.read(fd, min(remaining, 1 << 20))
        if not chunk:
            raise EOFError("the outlines-core worker exited")
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)


def _read_message(fd: int) -> object:
    return _read_sized_message(fd)[0]


def _read_sized_message(fd: int) -> tuple[object, int]:
    """A message and its pickled length."""
    (size,) = _HEADER.unpack(_read_exactly(fd, _HEADER.size))
    return pickle.loads(_read_exactly(fd, size)), size


def _child_main(max_memory_bytes: int) -> None:
    # Die with the parent (Linux), even in the middle of a build. The signal follows the
    # parent *thread* that started the child: pools are used from long-lived compile threads.
    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if max_memory_bytes > 0:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (max_memory_bytes, max_memory_bytes))
    import outlines_core

    regex_text = _load_regex_text()
    fd_in = sys.stdin.fileno()
    fd_out = os.dup(sys.stdout.fileno())  # messages only: anything printed goes to stderr
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    vocabulary = _read_message(fd_in)
    while True:
        try:
            request = _read_message(fd_in)
        except EOFError:  # the parent closed the pipe or went away
            return
        try:
            reply = (True, _build(outlines_core, regex_text, vocabulary, request))
        except _Rejected as exc:
            reply = (False, str(exc))
        except BaseException as exc:  # pyo3 panics derive from BaseException
            if isinstance(exc, KeyboardInterrupt):
                raise
            if isinstance(exc, MemoryError):
                _write_message(fd_out, (False, "MemoryError"))
                return  # a process that ran out of memory is not reused
            reply = (False, str(exc).strip() or type(exc).__name__)
        _write_message(fd_out, reply)


class _Rejected(Exception):
    """A request the child turns down without building anything."""


def _load_regex_text():
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "regex_text.py")
    spec = importlib.util.spec_from_file_location("_radixlm_regex_text", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build(outlines_core, regex_text, vocabulary, request: tuple):
    if request[0] == "index":
        return outlines_core.Index(request[1], vocabulary)
    _, schema, whitespace_pattern, max_chars = request
    regex = outlines_core.json_schema.build_regex_from_schema(schema, whitespace_pattern)
    if max_chars is not None and len(regex) > max_chars:
        raise _Rejected(
            f"its regex has {len(regex):,} characters, over the {max_chars:,} "
            "allowed for outlines-core"
        )
    # The same rewrites as outlines_backend.spec_to_regex.
    regex = regex_text.anchor_regex(regex_text.ascii_digit_classes(regex))
    del schema
    return outlines_core.Index(regex, vocabulary)


if __name__ == "__main__":
    here = os.path.dirname(os.path.abspath(__file__))  # no module here may shadow another
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    _child_main(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
    sys.exit(0)


from radixlm.grammar.base import GrammarCompileError  # noqa: E402  (parent side only)


class _Worker:
    def __init__(self, vocabulary: object, max_memory_bytes: int) -> None:
        self.process = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), str(max_memory_bytes)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            close_fds=True,
        )
        self.fd_in = self.process.stdin.fileno()
        self.fd_out = self.process.stdout.fileno()
        _write_message(self.fd_in, vocabulary)

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()
        self.process.stdin.close()
        self.process.stdout.close()


class IndexJob:
    """One index build in a child process."""

    def __init__(self, pool: IndexWorkerPool, worker: _Worker, kind: str) -> None:
        self._pool = pool
        self._worker = worker
        self._kind = kind
        self._lock = threading.Lock()
        self._outcome: tuple[bool, object] | None = None
        self.num_message_bytes = 0  # length of the child's answer (about the index's size)

    def wait(self, timeout_s: float):
        """The ``Index``, or None if the build is still going after ``timeout_s``; raises
        ``GrammarCompileError`` when outlines-core rejected the regex or the child died."""
        with self._lock:
            if self._outcome is None:
                worker = self._worker
                if worker is None:
                    raise GrammarCompileError(self._kind, "the outlines-core build was cancelled")
                poller = select.poll()  # no FD_SETSIZE limit, unlike select.select
                poller.register(worker.fd_out, select.POLLIN)
                if not poller.poll(max(timeout_s, 0.0) * 1000):
                    return None
                self._outcome = self._read_outcome(worker)
                self._worker = None
            ok, value = self._outcome
        if not ok:
            raise GrammarCompileError(self._kind, str(value))
        return value

    def _read_outcome(self, worker: _Worker) -> tuple[bool, object]:
        try:
            (ok, value), self.num_message_bytes = _read_sized_message(worker.fd_out)
        except (EOFError, OSError, pickle.UnpicklingError) as exc:
            worker.process.wait()  # it exited: an allocation past RLIMIT_AS aborts it
            worker.kill()
            if worker.process.returncode == -signal.SIGABRT:  # Rust aborts when malloc fails
                return False, self._pool.out_of_memory_reason()
            return (
                False,
                f"the outlines-core worker failed ({exc}; exit status {worker.process.returncode})",
            )
        if not ok and str(value).startswith("MemoryError"):
            worker.kill()  # the child exits after a MemoryError; never reused
            return False, self._pool.out_of_memory_reason()
        self._pool._release(worker)
        return ok, value

    def cancel(self) -> None:
        """Stops the build (kills its child process) unless it has finished."""
        with self._lock:
            if self._worker is not None:
                self._worker.kill()
                self._worker = None
                self._pool.num_killed += 1


class IndexWorkerPool:
    """Child processes building outlines-core indexes over one vocabulary."""

    def __init__(
        self, vocabulary_factory, max_memory_bytes: int = DEFAULT_MAX_MEMORY_BYTES
    ) -> None:
        self._vocabulary_factory = vocabulary_factory  # called once, on first use
        self.max_memory_bytes = max_memory_bytes  # RLIMIT_AS of each child (0: none)
        self._idle: list[_Worker] = []
        self.num_killed = 0  # builds stopped before they finished
        self._lock = threading.Lock()
        self._closed = False

    def start(self, regex: str, kind: str) -> IndexJob:
        """Builds the index of ``regex`` (already anchored and rewritten)."""
        return self._submit(("index", regex), kind)

    def start_schema(
        self,
        schema: str,
        whitespace_pattern: str,
        max_regex_chars: int | None,
        kind: str = "json_schema",
    ) -> IndexJob:
        """Turns JSON schema text into its regex (rejected when longer than
        ``max_regex_chars``), rewrites it as ``outlines_backend.spec_to_regex`` does and builds
        its index, all in the child."""
        return self._submit(("schema", schema, whitespace_pattern, max_regex_chars), kind)

    def out_of_memory_reason(self) -> str:
        return (
            f"outlines-core ran out of memory (its build process is limited to "
            f"{self.max_memory_bytes / (1 << 30):g} GiB of address space)"
        )

    def _submit(self, request: tuple, kind: str) -> IndexJob:
        with self._lock:
            if self._closed:
                raise GrammarCompileError(kind, "the grammar backend is shut down")
            worker = self._idle.pop() if self._idle else None
        if worker is None or worker.process.poll() is not None:
            worker = _Worker(self._vocabulary_factory(), self.max_memory_bytes)
        try:
            _write_message(worker.fd_in, request)
        except OSError as exc:
            worker.kill()
            raise GrammarCompileError(kind, f"the outlines-core worker failed ({exc})") from exc
        return IndexJob(self, worker, kind)

    def _release(self, worker: _Worker) -> None:
        with self._lock:
            if not self._closed:
                self._idle.append(worker)
                return
        worker.kill()

    def num_idle(self) -> int:
        with self._lock:
            return len(self._idle)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for worker in idle:
            worker.kill()
