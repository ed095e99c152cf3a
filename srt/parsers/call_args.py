"""Arguments built from parts, for formats whose calls are not JSON objects (qwen3_coder's XML
parameters, pythonic keyword arguments): the JSON text written as parameters complete, the
types a parameter's schema allows, typed reading of parameter text, safe reading of Python
literals, and the structural-tag content of a tool's parameters.

The arguments stream as parameters complete: ``{"a": 1`` after the first, ``, "b": "x"`` after
the next, ``}`` (``{}`` without parameters) when the call closes. A string parameter may stream
its value as it is read (``ArgumentsWriter.string_part``). An output cut off inside a call keeps
exactly the arguments streamed so far (the object not closed, a value being read not written,
except a streamed string's text so far).
"""

from __future__ import annotations

import ast
import json
import math
import warnings
from collections.abc import Callable
from urllib.parse import unquote

from radixlm.srt.parsers.call_stream import Emitter
from radixlm.srt.parsers.constraints import placed, quoted, with_defs
from radixlm.srt.parsers.json_stream import WHITESPACE, loads_strict
from radixlm.srt.parsers.tool_base import ToolSpec

JSON_TYPES = frozenset(("string", "number", "integer", "boolean", "object", "array", "null"))
_MAX_DEPTH = 32  # references followed, nesting read in a literal


class ArgumentsWriter:
    """The JSON text of one call's arguments, written to the emitter as parameters complete."""

    def __init__(self, emitter: Emitter) -> None:
        self._em = emitter
        self._count = 0

    def key(self, name: str) -> None:
        """Starts the parameter ``name`` (its value follows)."""
        self._em.arguments(("{" if self._count == 0 else ", ") + quoted(name) + ": ")
        self._count += 1

    def value(self, value: object) -> None:
        self._em.arguments(json.dumps(value, ensure_ascii=False))

    def string_part(self, text: str) -> None:
        """Part of a string value's body (the quotes are written by the caller)."""
        if text:
            self._em.arguments(json.dumps(text, ensure_ascii=False)[1:-1])

    def raw(self, text: str) -> None:
        self._em.arguments(text)

    def close(self) -> None:
        """The call ends: the object is closed."""
        self._em.arguments("}" if self._count else "{}")
        self._em.end_call()


def partial_end(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


# -- the types a parameter's schema allows --


def resolve_ref(root: object, ref: str) -> object | None:
    """The schema a local reference (``#`` or ``#/a/b``) points at in ``root``, else None."""
    if not ref.startswith("#"):
        return None
    node = root
    for part in unquote(ref[1:]).split("/")[1:]:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _type_of(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def value_types(schema: object, root: object, depth: int = 0) -> frozenset[str] | None:
    """The JSON types ``schema`` allows (from ``type``, ``enum`` / ``const``, ``anyOf`` /
    ``oneOf``, local ``$ref``), or None when it does not say."""
    if depth > _MAX_DEPTH or not isinstance(schema, dict):
        return None
    ref = schema.get("$ref")
    if isinstance(ref, str):
        return value_types(resolve_ref(root, ref), root, depth + 1)
    kind = schema.get("type")
    if isinstance(kind, str):
        kind = [kind]
    if isinstance(kind, list):
        found = frozenset(k for k in kind if isinstance(k, str)) & JSON_TYPES
        return found or None
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return frozenset(_type_of(v) for v in schema["enum"])
    if "const" in schema:
        return frozenset([_type_of(schema["const"])])
    for key in ("anyOf", "oneOf"):
        branches = schema.get(key)
        if isinstance(branches, list) and branches:
            found = [value_types(b, root, depth + 1) for b in branches]
            if any(f is None for f in found):
                return None
            return frozenset().union(*found)  # type: ignore[arg-type]
    if "properties" in schema:
        return frozenset(["object"])
    if "items" in schema:
        return frozenset(["array"])
    return None


def is_text(types: frozenset[str] | None) -> bool:
    """Whether a parameter of these types is read as plain text (strings, or unknown)."""
    return types is None or types == {"string"}


def typed_value(text: str, types: frozenset[str]) -> object:
    """Parameter text read as the first of its allowed types that fits: null, boolean, number,
    object / array (JSON, else a Python literal), else the text itself."""
    word = text.strip(WHITESPACE)
    lower = word.lower()
    if ("null" in types or "string" not in types) and lower in ("null", "none"):
        return None
    if "boolean" in types and lower in ("true", "false"):
        return lower == "true"
    if types & {"integer", "number", "object", "array"}:
        value = _json_or_literal(word, types)
        if value is not _MISSING:
            return value
    return text


_MISSING = object()


def _json_or_literal(word: str, types: frozenset[str]) -> object:
    try:
        value = loads_strict(word)
    except (ValueError, RecursionError):
        value = literal_value(word) if types & {"object", "array"} else _MISSING
    if isinstance(value, bool) or value is None:
        return _MISSING
    if isinstance(value, float) and value.is_integer() and "number" not in types:
        value = int(value)
    kind = _type_of(value)
    if kind in types or (kind == "integer" and "number" in types):
        return value
    return _MISSING


# -- Python literals --


def literal_value(text: str) -> object:
    """The JSON value of a Python literal (strings, numbers, True/False/None and JSON's
    true/false/null, lists, tuples as lists, dicts with string keys), else ``_MISSING``.
    Nothing is evaluated: the text is parsed and only literal nodes are read. A double-quoted
    string that is also a JSON string reads as JSON."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tree = ast.parse(text.strip(WHITESPACE), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return _MISSING
    lines = text.strip(WHITESPACE).encode("utf-8").split(b"\n")
    try:
        return _literal(tree.body, lines, 0)
    except (ValueError, RecursionError):
        return _MISSING


def is_literal(value: object) -> bool:
    return value is not _MISSING


_NAMES = {"True": True, "False": False, "None": None, "true": True, "false": False}
_NAMES["null"] = None


def _literal(node: ast.AST, lines: list[bytes], depth: int) -> object:
    if depth > _MAX_DEPTH:
        raise ValueError("too deep")
    if isinstance(node, ast.Constant):
        value = node.value
        if isinstance(value, str):
            return _string(node, value, lines)
        if isinstance(value, bool) or value is None:
            return value
        if isinstance(value, (int, float)) and not (
            isinstance(value, float) and not math.isfinite(value)
        ):
            return value
        raise ValueError("not a JSON literal")
    if isinstance(node, ast.Name) and node.id in _NAMES:
        return _NAMES[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        operand = _literal(node.operand, lines, depth + 1)
        if isinstance(operand, bool) or not isinstance(operand, (int, float)):
            raise ValueError("a sign before a non-number")
        return -operand if isinstance(node.op, ast.USub) else operand
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e, lines, depth + 1) for e in node.elts]
    if isinstance(node, ast.Dict):
        out = {}
        for key, value in zip(node.keys, node.values, strict=True):
            name = None if key is None else _literal(key, lines, depth + 1)
            if not isinstance(name, str):
                raise ValueError("a dict key that is not a string")
            out[name] = _literal(value, lines, depth + 1)
        return out
    raise ValueError("not a literal")


def _string(node: ast.Constant, value: str, lines: list[bytes]) -> str:
    """Python's reading of a string, or JSON's where the source is a JSON string (they differ
    on ``\\/`` and escaped surrogate pairs)."""
    if node.lineno != node.end_lineno or node.end_col_offset is None:
        return value
    source = lines[node.lineno - 1][node.col_offset : node.end_col_offset]
    if source.startswith(b'"') and not source.startswith(b'"""'):
        try:
            decoded = json.loads(source)
        except ValueError:
            return value
        if isinstance(decoded, str):
            return decoded
    return value


# -- structural-tag content of a tool's parameters --


def _property_schemas(tool: ToolSpec) -> list[tuple[str, dict, object, bool]]:
    """(name, schema to write its value with, its own schema, required) per declared
    property; a schema with local references is written as a reference into the tool's
    schema, placed under ``$defs``."""
    parameters = tool.parameters
    properties = parameters.get("properties")
    if not isinstance(properties, dict):
        return []
    required = parameters.get("required")
    required = set(required) if isinstance(required, list) else set()
    defs: dict = {}
    base = placed(parameters, "tool", defs)
    out = []
    for name, schema in properties.items():
        if "$ref" in base:
            pointer = name.replace("~", "~0").replace("/", "~1")
            written = with_defs({"$ref": f"{base['$ref']}/properties/{pointer}"}, defs)
        else:
            written = schema if isinstance(schema, dict) else {}
        out.append((name, written, schema, name in required))
    return out


def parameters_format(
    tool: ToolSpec, loose: bool, element: Callable[[str, dict, object, bool], dict], sep: str
) -> dict:
    """The format of a tool's parameters, each written by ``element(name, written, schema,
    loose)``: the required ones in schema order, then any of the others (joined by ``sep``).
    ``loose`` (the tool's arguments are free): every declared parameter is optional."""
    props = _property_schemas(tool)
    required = [] if loose else [p for p in props if p[3]]
    optional = [p for p in props if loose or not p[3]]
    elements: list[dict] = []
    for i, (name, written, schema, _) in enumerate(required):
        if i and sep:
            elements.append({"type": "const_string", "value": sep})
        elements.append(element(name, written, schema, loose))
    if optional:
        tags = [element(name, written, schema, loose) for name, written, schema, _ in optional]
        many = {"type": "tags_with_separator", "tags": tags, "separator": sep}
        if required:
            lead = [{"type": "const_string", "value": sep}] if sep else []
            more = {"type": "sequence", "elements": [*lead, {**many, "at_least_one": True}]}
            many = {"type": "or", "elements": [{"type": "const_string", "value": ""}, more]}
        elements.append(many)
    if not elements:
        return {"type": "const_string", "value": ""}
    return elements[0] if len(elements) == 1 else {"type": "sequence", "elements": elements}


_REGEX_SPECIALS = set("\\.+*?()|[]{}^$#&-~")


def literal_regex(text: str) -> str:
    """``text`` as a regex (Python and Rust syntax) matching exactly it."""
    out = []
    for c in text:
        if c in _REGEX_SPECIALS:
            out.append("\\" + c)
        elif c == "\n":
            out.append("\\n")
        elif c == "\r":
            out.append("\\r")
        elif c == "\t":
            out.append("\\t")
        else:
            out.append(c)
    return "".join(out)


def string_choices(schema: object, root: object) -> list[str] | None:
    """The strings an ``enum`` / ``const`` (possibly behind a ``$ref``) allows, else None."""
    if isinstance(schema, dict) and isinstance(schema.get("$ref"), str):
        schema = resolve_ref(root, schema["$ref"])
    if not isinstance(schema, dict):
        return None
    if "const" in schema and isinstance(schema["const"], str):
        return [schema["const"]]
    values = schema.get("enum")
    if isinstance(values, list) and values and all(isinstance(v, str) for v in values):
        return values
    return None
