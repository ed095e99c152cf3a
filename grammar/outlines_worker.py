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

This file is also the child's program (run by path, so the child imports no radixlm module):
it reads the pickled vocabulary, then pickled regexes, and answers each with
``(True, index)`` or ``(False, reason)``; messages are pickles behind an 8-byte length.
"""

from __future__ import annotations

import os
import pickle
import select
import struct
import subprocess
import sys
import threading
from pathlib import Path

_HEADER = struct.Struct("<Q")


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
    (size,) = _HEADER.unpack(_read_exactly(fd, _HEADER.size))
    return pickle.loads(_read_exactly(fd, size))


def _child_main() -> None:
    # Die with the parent (Linux), even in the middle of a build. The signal follows the
    # parent *thread* that started the child: pools are used from long-lived compile threads.
    try:
        import ctypes
        import signal

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    import outlines_core

    fd_in = sys.stdin.fileno()
    fd_out = os.dup(sys.stdout.fileno())  # messages only: anything printed goes to stderr
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    vocabulary = _read_message(fd_in)
    while True:
        try:
            regex = _read_message(fd_in)
        except EOFError:  # the parent closed the pipe or went away
            return
        try:
            reply = (True, outlines_core.Index(regex, vocabulary))
        except BaseException as exc:  # pyo3 panics derive from BaseException
            if isinstance(exc, KeyboardInterrupt):
                raise
            reply = (False, str(exc).strip() or type(exc).__name__)
        _write_message(fd_out, reply)


if __name__ == "__main__":
    here = os.path.dirname(os.path.abspath(__file__))  # no module here may shadow another
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    _child_main()
    sys.exit(0)


from radixlm.grammar.base import GrammarCompileError  # noqa: E402  (parent side only)


class _Worker:
    def __init__(self, vocabulary: object) -> None:
        self.process = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve())],
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
                try:
                    self._outcome = _read_message(worker.fd_out)
                except (EOFError, OSError, pickle.UnpicklingError) as exc:
                    self._outcome = (False, f"the outlines-core worker failed ({exc})")
                    worker.kill()
                else:
                    self._pool._release(worker)
                self._worker = None
            ok, value = self._outcome
        if not ok:
            raise GrammarCompileError(self._kind, str(value))
        return value

    def cancel(self) -> None:
        """Stops the build (kills its child process) unless it has finished."""
        with self._lock:
            if self._worker is not None:
                self._worker.kill()
                self._worker = None
                self._pool.num_killed += 1


class IndexWorkerPool:
    """Child processes building outlines-core indexes over one vocabulary."""

    def __init__(self, vocabulary_factory) -> None:
        self._vocabulary_factory = vocabulary_factory  # called once, on first use
        self._idle: list[_Worker] = []
        self.num_killed = 0  # builds stopped before they finished
        self._lock = threading.Lock()
        self._closed = False

    def start(self, regex: str, kind: str) -> IndexJob:
        with self._lock:
            if self._closed:
                raise GrammarCompileError(kind, "the grammar backend is shut down")
            worker = self._idle.pop() if self._idle else None
        if worker is None or worker.process.poll() is not None:
            worker = _Worker(self._vocabulary_factory())
        try:
            _write_message(worker.fd_in, regex)
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
