"""Bounded JSON whitespace inside Lark grammars' ``%json {schema}`` rules.

A JSON schema compiled on its own gets the configured whitespace pattern (at most one space by
default), but llguidance compiles a ``%json`` rule inside a Lark grammar with its own default,
``[\\x20\\x0A\\x0D\\x09]+``: any run of blanks and newlines between JSON tokens, which lets a
model emit whitespace until its token budget runs out. ``bound_json_whitespace`` writes the
pattern into each ``%json`` schema's ``x-guidance`` options, unless the grammar's author set a
whitespace option there already.
"""

from __future__ import annotations

import json
import re

_JSON_RULE = re.compile(r"%json\s*")
_WHITESPACE_OPTIONS = ("whitespace_pattern", "whitespace_flexible")


def bound_json_whitespace(lark: str, whitespace_pattern: str) -> str:
    """``lark`` with ``whitespace_pattern`` as the JSON whitespace of each ``%json`` rule."""
    if "%json" not in lark:
        return lark
    decoder = json.JSONDecoder()
    out, done = [], 0
    for match in _JSON_RULE.finditer(lark):
        if match.start() < done:
            continue
        try:
            schema, end = decoder.raw_decode(lark, match.end())
        except (ValueError, RecursionError):
            continue  # not a schema object here (a comment, a string): left to llguidance
        if not isinstance(schema, dict):
            continue
        options = schema.get("x-guidance")
        options = dict(options) if isinstance(options, dict) else {}
        if not any(key in options for key in _WHITESPACE_OPTIONS):
            options["whitespace_pattern"] = whitespace_pattern
        schema["x-guidance"] = options
        out.append(lark[done : match.end()])
        out.append(json.dumps(schema, ensure_ascii=False))
        done = end
    out.append(lark[done:])
    return "".join(out)
