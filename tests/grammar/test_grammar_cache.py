"""The compile cache: one compilation per distinct spec, cached failures, LRU bound, disk."""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from radixlm.grammar.base import GrammarCompileError, GrammarSpec
from radixlm.grammar.cache import GrammarCompileCache
from radixlm.grammar.llguidance_backend import LLGuidanceBackend
from radixlm.grammar.outlines_backend import OutlinesBackend
from radixlm.grammar.testing import random_walk, train_byte_level_tokenizer
from radixlm.grammar.vocab import build_vocab


@pytest.fixture(scope="module")
def vocab():
    return build_vocab(train_byte_level_tokenizer())


class CountingBackend(OutlinesBackend):
    """An outlines backend that counts compile calls and can be slowed down."""

    def __init__(self, vocab, delay_s: float = 0.0) -> None:
        super().__init__(vocab)
        self.delay_s = delay_s
        self.calls: list[GrammarSpec] = []
        self._calls_lock = threading.Lock()

    def compile(self, spec):
        with self._calls_lock:
            self.calls.append(spec)
        time.sleep(self.delay_s)
        return super().compile(spec)


def _cache(backend, vocab, **options):
    return GrammarCompileCache(backend, vocab.fingerprint, **options)


def test_identical_concurrent_specs_compile_once(vocab):
    backend = CountingBackend(vocab, delay_s=0.3)
    cache = _cache(backend, vocab)
    start = threading.Barrier(8)

    def request(_):
        start.wait()
        return cache.get_or_compile(GrammarSpec.regex(r"[a-f]{2}\d"))

    with ThreadPoolExecutor(8) as pool:
        futures = list(pool.map(request, range(8)))
    assert len({id(f) for f in futures}) == 1  # every caller shares one future
    grammar = futures[0].result(timeout=10)
    assert len(backend.calls) == 1
    assert cache.stats.misses == 1 and cache.stats.hits == 7
    # Equal specs written differently share the entry too.
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    first = cache.get_or_compile(GrammarSpec.json_schema(schema))
    again = cache.get_or_compile(
        GrammarSpec.json_schema('{"type":"object","properties":{"a":{"type":"integer"}}}')
    )
    assert first is again and first.result(timeout=10) is again.result()
    assert len(backend.calls) == 2
    assert grammar.new_matcher().accept_tokens(vocab.encode("ab1"))
    cache.check_integrity()
    cache.shutdown()


@pytest.mark.slow
def test_compilation_runs_off_the_caller_thread(vocab):
    backend = CountingBackend(vocab, delay_s=2.0)
    cache = _cache(backend, vocab)
    began = time.perf_counter()
    future = cache.get_or_compile(GrammarSpec.regex("abc"))
    assert time.perf_counter() - began < 1.0  # the caller does not wait for the compiler
    assert not future.done()
    assert future.result(timeout=10).new_matcher() is not None
    cache.shutdown()


def test_failures_are_cached(vocab):
    backend = CountingBackend(vocab)
    cache = _cache(backend, vocab)
    spec = GrammarSpec.regex("a(")
    future = cache.get_or_compile(spec)
    error = future.exception(timeout=10)
    assert isinstance(error, GrammarCompileError)
    assert str(error).startswith("Failed to compile regex grammar:")
    assert cache.get_or_compile(spec) is future
    with pytest.raises(GrammarCompileError):
        cache.get_or_compile(spec).result()
    assert len(backend.calls) == 1 and cache.stats.failures == 1
    cache.shutdown()


def test_lru_bound_evicts_least_recently_used(vocab):
    backend = CountingBackend(vocab)
    cache = _cache(backend, vocab, max_entries=3)
    specs = [GrammarSpec.regex(f"x{i}") for i in range(5)]
    for spec in specs[:3]:
        cache.get_or_compile(spec).result(timeout=10)
    cache.get_or_compile(specs[0]).result()  # refresh x0: x1 is now the oldest
    for spec in specs[3:]:
        cache.get_or_compile(spec).result(timeout=10)
    assert len(cache) == 3
    assert specs[0] in cache and specs[4] in cache and specs[3] in cache
    assert specs[1] not in cache and specs[2] not in cache
    cache.get_or_compile(specs[1]).result(timeout=10)
    assert len(backend.calls) == 6  # the evicted spec compiled again
    assert cache.stats.evictions == 3
    cache.check_integrity()
    cache.shutdown()


def test_timeout_fails_the_future_and_is_cached(vocab):
    backend = CountingBackend(vocab, delay_s=1.0)
    cache = _cache(backend, vocab, compile_timeout_s=0.1)
    future = cache.get_or_compile(GrammarSpec.regex("slow"))
    with pytest.raises(GrammarCompileError, match="did not finish within 0.1 s"):
        future.result(timeout=10)
    time.sleep(1.2)  # the late result must not replace the failure
    assert isinstance(future.exception(), GrammarCompileError)
    cache.shutdown()


@pytest.mark.parametrize("backend_class", [OutlinesBackend, LLGuidanceBackend])
def test_disk_cache_round_trip(vocab, tmp_path, backend_class):
    spec = GrammarSpec.json_schema(
        {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    )
    writer = _cache(backend_class(vocab), vocab, cache_dir=tmp_path)
    writer.get_or_compile(spec).result(timeout=10)
    assert writer.stats.compiles == 1 and len(list(tmp_path.glob("*.grammar"))) == 1
    reader = _cache(backend_class(vocab), vocab, cache_dir=tmp_path)
    grammar = reader.get_or_compile(spec).result(timeout=10)
    assert reader.stats.disk_hits == 1 and reader.stats.compiles == 0
    assert grammar.backend_name == backend_class.name
    ids, finished = random_walk(grammar.new_matcher(), vocab, random.Random(0))
    assert finished and b'"n"' in vocab.decode_bytes(ids)
    other_vocab = build_vocab(train_byte_level_tokenizer(vocab_size=400))
    stranger = _cache(backend_class(other_vocab), other_vocab, cache_dir=tmp_path)
    stranger.get_or_compile(spec).result(timeout=10)
    assert stranger.stats.disk_hits == 0  # another tokenizer never reads this entry
    for cache in (writer, reader, stranger):
        cache.shutdown()


def test_damaged_disk_entry_is_a_miss(vocab, tmp_path):
    spec = GrammarSpec.regex("[0-9]+")
    _cache(OutlinesBackend(vocab), vocab, cache_dir=tmp_path).get_or_compile(spec).result(10)
    (path,) = tmp_path.glob("*.grammar")
    path.write_bytes(path.read_bytes()[:40])
    cache = _cache(OutlinesBackend(vocab), vocab, cache_dir=tmp_path)
    grammar = cache.get_or_compile(spec).result(timeout=10)
    assert cache.stats.disk_hits == 0 and cache.stats.compiles == 1
    assert grammar.new_matcher().accept_tokens(vocab.encode("42"))


def test_backend_options_are_part_of_the_key(vocab):
    spec = GrammarSpec.json_schema({"type": "integer"})
    spaced = _cache(OutlinesBackend(vocab, whitespace_pattern=r"[ ]?"), vocab)
    compact = _cache(OutlinesBackend(vocab, whitespace_pattern=""), vocab)
    assert spaced.key(spec) != compact.key(spec)
    assert spaced.key(spec)[1] == vocab.fingerprint
