"""Builders of the sampling-params fragments that enforce a tool choice (structural tags).

A *call tag* is ``{"type": "tag", "begin": ..., "content": {"type": "json_schema", ...},
"end": ...}``: the text a model writes before a call's arguments object, the arguments' JSON
schema, and the text after it. The parsers pick the begin and end of their format; the choice
decides how the tags combine:

* ``"required"`` / named: calls only (``tags_with_separator``, at least one; one at most
  unless ``parallel``), arguments valid against each tool's schema;
* ``"auto"``: free text, and once the trigger appears a call (``triggered_tags``), built only
  when a tool is ``strict`` (non-strict tools then get any JSON object as arguments) or when
  an ``allowed_tools`` choice narrowed the tools (``names_only``: calls name those alone);
* a ``response_schema`` with ``"auto"``: an answer valid against it, or calls.

Formats that put a tool's schema (or the response schema) inside one bigger JSON schema move it
under that schema's ``$defs`` when it has local references (``placed``): pydantic writes nested
models as ``{"$ref": "#/$defs/Model"}``, which points at the root of the document it sits in, so
the same text below another root would point at nothing.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

from radixlm.grammar.schema_checks import DATA_KEYWORDS, SCHEMA_MAPS, ref_nodes
from radixlm.srt.parsers.tool_base import (
    ToolChoice,
    ToolSpec,
    check_choice,
    chosen_tools,
    forces_calls,
)

ANY_OBJECT: dict = {"type": "object"}


def arguments_schema(tool: ToolSpec, choice: ToolChoice) -> dict:
    """The schema a call's arguments must match: the tool's own when the choice forces calls
    or the tool is strict, else any object."""
    return tool.parameters if (tool.strict or forces_calls(choice)) else ANY_OBJECT


def _local_refs(schema: dict) -> bool:
    return any(node["$ref"].startswith("#") for node in ref_nodes(schema))


def _rebased(node: object, base: str) -> object:
    """A copy of the schema ``node`` whose local references (``#...``) point below ``base``."""
    if isinstance(node, list):
        return [_rebased(item, base) for item in node]
    if not isinstance(node, dict):
        return node
    out: dict = {}
    for key, value in node.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            out[key] = base + value[1:]
        elif key in DATA_KEYWORDS:
            out[key] = value
        elif key in SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: _rebased(sub, base) for name, sub in value.items()}
        else:
            out[key] = _rebased(value, base)
    return out


def placed(schema: dict, key: str, defs: dict) -> dict:
    """What to write where ``schema`` goes inside a bigger document: ``schema`` itself when it
    has no local references, else ``{"$ref": "#/$defs/<key>"}`` with the schema stored as
    ``defs[key]`` (its references rebased there, its ``$id`` / ``$schema`` dropped: they would
    make it a document of its own again). ``key`` must not need JSON-pointer escaping."""
    if not _local_refs(schema):
        return schema
    base = f"#/$defs/{key}"
    body = {k: v for k, v in schema.items() if k not in ("$id", "$schema")}
    defs[key] = _rebased(body, base)
    return {"$ref": base}


def with_defs(root: dict, defs: dict) -> dict:
    """``root`` holding the schemas ``placed`` stored in ``defs``."""
    return {**root, "$defs": defs} if defs else root


def call_object_schema(
    tool: ToolSpec, choice: ToolChoice, arguments_key: str, defs: dict, always: bool = False
) -> dict:
    """The JSON schema of one call object ``{"name": <the tool>, <arguments_key>: {...}}``,
    the arguments' schema ``placed`` in ``defs`` (tool names need no pointer escaping): the
    tool's own schema when ``always``, else ``arguments_schema``'s choice."""
    schema = tool.parameters if always else arguments_schema(tool, choice)
    arguments = placed(schema, f"tool_{tool.name}", defs)
    return {
        "type": "object",
        "properties": {
            "name": {"const": tool.name},
            arguments_key: arguments,
        },
        "required": ["name", arguments_key],
        "additionalProperties": False,
    }


def quoted(name: str) -> str:
    """A tool name as the JSON string a model writes."""
    return json.dumps(name, ensure_ascii=False)


def call_tag(begin: str, schema: dict, end: str) -> dict:
    return {
        "type": "tag",
        "begin": begin,
        "content": {"type": "json_schema", "json_schema": schema},
        "end": end,
    }


def structural_tag(fmt: dict) -> dict:
    """A sampling-params fragment holding the structural tag of ``fmt``."""
    return {"structural_tag": {"type": "structural_tag", "format": fmt}}


@dataclass(frozen=True)
class CallFormat:
    """How a format writes calls: ``begin_of(tool) + arguments + end``, several joined by
    ``separator``, all between ``opening`` and ``closing``. For ``"auto"`` with a strict tool:
    a ``trigger`` starts a call anywhere in free text; formats whose calls stand only at the
    start of the output give instead a ``text_pattern`` (a regex of the answers that start no
    call). Formats whose arguments are not a JSON object give ``content_of``."""

    begin_of: Callable[[ToolSpec], str]
    end: str
    separator: str
    trigger: str | None = None
    text_pattern: str | None = None
    # the format between begin and end, given the tool and whether its arguments are free
    # (any object); None: the arguments' JSON schema
    content_of: Callable[[ToolSpec, bool], dict] | None = None
    # around the calls of one reply (pythonic's ``[`` and ``]``)
    opening: str = ""
    closing: str = ""


def choice_format(
    form: CallFormat,
    tools: list[ToolSpec],
    choice: ToolChoice,
    parallel: bool,
    response_schema: dict | None,
    names_only: bool = False,
) -> dict | None:
    """The structural-tag format enforcing ``choice`` for calls written in ``form``; None
    when nothing needs enforcing (``names_only``: under ``"auto"`` calls must name one of
    ``tools``, strict or not). ``ValueError`` for an invalid choice."""
    check_choice(tools, choice)
    if choice == "none" or not tools:
        return None
    tags = [_call_tag(form, t, choice) for t in chosen_tools(tools, choice)]
    calls_only: dict = {
        "type": "tags_with_separator",
        "tags": tags,
        "separator": form.separator,
        "at_least_one": True,
        "stop_after_first": not parallel,
    }
    if form.opening or form.closing:
        calls_only = _between(form, calls_only)
    if forces_calls(choice):
        return calls_only
    if response_schema is not None:
        answer = {"type": "json_schema", "json_schema": response_schema}
        return {"type": "or", "elements": [answer, calls_only]}
    if not names_only and not any(t.strict for t in tools):
        return None
    return _auto_format(form, tags, calls_only, parallel)


def _call_tag(form: CallFormat, tool: ToolSpec, choice: ToolChoice) -> dict:
    schema = arguments_schema(tool, choice)
    if form.content_of is None:
        return call_tag(form.begin_of(tool), schema, form.end)
    content = form.content_of(tool, schema is ANY_OBJECT)
    return {"type": "tag", "begin": form.begin_of(tool), "content": content, "end": form.end}


def _between(form: CallFormat, fmt: dict) -> dict:
    """``fmt`` between the format's opening and closing texts."""
    parts = [{"type": "const_string", "value": form.opening}, fmt]
    parts.append({"type": "const_string", "value": form.closing})
    return {"type": "sequence", "elements": [p for p in parts if p.get("value") != ""]}


def _auto_format(form: CallFormat, tags: list[dict], calls_only: dict, parallel: bool) -> dict:
    if form.trigger is not None:
        if form.opening or form.closing:  # one call per opening (several openings if parallel)
            tags = [
                {**t, "begin": form.opening + t["begin"], "end": t["end"] + form.closing}
                for t in tags
            ]
        return {
            "type": "triggered_tags",
            "triggers": [form.trigger],
            "tags": tags,
            "at_least_one": False,
            "stop_after_first": not parallel,
        }
    assert form.text_pattern is not None, "a format without a trigger needs a text pattern"
    return {"type": "or", "elements": [calls_only, {"type": "regex", "pattern": form.text_pattern}]}
