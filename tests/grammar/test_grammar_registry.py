"""Backend selection: auto routes each spec and falls back to llguidance."""

from __future__ import annotations

import json
import os
import random
import threading
import time

import jsonschema
import pytest

from radixlm.grammar.base import GrammarCompileError, GrammarSpec, NullGrammarBackend
from radixlm.grammar.llguidance_backend import LLGuidanceBackend
from radixlm.grammar.outlines_backend import OutlinesBackend
from radixlm.grammar.registry import (
    AutoGrammarBackend,
    GrammarConfig,
    create_compile_cache,
    create_grammar_backend,
    run_only_when_idle,
)
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


class SlowOutlines(OutlinesBackend):
    def compile(self, spec):
        time.sleep(1.0)
        return super().compile(spec)


def test_auto_falls_back_when_outlines_exceeds_its_budget(vocab):
    auto = AutoGrammarBackend(SlowOutlines(vocab), LLGuidanceBackend(vocab), outlines_budget_s=0.05)
    began = time.perf_counter()
    grammar = auto.compile(GrammarSpec.regex("[0-9]{4}"))
    assert time.perf_counter() - began < 0.8  # did not wait for the slow compile
    assert grammar.backend_name == "llguidance" and auto.num_fallbacks == 1


class BlockedOutlines(OutlinesBackend):
    """Compiles only once released, recording the scheduling policy of its thread meanwhile."""

    def __init__(self, vocab):
        super().__init__(vocab)
        self.release = threading.Event()
        self.policies: list[int] = []

    def compile(self, spec):
        self.release.wait(5.0)
        self.policies.append(os.sched_getscheduler(0))
        return super().compile(spec)


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux-only")
def test_abandoned_outlines_runs_only_on_idle_cpu(vocab):
    """An over-budget outlines-core run cannot be stopped; it must not compete for the CPU
    with decoding, so its thread moves to SCHED_IDLE (runs within budget keep their class)."""
    outlines = BlockedOutlines(vocab)
    auto = AutoGrammarBackend(outlines, LLGuidanceBackend(vocab), outlines_budget_s=0.05)
    assert auto.compile(GrammarSpec.regex("[0-9]{4}")).backend_name == "llguidance"
    outlines.release.set()  # the abandoned run goes on and finishes
    deadline = time.monotonic() + 5.0
    while not outlines.policies and time.monotonic() < deadline:
        time.sleep(0.01)
    assert outlines.policies == [os.SCHED_IDLE]
    auto.outlines_budget_s = 5.0
    assert auto.compile(GrammarSpec.regex("[0-9]{2}")).backend_name == "outlines"
    assert outlines.policies[-1] == os.sched_getscheduler(0) != os.SCHED_IDLE


def test_run_only_when_idle_needs_a_live_thread():
    thread = threading.Thread(target=lambda: None)
    assert not run_only_when_idle(thread)  # not started: no native id
    thread.start()
    thread.join()
    assert not run_only_when_idle(thread)  # gone


def test_auto_skips_outlines_while_too_many_runs_are_abandoned(vocab):
    auto = AutoGrammarBackend(
        SlowOutlines(vocab),
        LLGuidanceBackend(vocab),
        outlines_budget_s=0.05,
        max_abandoned_outlines=1,
    )
    auto.compile(GrammarSpec.regex("a"))  # abandons one outlines run
    began = time.perf_counter()
    assert auto.compile(GrammarSpec.regex("b")).backend_name == "llguidance"
    assert time.perf_counter() - began < 0.04  # went straight to llguidance
    time.sleep(1.2)  # the abandoned run finishes and frees its slot
    assert auto.compile(GrammarSpec.regex("c")).backend_name == "llguidance"
    assert auto.num_fallbacks == 2


def test_auto_reports_both_failures(auto):
    with pytest.raises(GrammarCompileError) as info:
        auto.compile(GrammarSpec.regex("a("))
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
