"""Schema rewrites before compiling: oneOf branches that only describe one shared optional
property (the property is required), closing declared objects, anchors as pointers."""

from __future__ import annotations

import json

import jsonschema
import pytest

from radixlm.grammar.base import GrammarSpec
from radixlm.grammar.limits import check_json_text
from radixlm.grammar.llguidance_backend import LLGuidanceBackend
from radixlm.grammar.outlines_backend import OutlinesBackend
from radixlm.grammar.schema_checks import unresolved_ref
from radixlm.grammar.schema_rewrite import rewrite_schema, tighten_one_of
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


# ---------------------------------------------------------------- closed objects (strict mode)
def test_declared_objects_are_closed_and_explicit_openness_is_kept():
    schema = {
        "type": "object",
        "properties": {
            "a": {"type": "object", "properties": {"x": {"type": "integer"}}},
            "b": {"type": "object", "properties": {"y": {}}, "additionalProperties": True},
            "c": {"type": "object", "additionalProperties": {"type": "string"}},
            "d": {"type": "object", "properties": {"z": {}}, "patternProperties": {"^q": {}}},
            "e": {"type": "object", "properties": {"w": {}}, "required": ["w", "undeclared"]},
        },
    }
    out = json.loads(rewrite_schema(json.dumps(schema)))
    assert out["additionalProperties"] is False
    props = out["properties"]
    assert props["a"]["additionalProperties"] is False
    assert props["b"]["additionalProperties"] is True
    assert props["c"]["additionalProperties"] == {"type": "string"}
    assert "additionalProperties" not in props["d"]
    assert "additionalProperties" not in props["e"]  # closing it would admit no document


def test_objects_under_all_of_and_their_refs_stay_open():
    schema = {
        "$defs": {
            "Base": {"properties": {"id": {"type": "integer"}}},
            "Other": {"properties": {"n": {}}},
        },
        "allOf": [{"$ref": "#/$defs/Base"}, {"properties": {"name": {"type": "string"}}}],
        "properties": {"other": {"$ref": "#/$defs/Other"}},
    }
    out = json.loads(rewrite_schema(json.dumps(schema)))
    assert "additionalProperties" not in out["$defs"]["Base"]
    assert "additionalProperties" not in out["allOf"][1]
    assert out["$defs"]["Other"]["additionalProperties"] is False
    # the document that needs both allOf branches still validates against the rewritten schema
    jsonschema.validate({"id": 1, "name": "x"}, out)


def test_closed_schema_admits_a_subset_of_the_original():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    out = json.loads(rewrite_schema(json.dumps(schema)))
    jsonschema.validate({"a": 1}, out)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"a": 1, "extra": 2}, out)
    jsonschema.validate({"a": 1, "extra": 2}, schema)
    assert rewrite_schema(json.dumps(schema), strict_objects=False) == json.dumps(schema)


def test_data_is_never_rewritten() -> None:
    """``const`` / ``enum`` / ``default`` / ``examples`` hold documents, not schemas: an object
    there that looks like a schema stays exactly as written (closing it or requiring a property
    made the schema unsatisfiable), while a property *named* ``const`` is still a schema."""
    data = {"properties": {"a": 1}}
    branches = {"oneOf": [{"properties": {"e": {}}}, {"properties": {"e": {}}}]}
    schema = {
        "type": "object",
        "properties": {
            "c": {"const": data},
            "e": {"enum": [data, branches]},
            "d": {"type": "object", "default": data, "examples": [branches]},
            "const": {"type": "object", "properties": {"x": {"type": "integer"}}},
        },
        "required": ["c"],
    }
    out = json.loads(rewrite_schema(json.dumps(schema)))
    props = out["properties"]
    assert props["c"]["const"] == data and props["e"]["enum"] == [data, branches]
    assert props["d"]["default"] == data and props["d"]["examples"] == [branches]
    assert props["const"]["additionalProperties"] is False  # a schema under a data-like name
    assert out["additionalProperties"] is False


@pytest.mark.parametrize("where", ["anyOf", "oneOf", "$ref"])
def test_parts_combined_with_parent_properties_stay_open(where) -> None:
    """A branch (or ``$ref`` target) beside the parent's own properties is satisfied together
    with them: closing it refused the parent's keys (every document was refused)."""
    branch = {"properties": {"x": {"type": "integer"}}, "required": ["x"]}
    schema = {
        "$defs": {"b": branch},
        "type": "object",
        "properties": {"id": {"type": "integer"}},
        "required": ["id"],
    }
    if where == "$ref":
        schema["$ref"] = "#/$defs/b"
    else:
        schema[where] = [{"$ref": "#/$defs/b"}, {"required": ["y"]}]
    out = json.loads(rewrite_schema(json.dumps(schema)))
    assert "additionalProperties" not in out["$defs"]["b"]
    jsonschema.validate({"id": 1, "x": 2}, out)


def test_anchor_references_become_pointers() -> None:
    schema = {
        "$defs": {
            "s": {"$anchor": "short", "type": "string", "maxLength": 4},
            "i": {"$dynamicAnchor": "item", "type": "integer"},
        },
        "type": "object",
        "properties": {
            "v": {"$ref": "#short"},
            "w": {"$dynamicRef": "#item"},
            "u": {"$ref": "#no"},
        },
    }
    out = json.loads(rewrite_schema(json.dumps(schema)))
    props = out["properties"]
    assert props["v"] == {"$ref": "#/$defs/s"} and props["w"] == {"$ref": "#/$defs/i"}
    assert props["u"] == {"$ref": "#no"}  # unknown names stay, for unresolved_ref's 400
    assert unresolved_ref(out) == "#no"


def test_boolean_schemas() -> None:
    assert rewrite_schema("true") == "{}"
    with pytest.raises(ValueError, match="false, a schema no value satisfies"):
        check_json_text("json_schema", "false")
