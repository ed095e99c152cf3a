"""Backend selection: auto routes each spec and falls back to llguidance."""

from __future__ import annotations

import time

import pytest

from radixlm.grammar.base import GrammarCompileError, GrammarSpec, NullGrammarBackend
from radixlm.grammar.llguidance_backend import LLGuidanceBackend
from radixlm.grammar.outlines_backend import OutlinesBackend
from radixlm.grammar.registry import (
    AutoGrammarBackend,
    GrammarConfig,
    create_compile_cache,
    create_grammar_backend,
)
from radixlm.grammar.testing import train_byte_level_tokenizer
from radixlm.grammar.vocab import build_vocab

HOSTNAME = {"type": "string", "format": "hostname"}  # outlines-core: "not supported"


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
        (GrammarSpec.json_schema(HOSTNAME), "llguidance"),
    ],
)
def test_auto_routes_each_spec(auto, spec, expected):
    assert auto.compile(spec).backend_name == expected


def test_auto_falls_back_when_outlines_rejects(vocab):
    auto = create_grammar_backend(GrammarConfig(), vocab)
    grammar = auto.compile(GrammarSpec.json_schema(HOSTNAME))
    assert grammar.backend_name == "llguidance" and auto.num_fallbacks == 1
    matcher = grammar.new_matcher()
    assert matcher.accept_tokens(vocab.encode('"example.com"'))
    assert matcher.accept_token(vocab.eos_token_ids[0])


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
