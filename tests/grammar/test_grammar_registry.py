"""Backend selection: auto routes each spec and falls back to llguidance."""

from __future__ import annotations

import json
import random
import time

import jsonschema
import pytest

from radixlm.grammar.auto_backend import AutoGrammarBackend
from radixlm.grammar.base import GrammarCompileError, GrammarSpec, NullGrammarBackend
from radixlm.grammar.llguidance_backend import LLGuidanceBackend
from radixlm.grammar.outlines_backend import OutlinesBackend
from radixlm.grammar.registry import GrammarConfig, create_compile_cache, create_grammar_backend
from radixlm.grammar.testing import random_walk, train_byte_level_tokenizer
from radixlm.grammar.vocab import build_vocab

HOSTNAME = {"type": "string", "format": "hostname"}  # outlines-core: "not supported"
ALL_OF_NEXT_TO_PROPERTIES = {  # outlines-core compiles it but drops the allOf
    "type": "object",
    "properties": {"a": {"type": "integer"}},
    "allOf": [{"properties": {"b": {"type": "integer"}}, "required": ["b"]}],
}
# outlines-core rejects the hostname format, llguidance rejects uniqueItems: only the lenient
# last resort (which ignores uniqueItems) compiles it.
HOST_AND_IDS = {
    "type": "object",
    "properties": {
        "host": HOSTNAME,
        "ids": {"type": "array", "items": {"type": "integer"}, "maxItems": 3, "uniqueItems": True},
    },
    "required": ["host", "ids"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def vocab():
    return build_vocab(train_byte_level_tokenizer())


@pytest.fixture(scope="module")
def auto(vocab):
    return create_grammar_backend(GrammarConfig(backend="auto"), vocab)


def test_config_names_the_backend(vocab):
    assert isinstance(create_grammar_backend(GrammarConfig("outlines"), vocab), OutlinesBackend)
    assert isinstance(create_grammar_backend(GrammarConfig("llguidance"), vocab), LLGuidanceBackend)
    assert isinstance(create_grammar_backend(GrammarConfig("none"), vocab), NullGrammarBackend)
    with pytest.raises(ValueError, match="grammar backend must be one of"):
        GrammarConfig(backend="xgrammar")
    with pytest.raises(ValueError, match="positive"):
        GrammarConfig(outlines_budget_s=0)
    with pytest.raises(ValueError, match="outlines_max_regex_chars"):
        GrammarConfig(outlines_max_regex_chars=0)


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        (GrammarSpec.regex("[a-z]+"), "outlines"),
        (GrammarSpec.choices(["a", "b"]), "outlines"),
        (
            GrammarSpec.json_schema({"type": "object", "properties": {"a": {"type": "string"}}}),
            "outlines",
        ),
        (GrammarSpec.ebnf('start: "a"+'), "llguidance"),
        (GrammarSpec.json_object(), "llguidance"),
        (GrammarSpec.json_schema({"type": "integer", "maximum": 5}), "llguidance"),
        (GrammarSpec.json_schema(ALL_OF_NEXT_TO_PROPERTIES), "llguidance"),
        (GrammarSpec.json_schema(HOSTNAME), "llguidance"),
    ],
)
def test_auto_routes_each_spec(auto, spec, expected):
    assert auto.compile(spec).backend_name == expected


def test_auto_enforces_all_of_next_to_properties(auto, vocab):
    for doc, valid in (('{"a": 1}', False), ('{"a": 1, "b": 2}', True)):
        matcher = auto.compile(GrammarSpec.json_schema(ALL_OF_NEXT_TO_PROPERTIES)).new_matcher()
        ok = matcher.accept_tokens(vocab.encode(doc)) and matcher.accept_token(
            vocab.eos_token_ids[0]
        )
        assert ok == valid, doc
        assert (
            jsonschema.Draft7Validator(ALL_OF_NEXT_TO_PROPERTIES).is_valid(json.loads(doc)) == valid
        )


def test_auto_falls_back_when_outlines_rejects(vocab):
    auto = create_grammar_backend(GrammarConfig(), vocab)
    grammar = auto.compile(GrammarSpec.json_schema(HOSTNAME))
    assert grammar.backend_name == "llguidance" and auto.num_fallbacks == 1
    matcher = grammar.new_matcher()
    assert matcher.accept_tokens(vocab.encode('"example.com"'))
    assert matcher.accept_token(vocab.eos_token_ids[0])


def test_auto_lenient_last_resort_ignores_only_unimplemented_keywords(vocab):
    auto = create_grammar_backend(GrammarConfig(), vocab)
    grammar = auto.compile(GrammarSpec.json_schema(HOST_AND_IDS))
    assert grammar.backend_name == "llguidance" and auto.num_fallbacks == 2
    rng = random.Random(3)
    without_unique = json.loads(json.dumps(HOST_AND_IDS))
    del without_unique["properties"]["ids"]["uniqueItems"]
    for _ in range(6):  # everything else is still enforced
        ids, finished = random_walk(grammar.new_matcher(), vocab, rng, check_rejections=False)
        assert finished
        jsonschema.validate(json.loads(vocab.decode_bytes(ids)), without_unique)
    repeated = grammar.new_matcher()  # the ignored keyword: duplicates pass
    assert repeated.accept_tokens(vocab.encode('{"host": "a.com", "ids": [1, 1]}'))
    assert repeated.accept_token(vocab.eos_token_ids[0])


def test_auto_without_lenient_fallback_reports_every_failure(vocab):
    auto = create_grammar_backend(GrammarConfig(lenient_json_fallback=False), vocab)
    with pytest.raises(GrammarCompileError) as info:
        auto.compile(GrammarSpec.json_schema(HOST_AND_IDS))
    assert "uniqueItems" in info.value.reason and "outlines: " in info.value.reason


def test_auto_sends_long_regexes_to_llguidance(vocab):
    schema = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}
    with pytest.raises(GrammarCompileError, match="characters, over the 50 allowed"):
        OutlinesBackend(vocab, max_regex_chars=50).compile(GrammarSpec.json_schema(schema))
    auto = create_grammar_backend(GrammarConfig(outlines_max_regex_chars=50), vocab)
    began = time.perf_counter()
    assert auto.compile(GrammarSpec.json_schema(schema)).backend_name == "llguidance"
    assert auto.num_fallbacks == 1 and time.perf_counter() - began < 1.0
    assert auto.compile(GrammarSpec.regex("[a-z]{3}")).backend_name == "outlines"  # short


def test_regex_length_is_checked_before_the_digit_rewrite(vocab, monkeypatch):
    """The \\d rewrite takes seconds on multi-megabyte schema regexes; over-long regexes must be
    rejected before it runs."""
    from radixlm.grammar import outlines_backend

    def rewrite_not_allowed(regex):
        raise AssertionError("rewrote an over-long regex")

    monkeypatch.setattr(outlines_backend, "ascii_digit_classes", rewrite_not_allowed)
    schema = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}
    short = OutlinesBackend(vocab, max_regex_chars=50)
    for spec in (GrammarSpec.json_schema(schema), GrammarSpec.regex("x" * 60)):
        with pytest.raises(GrammarCompileError, match="over the 50 allowed"):
            short.compile(spec)


def slow_regex(seconds: float) -> GrammarSpec:
    """A regex whose outlines-core index takes about ``seconds`` on the 2-core dev CPU with the
    test vocabulary (its DFA doubles with each step of n: n=15 0.5 s, n=16 1 s)."""
    n = {0.5: 15, 1.0: 16, 4.0: 18}[seconds]
    return GrammarSpec.regex(f"[ab]*a[ab]{{{n}}}")


class RejectingLLGuidance(LLGuidanceBackend):
    def compile(self, spec):
        raise GrammarCompileError(spec.kind, "not supported here")


def test_auto_falls_back_when_outlines_exceeds_its_budget_and_stops_the_build(vocab):
    auto = AutoGrammarBackend(
        OutlinesBackend(vocab), LLGuidanceBackend(vocab), outlines_budget_s=0.05
    )
    try:
        began = time.perf_counter()
        grammar = auto.compile(slow_regex(1.0))
        assert time.perf_counter() - began < 0.8  # did not wait for the slow build
        assert grammar.backend_name == "llguidance" and auto.num_fallbacks == 1
        assert auto.index_workers.num_idle() == 0  # the over-budget child was killed
        assert auto.index_workers.num_killed == 1
        auto.outlines_budget_s = 5.0  # the next build gets a fresh child
        assert auto.compile(GrammarSpec.regex("[0-9]{2}")).backend_name == "outlines"
        assert auto.index_workers.num_idle() == 1
    finally:
        auto.shutdown()


def test_auto_waits_for_an_over_budget_outlines_build_when_nothing_else_compiles(vocab):
    """A spec only outlines-core accepts, built just past its budget (a loaded CPU): auto
    waits for that build instead of failing."""
    auto = AutoGrammarBackend(
        OutlinesBackend(vocab),
        RejectingLLGuidance(vocab),
        outlines_budget_s=0.05,
        outlines_last_resort_s=10.0,
    )
    try:
        grammar = auto.compile(slow_regex(0.5))
        assert grammar.backend_name == "outlines"
        matcher = grammar.new_matcher()
        assert matcher.accept_tokens(vocab.encode("a" * 16))
        assert matcher.accept_token(vocab.eos_token_ids[0])
    finally:
        auto.shutdown()


def test_auto_last_resort_wait_is_bounded(vocab):
    auto = AutoGrammarBackend(
        OutlinesBackend(vocab),
        RejectingLLGuidance(vocab),
        outlines_budget_s=0.05,
        outlines_last_resort_s=0.2,
    )
    no_wait = AutoGrammarBackend(
        OutlinesBackend(vocab),
        RejectingLLGuidance(vocab),
        outlines_budget_s=0.05,
        outlines_last_resort_s=0,
    )
    try:
        began = time.perf_counter()
        with pytest.raises(GrammarCompileError) as info:
            auto.compile(slow_regex(4.0))
        assert time.perf_counter() - began < 1.5
        assert "not supported here" in info.value.reason and "did not finish" in info.value.reason
        assert auto.index_workers.num_killed == 1
        began = time.perf_counter()
        with pytest.raises(GrammarCompileError):
            no_wait.compile(slow_regex(4.0))
        assert time.perf_counter() - began < 1.0
    finally:
        auto.shutdown()
        no_wait.shutdown()


def test_auto_reports_both_failures(auto):
    with pytest.raises(GrammarCompileError) as info:
        auto.compile(GrammarSpec.regex("a{2,1}"))  # balanced, so both backends see it
    message = str(info.value)
    assert message.startswith("Failed to compile regex grammar: ")
    assert "outlines" in message  # the first backend's reason is kept


def test_null_backend_rejects_everything():
    with pytest.raises(GrammarCompileError, match="disabled"):
        NullGrammarBackend().compile(GrammarSpec.regex("a"))


def test_compile_cache_from_config(vocab, tmp_path):
    config = GrammarConfig(cache_max_entries=4, cache_dir=str(tmp_path), compile_workers=1)
    cache = create_compile_cache(config, vocab)
    grammar = cache.get_or_compile(GrammarSpec.regex("[ab]{2}")).result(timeout=10)
    assert grammar.backend_name == "outlines"
    assert cache.max_entries == 4 and list(tmp_path.glob("*.grammar"))
    assert cache.key(GrammarSpec.regex("x"))[0].startswith("auto[")
    cache.shutdown()
