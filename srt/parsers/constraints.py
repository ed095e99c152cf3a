"""Builders of the sampling-params fragments that enforce a tool choice (structural tags).

A *call tag* is ``{"type": "tag", "begin": ..., "content": {"type": "json_schema", ...},
"end": ...}``: the text a model writes before a call's arguments object, the arguments' JSON
schema, and the text after it. The parsers pick the begin and end of their format; the choice
decides how the tags combine:

* ``"required"`` / named: calls only (``tags_with_separator``, at least one; one at most
  unless ``parallel``), arguments valid against each tool's schema;
* ``"auto"``: free text, and once the trigger appears a call (``triggered_tags``), built only
  when a tool is ``strict`` (non-strict tools then get any JSON object as arguments);
* a ``response_schema`` with ``"auto"``: an answer valid against it, or calls.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

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


def call_object_schema(tool: ToolSpec, choice: ToolChoice, arguments_key: str) -> dict:
    """The JSON schema of one call object ``{"name": <the tool>, <arguments_key>: {...}}``."""
    return {
        "type": "object",
        "properties": {
            "name": {"const": tool.name},
            arguments_key: arguments_schema(tool, choice),
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
    ``separator``. For ``"auto"`` with a strict tool: a ``trigger`` starts a call anywhere in
    free text; formats whose calls stand only at the start of the output give instead a
    ``text_pattern`` (a regex of the answers that start no call)."""

    begin_of: Callable[[ToolSpec], str]
    end: str
    separator: str
    trigger: str | None = None
    text_pattern: str | None = None


def choice_format(
    form: CallFormat,
    tools: list[ToolSpec],
    choice: ToolChoice,
    parallel: bool,
    response_schema: dict | None,
) -> dict | None:
    """The structural-tag format enforcing ``choice`` for calls written in ``form``; None
    when nothing needs enforcing. ``ValueError`` for an invalid choice."""
    check_choice(tools, choice)
    if choice == "none" or not tools:
        return None
    tags = [
        call_tag(form.begin_of(t), arguments_schema(t, choice), form.end)
        for t in chosen_tools(tools, choice)
    ]
    calls_only = {
        "type": "tags_with_separator",
        "tags": tags,
        "separator": form.separator,
        "at_least_one": True,
        "stop_after_first": not parallel,
    }
    if forces_calls(choice):
        return calls_only
    if response_schema is not None:
        answer = {"type": "json_schema", "json_schema": response_schema}
        return {"type": "or", "elements": [answer, calls_only]}
    if not any(t.strict for t in tools):
        return None
    return _auto_format(form, tags, calls_only, parallel)


def _auto_format(form: CallFormat, tags: list[dict], calls_only: dict, parallel: bool) -> dict:
    if form.trigger is not None:
        return {
            "type": "triggered_tags",
            "triggers": [form.trigger],
            "tags": tags,
            "at_least_one": False,
            "stop_after_first": not parallel,
        }
    assert form.text_pattern is not None, "a format without a trigger needs a text pattern"
    return {"type": "or", "elements": [calls_only, {"type": "regex", "pattern": form.text_pattern}]}
