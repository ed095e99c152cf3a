"""Grammar backends by name (``--grammar-backend auto|outlines|llguidance``).

``auto`` compiles regexes, choices and JSON schemas with outlines-core, falling back to
llguidance when outlines-core rejects the spec, when the spec's regex is too long for a DFA
(``outlines_max_regex_chars``) or when it does not finish within ``outlines_budget_s`` (it runs
on a worker thread; outlines-core releases the GIL while it builds an index). llguidance
compiles in tens of milliseconds, so the whole attempt stays within about 5 s. EBNF grammars and
``json_object`` go straight to llguidance (the generic-JSON DFA is slow to build). JSON schemas
with numeric bounds or ``allOf`` (which outlines-core accepts but may ignore) try llguidance
first. A JSON schema neither backend accepts gets a last try on llguidance in lenient mode,
which ignores the keywords it does not implement. An over-budget outlines-core run cannot be
stopped: it goes on in Linux's ``SCHED_IDLE`` class, using only CPU time nothing else wants.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

from radixlm.grammar.base import (
    CompiledGrammar,
    GrammarBackend,
    GrammarCompileError,
    GrammarSpec,
    NullGrammarBackend,
)
from radixlm.grammar.cache import GrammarCompileCache
from radixlm.grammar.llguidance_backend import LLGuidanceBackend
from radixlm.grammar.outlines_backend import DEFAULT_WHITESPACE_PATTERN, OutlinesBackend
from radixlm.grammar.vocab import TokenizerVocab

logger = logging.getLogger(__name__)

GRAMMAR_BACKEND_NAMES = ("auto", "outlines", "llguidance", "none")
_LLGUIDANCE_ONLY_KINDS = ("ebnf", "json_object")
# JSON Schema keywords outlines-core accepts but does not (always) enforce, while llguidance
# does. outlines-core drops an ``allOf`` next to ``properties`` in the same schema.
_OUTLINES_IGNORED_KEYWORDS = frozenset(
    {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "allOf"}
)


@dataclass(frozen=True)
class GrammarConfig:
    backend: str = "auto"  # one of GRAMMAR_BACKEND_NAMES
    outlines_budget_s: float = 3.0  # auto: give up on outlines-core after this long
    outlines_max_regex_chars: int = 100_000  # auto: longer regexes go to llguidance
    lenient_json_fallback: bool = True  # auto: last try on llguidance ignoring unknown keywords
    max_abandoned_outlines: int = 2  # auto: skip outlines while this many over-budget runs go on
    whitespace_pattern: str = DEFAULT_WHITESPACE_PATTERN  # JSON whitespace between tokens
    compile_timeout_s: float = 60.0  # compile cache: fail a compilation after this long
    cache_max_entries: int = 512  # compile cache: in-memory LRU bound
    cache_dir: str | None = None  # compile cache: on-disk folder (None: memory only)
    compile_workers: int = 2  # compile cache: worker threads

    def __post_init__(self) -> None:
        if self.backend not in GRAMMAR_BACKEND_NAMES:
            raise ValueError(
                f"grammar backend must be one of {list(GRAMMAR_BACKEND_NAMES)}, got {self.backend!r}"
            )
        if self.outlines_budget_s <= 0 or self.compile_timeout_s <= 0:
            raise ValueError("grammar compile budgets and timeouts must be positive seconds")
        if self.cache_max_entries < 1 or self.compile_workers < 1:
            raise ValueError("cache_max_entries and compile_workers must be >= 1")
        if self.outlines_max_regex_chars < 1:
            raise ValueError("outlines_max_regex_chars must be >= 1")


def _uses_keywords_outlines_ignores(spec: GrammarSpec) -> bool:
    if spec.kind != "json_schema":
        return False
    try:
        schema = json.loads(str(spec.value))
    except ValueError:
        return False
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if _OUTLINES_IGNORED_KEYWORDS.intersection(node):
                return True
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return False


class AutoGrammarBackend(GrammarBackend):
    """outlines-core first for regular specs, llguidance for the rest and as the fallback."""

    name = "auto"

    def __init__(
        self,
        outlines: OutlinesBackend,
        llguidance: LLGuidanceBackend,
        outlines_budget_s: float = 3.0,
        max_abandoned_outlines: int = 2,
        lenient_llguidance: LLGuidanceBackend | None = None,
    ) -> None:
        self.outlines = outlines
        self.llguidance = llguidance
        self.lenient_llguidance = lenient_llguidance  # JSON schemas both others reject
        self.outlines_budget_s = outlines_budget_s
        self.max_abandoned_outlines = max_abandoned_outlines
        self.num_fallbacks = 0
        self._num_abandoned = 0  # over-budget outlines runs still going
        self._lock = threading.Lock()

    def cache_tag(self) -> str:
        lenient = "+lenient" if self.lenient_llguidance is not None else ""
        return f"auto[{self.outlines.cache_tag()}+{self.llguidance.cache_tag()}{lenient}]"

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        candidates = self._order(spec)
        errors: list[tuple[GrammarBackend, GrammarCompileError]] = []
        for backend in candidates:
            if errors:
                with self._lock:
                    self.num_fallbacks += 1
                logger.info(
                    "%s failed on %s (%s); trying %s",
                    _label(errors[-1][0]),
                    spec.describe(),
                    errors[-1][1].reason,
                    _label(backend),
                )
            try:
                return self._compile_with(backend, spec)
            except GrammarCompileError as error:
                errors.append((backend, error))
        last = errors[-1][1]
        earlier = "; ".join(f"{_label(b)}: {e.reason}" for b, e in errors[:-1])
        reason = f"{last.reason} ({earlier})" if earlier else last.reason
        raise GrammarCompileError(spec.kind, reason) from last

    def _order(self, spec: GrammarSpec) -> list[GrammarBackend]:
        if spec.kind in _LLGUIDANCE_ONLY_KINDS:
            return [self.llguidance]
        if self._too_many_abandoned() or _uses_keywords_outlines_ignores(spec):
            order: list[GrammarBackend] = [self.llguidance, self.outlines]
        else:
            order = [self.outlines, self.llguidance]
        if spec.kind == "json_schema" and self.lenient_llguidance is not None:
            order.append(self.lenient_llguidance)
        return order

    def _compile_with(self, backend: GrammarBackend, spec: GrammarSpec) -> CompiledGrammar:
        if backend is self.outlines:
            return self._compile_outlines_within_budget(spec)
        return backend.compile(spec)

    def deserialize(self, spec: GrammarSpec, backend_name: str, data: bytes) -> CompiledGrammar:
        # A lenient llguidance grammar's text carries its options: any llguidance backend loads it.
        backend = self.outlines if backend_name == self.outlines.name else self.llguidance
        return backend.deserialize(spec, backend_name, data)

    def _too_many_abandoned(self) -> bool:
        with self._lock:
            return self._num_abandoned >= self.max_abandoned_outlines

    def _compile_outlines_within_budget(self, spec: GrammarSpec) -> CompiledGrammar:
        result: Future[CompiledGrammar] = Future()
        state = {"abandoned": False}

        def run() -> None:
            try:
                result.set_result(self.outlines.compile(spec))
            except BaseException as exc:  # handed to the waiting thread
                result.set_exception(exc)
            with self._lock:
                if state["abandoned"]:
                    self._num_abandoned -= 1

        # A daemon thread: an over-budget compile cannot be stopped, only left behind.
        thread = threading.Thread(target=run, name="outlines-compile", daemon=True)
        thread.start()
        try:
            return result.result(timeout=self.outlines_budget_s)
        except FutureTimeout:
            with self._lock:
                if not result.done():
                    state["abandoned"] = True
                    self._num_abandoned += 1
                    run_only_when_idle(thread)
            if result.done():
                return result.result()
            raise GrammarCompileError(
                spec.kind, f"outlines-core did not finish within {self.outlines_budget_s:g} s"
            ) from None


def run_only_when_idle(thread: threading.Thread) -> bool:
    """Moves a running thread to Linux's ``SCHED_IDLE`` class, where it gets only CPU time no
    other thread wants; False where that is not possible (another OS, a finished thread).

    An abandoned outlines-core compile keeps a core busy for up to minutes (one jsonschemabench
    schema ran for 4 minutes and grew to 7.7 GB). On 2 cores that thread competed with the
    forward pass's OpenMP threads and with the scheduler thread: parallel ops waited for a
    preempted worker, and mask rows took milliseconds instead of microseconds.
    """
    if not hasattr(os, "SCHED_IDLE") or thread.native_id is None:
        return False
    try:
        os.sched_setscheduler(thread.native_id, os.SCHED_IDLE, os.sched_param(0))
    except OSError:  # the thread is gone, or the OS refuses
        return False
    return True


def _label(backend: GrammarBackend) -> str:
    return f"{backend.name} (lenient)" if getattr(backend, "lenient", False) else backend.name


def create_grammar_backend(config: GrammarConfig, vocab: TokenizerVocab) -> GrammarBackend:
    """The backend named by ``config.backend`` over ``vocab``."""
    if config.backend == "none":
        return NullGrammarBackend()
    if config.backend == "outlines":
        return OutlinesBackend(vocab, config.whitespace_pattern)
    llguidance = LLGuidanceBackend(vocab, config.whitespace_pattern)
    if config.backend == "llguidance":
        return llguidance
    return AutoGrammarBackend(
        OutlinesBackend(vocab, config.whitespace_pattern, config.outlines_max_regex_chars),
        llguidance,
        config.outlines_budget_s,
        config.max_abandoned_outlines,
        llguidance.lenient_twin() if config.lenient_json_fallback else None,
    )


def create_compile_cache(config: GrammarConfig, vocab: TokenizerVocab) -> GrammarCompileCache:
    """The configured backend behind a compile cache: what a scheduler holds."""
    return GrammarCompileCache(
        create_grammar_backend(config, vocab),
        vocab.fingerprint,
        max_entries=config.cache_max_entries,
        cache_dir=config.cache_dir,
        compile_timeout_s=config.compile_timeout_s,
        num_workers=config.compile_workers,
    )
