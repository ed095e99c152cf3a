"""The compile cache under hostile load: lanes, deadlines, cancellation, byte bound; and
invalid JSON schemas that ``auto`` must not hand to a backend that ignores the fault."""

from __future__ import annotations

import time

import pytest

from radixlm.grammar.base import GrammarCompileError, GrammarSpec
from radixlm.grammar.cache import GrammarCompileCache
from radixlm.grammar.outlines_backend import OutlinesBackend
from radixlm.grammar.registry import GrammarConfig, create_compile_cache, create_grammar_backend
from radixlm.grammar.testing import train_byte_level_tokenizer
from radixlm.grammar.vocab import build_vocab


@pytest.fixture(scope="module")
def vocab():
    return build_vocab(train_byte_level_tokenizer())


def bomb(i: int) -> GrammarSpec:
    """A regex whose DFA has about a million states (distinct per ``i``: no cache hits)."""
    return GrammarSpec.regex(f"(a{{{1001 + i}}}){{{1000 + i}}}")


def wait_until(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def test_a_small_grammar_is_not_stuck_behind_bombs(vocab):
    cache = create_compile_cache(GrammarConfig(), vocab)
    try:
        cache.get_or_compile(GrammarSpec.regex("[0-9]{2}y")).result(timeout=30)  # warm-up
        bombs = [cache.get_or_compile(bomb(i)) for i in range(4)]
        time.sleep(0.3)  # the bombs hold their workers
        began = time.monotonic()
        grammar = cache.get_or_compile(GrammarSpec.regex("[0-9]{3}x123")).result(timeout=30)
        assert time.monotonic() - began < 5.0
        assert cache.backlog()["num_compiling"] == 4  # the backlog is visible
        assert grammar.new_matcher().accept_tokens(vocab.encode("123x123"))
        assert not all(f.done() for f in bombs)
    finally:
        cache.shutdown()


def test_a_compilation_nobody_waits_for_is_cancelled(vocab):
    cache = create_compile_cache(GrammarConfig(), vocab)
    try:
        spec = bomb(10)
        future = cache.get_or_compile(spec)
        cache.get_or_compile(spec)  # a second waiter
        time.sleep(0.5)
        cache.release(spec)
        assert not future.done()  # one request still waits
        cache.release(spec)
        with pytest.raises(GrammarCompileError, match="cancelled"):
            future.result(timeout=1)
        assert spec not in cache and cache.backlog()["num_compiling"] == 0
        pool = cache.backend.index_workers
        assert wait_until(lambda: pool.num_killed >= 1, 5.0)  # the outlines-core child is gone
        assert cache.stats.cancellations == 1
        cache.check_integrity()
    finally:
        cache.shutdown()


@pytest.mark.slow
def test_the_compile_timeout_counts_time_spent_queueing(vocab):
    config = GrammarConfig(compile_timeout_s=2.0, compile_workers=1, compile_slow_workers=1)
    cache = create_compile_cache(config, vocab)
    try:
        began = time.monotonic()
        futures = [cache.get_or_compile(bomb(20 + i)) for i in range(3)]
        for future in futures:
            with pytest.raises(GrammarCompileError, match="did not finish within 2 s"):
                future.result(timeout=30)
        assert time.monotonic() - began < 8.0  # not one timeout after another
        assert cache.backlog()["num_compiling"] == 0
    finally:
        cache.shutdown()


def _distinct_regexes(n: int) -> list[GrammarSpec]:
    return [GrammarSpec.regex(f"x{i}[a-z]{{1,40}}@[a-z]{{1,30}}") for i in range(n)]


def test_the_cache_is_bounded_by_bytes(vocab):
    backend = OutlinesBackend(vocab)
    one = backend.compile(_distinct_regexes(1)[0])
    size = one.size_bytes()
    assert size >= 2 * len(one.serialize()) > 0
    cache = GrammarCompileCache(backend, vocab.fingerprint, max_bytes=int(2.5 * size))
    try:
        for spec in _distinct_regexes(6):  # one after another: a deterministic LRU order
            cache.get_or_compile(spec).result(timeout=60)
        assert cache.num_bytes <= int(2.5 * size)
        assert len(cache) <= 3 and cache.stats.evictions >= 3
        assert _distinct_regexes(6)[-1] in cache  # least recently used ones went first
        cache.clear()
        assert cache.num_bytes == 0 and len(cache) == 0
        cache.check_integrity()
    finally:
        cache.shutdown()


@pytest.fixture(scope="module")
def auto(vocab):
    backend = create_grammar_backend(GrammarConfig(), vocab)
    yield backend
    backend.shutdown()


@pytest.mark.parametrize(
    "schema, words",
    [
        ({"type": "integer", "minimum": 10, "maximum": 1}, "minimum"),
        ({"type": "number", "multipleOf": 0}, "multiple"),
        ({"type": "string", "minLength": 5, "maxLength": 2}, "minLength"),
        (
            {
                "type": "object",
                "properties": {"a": {"type": "integer", "minimum": 3, "maximum": 2}},
                "required": ["a"],
            },
            "unsatisfiable",
        ),
    ],
)
def test_auto_rejects_invalid_or_unsatisfiable_schemas(auto, schema, words):
    with pytest.raises(GrammarCompileError) as info:
        auto.compile(GrammarSpec.json_schema(schema))
    message = str(info.value)
    assert "json_schema" in message and words.lower() in message.lower()
    assert "outlines" not in message  # no other backend was tried


def test_auto_still_falls_back_on_unsupported_keywords(auto):
    # (an unknown format such as "color" is now removed before compiling: any string)
    schema = {"type": "array", "items": {"type": "string"}, "uniqueItems": True}
    grammar = auto.compile(GrammarSpec.json_schema(schema))
    assert grammar.unenforced == ("uniqueItems",)  # lenient llguidance ignored it
    assert grammar.new_matcher().accept_tokens(auto.llguidance.vocab.encode('["red"]'))


def _accepts(auto, grammar, text: str) -> bool:
    """Whether the grammar takes ``text`` and then ends (accepts EOS)."""
    vocab = auto.llguidance.vocab
    matcher = grammar.new_matcher()
    return matcher.accept_tokens(vocab.encode(text)) and matcher.accept_token(
        vocab.eos_token_ids[0]
    )


@pytest.mark.parametrize(
    "schema, good, bad",
    [
        # names needing escapes: outlines-core wrote them raw (not JSON)
        (
            {
                "type": "object",
                "properties": {'say "hi"': {"type": "integer"}},
                "required": ['say "hi"'],
            },
            '{"say \\"hi\\"": 1}',
            '{"say "hi"": 1}',
        ),
        # a pattern's alternation lost its grouping in outlines-core's string regex
        ({"type": "string", "pattern": "^(cat|dog)$"}, '"dog"', '"cat'),
        ({"type": "string", "pattern": "cat|dog"}, '"a dog"', '"cat'),
        # "." let a raw quote into the string
        (
            {
                "type": "object",
                "properties": {"q": {"type": "string", "pattern": "^.+$"}},
                "required": ["q"],
            },
            '{"q": "yes"}',
            '{"q": "a" "b"}',
        ),
        # a required name outside properties was ignored
        (
            {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a", "b"]},
            '{"a": "x", "b": 2}',
            '{"a": "x"}',
        ),
        # prefixItems dropped items and minItems
        (
            {
                "type": "array",
                "prefixItems": [{"type": "string"}],
                "items": {"type": "integer"},
                "minItems": 3,
            },
            '["a", 1, 2]',
            '["a"]',
        ),
    ],
)
def test_auto_sends_what_outlines_mistranslates_to_llguidance(auto, schema, good, bad):
    grammar = auto.compile(GrammarSpec.json_schema(schema))
    assert _accepts(auto, grammar, good), good
    assert not _accepts(auto, grammar, bad), bad
