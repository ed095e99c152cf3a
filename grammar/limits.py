"""Cheap checks of a grammar spec before anything compiles it (the request front door).

Every check here is linear in the spec's length, pure Python and never recursive, so a hostile
spec costs the HTTP process microseconds to milliseconds, and a spec that passes cannot make a
backend recurse past Python's stack or a DFA grow without bound because of its *shape* alone:

* size: at most ``max_spec_bytes`` UTF-8 bytes per spec (default 256 KiB; the largest schema
  of the jsonschemabench sample is about 100 KiB). A 2 MB schema of optional properties made
  outlines-core's schema-to-regex step allocate tens of gigabytes.
* JSON nesting: at most ``max_json_depth`` nested arrays / objects (default 128), counted by an
  iterative scan of the text *before* ``json.loads`` (which recurses in C and in the backends'
  Python rewrites: 3,000 levels raised RecursionError).
* control characters: a regex, EBNF grammar or choice may not contain NUL or other C0 control
  characters (tab, line feed and carriage return are fine), written literally or as a ``\\x00``
  / ``\\u0000`` / ``\\x{0}`` escape: outputs holding NUL break C-string clients and logs.
* JSON schemas must parse and be an object or a boolean.
* structural tags must parse (``structural_tag.parse_structural_tag``: recursive, but only
  below the nesting bound) and hold at most ``max_structural_nodes`` formats (tags, elements)
  and ``max_structural_triggers`` triggers; their strings may not hold control characters.

``check_spec(kind, value)`` raises ``ValueError`` with a message naming the parameter.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from radixlm.grammar.regex_text import check_regex_structure

DEFAULT_MAX_SPEC_BYTES = 256 * 1024
DEFAULT_MAX_JSON_DEPTH = 128
# A tool-calling tag holds about 3 formats per tool; 1,024 formats compile in well under a
# second (structural_tag_lark) and leave room for several hundred tools.
DEFAULT_MAX_STRUCTURAL_NODES = 1024
DEFAULT_MAX_STRUCTURAL_TRIGGERS = 128
# C0 controls except \t \n \r.
_CONTROL_CHARS = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f]")
# A NUL escape not itself escaped: \x00, \x{0...}, \u0000, \U00000000, \0 (odd backslashes).
_NUL_ESCAPE = re.compile(r"(?<!\\)(?:\\\\)*\\(?:x00|x\{0+\}|u0000|U00000000|0(?![0-9]))")
# Each kind's parameter name in sampling params (json_object has no text).
_PARAMETER = {
    "json_schema": "json_schema",
    "regex": "regex",
    "ebnf": "ebnf",
    "choices": "choices",
    "json_object": "json_schema",
    "structural_tag": "structural_tag",
}


@dataclass(frozen=True)
class GrammarLimits:
    max_spec_bytes: int = DEFAULT_MAX_SPEC_BYTES
    max_json_depth: int = DEFAULT_MAX_JSON_DEPTH
    max_structural_nodes: int = DEFAULT_MAX_STRUCTURAL_NODES
    max_structural_triggers: int = DEFAULT_MAX_STRUCTURAL_TRIGGERS

    def __post_init__(self) -> None:
        bounds = (
            self.max_spec_bytes,
            self.max_json_depth,
            self.max_structural_nodes,
            self.max_structural_triggers,
        )
        if min(bounds) < 1:
            raise ValueError(
                "grammar limits max_spec_bytes, max_json_depth, max_structural_nodes and "
                "max_structural_triggers must be >= 1"
            )


def check_spec(kind: str, value: str | Sequence[str], limits: GrammarLimits | None = None) -> None:
    """Raises ``ValueError`` naming the parameter when the spec of ``kind`` (a sampling-params
    grammar field or a ``GrammarSpec`` kind) is too large, nests too deeply, holds control
    characters or (a JSON schema) does not parse."""
    limits = limits or GrammarLimits()
    name = _PARAMETER.get(kind, kind)
    if kind == "choices":
        if isinstance(value, str):
            raise ValueError("choices must be a list of strings")
        texts = list(value)
    else:
        texts = [str(value)]
    size = sum(len(t.encode("utf-8", "surrogatepass")) for t in texts)
    if size > limits.max_spec_bytes:
        raise ValueError(
            f"{name} is {size:,} bytes long; at most {limits.max_spec_bytes:,} bytes "
            "are allowed (shorten it, or raise the server's grammar size limit)"
        )
    if kind in ("json_schema", "json_object"):
        if kind == "json_schema" or texts[0]:
            check_json_text(name, texts[0], limits.max_json_depth)
        return
    if kind == "structural_tag":
        # Imported here: structural_tag imports this module's helpers.
        from radixlm.grammar.structural_tag import parse_structural_tag

        parse_structural_tag(texts[0], limits)
        return
    for text in texts:
        check_controls(name, text)
    if kind == "regex":
        check_regex_structure(texts[0])


def check_json_text(name: str, text: str, max_depth: int = DEFAULT_MAX_JSON_DEPTH) -> Any:
    """The parsed JSON schema ``text``; ``ValueError`` naming ``name`` when it nests deeper than
    ``max_depth``, does not parse, or is neither an object nor a boolean."""
    depth = json_nesting_depth(text)
    if depth > max_depth:
        raise ValueError(
            f"{name} nests {depth} levels deep; at most {max_depth} nested objects "
            "and arrays are allowed"
        )
    try:
        schema = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"{name} is not valid JSON ({exc})") from None
    except RecursionError:  # cannot happen below the depth bound; kept as a clean error
        raise ValueError(f"{name} nests too deeply") from None
    if not isinstance(schema, (dict, bool)):
        raise ValueError(f"{name} must be a JSON object (or true), got {type(schema).__name__}")
    if schema is False:
        raise ValueError(f"{name} is false, a schema no value satisfies; use true for any value")
    return schema


_JSON_TOKENS = re.compile(r'"(?:[^"\\]|\\.)*"?|[\[\]{}]')


def json_nesting_depth(text: str) -> int:
    """The deepest nesting of arrays and objects in JSON ``text`` (strings skipped), without
    parsing or recursing; unbalanced text still gets a number (parsing then reports it)."""
    depth = deepest = 0
    for match in _JSON_TOKENS.finditer(text):
        char = match.group()[0]
        if char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth -= 1
    return deepest


def check_controls(name: str, text: str, escapes: bool = True) -> None:
    """``ValueError`` naming ``name`` when ``text`` holds a C0 control character other than tab,
    line feed and carriage return, or (with ``escapes``: regex and grammar text) a NUL
    escape."""
    found = _CONTROL_CHARS.search(text)
    if found:
        raise ValueError(
            f"{name} contains the control character U+{ord(found.group()):04X} at "
            f"offset {found.start()}; control characters other than tab, line feed "
            "and carriage return are not allowed"
        )
    escaped = _NUL_ESCAPE.search(text) if escapes else None
    if escaped:
        raise ValueError(
            f"{name} contains a NUL escape at offset {escaped.start()}; outputs may "
            "not contain NUL characters"
        )
