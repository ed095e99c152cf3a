"""The grammar compile cache: compile off the caller's thread, once per distinct spec.

Keys are ``(backend cache tag, tokenizer fingerprint, kind, canonical spec)``. The in-memory
table is an LRU of ``Future``s, so identical concurrent requests share one compilation and a
failure (``GrammarCompileError``, including a timeout) is remembered like a success. The table
is bounded by entries (``max_entries``) and by the compiled grammars' estimated bytes
(``max_bytes``, ``CompiledGrammar.size_bytes``). Grammars whose backend can serialize them are
also written to ``cache_dir`` (one file per key) and reloaded from there by later processes.

Lanes: a new spec goes to the fast lane (``num_workers`` threads). Its compilation runs with a
``CompileControl``: while other specs wait for a fast worker, a backend gives up slow work
(``auto``: an outlines-core build past ``outlines_yield_after_s`` is killed, llguidance tried)
and raises ``CompileDeferred``; the spec then queues on the slow lane (``num_slow_workers``),
where it compiles without yielding. So specs that compile in milliseconds never wait behind
builds that take seconds, and expensive specs cost at most ``num_slow_workers`` busy builds.

Deadline and cancellation: ``compile_timeout_s`` counts from ``get_or_compile`` (queueing
included); at the deadline the future fails and a running build is stopped. ``release(spec)``
drops one waiter; a compilation whose every waiter is gone is cancelled and forgotten.

Thread model: ``get_or_compile`` / ``release`` may be called from any thread; compilations run
on private ``ThreadPoolExecutor``s.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import threading
from collections import OrderedDict
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from radixlm.grammar.base import (
    CompileControl,
    CompileDeferred,
    CompiledGrammar,
    GrammarBackend,
    GrammarCompileError,
    GrammarSpec,
)
from radixlm.grammar.deadlines import Deadlines

logger = logging.getLogger(__name__)

CacheKey = tuple[str, str, str, str]
_DISK_FORMAT = "radixlm-grammar-v1"
DEFAULT_MAX_BYTES = 2 << 30  # estimated bytes of compiled grammars kept in memory


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    compiles: int = 0  # backend compile calls (a deferred spec's second attempt included)
    disk_hits: int = 0
    failures: int = 0
    evictions: int = 0
    deferrals: int = 0  # specs moved from the fast lane to the slow one
    cancellations: int = 0  # compilations dropped because every waiter was gone


def _settle(future: Future, result: CompiledGrammar | None, error: BaseException | None) -> bool:
    """Completes ``future`` unless it is already complete (a timeout got there first)."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
        return True
    except InvalidStateError:
        return False


@dataclass
class _Job:
    """One compilation in flight (queued or running)."""

    key: CacheKey
    spec: GrammarSpec
    future: Future
    num_waiters: int = 1
    is_cancelled: bool = False
    lane: str = "fast"


class _LaneControl(CompileControl):
    def __init__(self, cache: GrammarCompileCache, job: _Job) -> None:
        self._cache = cache
        self._job = job

    def is_cancelled(self) -> bool:
        return self._job.is_cancelled or self._job.future.done()

    def should_yield(self) -> bool:
        cache = self._cache
        return self._job.lane == "fast" and cache._num_queued["fast"] + cache._num_fast_running > 1


class GrammarCompileCache:
    def __init__(
        self,
        backend: GrammarBackend,
        tokenizer_fingerprint: str,
        *,
        max_entries: int = 512,
        max_bytes: int = DEFAULT_MAX_BYTES,
        cache_dir: str | os.PathLike | None = None,
        compile_timeout_s: float = 60.0,
        num_workers: int = 8,
        num_slow_workers: int = 1,
    ) -> None:
        if max_entries < 1 or max_bytes < 0:
            raise ValueError(f"max_entries must be >= 1 and max_bytes >= 0, got {max_entries}")
        self.backend = backend
        self.tokenizer_fingerprint = tokenizer_fingerprint
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.cache_dir = Path(cache_dir) if cache_dir is not None else None
        self.compile_timeout_s = compile_timeout_s
        self.stats = CacheStats()
        self._entries: OrderedDict[CacheKey, Future] = OrderedDict()  # LRU order, newest last
        self._sizes: dict[CacheKey, int] = {}  # estimated bytes of finished entries
        self._num_bytes = 0  # sum of _sizes
        self._jobs: dict[CacheKey, _Job] = {}  # compilations in flight
        self._num_queued = {"fast": 0, "slow": 0}  # jobs waiting for a worker of each lane
        self._num_fast_running = 0
        self._lock = threading.Lock()
        self._deadlines = Deadlines()  # the compile timeouts, one thread for all
        self._lanes = {
            "fast": ThreadPoolExecutor(num_workers, thread_name_prefix="grammar-compile"),
            "slow": ThreadPoolExecutor(num_slow_workers, thread_name_prefix="grammar-slow"),
        }
        if self.cache_dir is not None:
            self.cache_dir.mkdir(parents=True, exist_ok=True)

    def key(self, spec: GrammarSpec) -> CacheKey:
        return (self.backend.cache_tag(), self.tokenizer_fingerprint, spec.kind, spec.canonical())

    def get_or_compile(self, spec: GrammarSpec) -> Future[CompiledGrammar]:
        """The (possibly still running) compilation of ``spec``; its result or its
        ``GrammarCompileError`` is shared by every caller asking for an equal spec. Each call
        counts as one waiter of a compilation in flight (see ``release``)."""
        key = self.key(spec)
        with self._lock:
            future = self._entries.get(key)
            if future is not None:
                self._entries.move_to_end(key)
                self.stats.hits += 1
                job = self._jobs.get(key)
                if job is not None:
                    job.num_waiters += 1
                return future
            self.stats.misses += 1
            future = Future()
            self._entries[key] = future
            job = self._jobs[key] = _Job(key, spec, future)
            self._evict_locked()
        handle = self._deadlines.call_after(self.compile_timeout_s, lambda: self._expire(job))
        future.add_done_callback(lambda _: self._deadlines.cancel(handle))
        self._enqueue(job, "fast")
        return future

    def release(self, spec: GrammarSpec) -> None:
        """One waiter of ``spec``'s compilation is gone (its request was aborted). When none
        is left, the compilation is cancelled (queued: skipped; running: its build stopped)
        and forgotten, so a later request compiles the spec again."""
        key = self.key(spec)
        with self._lock:
            job = self._jobs.get(key)
            if job is None:
                return
            job.num_waiters -= 1
            if job.num_waiters > 0:
                return
            self._forget_locked(job)
            job.is_cancelled = True
            self.stats.cancellations += 1
        _settle(job.future, None, GrammarCompileError(spec.kind, "the compilation was cancelled"))

    def backlog(self) -> dict[str, int]:
        """Compilations in flight, by state (for server info)."""
        with self._lock:
            return {
                "num_compiling": len(self._jobs),
                "num_compile_queued": self._num_queued["fast"],
                "num_compile_slow_queued": self._num_queued["slow"],
                "num_cached": len(self._entries),
                "cached_bytes": self._num_bytes,
            }

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def __contains__(self, spec: GrammarSpec) -> bool:
        with self._lock:
            return self.key(spec) in self._entries

    @property
    def num_bytes(self) -> int:
        """Estimated bytes of the finished grammars in the table."""
        with self._lock:
            return self._num_bytes

    def clear(self) -> None:
        """Forgets every finished grammar (requests holding matchers keep theirs); compilations
        in flight stay, so their waiters still get them."""
        with self._lock:
            for key in [k for k, f in self._entries.items() if f.done()]:
                self._drop_locked(key)

    def shutdown(self) -> None:
        with self._lock:
            for job in self._jobs.values():
                job.is_cancelled = True
        self._deadlines.close()
        for lane in self._lanes.values():
            lane.shutdown(wait=False, cancel_futures=True)
        self.backend.shutdown()

    def check_integrity(self) -> None:
        with self._lock:
            assert len(self._entries) <= self.max_entries, "LRU grew past its bound"
            assert self._num_bytes == sum(self._sizes.values()) and self._sizes.keys() <= set(
                self._entries
            )
            assert all(self._entries.get(k) is j.future for k, j in self._jobs.items())
            s = self.stats
            assert s.hits + s.misses >= len(self._entries)

    def _enqueue(self, job: _Job, lane: str) -> None:
        with self._lock:
            job.lane = lane
            self._num_queued[lane] += 1
        try:
            self._lanes[lane].submit(self._compile_into, job)
        except RuntimeError:  # shut down
            with self._lock:
                self._num_queued[lane] -= 1
            _settle(job.future, None, GrammarCompileError(job.spec.kind, "the cache is shut down"))

    def _evict_locked(self) -> None:
        """Drops least recently used entries, finished ones first (callers holding a running
        future still get its result; only a later identical request would compile again)."""
        while len(self._entries) > self.max_entries or (self._num_bytes > self.max_bytes):
            if len(self._entries) > self.max_entries:
                victim = next((k for k, f in self._entries.items() if f.done()), None)
                victim = victim if victim is not None else next(iter(self._entries))
            else:  # over the byte bound: the least recently used grammar holding bytes
                victim = next(k for k in self._entries if self._sizes.get(k, 0) > 0)
            self._drop_locked(victim)
            self.stats.evictions += 1

    def _drop_locked(self, key: CacheKey) -> None:
        del self._entries[key]
        self._num_bytes -= self._sizes.pop(key, 0)

    def _forget_locked(self, job: _Job) -> None:
        """Takes ``job`` out of the in-flight table (and its entry out of the LRU, if it is
        still there): a cancelled compilation is not remembered."""
        if self._jobs.get(job.key) is job:
            del self._jobs[job.key]
        if self._entries.get(job.key) is job.future:
            self._drop_locked(job.key)

    def _compile_into(self, job: _Job) -> None:
        with self._lock:
            self._num_queued[job.lane] -= 1
            if job.is_cancelled or job.future.done():  # aborted or expired while queued
                return
            lane = job.lane
            self._num_fast_running += lane == "fast"
        try:
            self._run(job)
        finally:
            with self._lock:
                self._num_fast_running -= lane == "fast"

    def _run(self, job: _Job) -> None:
        try:
            compiled = self._load_from_disk(job.key, job.spec)
            if compiled is None:
                with self._lock:
                    self.stats.compiles += 1
                compiled = self.backend.compile_controlled(job.spec, _LaneControl(self, job))
                self._store_on_disk(job.key, compiled)
            self._finish(job, compiled)
        except CompileDeferred:
            with self._lock:
                self.stats.deferrals += 1
            self._enqueue(job, "slow")
        except GrammarCompileError as exc:
            self._finish(job, None, exc)
        except Exception as exc:  # a backend bug must not leave the future pending
            logger.exception("grammar compilation crashed for %s", job.spec.describe())
            error = GrammarCompileError(job.spec.kind, f"internal error: {exc}")
            self._finish(job, None, error)

    def _finish(
        self, job: _Job, compiled: CompiledGrammar | None, error: GrammarCompileError | None = None
    ) -> None:
        size = max(0, int(compiled.size_bytes())) if compiled is not None else 0
        is_settled = self._settle_counted(job.future, compiled, error)
        with self._lock:
            if self._jobs.get(job.key) is job:
                del self._jobs[job.key]
            if is_settled and compiled is not None and self._entries.get(job.key) is job.future:
                self._sizes[job.key] = size
                self._num_bytes += size
                self._evict_locked()

    def _settle_counted(
        self, future: Future, compiled: CompiledGrammar | None, error: GrammarCompileError | None
    ) -> bool:
        """``_settle``, with a failure counted before the future completes, so whoever waited
        on it finds it in ``stats`` (taken back if a timeout settled the future first)."""
        if error is None:
            return _settle(future, compiled, None)
        with self._lock:
            self.stats.failures += 1
        if _settle(future, None, error):
            return True
        with self._lock:
            self.stats.failures -= 1
        return False

    def _expire(self, job: _Job) -> None:
        reason = f"compilation did not finish within {self.compile_timeout_s:g} s"
        if self._settle_counted(job.future, None, GrammarCompileError(job.spec.kind, reason)):
            with self._lock:
                job.is_cancelled = True  # a running build stops; the failure stays cached
                if self._jobs.get(job.key) is job:
                    del self._jobs[job.key]

    def _disk_path(self, key: CacheKey) -> Path | None:
        if self.cache_dir is None:
            return None
        digest = hashlib.sha256(json.dumps(list(key)).encode("utf-8")).hexdigest()
        return self.cache_dir / f"{digest}.grammar"

    def _load_from_disk(self, key: CacheKey, spec: GrammarSpec) -> CompiledGrammar | None:
        path = self._disk_path(key)
        if path is None or not path.exists():
            return None
        try:
            raw = path.read_bytes()
            header_end = raw.index(b"\n")
            header = json.loads(raw[:header_end])
            if header.get("format") != _DISK_FORMAT or header.get("key") != list(key):
                return None
            compiled = self.backend.deserialize(spec, header["backend"], raw[header_end + 1 :])
        except Exception as exc:  # a stale or damaged file is only a cache miss
            logger.warning("ignoring grammar cache file %s: %s", path, exc)
            return None
        with self._lock:
            self.stats.disk_hits += 1
        return compiled

    def _store_on_disk(self, key: CacheKey, compiled: CompiledGrammar) -> None:
        path = self._disk_path(key)
        payload = compiled.serialize() if path is not None else None
        if path is None or payload is None:
            return
        header = {"format": _DISK_FORMAT, "key": list(key), "backend": compiled.backend_name}
        try:
            fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
            with os.fdopen(fd, "wb") as out:
                out.write(json.dumps(header).encode("utf-8") + b"\n" + payload)
            os.replace(tmp, path)
        except OSError as exc:
            logger.warning("could not write grammar cache file %s: %s", path, exc)
