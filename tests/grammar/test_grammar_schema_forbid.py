"""The rewrites of ``schema_forbid``: what each turns a construct into, that the result admits
exactly the documents (or a subset of those) the original does, and what is left alone."""

from __future__ import annotations

import copy
import json

import jsonschema
import pytest

from radixlm.grammar.schema_forbid import (
    drop_forbidden_properties,
    drop_unknown_formats,
    forbid_unsatisfiable,
    inline_recursive_ref_siblings,
    intersect_all_of,
)
from radixlm.grammar.schema_keywords import unenforced_keywords, unknown_formats
from radixlm.grammar.schema_rewrite import rewrite_schema


def _same_verdicts(before, after, documents):
    for doc in documents:
        old = jsonschema.Draft202012Validator(before).is_valid(doc)
        assert jsonschema.Draft202012Validator(after).is_valid(doc) == old, doc


@pytest.mark.parametrize(
    "subschema",
    [
        {"not": {}},
        {"not": True},
        {"not": {"description": "anything"}, "type": "string"},
        {"allOf": [{"type": "string"}, False]},
        {"anyOf": [False, {"not": {}}]},
        {"enum": []},
        {"type": "object", "properties": {"z": False}, "required": ["z"]},
        {"$ref": "#/$defs/never"},
    ],
)
def test_subschemas_nothing_satisfies_become_false(subschema):
    schema = {"$defs": {"never": {"not": {}}}, "properties": {"a": subschema, "b": {}}}
    original = copy.deepcopy(schema)
    assert forbid_unsatisfiable(schema)
    assert schema["properties"]["a"] is False and schema["$defs"]["never"] is False
    _same_verdicts(original, schema, [{}, {"b": 1}, {"a": 1}, {"a": "s"}, {"a": {"z": 1}}])


def test_false_branches_are_dropped_and_not_type_is_complemented():
    schema = {
        "properties": {
            "v": {"anyOf": [False, {"type": "integer"}]},
            "w": {"not": {"type": "null"}},
            "t": {"type": ["string", "integer", "null"], "not": {"type": ["null", "integer"]}},
            "n": {"type": ["number", "string"], "not": {"type": "integer"}},  # not expressible
        }
    }
    original = copy.deepcopy(schema)
    assert forbid_unsatisfiable(schema)
    props = schema["properties"]
    assert props["v"] == {"anyOf": [{"type": "integer"}]}
    assert props["w"] == {"type": ["boolean", "object", "array", "number", "string"]}
    assert props["t"] == {"type": "string"}
    assert props["n"] == original["properties"]["n"]
    docs = [{"v": 1}, {"v": "x"}, {"w": None}, {"w": 1.5}, {"t": 1}, {"t": "s"}, {"t": None}]
    _same_verdicts(original, schema, docs)


def test_forbidden_properties_of_closed_objects_are_removed():
    schema = {
        "properties": {"a": {"type": "string"}, "gone": False},
        "additionalProperties": False,
    }
    assert drop_forbidden_properties(schema)
    assert schema["properties"] == {"a": {"type": "string"}}
    kept = {"properties": {"gone": False}, "additionalProperties": {"type": "integer"}}
    assert not drop_forbidden_properties(kept)  # open: the false entry keeps the key out
    pattern = {"properties": {"gone": False}, "patternProperties": {"^g": {}}}
    pattern["additionalProperties"] = False
    assert not drop_forbidden_properties(pattern)  # a pattern would admit the key again


def test_unknown_formats_are_dropped_and_listed():
    schema = {"properties": {"c": {"type": "string", "format": "color"}, "d": {"format": "date"}}}
    assert unknown_formats(schema) == ["color"]
    assert drop_unknown_formats(schema)
    assert schema["properties"] == {"c": {"type": "string"}, "d": {"format": "date"}}
    assert unenforced_keywords(schema, "llguidance", {"format": "URI"}) == ("format:URI",)
    with pytest.raises(ValueError, match="engine"):
        unenforced_keywords(schema, "xgrammar")


def test_unenforced_keywords_per_engine():
    schema = {"type": "array", "uniqueItems": True, "items": {"minimum": 1}}
    assert unenforced_keywords(schema, "llguidance") == ()
    assert unenforced_keywords(schema, "llguidance-lenient") == ("uniqueItems",)
    assert unenforced_keywords(schema, "outlines") == ("minimum", "uniqueItems")


NODE = {
    "type": "object",
    "properties": {
        "v": {"type": "integer"},
        "next": {"$ref": "#/$defs/node", "required": ["v"]},
    },
}


def test_a_recursive_ref_beside_keywords_becomes_a_merged_definition():
    schema = {"$defs": {"node": copy.deepcopy(NODE)}, "$ref": "#/$defs/node"}
    original = copy.deepcopy(schema)
    assert inline_recursive_ref_siblings(schema)
    merged_ref = schema["$defs"]["node"]["properties"]["next"]["$ref"]
    merged = schema["$defs"][merged_ref.rsplit("/", 1)[1]]
    assert merged["required"] == ["v"]
    assert merged["properties"]["next"] == {"$ref": merged_ref}  # the recursion is kept
    docs = [{}, {"next": {"v": 1}}, {"next": {}}, {"next": {"v": 1, "next": {}}}]
    _same_verdicts(original, schema, docs)
    json.dumps(schema)  # no shared cycles: the copy is a tree


@pytest.mark.parametrize(
    "siblings",
    [
        {"additionalProperties": False, "properties": {"w": {}}},  # would close the target
        {"properties": {"v": {"type": "string"}}},  # the same property, another schema
        {"type": "string"},  # no common type
        {"unevaluatedProperties": False},
    ],
)
def test_interacting_siblings_are_left_alone(siblings):
    node = copy.deepcopy(NODE)
    node["properties"]["next"] = {"$ref": "#/$defs/node", **siblings}
    schema = {"$defs": {"node": node}, "$ref": "#/$defs/node"}
    before = copy.deepcopy(schema)
    assert not inline_recursive_ref_siblings(schema)
    assert schema == before


def test_non_recursive_refs_with_siblings_are_left_to_the_engines():
    schema = {"$defs": {"n": {"type": "object"}}, "$ref": "#/$defs/n", "required": ["a"]}
    assert not inline_recursive_ref_siblings(schema)


def test_allof_chains_are_intersected_level_by_level():
    defs = {}
    for i in range(50):
        defs[f"a{i}"] = {"type": "object", "properties": {"n": {"$ref": f"#/$defs/a{i + 1}"}}}
        defs[f"b{i}"] = {"properties": {"n": {"$ref": f"#/$defs/b{i + 1}"}}, "required": ["n"]}
    defs["a50"], defs["b50"] = {"type": "object"}, {"type": "object", "required": ["e"]}
    schema = {"$defs": defs, "allOf": [{"$ref": "#/$defs/a0"}, {"$ref": "#/$defs/b0"}]}
    original = copy.deepcopy(schema)
    assert intersect_all_of(schema)
    assert "allOf" not in json.dumps({k: v for k, v in schema.items() if k != "$defs"})
    deep: dict = {"e": 1}
    for _ in range(50):
        deep = {"n": deep}
    _same_verdicts(original, schema, [deep, {"n": {}}, {}, deep["n"]])
    assert not intersect_all_of({"allOf": [{"type": "string"}, {"maxLength": 3}]})


def test_rewrite_schema_keeps_unaffected_schemas_byte_for_byte():
    text = json.dumps({"type": "object", "properties": {"a": {"type": "string", "format": "date"}}})
    rewritten = json.loads(rewrite_schema(text))
    assert rewritten["properties"] == {"a": {"type": "string", "format": "date"}}
    plain = json.dumps({"type": "array", "items": {"type": "integer"}})
    assert rewrite_schema(plain) == plain


@pytest.mark.parametrize("items", [{"not": {}}, [{"not": {}}]])
def test_items_in_both_forms_are_walked(items):
    schema = {"type": "array", "items": items}
    assert forbid_unsatisfiable(schema)
    assert schema["items"] in (False, [False])
