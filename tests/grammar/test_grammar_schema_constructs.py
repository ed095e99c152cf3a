"""Schema constructs the engines used to refuse or misread, compiled and enforced.

``data/schema_constructs.jsonl`` holds schemas written for each construct: forbidden properties
(``false``, ``not: {}``, ``not: true``, a ``$ref`` to ``false``, a required ``false`` property
of an optional object), ``not: {"type": ...}``, recursive ``$ref``s with sibling keywords,
unknown ``format``s, oversized regexes and slow outlines-core builds beside those, and
``allOf`` chains past llguidance's intersection depth. Each compiles under ``auto`` (the
server's configuration) over a tiny vocabulary, every document random walks finish with
validates against the whole schema with ``jsonschema``, and a forbidden key is rejected by the
matchers of every engine that compiles the schema.
"""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path

import jsonschema
import pytest
from jsonschema.validators import validator_for

from radixlm.grammar.base import GrammarCompileError, GrammarSpec
from radixlm.grammar.registry import GrammarConfig, create_grammar_backend
from radixlm.grammar.testing import closing_tokens, closing_walk, train_byte_level_tokenizer
from radixlm.grammar.vocab import build_vocab

CONSTRUCTS = [
    json.loads(line)
    for line in (Path(__file__).parent / "data" / "schema_constructs.jsonl").open()
    if line.strip()
]
BY_ID = {entry["id"]: entry for entry in CONSTRUCTS}
WALKS = 4


@pytest.fixture(scope="module")
def vocab():
    return build_vocab(train_byte_level_tokenizer())


@pytest.fixture(scope="module")
def backends(vocab):
    built = {
        name: create_grammar_backend(GrammarConfig(backend=name), vocab)
        for name in ("auto", "outlines", "llguidance")
    }
    yield built
    built["auto"].shutdown()


def _spec(schema) -> GrammarSpec:
    return GrammarSpec.json_schema(json.dumps(schema))


def _validator(schema):
    cls = validator_for(schema, default=jsonschema.Draft202012Validator)
    return cls(schema, format_checker=cls.FORMAT_CHECKER)


@pytest.mark.parametrize("entry", CONSTRUCTS, ids=[e["id"] for e in CONSTRUCTS])
def test_construct_compiles_and_its_walks_validate(vocab, backends, entry):
    grammar = backends["auto"].compile(_spec(entry["schema"]))
    assert list(grammar.unenforced) == entry.get("unenforced", [])
    validator = _validator(entry["schema"])
    rng = random.Random(entry["id"])
    closers = closing_tokens(vocab)
    finished = 0
    for _ in range(WALKS):
        ids, ended = closing_walk(grammar.new_matcher(), vocab, rng, closers)
        if not ended:
            continue
        finished += 1
        text = vocab.decode_bytes(ids).decode("utf-8")
        errors = [e.message for e in validator.iter_errors(json.loads(text))]
        assert not errors, (text, errors)
    assert finished, f"no walk of {WALKS} ended"


def _accepts(grammar, vocab, text: str) -> bool:
    """Whether the matcher takes ``text`` and then EOS (keys in the schema's order: both
    engines write properties in declaration order)."""
    matcher = grammar.new_matcher()
    return matcher.accept_tokens(vocab.encode(text)) and matcher.accept_token(
        vocab.eos_token_ids[0]
    )


# (construct, a valid document, the same with a forbidden key)
FORBIDDEN = [
    ("not_empty_optional", '{"id": 1}', '{"id": 1, "legacy": 2}'),
    ("not_true_optional", '{"name": "a"}', '{"name": "a", "old_name": "b"}'),
    ("false_optional", '{"id": 1}', '{"id": 1, "deprecated": true}'),
    ("false_open_object", '{"a": "x", "n": 3}', '{"a": "x", "secret": 3}'),
    ("not_empty_open_object", '{"y": true, "z": 1}', '{"y": true, "x": 1}'),
    ("false_ref", '{"b": "x"}', '{"a": "x", "b": "x"}'),
    ("not_empty_ref_nested", '{"user": {"name": "a"}}', '{"user": {"name": "a"}, "token": 1}'),
    ("not_empty_ref_nested", '{"user": {"name": "a"}}', '{"user": {"name": "a", "password": 1}}'),
    ("false_required_nested", '{"n": 1}', '{"o": {"z": 1}, "n": 1}'),
    ("false_allof_property", '{"b": 1}', '{"a": "x", "b": 1}'),
    ("pattern_properties_false", '{"name": "a", "n": 1}', '{"x-id": 1}'),
    ("false_items_after_prefix", '["a", 1]', '["a", 1, 2]'),
    ("not_type_null", '{"v": 1}', '{"v": null}'),
    ("not_type_list", '{"v": "s"}', '{"v": 1}'),
    ("oversized_regex_not_empty", '{"field_1": "a"}', '{"field_1": "a", "gone": 1}'),
    (
        "oversized_regex_enum",
        '{"code": "value-00001-bbbbbbbbbbbbbbbbbbbbbbbbbbbbbb"}',
        '{"code": "value-00001-bbbbbbbbbbbbbbbbbbbbbbbbbbbbbb", "old": 1}',
    ),
]


def _forbidden_cases():
    """Every (construct, engine) pair; outlines-core building an oversized construct's whole
    regex (what ``auto`` avoids by sending it to llguidance) spends seconds to tens of seconds of
    CPU, so those pairs run in the full suite only (the same forbidden-key constructs at small
    size run everywhere)."""
    for construct, good, bad in FORBIDDEN:
        for name in ("auto", "llguidance", "outlines"):
            marks = (
                [pytest.mark.slow]
                if name == "outlines" and construct.startswith("oversized_")
                else []
            )
            yield pytest.param(name, construct, good, bad, marks=marks, id=f"{construct}-{name}")


@pytest.mark.parametrize(("name", "construct", "good", "bad"), list(_forbidden_cases()))
def test_no_engine_admits_a_forbidden_value(vocab, backends, name, construct, good, bad):
    try:
        grammar = backends[name].compile(_spec(BY_ID[construct]["schema"]))
    except GrammarCompileError:
        assert name == "outlines", "auto and llguidance compile every construct"
        return  # outlines-core refuses (false in an open object, look-alikes): never admits
    # outlines-core alone misreads patternProperties (auto sends them to llguidance)
    assert _accepts(grammar, vocab, good) or name == "outlines"
    assert not _accepts(grammar, vocab, bad)
    validator = _validator(BY_ID[construct]["schema"])
    assert validator.is_valid(json.loads(good)) and not validator.is_valid(json.loads(bad))


@pytest.mark.parametrize(
    ("construct", "good", "bad"),
    [
        ("rec_sibling_required", '{"right": {"value": 1}}', '{"right": {"left": {}}}'),
        ("rec_sibling_root", '{"v": 1, "next": {"v": 2}}', '{"v": 1, "next": {}}'),
        (
            "rec_sibling_self_root",
            '{"name": "a", "child": {"name": "b"}}',
            '{"name": "a", "child": {}}',
        ),
        ("rec_sibling_mutual", '{"b": {"a": {"x": 1}}}', '{"b": {"a": {}}}'),
        (  # sourcemap-v3's shape: llguidance refused it, outlines-core wrote `[{}{"offset"`
            "rec_allof_in_items",
            '{"sections": [{"url": "a", "offset": 1}]}',
            '{"sections": [{"url": "a"}]}',
        ),
        ("allof_two_chains_40", '{"next": {"y": 2}, "y": 1}', '{"next": {"x": 2}, "y": 1}'),
    ],
)
def test_sibling_keywords_of_recursive_refs_are_enforced(vocab, backends, construct, good, bad):
    schema = BY_ID[construct]["schema"]
    validator = _validator(schema)
    assert validator.is_valid(json.loads(good)) and not validator.is_valid(json.loads(bad))
    for name in ("auto", "llguidance"):
        grammar = backends[name].compile(_spec(schema))
        assert grammar.backend_name == "llguidance"
        assert _accepts(grammar, vocab, good)
        assert not _accepts(grammar, vocab, bad)


def test_unknown_formats_compile_as_strings_and_are_logged(vocab, backends, caplog):
    schema = {"type": "object", "properties": {"c": {"type": "string", "format": "rgb-color"}}}
    with caplog.at_level(logging.INFO, logger="radixlm.grammar.auto_backend"):
        grammar = backends["auto"].compile(_spec(schema))
    assert grammar.unenforced == ("format:rgb-color",)
    assert any("not enforced: format:rgb-color" in r.getMessage() for r in caplog.records)
    assert _accepts(grammar, vocab, '{"c": "any text"}')
    for name in ("llguidance", "outlines"):  # each engine alone too
        alone = backends[name].compile(_spec(schema))
        assert alone.unenforced == ("format:rgb-color",)
        assert _accepts(alone, vocab, '{"c": "x"}')


def test_known_formats_stay_enforced(vocab, backends):
    grammar = backends["auto"].compile(_spec({"type": "string", "format": "ipv4"}))
    assert grammar.unenforced == ()
    assert _accepts(grammar, vocab, '"10.0.0.1"') and not _accepts(grammar, vocab, '"ten"')


def test_lenient_fallback_lists_the_keywords_it_ignores(backends):
    schema = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    grammar = backends["auto"].compile(_spec(schema))
    assert grammar.unenforced == ("uniqueItems",)


def test_a_required_forbidden_property_is_still_refused(backends):
    schema = {"type": "object", "properties": {"a": {"not": {}}}, "required": ["a"]}
    with pytest.raises(GrammarCompileError):
        backends["auto"].compile(_spec(schema))
