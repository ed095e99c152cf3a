"""The contract of tool-call parsers: what a model's output means as OpenAI tool calls.

A ``ToolCallParser`` knows one model family's tool-call format. It has four jobs, all pure
functions of text (no tokenizer, no torch):

* ``render``: chat messages in OpenAI shape -> messages (and ``apply_chat_template`` keyword
  arguments) ready for that family's chat template;
* ``constraint``: a sampling-params fragment that makes the model's output obey a tool choice;
* ``parse``: a whole output -> content text and the calls found in it;
* ``feed`` / ``flush``: the same, streamed.

Invariant: for every text and every way of splitting it into deltas, a fresh parser fed the
deltas in order and then flushed yields the same content (concatenated) and the same calls
(names, and argument fragments concatenated per ``index``) as ``parse`` of the whole text.
Every call's ``arguments`` is the JSON text of an object, except when the output ends inside
the call (cut off by max_tokens): then it is exactly the text written so far, never completed
with invented text. Malformed call markup becomes content; markup that an output ends in does
not (a call with a complete name stands, anything less is dropped); no method raises on model
output. Work per delta is linear in the delta plus a bounded hold-back, so a long output costs
linear time.

``ToolChoice`` is a string: ``"none"``, ``"auto"``, ``"required"`` or ``"function:<name>"``
(call exactly that tool). With ``"none"`` a parser renders no tool definitions and constrains
nothing; the server then shows the output as plain content without parsing it.
"""

from __future__ import annotations

import copy
import json
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

ToolChoice = str
CHOICES = ("none", "auto", "required")
NAMED_PREFIX = "function:"


def _empty_object_schema() -> dict:
    return {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolSpec:
    """One function tool offered to the model; ``parameters`` is the JSON schema of its
    arguments object; ``strict``: the arguments must match it even under ``"auto"``."""

    name: str
    description: str | None = None
    parameters: dict = field(default_factory=_empty_object_schema)
    strict: bool = False

    @classmethod
    def from_openai(cls, tool: dict) -> ToolSpec:
        """From an OpenAI ``{"type": "function", "function": {...}}`` entry (already checked by
        the request's model; a missing ``parameters`` means no arguments)."""
        fn = tool.get("function", tool)
        parameters = fn.get("parameters")
        return cls(
            name=fn["name"],
            description=fn.get("description"),
            parameters=_empty_object_schema() if parameters is None else parameters,
            strict=bool(fn.get("strict") or False),
        )

    def to_openai(self) -> dict:
        """The OpenAI tool entry chat templates iterate over (``tools`` of
        ``apply_chat_template``); ``description`` is left out when there is none."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = copy.deepcopy(self.parameters)
        return {"type": "function", "function": function}


@dataclass
class ToolCall:
    """One call found in an output; ``arguments`` is the JSON text of an object, or the part
    of it that was written when the output was cut off inside the call."""

    name: str
    arguments: str


@dataclass
class ToolCallDelta:
    """A streamed piece of call ``index`` (counted from 0 in output order): ``name`` only on
    the call's first delta; ``arguments`` fragments concatenate to the call's arguments."""

    index: int
    name: str | None = None
    arguments: str = ""


@dataclass
class ParseResult:
    """A whole output: the content text (everything that is not call markup) and the calls."""

    content: str
    calls: list[ToolCall]


def named_tool(choice: ToolChoice) -> str | None:
    """The tool name of a ``"function:<name>"`` choice, else None."""
    return choice[len(NAMED_PREFIX) :] if choice.startswith(NAMED_PREFIX) else None


def check_choice(tools: list[ToolSpec], choice: ToolChoice) -> None:
    """``ValueError`` for a choice that is not one of the four forms, or names no offered tool,
    or asks for calls without tools."""
    name = named_tool(choice)
    if name is None and choice not in CHOICES:
        raise ValueError(
            f"tool_choice must be none, auto, required or function:<name>, got {choice!r}"
        )
    if name is not None and all(t.name != name for t in tools):
        offered = [t.name for t in tools]
        raise ValueError(f"tool_choice names the tool {name!r}, which is not offered: {offered}")
    if choice == "required" and not tools:
        raise ValueError('tool_choice "required" needs at least one tool')


def chosen_tools(tools: list[ToolSpec], choice: ToolChoice) -> list[ToolSpec]:
    """The tools a call may name under ``choice`` (all of them, or only the named one)."""
    name = named_tool(choice)
    return list(tools) if name is None else [t for t in tools if t.name == name]


def forces_calls(choice: ToolChoice) -> bool:
    """Whether the output must be calls only (``"required"`` or a named tool)."""
    return choice == "required" or named_tool(choice) is not None


def calls_from_deltas(deltas: list[ToolCallDelta]) -> list[ToolCall]:
    """Folds streamed deltas into whole calls, in index order."""
    calls: dict[int, ToolCall] = {}
    for delta in deltas:
        if delta.index not in calls:
            calls[delta.index] = ToolCall(delta.name or "", "")
        calls[delta.index].arguments += delta.arguments
    return [calls[i] for i in sorted(calls)]


def arguments_as_object(arguments: Any) -> Any:
    """A history call's ``arguments`` (OpenAI sends JSON text) as the dict templates expect;
    text that is not a JSON object is passed on unchanged."""
    if isinstance(arguments, str):
        try:
            value = json.loads(arguments)
        except (ValueError, RecursionError):
            return arguments
        return value if isinstance(value, dict) else arguments
    return arguments


class ToolCallParser(ABC):
    """One model family's tool-call format; one instance per response (it keeps the stream
    state of ``feed``). See the module docstring for the invariant all methods keep."""

    name: str = ""
    # markers of the format that tokenizers make special tokens, which decoding drops unless
    # told not to (and grammars cannot write)
    special_markers: tuple[str, ...] = ()

    def __init__(self, tools: list[ToolSpec]) -> None:
        self.tools = list(tools)

    def new_call_id(self) -> str:
        """A fresh id for a call found in an output (OpenAI's ``call_`` and 24 hex digits;
        formats whose templates check ids give their own)."""
        return f"call_{uuid.uuid4().hex[:24]}"

    def parse(self, text: str) -> ParseResult:
        """The content and calls of a whole output (the streaming machine run once, so parse
        and feed/flush agree by construction). Leaves this parser's stream state alone."""
        fresh = type(self)(self.tools)
        content, deltas = fresh.feed(text)
        tail, more = fresh.flush()
        return ParseResult(content + tail, calls_from_deltas(deltas + more))

    @abstractmethod
    def feed(self, delta: str) -> tuple[str, list[ToolCallDelta]]:
        """Content text to show now and call deltas; text that may still turn out to be call
        markup (a partial marker) is held back until it is decided."""

    @abstractmethod
    def flush(self) -> tuple[str, list[ToolCallDelta]]:
        """End of stream: decides whatever is still held back. Output cut off inside call
        markup: a call whose name is complete gets the rest of its arguments as written (not
        closed into valid JSON); the rest of the markup is dropped, not shown as content."""

    @abstractmethod
    def render(
        self, messages: list[dict], tools: list[ToolSpec], choice: ToolChoice
    ) -> tuple[list[dict], dict]:
        """Messages for the chat template and extra ``apply_chat_template`` keyword arguments.

        ``messages`` are in OpenAI shape (assistant ``tool_calls`` with JSON-text arguments and
        content possibly None; ``role: "tool"`` with ``tool_call_id``); they are not modified."""

    @abstractmethod
    def constraint(
        self,
        tools: list[ToolSpec],
        choice: ToolChoice,
        parallel: bool,
        response_schema: dict | None,
        names_only: bool = False,
    ) -> dict | None:
        """A sampling-params fragment (``{"structural_tag": ...}`` or ``{"json_schema": ...}``)
        enforcing ``choice``, or None when nothing needs enforcing (the server then applies
        ``response_schema`` itself, if any). With a fragment, ``response_schema`` is already in
        it. ``"required"`` / named: calls only, arguments valid against the tool's schema,
        exactly one call unless ``parallel``. ``names_only`` (an ``allowed_tools`` choice
        narrowed ``tools``): under ``"auto"`` a call may name none but ``tools`` even when no
        tool is strict. ``ValueError`` for an invalid choice."""
