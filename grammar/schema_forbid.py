"""Rewrites (in place) of schema constructs the engines reject or misread, into ones they
compile exactly. Each returns whether it changed anything; ``schema_rewrite.rewrite_schema``
runs them before its own rewrites.

* ``forbid_unsatisfiable``: a subschema no value satisfies becomes ``false``: ``not: {}`` /
  ``not: true`` (llguidance rejects ``not``; lenient llguidance ignored it, so a property that
  had to be absent was written), an ``allOf`` holding ``false``, a ``$ref`` to such a schema
  (llguidance calls the whole schema unsatisfiable), ``anyOf`` / ``oneOf`` of only such
  branches, ``enum: []``, an object schema whose required property is ``false``. ``false``
  branches of ``anyOf`` / ``oneOf`` are dropped. ``not: {"type": T}`` (annotations aside)
  becomes the complementary ``type``.
* ``drop_forbidden_properties``: a ``false`` property of an object that admits no other keys
  (``additionalProperties: false``, no ``patternProperties``) is removed: the key is absent
  either way, and outlines-core rejects ``false``. Elsewhere ``false`` stays (llguidance keeps
  such a key out of the extra properties).
* ``drop_unknown_formats``: a ``format`` no engine implements is removed (the value is any
  string, as the draft 2020-12 annotation vocabulary reads it); ``schema_keywords`` lists it as
  unenforced.
* ``inline_recursive_ref_siblings``: ``{"$ref": R, <keywords>}`` where R is part of a
  recursion (llguidance: "circular references with sibling keys are not supported";
  outlines-core dropped the siblings) becomes R's keywords merged with the siblings, when the
  two do not interact (no keyword on both sides with different values, except ``required``
  (union) and ``type`` (intersection); ``properties`` on both sides only when neither side
  says anything about extra properties). ``allOf: [{"$ref": R}, S]`` is read as R beside S.
  The merged schema is a new definition (one per distinct R and siblings) that still refers
  to R, so the recursion is kept.
* ``intersect_all_of`` (only where llguidance gives up: its intersection depth): an ``allOf``
  of plain object schemas becomes one object schema, level by level.

Walks are iterative over schema positions only (never into ``const`` / ``enum`` data).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from typing import Any

from radixlm.grammar.schema_checks import resolve_pointer
from radixlm.grammar.schema_keywords import KNOWN_FORMATS

_ANNOTATIONS = frozenset(
    {"title", "description", "default", "examples", "$comment", "$schema", "$id", "id",
     "deprecated", "readOnly", "writeOnly"}
)  # fmt: skip
_SINGLE = (
    "items",
    "additionalProperties",
    "additionalItems",
    "not",
    "if",
    "then",
    "else",
    "contains",
    "propertyNames",
    "unevaluatedProperties",
    "unevaluatedItems",
)
_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_TYPES = ("null", "boolean", "object", "array", "number", "string")
_MAX_MERGED = 64  # merged definitions per schema (each a copy of its target)
_MAX_MERGED_NODES = 20_000  # schema objects copied into them, all together
_DERIVED = frozenset({"$ref", "allOf", "anyOf", "oneOf", "required"})
_MAX_PASSES = 8  # each pass is linear; a chain of false references needs one pass per link


_KIND = {  # "items" is a schema or (before 2020-12) a list of them
    **dict.fromkeys(_SINGLE, "single"),
    **dict.fromkeys(_LISTS, "list"),
    **dict.fromkeys(_MAPS, "map"),
}


def _slots(schema: Any) -> Iterator[tuple[Any, Any, Any]]:
    """``(container, key, subschema)`` for every subschema position under ``schema``."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        for key, value in node.items():
            kind = _KIND.get(key)
            if kind is None:
                continue
            if isinstance(value, (dict, bool)) and (kind == "single" or key == "items"):
                yield node, key, value
                stack.append(value)
            elif isinstance(value, list) and kind == "list":
                for i, item in enumerate(value):
                    if isinstance(item, (dict, bool)):
                        yield value, i, item
                        stack.append(item)
            elif isinstance(value, dict) and kind == "map":
                for name, item in value.items():
                    if isinstance(item, (dict, bool)):
                        yield value, name, item
                        stack.append(item)


def _nodes(schema: Any) -> list[dict]:
    found = [schema] if isinstance(schema, dict) else []
    found += [value for _, _, value in _slots(schema) if isinstance(value, dict)]
    return found


def _is_empty(node: Any) -> bool:
    """Whether every value satisfies ``node`` (``true``, or annotations only)."""
    return node is True or (isinstance(node, dict) and set(node) <= _ANNOTATIONS)


def _types(node: dict) -> list[str] | None:
    kind = node.get("type")
    if isinstance(kind, str):
        return [kind]
    if isinstance(kind, list) and all(isinstance(t, str) for t in kind):
        return list(kind)
    return None


def _never(root: Any, node: Any, false_refs: dict[str, bool]) -> bool:
    """Whether no value satisfies ``node`` (after its subschemas were normalized);
    ``false_refs`` memoizes which references point at ``false``."""
    if node is False:
        return True
    if not isinstance(node, dict):
        return False
    if "not" in node and _is_empty(node["not"]):
        return True
    if node.get("enum") == [] or _types(node) == []:
        return True
    if isinstance(node.get("allOf"), list) and False in node["allOf"]:
        return True
    for key in ("anyOf", "oneOf"):
        branches = node.get(key)
        if isinstance(branches, list) and branches and all(b is False for b in branches):
            return True
    ref = node.get("$ref")
    if isinstance(ref, str):
        if ref not in false_refs:
            false_refs[ref] = resolve_pointer(root, ref, {}) == (True, False)
        if false_refs[ref]:
            return True
    if _types(node) == ["object"] and isinstance(node.get("required"), list):
        properties = node.get("properties")
        properties = properties if isinstance(properties, dict) else {}
        extra = node.get("additionalProperties", True)
        patterns = node.get("patternProperties")
        for name in node["required"]:
            if properties.get(name, None if patterns else extra) is False:
                return True
    return False


def _complement_type(node: dict) -> bool:
    """``not: {"type": T}`` beside an optional ``type`` as one ``type``; whether done."""
    negated = node.get("not")
    if not isinstance(negated, dict) or set(negated) - _ANNOTATIONS != {"type"}:
        return False
    excluded = _types(negated)
    allowed = _types(node) if "type" in node else list(_TYPES)
    if excluded is None or allowed is None:
        return False
    if "integer" in excluded and "number" not in excluded and "number" in allowed:
        return False  # numbers that are not integers: no type says that
    kept = [t for t in allowed if t not in excluded]
    kept = [t for t in kept if not (t == "integer" and "number" in excluded)]
    del node["not"]
    node["type"] = kept[0] if len(kept) == 1 else kept
    return True


def _may_be_never(node: dict) -> bool:
    """Whether ``node`` holds what ``_never`` looks for (a ``false`` subschema, ``not``, an
    empty ``enum`` / ``type``)."""
    if "not" in node or node.get("enum") == [] or node.get("type") == []:
        return True
    return any(
        value is False for key, value in node.items() if key != "additionalProperties"
    ) or any(
        isinstance(node.get(key), (list, dict)) and False in _values(node[key])
        for key in (*_LISTS, *_MAPS)
    )


def _values(container: list | dict) -> list:
    return list(container.values()) if isinstance(container, dict) else container


def forbid_unsatisfiable(schema: Any) -> bool:
    if not isinstance(schema, dict):
        return False
    changed = False
    nodes = _nodes(schema)
    for node in nodes:
        changed |= _complement_type(node)
    if not changed and not any(_may_be_never(node) for node in nodes):
        return False  # the usual case: one walk
    slots = [slot for slot in _slots(schema) if isinstance(slot[2], dict)]
    for _ in range(_MAX_PASSES):  # later passes: only what a false subschema can make false
        replaced = False
        false_refs: dict[str, bool] = {}
        for container, key, value in slots:
            if container[key] is value and _never(schema, value, false_refs):
                container[key] = False
                replaced = True
        changed |= replaced
        if not replaced:
            break
        slots = [slot for slot in slots if _DERIVED.intersection(slot[2])]
    for node in _nodes(schema):
        for key in ("anyOf", "oneOf"):
            branches = node.get(key)
            if isinstance(branches, list) and False in branches and any(branches):
                node[key] = [b for b in branches if b is not False]
                changed = True
    return changed


def drop_forbidden_properties(schema: Any) -> bool:
    changed = False
    for node in _nodes(schema):
        properties = node.get("properties")
        if (
            isinstance(properties, dict)
            and node.get("additionalProperties") is False
            and "patternProperties" not in node
        ):
            required = node.get("required")
            required = set(required) if isinstance(required, list) else set()
            for name in [n for n, v in properties.items() if v is False and n not in required]:
                del properties[name]
                changed = True
    return changed


def drop_unknown_formats(schema: Any) -> bool:
    changed = False
    for node in _nodes(schema):
        value = node.get("format")
        if isinstance(value, str) and value not in KNOWN_FORMATS:
            del node["format"]
            changed = True
    return changed


# ---------------------------------------------------------------------- recursive $ref
_OBJECT_GROUP = frozenset({"properties", "patternProperties", "additionalProperties"})
_INTERACTING = (
    frozenset({"items", "prefixItems", "additionalItems"}),
    frozenset({"if", "then", "else"}),
    frozenset({"contains", "minContains", "maxContains"}),
)
_NEVER_MERGED = frozenset({"unevaluatedProperties", "unevaluatedItems", "$ref", "$dynamicRef"})
_HOLDERS = frozenset({"$defs", "definitions"})


def _recursive_targets(root: dict) -> set[str]:
    """Local ``$ref`` values whose target refers (directly or not) back to itself."""
    graph: dict[str, set[str]] = {}
    pending = ["#"] + [n["$ref"] for n in _nodes(root) if isinstance(n.get("$ref"), str)]
    while pending:
        ref = pending.pop()
        if ref in graph:
            continue
        ok, target = resolve_pointer(root, ref, {})
        if not ok:
            continue
        children = {n["$ref"] for n in _nodes(target) if isinstance(n.get("$ref"), str)}
        if ref == "#":  # the root's definitions are not part of the root schema's own body
            children = {
                n["$ref"]
                for n in _nodes({k: v for k, v in root.items() if k not in _HOLDERS})
                if isinstance(n.get("$ref"), str)
            }
        graph[ref] = children
        pending.extend(children)
    cyclic = set()
    for start in graph:
        seen, stack = set(), list(graph[start])
        while stack:
            ref = stack.pop()
            if ref == start:
                cyclic.add(start)
                break
            if ref not in seen:
                seen.add(ref)
                stack.extend(graph.get(ref, ()))
    return cyclic


def _merged(target: dict, siblings: dict) -> dict | None:
    """``target`` and ``siblings`` as one schema object admitting exactly what both do, or
    None when their keywords interact."""
    body = {k: v for k, v in target.items() if k not in _HOLDERS and k not in _ANNOTATIONS}
    if _NEVER_MERGED.intersection(body) or _NEVER_MERGED.intersection(siblings):
        return None
    for group in _INTERACTING:
        if group.intersection(body) and group.intersection(siblings):
            return None
    out = dict(body)
    for key, value in siblings.items():
        if key not in out or out[key] == value:
            out[key] = value
        elif key == "required" and isinstance(value, list) and isinstance(out[key], list):
            out[key] = list(dict.fromkeys([*out[key], *value]))
        elif key == "type" and _types(body) is not None and _types(siblings) is not None:
            mine = _types(siblings) or []
            kept = [
                t for t in _types(body) or [] if t in mine or (t == "integer" and "number" in mine)
            ]
            kept += [t for t in mine if t == "integer" and "number" in (_types(body) or [])]
            if not kept:
                return None
            out[key] = kept[0] if len(kept) == 1 else kept
        elif key == "properties" and isinstance(value, dict) and isinstance(out[key], dict):
            both = _OBJECT_GROUP - {"properties"}
            if both.intersection(body) or both.intersection(siblings):
                return None
            common = set(value) & set(out[key])
            if any(value[n] != out[key][n] for n in common):
                return None
            out[key] = {**out[key], **value}
        else:
            return None
    if (_OBJECT_GROUP.intersection(body) - {"properties"}) and (
        _OBJECT_GROUP.intersection(siblings) - set(body)
    ):
        return None  # extra-property rules of one side would apply to the other's keys
    if (_OBJECT_GROUP.intersection(siblings) - {"properties"}) and "properties" in body:
        if "properties" not in siblings or siblings["properties"] != body["properties"]:
            return None
    return out


def _sibling_form(node: dict) -> tuple[str, dict] | None:
    """``(ref, siblings)`` when ``node`` is a ``$ref`` beside keywords, or an ``allOf`` of one
    pure ``$ref`` and one schema object with nothing else beside it."""
    ref = node.get("$ref")
    if isinstance(ref, str):
        siblings = {k: v for k, v in node.items() if k != "$ref" and k not in _ANNOTATIONS}
        siblings = {k: v for k, v in siblings.items() if k not in _HOLDERS}
        return (ref, siblings) if siblings else None
    branches = node.get("allOf")
    others = set(node) - _ANNOTATIONS - _HOLDERS - {"allOf"}
    if not isinstance(branches, list) or len(branches) != 2 or others:
        return None
    for first, second in (branches, branches[::-1]):
        if (
            isinstance(first, dict)
            and isinstance(first.get("$ref"), str)
            and set(first) - _ANNOTATIONS == {"$ref"}
            and isinstance(second, dict)
        ):
            rest = {k: v for k, v in second.items() if k not in _ANNOTATIONS}
            return (first["$ref"], rest) if rest and "$ref" not in rest else None
    return None


def inline_recursive_ref_siblings(schema: Any) -> bool:
    if not isinstance(schema, dict):
        return False
    holder = schema.get("$defs", {})
    if not isinstance(holder, dict) or not any(_sibling_form(n) for n in _nodes(schema)):
        return False  # the usual case: one walk
    cyclic = _recursive_targets(schema)
    if not cyclic:
        return False
    made: dict[str, str] = {}  # (ref, siblings) as JSON -> the merged definition's pointer
    copied_nodes = 0
    pending = _nodes(schema)
    while pending:
        node = pending.pop()
        form = _sibling_form(node)
        if form is None or form[0] not in cyclic:
            continue
        key = json.dumps(form, sort_keys=True)
        if key not in made:
            if len(made) >= _MAX_MERGED:
                continue
            ok, target = resolve_pointer(schema, form[0], {})
            merged = _merged(target, form[1]) if ok and isinstance(target, dict) else None
            if merged is None:
                continue
            copied = _nodes(merged)
            if copied_nodes + len(copied) > _MAX_MERGED_NODES:
                continue  # a large target copied many times: leave the rest to the engines
            copied_nodes += len(copied)
            name = _fresh_name(holder, len(holder))
            holder[name] = merged = copy.deepcopy(merged)
            made[key] = f"#/$defs/{name}"
            pending.extend(_nodes(merged))  # its copies of the sibling forms point here too
        for name in [k for k in node if k not in _ANNOTATIONS and k not in _HOLDERS]:
            del node[name]
        node["$ref"] = made[key]
    if made and "$defs" not in schema:
        schema["$defs"] = holder
    return bool(made)


def _fresh_name(holder: dict, index: int) -> str:
    name = f"radixlm-{index}"
    while name in holder:
        name += "_"
    return name


# ---------------------------------------------------------------------- allOf of objects
_PLAIN_OBJECT_KEYS = frozenset({"type", "properties", "required", "additionalProperties"})
_MAX_INTERSECTIONS = 1024  # intersection definitions per schema
_MAX_REF_HOPS = 32


def _plain_object(root: dict, branch: Any) -> dict | None:
    """``branch`` (through plain ``$ref`` chains) when it is an object schema of
    ``properties`` / ``required`` / ``additionalProperties`` only, else None."""
    for _ in range(_MAX_REF_HOPS):
        if not (isinstance(branch, dict) and set(branch) - _ANNOTATIONS == {"$ref"}):
            break
        ok, branch = resolve_pointer(root, branch["$ref"], {})
        if not ok:
            return None
    if not isinstance(branch, dict) or set(branch) - _ANNOTATIONS - _PLAIN_OBJECT_KEYS:
        return None
    if _types(branch) not in (None, ["object"]) or not isinstance(
        branch.get("properties", {}), dict
    ):
        return None
    return branch


def _all_of(schemas: list[Any]) -> Any:
    """The intersection of ``schemas`` as one schema (an ``allOf`` only when needed)."""
    kept: list[Any] = []
    for schema in schemas:
        if schema is False:
            return False
        if not _is_empty(schema) and schema not in kept:
            kept.append(schema)
    if not kept:
        return {}
    return kept[0] if len(kept) == 1 else {"allOf": kept}


def _intersect_objects(parts: list[dict]) -> dict:
    names = list(dict.fromkeys(n for p in parts for n in p.get("properties", {})))
    properties = {
        name: _all_of(
            [p.get("properties", {}).get(name, p.get("additionalProperties", True)) for p in parts]
        )
        for name in names
    }
    required = list(dict.fromkeys(n for p in parts for n in p.get("required", [])))
    out: dict[str, Any] = {"type": "object", "properties": properties}
    if required:
        out["required"] = required
    extra = [p["additionalProperties"] for p in parts if "additionalProperties" in p]
    if extra:
        out["additionalProperties"] = _all_of(extra)
    return out


def intersect_all_of(schema: Any) -> bool:
    """Every ``allOf`` (nothing beside it) of plain object schemas, directly or through
    ``$ref``s, becomes one object schema (a new definition, one per distinct ``allOf``):
    properties on several sides get the ``allOf`` of their schemas, which is rewritten the same
    way. llguidance intersects such ``allOf``s recursively through every level of nesting
    ("Schema intersection stack level exceeded" past 128 levels: two chains of 40 nested
    definitions); here a worklist does it, one level per definition."""
    if not isinstance(schema, dict) or not isinstance(schema.get("$defs", {}), dict):
        return False
    holder = schema.get("$defs", {})
    made: dict[str, str] = {}  # the allOf list as JSON -> its definition's pointer
    pending = _nodes(schema)
    while pending:
        node = pending.pop()
        branches = node.get("allOf")
        if not isinstance(branches, list) or len(branches) < 2:
            continue
        if set(node) - _ANNOTATIONS - _HOLDERS - {"allOf"}:
            continue
        key = json.dumps(branches, sort_keys=True)
        if key not in made:
            parts = [_plain_object(schema, branch) for branch in branches]
            if len(made) >= _MAX_INTERSECTIONS or any(p is None for p in parts):
                continue
            merged = _intersect_objects(parts)  # type: ignore[arg-type]
            name = _fresh_name(holder, len(holder))
            holder[name] = merged
            made[key] = f"#/$defs/{name}"
            pending.extend(_nodes(merged))
        del node["allOf"]
        node["$ref"] = made[key]
    if made and "$defs" not in schema:
        schema["$defs"] = holder
    return bool(made)
