"""oneOf branches that only describe one shared optional property: the property is required."""

from __future__ import annotations

import json

import jsonschema
import pytest

from radixlm.grammar.base import GrammarSpec
from radixlm.grammar.llguidance_backend import LLGuidanceBackend
from radixlm.grammar.outlines_backend import OutlinesBackend
from radixlm.grammar.schema_rewrite import tighten_one_of
from radixlm.grammar.testing import train_byte_level_tokenizer
from radixlm.grammar.vocab import build_vocab

EVENTS = {  # the shape of JsonSchemaStore's grunt-watch-task "optionsWithEvents"
    "oneOf": [
        {"properties": {"ev": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}}},
        {"description": "one event", "properties": {"ev": {"enum": ["a", "b"]}}},
    ]
}
SCHEMA = {
    "type": "object",
    "properties": {"opts": EVENTS},
    "required": ["opts"],
    "additionalProperties": False,
}
BACKENDS = {"outlines": OutlinesBackend, "llguidance": LLGuidanceBackend}


def test_rewrite_requires_the_shared_property_everywhere():
    rewritten = json.loads(tighten_one_of(json.dumps(SCHEMA)))
    branches = rewritten["properties"]["opts"]["oneOf"]
    assert [b["required"] for b in branches] == [["ev"], ["ev"]]
    validator = jsonschema.Draft7Validator
    for doc in ({"opts": {}}, {"opts": {"ev": "a"}}, {"opts": {"ev": ["a"]}}, {"opts": {"ev": 1}}):
        assert validator(rewritten).is_valid(doc) == validator(SCHEMA).is_valid(doc), doc


@pytest.mark.parametrize(
    "branches",
    [
        [{"properties": {"a": {}}}, {"properties": {"b": {}}}],  # different properties
        [{"properties": {"a": {}}, "minProperties": 2}, {"properties": {"a": {}}}],  # more
        [{"properties": {"a": {}, "b": {}}}, {"properties": {"a": {}}}],  # two properties
        [{"properties": {"a": {}}}],  # a single branch
        [{"type": "string"}, {"properties": {"a": {}}}],
    ],
)
def test_other_one_of_shapes_are_left_alone(branches):
    text = json.dumps({"oneOf": branches})
    assert tighten_one_of(text) == text
    assert tighten_one_of("{not json") == "{not json"


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_backends_reject_objects_matching_every_branch(name):
    vocab = build_vocab(train_byte_level_tokenizer())
    grammar = BACKENDS[name](vocab).compile(GrammarSpec.json_schema(SCHEMA))
    eos = vocab.eos_token_ids[0]
    for text, valid in (('{"opts": {"ev": "a"}}', True), ('{"opts": {}}', False)):
        matcher = grammar.new_matcher()
        accepted = matcher.accept_tokens(vocab.encode(text)) and matcher.accept_token(eos)
        assert accepted == valid, (text, name)
        assert jsonschema.Draft7Validator(SCHEMA).is_valid(json.loads(text)) == valid
