"""The grammar compile cache: compile off the caller's thread, once per distinct spec.

Keys are ``(backend cache tag, tokenizer fingerprint, kind, canonical spec)``. The in-memory
table is an LRU of ``Future``s, so identical concurrent requests share one compilation and a
failure (``GrammarCompileError``, including a timeout) is remembered like a success. Grammars
whose backend can serialize them are also written to ``cache_dir`` (one file per key) and
reloaded from there by later processes.

Thread model: ``get_or_compile`` may be called from any thread; compilations run on a private
``ThreadPoolExecutor``; a compilation that outlives ``compile_timeout_s`` fails its future (the
worker cannot be interrupted and its late result is dropped).
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

from radixlm.grammar.base import CompiledGrammar, GrammarBackend, GrammarCompileError, GrammarSpec

logger = logging.getLogger(__name__)

CacheKey = tuple[str, str, str, str]
_DISK_FORMAT = "radixlm-grammar-v1"


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    compiles: int = 0  # backend.compile calls
    disk_hits: int = 0
    failures: int = 0
    evictions: int = 0


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


class GrammarCompileCache:
    def __init__(
        self,
        backend: GrammarBackend,
        tokenizer_fingerprint: str,
        *,
        max_entries: int = 512,
        cache_dir: str | os.PathLike | None = None,
        compile_timeout_s: float = 60.0,
        num_workers: int = 2,
    ) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self.backend = backend
        self.tokenizer_fingerprint = tokenizer_fingerprint
        self.max_entries = max_entries
        self.cache_dir = Path(cache_dir) if cache_dir is not None else None
        self.compile_timeout_s = compile_timeout_s
        self.stats = CacheStats()
        self._entries: OrderedDict[CacheKey, Future] = OrderedDict()  # LRU order, newest last
        self._lock = threading.Lock()
        self._executor = ThreadPoolExecutor(num_workers, thread_name_prefix="grammar-compile")
        if self.cache_dir is not None:
            self.cache_dir.mkdir(parents=True, exist_ok=True)

    def key(self, spec: GrammarSpec) -> CacheKey:
        return (self.backend.cache_tag(), self.tokenizer_fingerprint, spec.kind, spec.canonical())

    def get_or_compile(self, spec: GrammarSpec) -> Future[CompiledGrammar]:
        """The (possibly still running) compilation of ``spec``; its result or its
        ``GrammarCompileError`` is shared by every caller asking for an equal spec."""
        key = self.key(spec)
        with self._lock:
            future = self._entries.get(key)
            if future is not None:
                self._entries.move_to_end(key)
                self.stats.hits += 1
                return future
            self.stats.misses += 1
            future = Future()
            self._entries[key] = future
            self._evict_locked()
        self._executor.submit(self._compile_into, key, spec, future)
        return future

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def __contains__(self, spec: GrammarSpec) -> bool:
        with self._lock:
            return self.key(spec) in self._entries

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        self.backend.shutdown()

    def check_integrity(self) -> None:
        with self._lock:
            assert len(self._entries) <= self.max_entries, "LRU grew past its bound"
            s = self.stats
            assert s.hits + s.misses >= len(self._entries) and s.compiles <= s.misses

    def _evict_locked(self) -> None:
        """Drops least recently used entries, finished ones first (callers holding a running
        future still get its result; only a later identical request would compile again)."""
        while len(self._entries) > self.max_entries:
            victim = next((k for k, f in self._entries.items() if f.done()), None)
            if victim is None:
                victim = next(iter(self._entries))
            del self._entries[victim]
            self.stats.evictions += 1

    def _compile_into(self, key: CacheKey, spec: GrammarSpec, future: Future) -> None:
        if not future.set_running_or_notify_cancel():
            return
        timer = threading.Timer(self.compile_timeout_s, self._expire, (spec, future))
        timer.daemon = True
        timer.start()
        try:
            compiled = self._load_from_disk(key, spec)
            if compiled is None:
                with self._lock:
                    self.stats.compiles += 1
                compiled = self.backend.compile(spec)
                self._store_on_disk(key, compiled)
            _settle(future, compiled, None)
        except GrammarCompileError as exc:
            self._record_failure(future, exc)
        except Exception as exc:  # a backend bug must not leave the future pending
            logger.exception("grammar compilation crashed for %s", spec.describe())
            self._record_failure(future, GrammarCompileError(spec.kind, f"internal error: {exc}"))
        finally:
            timer.cancel()

    def _expire(self, spec: GrammarSpec, future: Future) -> None:
        reason = f"compilation did not finish within {self.compile_timeout_s:g} s"
        self._record_failure(future, GrammarCompileError(spec.kind, reason))

    def _record_failure(self, future: Future, error: GrammarCompileError) -> None:
        if _settle(future, None, error):
            with self._lock:
                self.stats.failures += 1

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
