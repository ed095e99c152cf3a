"""Every document the ``auto`` grammar admits for 140 real-world-style JSON schemas validates.

``data/json_schema_corpus.jsonl`` holds hand-written schemas in the styles of function-call
arguments (Glaive), GitHub, Kubernetes, Snowplow, Washington Post and Schema Store files, and
108 keyword cases of draft 2020-12 (``$anchor``, ``$dynamicRef``, ``$ref`` beside properties,
``anyOf`` beside parent properties, formats, patterns, bounds, ...). Each schema is compiled the
way the server does (``GrammarConfig()``: outlines-core or llguidance as ``auto`` routes it) over
a small byte-level vocabulary, and walks that pick random allowed tokens (ending strings more
and more often) must produce JSON that ``jsonschema`` accepts. Keywords the grammar README lists
as ignored are dropped from the schema before validating; everything else is enforced.
"""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path

import jsonschema
import pytest
import regex
from jsonschema.validators import extend, validator_for

from radixlm.grammar.base import GrammarCompileError, GrammarSpec
from radixlm.grammar.registry import GrammarConfig, create_grammar_backend
from radixlm.grammar.schema_checks import schema_nodes
from radixlm.grammar.testing import closing_tokens, closing_walk, train_byte_level_tokenizer
from radixlm.grammar.vocab import build_vocab

CORPUS = [
    json.loads(line)
    for line in (Path(__file__).parent / "data" / "json_schema_corpus.jsonl").open()
    if line.strip()
]
# grammar/README.md: compiled but without effect (outlines-core ignores them; llguidance
# rejects them and auto's lenient llguidance ignores them)
IGNORED = (
    "propertyNames",
    "minProperties",
    "maxProperties",
    "uniqueItems",
    "contains",
    "minContains",
    "maxContains",
    "if",
    "then",
    "else",
    "dependentRequired",
    "dependentSchemas",
    "dependencies",
    "not",
    "unevaluatedProperties",
)
# refused with a 400: no document matches, or a pattern no regex engine here builds
REFUSED = {
    "kw_addl_false_required_missing": "required property not allowed by additionalProperties",
    "kw_string_min_gt_max": "minLength > maxLength",
    "kw_num_min_gt_max": "minimum > maximum",
    "kw_allof_contradiction": "allOf of two types",
    "kw_false_schema": "false",
    "kw_ref_unresolvable": "$ref to a missing definition",
    "kw_pattern_lookahead": "look-around",
    "kw_pattern_backref": "back-reference",
    "kw_pattern_word_boundary": "Unicode word boundary",
    "kw_int_huge_bounds": "integer bounds past 2^63 (no engine here enforces them)",
}
GAPS: set[str] = set()  # compiled but not validated (none left)
# a random walk seldom ends these (the string must end in ".json"); its walks still validate
RARELY_ENDS = {"kw_pattern_end_anchor"}
WALKS = 6


@pytest.fixture(scope="module")
def setup():
    vocab = build_vocab(train_byte_level_tokenizer())
    return vocab, create_grammar_backend(GrammarConfig(), vocab), closing_tokens(vocab)


def _pattern(validator, pattern, instance, schema):
    """``pattern`` through the ``regex`` module: ``re`` lacks ``\\p{L}``."""
    if validator.is_type(instance, "string") and not regex.search(pattern, instance):
        yield jsonschema.ValidationError(f"{instance!r} does not match {pattern!r}")


def _validator(schema):
    enforced = copy.deepcopy(schema)
    for node in list(schema_nodes(enforced)):
        for key in IGNORED:
            node.pop(key, None)
        if "oneOf" in node:  # compiled as anyOf (README: exact for disjoint branches)
            node["anyOf"] = node.pop("oneOf")
    cls = validator_for(enforced, default=jsonschema.Draft202012Validator)
    cls = extend(cls, {"pattern": _pattern})
    return cls(enforced, format_checker=cls.FORMAT_CHECKER)


# schemas that admit any JSON value: their walks nest deep before they close (seconds each)
ANY_VALUE = {
    "kw_type_object_any",
    "kw_true_schema",
    "kw_type_array_any",
    "kw_property_names_maxlen",
}


@pytest.mark.parametrize(
    "entry",
    [
        pytest.param(e, id=e["id"], marks=[pytest.mark.slow] if e["id"] in ANY_VALUE else [])
        for e in CORPUS
    ],
)
def test_walks_validate(setup, entry):
    vocab, backend, closers = setup
    spec = GrammarSpec.json_schema(json.dumps(entry["schema"]))
    if entry["id"] in REFUSED:
        with pytest.raises(GrammarCompileError):
            backend.compile(spec)
        return
    grammar = backend.compile(spec)
    validator = None if entry["id"] in GAPS else _validator(entry["schema"])
    rng = random.Random(entry["id"])
    finished = 0
    for _ in range(WALKS):
        ids, ended = closing_walk(grammar.new_matcher(), vocab, rng, closers)
        if not ended:
            continue
        finished += 1
        text = vocab.decode_bytes(ids).decode("utf-8")
        document = json.loads(text)  # the grammar admitted text that is not JSON if this fails
        if validator is not None:
            errors = [e.message for e in validator.iter_errors(document)]
            assert not errors, (text, errors)
    assert finished or entry["id"] in RARELY_ENDS, f"no walk of {WALKS} ended"


def test_the_corpus_is_what_the_docstring_says():
    assert len(CORPUS) == 140
    assert sum(e["category"] == "keyword" for e in CORPUS) == 108
    assert set(REFUSED) | GAPS | RARELY_ENDS | ANY_VALUE <= {e["id"] for e in CORPUS}
