"""Exact JSON Schema rewrites applied before either backend compiles a schema.

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

_ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$comment"})


def tighten_one_of(schema_text: str) -> str:
    """``schema_text`` with the rewrite above applied; unchanged text when nothing applies."""
    try:
        schema = json.loads(schema_text)
    except ValueError:
        return schema_text  # the backends report the parse error
    return json.dumps(schema) if _visit(schema) else schema_text


def _visit(node: Any) -> bool:
    changed = False
    if isinstance(node, dict):
        branches = node.get("oneOf")
        if isinstance(branches, list):
            changed |= _require_shared_property(branches)
        for value in node.values():
            changed |= _visit(value)
    elif isinstance(node, list):
        for value in node:
            changed |= _visit(value)
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
