"""JSON Schema rewrites applied before either backend compiles a schema.

``rewrite_schema`` applies the rewrites below; the backends call it. The first three
(``schema_forbid``) turn constructs the engines reject or misread into ones they compile
exactly: subschemas no value satisfies (``false``, ``not: {}``) become ``false`` and forbid
what they stand for (a property that must be absent), ``not: {"type": ...}`` becomes the
complementary ``type``, unknown ``format`` values are dropped (any string; listed as
unenforced) and a ``$ref`` into a recursion with sibling keywords is inlined.

``close_objects`` (on by default, ``strict_objects``): an object schema that declares
``properties`` but says nothing about ``additionalProperties`` (nor ``patternProperties`` or
``unevaluatedProperties``, and whose ``required``/``minProperties`` the declared properties
can meet) admits no properties beyond the declared ones, as XGrammar's strict
mode (SGLang's default) and OpenAI's strict structured outputs do. The documents it admits are a
subset of the schema's, so every output still validates; without it a small model given a schema
writes key after undeclared key (often copying the schema's own text) until its token budget
runs out. Objects inside ``allOf`` (and the definitions they reference) are left open, since
closing one branch would forbid the properties the other branches add.

Both backends compile ``oneOf`` as ``anyOf``. ``tighten_one_of`` removes one common way that lets
invalid documents through: branches that each only describe the same single optional property,

    {"oneOf": [{"properties": {"events": A}}, {"properties": {"events": B}}]}

An object without ``events`` matches every branch, so ``oneOf`` rejects it, but ``anyOf``
accepts it. Requiring ``events`` in every branch leaves exactly the objects that match one
branch (or several, if ``A`` and ``B`` overlap: that part stays approximate).
"""

from __future__ import annotations

import json
from typing import Any

from radixlm.grammar.schema_checks import anchors_as_pointers, resolve_pointer, schema_nodes
from radixlm.grammar.schema_forbid import (
    drop_forbidden_properties,
    drop_unknown_formats,
    forbid_unsatisfiable,
    inline_recursive_ref_siblings,
    intersect_all_of,
)

_ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$comment"})


def rewrite_schema(
    schema_text: str, strict_objects: bool = True, intersect_objects: bool = False
) -> str:
    """``schema_text`` with the ``schema_forbid`` rewrites, ``tighten_one_of``, (if
    ``strict_objects``) ``close_objects`` and (if ``intersect_objects``) ``intersect_all_of``
    applied; unchanged text when nothing applies or the text is not JSON."""
    try:
        schema = json.loads(schema_text)
    except ValueError:
        return schema_text  # the backends report the parse error
    if schema is True:  # the boolean schema any value satisfies: the empty schema
        return "{}"
    changed = anchors_as_pointers(schema)  # first: the walks below follow pointers only
    changed |= drop_unknown_formats(schema)
    changed |= inline_recursive_ref_siblings(schema)
    if intersect_objects:
        changed |= intersect_all_of(schema)
    changed |= forbid_unsatisfiable(schema)
    changed |= _visit(schema)
    if strict_objects:
        changed |= close_objects(schema)
    changed |= drop_forbidden_properties(schema)  # after closing: absent keys stay absent
    return json.dumps(schema) if changed else schema_text


def close_objects(schema: Any) -> bool:
    """Sets ``additionalProperties: false`` in place on every object schema that declares
    ``properties`` and leaves extra properties unspecified, except in the parts that combine
    with other schemas (``_combined_nodes``); whether anything changed."""
    keep_open = {id(node) for node in _combined_nodes(schema)}
    changed = False
    for node in list(schema_nodes(schema)):  # never into const / enum / default data
        if id(node) not in keep_open and _is_open_declared_object(node):
            node["additionalProperties"] = False
            changed = True
    return changed


# keys that say something about extra properties, or may add properties of their own
_OPEN_KEYS = (
    "additionalProperties",
    "patternProperties",
    "unevaluatedProperties",
    "dependentSchemas",
    "dependencies",
    "if",
    "then",
    "else",
    "propertyNames",
    "allOf",
    "anyOf",
    "oneOf",
    "$ref",
)


def _is_open_declared_object(node: dict) -> bool:
    """An object schema with declared properties that closing would not make unsatisfiable."""
    properties = node.get("properties")
    if not isinstance(properties, dict) or any(k in node for k in _OPEN_KEYS):
        return False
    required = node.get("required", [])
    if not isinstance(required, list) or not set(map(str, required)) <= set(properties):
        return False
    min_properties = node.get("minProperties", 0)
    return isinstance(min_properties, int) and min_properties <= len(properties)


def _combined_nodes(schema: Any) -> list[Any]:
    """The nodes a document must satisfy together with another schema's properties, and the
    local ``$ref`` targets (transitively) used there: everything inside an ``allOf``; the
    ``anyOf`` / ``oneOf`` branches of a node that declares properties itself; the target of a
    ``$ref`` beside declared properties. Closing one of them would refuse the other's keys."""
    found: list[Any] = []
    seen: set[int] = set()
    stack: list[Any] = []
    for n in _walk(schema):
        if not isinstance(n, dict):
            continue
        stack.extend(n["allOf"] if isinstance(n.get("allOf"), list) else [])
        if "properties" in n or "required" in n:
            for key in ("anyOf", "oneOf"):
                stack.extend(n[key] if isinstance(n.get(key), list) else [])
            if isinstance(n.get("$ref"), str):
                stack.append({"$ref": n["$ref"]})
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        found.append(node)
        children = (
            list(node.values())
            if isinstance(node, dict)
            else (list(node) if isinstance(node, list) else [])
        )
        if isinstance(node, dict) and isinstance(node.get("$ref"), str):
            found_target, target = resolve_pointer(schema, node["$ref"], {})  # anchors: pointers
            if found_target:
                children.append(target)
        stack.extend(c for c in children if isinstance(c, (dict, list)))
    return found


def _walk(node: Any):
    return schema_nodes(node)


def tighten_one_of(schema_text: str) -> str:
    """``schema_text`` with the rewrite above applied; unchanged text when nothing applies."""
    try:
        schema = json.loads(schema_text)
    except ValueError:
        return schema_text  # the backends report the parse error
    return json.dumps(schema) if _visit(schema) else schema_text


def _visit(schema: Any) -> bool:
    changed = False
    for node in list(schema_nodes(schema)):  # never into const / enum / default data
        branches = node.get("oneOf")
        if isinstance(branches, list):
            changed |= _require_shared_property(branches)
    return changed


def _require_shared_property(branches: list[Any]) -> bool:
    if len(branches) < 2 or not all(_single_optional_property(b) for b in branches):
        return False
    keys = {next(iter(b["properties"])) for b in branches}
    if len(keys) != 1:
        return False
    for branch in branches:
        branch["required"] = list(keys)
    return True


def _single_optional_property(branch: Any) -> bool:
    if not isinstance(branch, dict) or branch.get("type", "object") != "object":
        return False
    properties = branch.get("properties")
    if not isinstance(properties, dict) or len(properties) != 1:
        return False
    return set(branch) - _ANNOTATIONS <= {"properties", "type"}
