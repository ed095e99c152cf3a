"""Shape checks of a parsed JSON schema: recursion through ``$ref`` and whether a finite
document exists at all.

outlines-core unrolls recursive schemas to a fixed depth, so a recursive schema compiled there
can reach a state with no way forward in the middle of a document. ``auto`` therefore sends
recursive schemas to llguidance (an Earley parser: recursion is native) first.

A recursive schema can also admit no finite document: ``{"$ref": "#"}`` (a reference to itself
and nothing else) or a definition whose required property is the definition again. Both engines
compile such schemas; generation then either offers only EOS where EOS is not allowed or nests
forever until the token budget runs out. ``unsatisfiable_reason`` finds them before compiling
(a least fixed point over the referenced definitions).

Only local references (``#`` and ``#/json/pointer``) are followed; others are treated as
satisfiable and left to the engines. The checks recurse over the schema's structure, whose
nesting the front door bounds (``limits.DEFAULT_MAX_JSON_DEPTH``); references are not followed
recursively.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote, unquote

from radixlm.grammar.base import GrammarCompileError, GrammarSpec
from radixlm.grammar.limits import GrammarLimits, check_spec

_COMBINATORS = ("anyOf", "oneOf", "allOf")
_OBJECT_HINTS = ("properties", "required", "additionalProperties")
_ARRAY_HINTS = ("items", "prefixItems", "minItems")


def resolve_pointer(
    schema: Any, ref: str, anchors: dict[str, str] | None = None
) -> tuple[bool, Any]:
    """``(True, node)`` for a local reference that resolves, else ``(False, None)``. A
    plain-name fragment (``#name``) names an ``$anchor`` / ``$dynamicAnchor``: it resolves
    through ``anchors`` (``anchor_pointers``; computed here when not given)."""
    if not ref.startswith("#"):
        return False, None
    fragment = unquote(ref[1:])
    if fragment and not fragment.startswith("/"):
        pointer = (anchor_pointers(schema) if anchors is None else anchors).get(fragment)
        return (False, None) if pointer is None else resolve_pointer(schema, pointer, {})
    node = schema
    for raw in fragment.split("/")[1:]:
        part = raw.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return False, None
    return True, node


def _refs_in(node: Any) -> list[str]:
    """Local ``$ref`` values anywhere under ``node`` (iterative walk)."""
    refs, stack = [], [node]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            ref = item.get("$ref")
            if isinstance(ref, str) and ref.startswith("#"):
                refs.append(ref)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return refs


# Keywords whose values are data, not schemas (a "$ref" key in them is not a reference), and
# keywords whose values map names to schemas (the names are not keywords).
DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})
SCHEMA_MAPS = frozenset(
    {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"}
)


def schema_nodes(schema: Any) -> Iterator[dict]:
    """Every schema object under ``schema`` (itself included), never looking into data
    (``const``, ``enum``, ``default``, ``examples``), where an object is a value, not a schema."""
    stack = [schema]
    while stack:
        item = stack.pop()
        if isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, dict):
            yield item
            for key, value in item.items():
                if key in SCHEMA_MAPS and isinstance(value, dict):
                    stack.extend(value.values())
                elif key not in DATA_KEYWORDS:
                    stack.append(value)


def anchor_pointers(schema: Any) -> dict[str, str]:
    """``$anchor`` / ``$dynamicAnchor`` name -> the JSON pointer (``#/...``) of its schema
    object, the first found of each name; data (``const``, ``enum``, ...) is never searched."""
    found: dict[str, str] = {}
    nodes = list(schema_nodes(schema))
    if not any("$anchor" in node or "$dynamicAnchor" in node for node in nodes):
        return found  # the usual case: no paths built
    is_schema = {id(node) for node in nodes}
    stack: list[tuple[Any, str]] = [(schema, "#")]
    while stack:
        item, path = stack.pop()
        if isinstance(item, dict):
            if id(item) in is_schema:
                for key in ("$anchor", "$dynamicAnchor"):
                    name = item.get(key)
                    if isinstance(name, str) and name not in found:
                        found[name] = path
            for key, value in item.items():
                if isinstance(value, (dict, list)) and key not in DATA_KEYWORDS:
                    # RFC 3986 fragment characters stay as written (outlines-core does
                    # not percent-decode); others are encoded (llguidance decodes them)
                    part = quote(key.replace("~", "~0").replace("/", "~1"), safe="~!$&'()*+,;=:@")
                    stack.append((value, f"{path}/{part}"))
        elif isinstance(item, list):
            stack.extend((value, f"{path}/{i}") for i, value in enumerate(item))
    return found


def anchors_as_pointers(schema: Any) -> bool:
    """Rewrites in place every ``$ref`` / ``$dynamicRef`` to a plain-name fragment (``#name``)
    that names an anchor of ``schema`` as a ``$ref`` to its JSON pointer: the engines resolve
    only pointers (a ``$dynamicRef`` is read as a ``$ref``: there is one document, so the
    dynamic scope holds this one anchor). Unknown names are left for ``unresolved_ref``.
    Whether anything changed."""
    if not isinstance(schema, dict):
        return False
    anchors: dict[str, str] | None = None
    changed = False
    for node in list(schema_nodes(schema)):
        for key in ("$ref", "$dynamicRef"):
            ref = node.get(key)
            if not isinstance(ref, str) or not ref.startswith("#"):
                continue
            fragment = unquote(ref[1:])
            if not fragment or fragment.startswith("/"):
                continue
            anchors = anchor_pointers(schema) if anchors is None else anchors
            if fragment in anchors and (key == "$ref" or "$ref" not in node):
                del node[key]
                node["$ref"] = anchors[fragment]
                changed = True
    return changed


def ref_nodes(schema: Any) -> Iterator[dict]:
    """Every schema object under ``schema`` (itself included) whose ``$ref`` is a string."""
    return (node for node in schema_nodes(schema) if isinstance(node.get("$ref"), str))


def unresolved_ref(schema: Any) -> str | None:
    """The first ``$ref`` of ``schema`` that is not a local reference (``#...``) or points at
    nothing in ``schema``; None when every reference resolves."""
    anchors = anchor_pointers(schema)
    for node in ref_nodes(schema):
        if not resolve_pointer(schema, node["$ref"], anchors)[0]:
            return node["$ref"]
    return None


def _ref_graph(schema: Any) -> dict[str, list[str]]:
    """Reference target -> targets referenced inside it, for every target reachable from the
    root (unresolvable targets have no entry)."""
    graph: dict[str, list[str]] = {}
    pending = ["#"]
    anchors = anchor_pointers(schema)
    while pending:
        target = pending.pop()
        if target in graph:
            continue
        ok, node = resolve_pointer(schema, target, anchors)
        if not ok:
            continue
        graph[target] = sorted(set(_refs_in(node)))
        pending.extend(graph[target])
    return graph


def recursive_ref(schema: Any) -> str | None:
    """A reference target that (directly or not) contains a reference to itself, or None."""
    if not isinstance(schema, dict):
        return None
    graph = _ref_graph(schema)
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for start in graph:
        if state.get(start):
            continue
        stack = [(start, iter(graph[start]))]
        state[start] = 1
        while stack:
            node, edges = stack[-1]
            nxt = next(edges, None)
            if nxt is None:
                state[node] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return nxt
            elif nxt in graph and not state.get(nxt):
                state[nxt] = 1
                stack.append((nxt, iter(graph[nxt])))
    return None


def unsatisfiable_reason(schema: Any) -> str | None:
    """Why no finite document matches ``schema`` (through ``$ref`` recursion or empty
    ``enum`` / ``false`` parts on every path), or None when one may exist."""
    if not isinstance(schema, (dict, bool)):
        return None
    graph = _ref_graph(schema) if isinstance(schema, dict) else {}
    anchors = anchor_pointers(schema)
    nodes = {t: resolve_pointer(schema, t, anchors)[1] for t in graph}
    known: dict[str, bool] = dict.fromkeys(graph, False)  # least fixed point: start with none
    changed = True
    while changed:
        changed = False
        for target, node in nodes.items():
            if not known[target] and _satisfiable(node, known):
                known[target] = changed = True
    if _satisfiable(schema, known):
        return None
    stuck = sorted(t for t, ok in known.items() if not ok and t != "#")
    if not stuck and not recursive_ref(schema):
        return (
            "no JSON document matches the schema: a part every document needs admits no value "
            "(an empty enum, a false schema, or a required property that is not in properties "
            "while additionalProperties is false)"
        )
    where = f" (through {', '.join(repr(t) for t in stuck[:3])})" if stuck else ""
    return (
        "no finite JSON document matches the schema: every alternative refers back to "
        f"itself with no way to end the recursion{where}"
    )


def _satisfiable(node: Any, known: dict[str, bool]) -> bool:
    if isinstance(node, bool):
        return node
    if not isinstance(node, dict):
        return True  # not a schema: the engines report it
    ref = node.get("$ref")
    if isinstance(ref, str) and not known.get(ref, True):
        return False
    if not all(_satisfiable(s, known) for s in _as_list(node.get("allOf"))):
        return False
    for key in ("anyOf", "oneOf"):
        branches = _as_list(node.get(key))
        if branches and not any(_satisfiable(s, known) for s in branches):
            return False
    if "const" in node or "enum" in node:
        return node.get("enum", [None]) != []
    types = node.get("type")
    if types is None:
        if any(k in node for k in _OBJECT_HINTS):
            types = ["object"]  # what the engines assume
        elif any(k in node for k in _ARRAY_HINTS):
            types = ["array"]
        else:
            return True
    types = types if isinstance(types, list) else [types]
    return any(_type_satisfiable(t, node, known) for t in types)


def _type_satisfiable(kind: Any, node: dict, known: dict[str, bool]) -> bool:
    if kind == "object":
        properties = node.get("properties")
        properties = properties if isinstance(properties, dict) else {}
        extra = node.get("additionalProperties", True)
        for name in _as_list(node.get("required")):
            sub = properties.get(name, extra) if isinstance(name, str) else True
            if not _satisfiable(sub, known):
                return False
        return True
    if kind == "array":
        needed = node.get("minItems", 0)
        needed = needed if isinstance(needed, int) else 0
        prefix = _as_list(node.get("prefixItems"))
        if not all(_satisfiable(s, known) for s in prefix[:needed]):
            return False
        return needed <= len(prefix) or _satisfiable(node.get("items", True), known)
    return True


_I64_MAX = 2**63 - 1
# bound keyword, and the sign that makes "past the 64-bit range" a large positive value
_BOUNDS = (("minimum", 1), ("exclusiveMinimum", 1), ("maximum", -1), ("exclusiveMaximum", -1))


def unenforceable_bound(schema: Any) -> str | None:
    """Why an integer bound cannot be enforced: llguidance clamps integer bounds to 64 bits
    (``"minimum": 1e20`` admitted only 9223372036854775807, which is below it) and the other
    engines ignore bounds, so an integer schema needing values past +-(2^63 - 1) is refused."""
    for node in schema_nodes(schema):
        types = node.get("type")
        if not (types == "integer" or (isinstance(types, list) and "integer" in types)):
            continue
        for key, sign in _BOUNDS:
            value = node.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                if sign * value >= _I64_MAX:
                    return (
                        f"integer {key} {value} is past what the grammar engines enforce "
                        f"(integers within +-{_I64_MAX})"
                    )
    return None


def _as_list(value: Any) -> list:
    return value if isinstance(value, list) else []


def check_compilable(spec: GrammarSpec, limits: GrammarLimits | None = None) -> Any:
    """Raises ``GrammarCompileError`` for a spec no backend should try: over the size or
    nesting limits, control characters, or (JSON schemas) no finite document. Returns the
    parsed schema (None for other kinds). Cheap: run by every backend before compiling, so a
    caller that skipped the front-door check is still safe."""
    try:
        check_spec(spec.kind, spec.value, limits)
    except ValueError as exc:
        raise GrammarCompileError(spec.kind, str(exc)) from None
    if spec.kind != "json_schema":
        return None
    schema = json.loads(str(spec.value))  # parses: check_spec parsed it within the depth bound
    anchors_as_pointers(schema)
    reason = unsatisfiable_reason(schema) or unenforceable_bound(schema)
    if reason is not None:
        raise GrammarCompileError(spec.kind, reason)
    return schema


def optional_property_counts(schema: Any) -> list[int]:
    """The number of optional properties of every object schema in ``schema``."""
    counts, stack = [], [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            properties = node.get("properties")
            if isinstance(properties, dict):
                required = node.get("required")
                required = set(required) if isinstance(required, list) else set()
                counts.append(sum(1 for name in properties if name not in required))
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return counts


def outlines_regex_lower_bound(schema: Any) -> int:
    """A lower bound on the length of outlines-core's regex for ``schema`` from its objects'
    optional properties alone: outlines-core writes every order of them, about
    ``k * k * 35`` characters for ``k`` string properties (5.6 M for 400), ``k * k * 14``
    for one-character names of one-character values; 12 per pair is taken. Lets ``auto`` skip
    building a regex it would reject (in a child process, but seconds of CPU and gigabytes)."""
    total = sum(k * k * 12 for k in optional_property_counts(schema))
    return total
