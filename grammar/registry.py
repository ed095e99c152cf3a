"""Grammar backends by name (``--grammar-backend auto|outlines|llguidance|none``): the
configuration and the factory. ``auto`` (outlines-core with llguidance as the fallback) lives in
auto_backend.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from radixlm.grammar.auto_backend import AutoGrammarBackend
from radixlm.grammar.base import GrammarBackend, NullGrammarBackend
from radixlm.grammar.cache import DEFAULT_MAX_BYTES, GrammarCompileCache
from radixlm.grammar.limits import DEFAULT_MAX_JSON_DEPTH, DEFAULT_MAX_SPEC_BYTES, GrammarLimits
from radixlm.grammar.llguidance_backend import LLGuidanceBackend
from radixlm.grammar.outlines_backend import DEFAULT_WHITESPACE_PATTERN, OutlinesBackend
from radixlm.grammar.outlines_worker import DEFAULT_MAX_MEMORY_BYTES
from radixlm.grammar.vocab import TokenizerVocab

__all__ = [
    "GRAMMAR_BACKEND_NAMES",
    "AutoGrammarBackend",
    "GrammarConfig",
    "create_compile_cache",
    "create_grammar_backend",
]

GRAMMAR_BACKEND_NAMES = ("auto", "outlines", "llguidance", "none")


@dataclass(frozen=True)
class GrammarConfig:
    backend: str = "auto"  # one of GRAMMAR_BACKEND_NAMES
    outlines_budget_s: float = 3.0  # auto: give up on outlines-core after this long
    outlines_last_resort_s: float = 7.0  # auto: wait this much more when nothing else compiles
    outlines_yield_after_s: float = 0.5  # auto: under contention, kill a build after this long
    outlines_max_regex_chars: int = 100_000  # auto: longer regexes go to llguidance
    lenient_json_fallback: bool = True  # auto: last try on llguidance ignoring unknown keywords
    whitespace_pattern: str = DEFAULT_WHITESPACE_PATTERN  # JSON whitespace between tokens
    compile_timeout_s: float = 60.0  # compile cache: fail a compilation after this long
    cache_max_entries: int = 512  # compile cache: in-memory LRU bound
    cache_max_bytes: int = DEFAULT_MAX_BYTES  # compile cache: estimated bytes of grammars kept
    cache_dir: str | None = None  # compile cache: on-disk folder (None: memory only)
    compile_workers: int = 8  # compile cache: fast-lane worker threads
    compile_slow_workers: int = 1  # compile cache: threads for specs that gave way (slow lane)
    max_spec_bytes: int = DEFAULT_MAX_SPEC_BYTES  # longest spec any backend compiles (UTF-8)
    max_json_depth: int = DEFAULT_MAX_JSON_DEPTH  # deepest schema nesting (objects, arrays)
    outlines_max_memory_bytes: int = DEFAULT_MAX_MEMORY_BYTES  # RLIMIT_AS of index builds

    @property
    def limits(self) -> GrammarLimits:
        return GrammarLimits(self.max_spec_bytes, self.max_json_depth)

    def __post_init__(self) -> None:
        if self.backend not in GRAMMAR_BACKEND_NAMES:
            raise ValueError(
                f"grammar backend must be one of {list(GRAMMAR_BACKEND_NAMES)}, got {self.backend!r}"
            )
        if (
            self.outlines_budget_s <= 0
            or self.compile_timeout_s <= 0
            or self.outlines_last_resort_s < 0
        ):
            raise ValueError("grammar compile budgets and timeouts must be positive seconds")
        if self.cache_max_entries < 1 or min(self.compile_workers, self.compile_slow_workers) < 1:
            raise ValueError("cache_max_entries and compile_(slow_)workers must be >= 1")
        if self.cache_max_bytes < 0 or self.outlines_yield_after_s < 0:
            raise ValueError("cache_max_bytes and outlines_yield_after_s must be >= 0")
        if self.outlines_max_regex_chars < 1:
            raise ValueError("outlines_max_regex_chars must be >= 1")
        if self.outlines_max_memory_bytes < 0:
            raise ValueError("outlines_max_memory_bytes must be >= 0 (0: no limit)")
        self.limits  # noqa: B018  (validates the limits)


def create_grammar_backend(config: GrammarConfig, vocab: TokenizerVocab) -> GrammarBackend:
    """The backend named by ``config.backend`` over ``vocab``."""
    if config.backend == "none":
        return NullGrammarBackend()
    if config.backend == "outlines":
        return OutlinesBackend(vocab, config.whitespace_pattern, limits=config.limits)
    llguidance = LLGuidanceBackend(vocab, config.whitespace_pattern, limits=config.limits)
    if config.backend == "llguidance":
        return llguidance
    return AutoGrammarBackend(
        OutlinesBackend(
            vocab, config.whitespace_pattern, config.outlines_max_regex_chars, limits=config.limits
        ),
        llguidance,
        config.outlines_budget_s,
        llguidance.lenient_twin() if config.lenient_json_fallback else None,
        config.outlines_last_resort_s,
        config.outlines_max_memory_bytes,
        config.outlines_yield_after_s,
    )


def create_compile_cache(config: GrammarConfig, vocab: TokenizerVocab) -> GrammarCompileCache:
    """The configured backend behind a compile cache: what a scheduler holds."""
    return GrammarCompileCache(
        create_grammar_backend(config, vocab),
        vocab.fingerprint,
        max_entries=config.cache_max_entries,
        max_bytes=config.cache_max_bytes,
        cache_dir=config.cache_dir,
        compile_timeout_s=config.compile_timeout_s,
        num_workers=config.compile_workers,
        num_slow_workers=config.compile_slow_workers,
    )
