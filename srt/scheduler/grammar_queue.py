"""The grammar compile queue: constrained requests wait here while their grammar compiles.

A request with ``json_schema``, ``regex``, ``ebnf``, ``choices`` or ``structural_tag`` enters
this queue (not ``Scheduler.waiting``) while its grammar compiles on the compile cache's worker
threads; ``poll`` hands it to the waiting queue with a matcher attached once the compilation is
done, or finishes it with a 400 abort ("Failed to compile <kind> grammar: <reason>"). Other
requests keep flowing meanwhile. The grammar vocabulary and the compile cache are built on first use, off the
scheduler loop, so servers that never see a grammar pay nothing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import Any

from radixlm.grammar import (
    GrammarCompileCache,
    GrammarCompileError,
    GrammarConfig,
    GrammarSpec,
    TokenizerVocab,
    build_vocab,
    create_compile_cache,
)
from radixlm.srt.config import ServerConfig
from radixlm.srt.sampling.params import SamplingParams
from radixlm.srt.scheduler.req import Req

logger = logging.getLogger(__name__)


def grammar_spec(params: SamplingParams, kind: str | None = None) -> GrammarSpec | None:
    """The request's output constraint, or None; ValueError for an unusable one. ``kind`` is
    the message's ``grammar_kind``, decided by the front door (``json_object`` has no text);
    without it, the kind of the grammar field that is set."""
    if kind == "json_object":
        return GrammarSpec.json_object()  # same language as {"type": "object"}; compiles fast
    if params.json_schema is not None:
        return GrammarSpec.json_schema(params.json_schema)
    if params.regex is not None:
        return GrammarSpec.regex(params.regex)
    if params.ebnf is not None:
        return GrammarSpec.ebnf(params.ebnf)
    if params.choices is not None:
        return GrammarSpec.choices(params.choices)
    if params.structural_tag is not None:
        return GrammarSpec.structural_tag(params.structural_tag)
    return None


def grammar_config(cfg: ServerConfig) -> GrammarConfig:
    extra: dict[str, Any] = {}
    if cfg.grammar_whitespace_pattern is not None:
        extra["whitespace_pattern"] = cfg.grammar_whitespace_pattern
    return GrammarConfig(
        backend=cfg.grammar_backend,
        cache_dir=cfg.grammar_cache_dir,
        compile_timeout_s=cfg.grammar_compile_timeout_s,
        **extra,
    )


@dataclass
class PendingGrammar:
    req: Req
    spec: GrammarSpec
    future: Future | None = None  # the compile cache's future, once the cache exists


@dataclass
class GrammarStats:
    """Counters of the queue and of the per-step work (``GrammarManager``), reported together."""

    num_compiled: int = 0  # requests that got a matcher
    num_failed: int = 0  # requests finished by a compile error or a failing matcher
    num_mask_rows: int = 0  # mask rows filled
    num_prefetched_rows: int = 0  # ... of which a worker thread filled during the forward
    mask_fill_s: float = 0.0  # scheduler-thread time spent on mask rows
    num_jump_forwards: int = 0  # edits applied
    num_forced_tokens: int = 0  # output tokens appended net of rolled-back ones

    def as_dict(self) -> dict[str, Any]:
        per_row_us = 1e6 * self.mask_fill_s / self.num_mask_rows if self.num_mask_rows else 0.0
        return {**self.__dict__, "mask_fill_us_per_row": per_row_us}


class GrammarQueue:
    """Constrained requests whose grammar is compiling: submit, poll, wait, remove, shutdown."""

    def __init__(
        self,
        config: GrammarConfig,
        tokenizer: Any,
        eos_token_ids: set[int],
        vocab_size: int,
        stats: GrammarStats,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.eos_token_ids = sorted(eos_token_ids)
        self.vocab_size = vocab_size
        self.stats = stats
        self.pending: list[PendingGrammar] = []
        self.vocab: TokenizerVocab | None = None  # built with the compile cache
        self._setup: Future[GrammarCompileCache] | None = None  # vocab + cache, built once
        self._setup_pool: ThreadPoolExecutor | None = None

    def submit(self, req: Req, spec: GrammarSpec) -> None:
        """Starts compiling ``spec`` for ``req``; the request waits in the queue."""
        if self._setup is None:
            self._setup_pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-setup")
            self._setup = self._setup_pool.submit(self._build_cache)
        self.pending.append(PendingGrammar(req, spec))
        self._start_compiles()

    def has_pending(self) -> bool:
        return bool(self.pending)

    def poll(self) -> tuple[list[Req], list[Req]]:
        """Requests whose grammar is ready (matcher attached) and requests whose grammar
        failed (finished with a 400 abort), both in arrival order."""
        if not self.pending:
            return [], []
        self._start_compiles()
        ready: list[Req] = []
        failed: list[Req] = []
        still: list[PendingGrammar] = []
        for item in self.pending:
            future = item.future if item.future is not None else self._failed_setup()
            if future is None or not future.done():
                still.append(item)
            elif self._attach(item, future):
                ready.append(item.req)
            else:
                failed.append(item.req)
        self.pending = still
        return ready, failed

    def wait(self, timeout_s: float) -> None:
        """Blocks until some pending compilation finishes (or ``timeout_s``): the loop calls
        this instead of spinning when nothing but compilations is left to do."""
        futures = [p.future for p in self.pending if p.future is not None]
        if self._setup is not None and not self._setup.done():
            futures.append(self._setup)
        if futures:
            wait_futures(futures, timeout=timeout_s, return_when="FIRST_COMPLETED")

    def remove(self, hit: Callable[[Req], bool]) -> list[Req]:
        """Takes the queued requests ``hit`` selects out of the queue (aborts). A compilation
        no other request waits for is cancelled (its outlines-core build is killed)."""
        gone = [p for p in self.pending if hit(p.req)]
        self.pending = [p for p in self.pending if not hit(p.req)]
        cache = self.compile_cache
        for item in gone:
            if cache is not None and item.future is not None:
                cache.release(item.spec)
        return [p.req for p in gone]

    def backlog(self) -> dict[str, int]:
        """The compile cache's compilations in flight (aborted requests' included until they
        are cancelled), for server info."""
        cache = self.compile_cache
        return cache.backlog() if cache is not None else {}

    @property
    def compile_cache(self) -> GrammarCompileCache | None:
        """The compile cache, once the first constrained request has built it."""
        if self._setup is None or not self._setup.done() or self._setup.exception() is not None:
            return None
        return self._setup.result()

    def check_integrity(self) -> None:
        for item in self.pending:
            assert item.req.grammar is None and not item.req.output_ids, item.req.rid

    def shutdown(self) -> None:
        """Stops the set-up thread and the compile cache (its workers, the backends' child
        processes). A later constrained request builds the vocabulary and the cache again."""
        cache = self.compile_cache
        if cache is not None:
            cache.shutdown()
        if self._setup_pool is not None:
            self._setup_pool.shutdown(wait=False, cancel_futures=True)
        self._setup = self._setup_pool = None

    def _build_cache(self) -> GrammarCompileCache:
        start = time.perf_counter()
        self.vocab = build_vocab(self.tokenizer, self.eos_token_ids, self.vocab_size)
        cache = create_compile_cache(self.config, self.vocab)
        logger.info(
            "grammar backend %s ready in %.2f s", self.config.backend, time.perf_counter() - start
        )
        return cache

    def _failed_setup(self) -> Future | None:
        """The setup future when building the vocabulary or backend failed (its error then
        fails every queued request), else None."""
        if self._setup is not None and self._setup.done() and self._setup.exception() is not None:
            return self._setup
        return None

    def _start_compiles(self) -> None:
        cache = self.compile_cache
        if cache is None:
            return
        for item in self.pending:
            if item.future is None:
                item.future = cache.get_or_compile(item.spec)

    def _attach(self, item: PendingGrammar, future: Future) -> bool:
        try:
            item.req.grammar = future.result().new_matcher()
        except GrammarCompileError as e:
            return self._fail(item, str(e))
        except Exception as e:  # a failed set-up (vocabulary, backend) fails the request too
            logger.exception("grammar set-up failed for %s", item.req.rid)
            return self._fail(item, str(GrammarCompileError(item.spec.kind, str(e))))
        self.stats.num_compiled += 1
        return True

    def _fail(self, item: PendingGrammar, message: str) -> bool:
        """A 400 whose ``param`` is the native field of the grammar (json_schema, regex, ...)."""
        reason = {"type": "abort", "message": message, "status_code": 400, "param": item.spec.kind}
        item.req.finish(reason)
        self.stats.num_failed += 1
        return False
