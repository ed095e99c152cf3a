"""Tools and reasoning on the chat route, response side: outputs read back into messages.

:func:`chat_message` turns a finished output into the assistant message (``content``,
``tool_calls``, ``reasoning_content``); :class:`ChoiceStream` does the same incrementally for
one streamed choice. Each output gets its own parsers (``n > 1``: one pair per choice).

A call naming a tool the request did not offer is dropped, markup and all, and the calls after
it are numbered on (SGLang's rule); ``SGLANG_FORWARD_UNKNOWN_TOOLS=1`` (SGLang's switch) keeps
such calls for clients that handle unknown names themselves.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

from radixlm.srt.parsers.tool_base import ToolCall, ToolCallDelta, ToolCallParser
from radixlm.srt.server.chat.tools import ChatParsing

logger = logging.getLogger(__name__)


def _forward_unknown_tools() -> bool:
    return os.environ.get("SGLANG_FORWARD_UNKNOWN_TOOLS", "").lower() in ("1", "true", "yes")


class OfferedCalls:
    """Keeps the calls that name an offered tool, renumbered densely from 0 in output order.

    Streamed deltas come per parser index; a call's first delta carries its name, so the
    decision is taken there and applies to the rest of that call's deltas."""

    def __init__(self, parsing: ChatParsing) -> None:
        self.names = None if _forward_unknown_tools() else {s.name for s in parsing.specs}
        self.kept: dict[int, int] = {}  # parser index -> output index
        self.dropped: set[int] = set()

    def _keeps(self, name: str | None) -> bool:
        if self.names is None or name in self.names:
            return True
        logger.warning("dropped a call of %r: the request offered no tool of that name", name)
        return False

    def calls(self, calls: list[ToolCall]) -> list[ToolCall]:
        return [c for c in calls if self._keeps(c.name)]

    def deltas(self, deltas: list[ToolCallDelta]) -> list[ToolCallDelta]:
        out = []
        for d in deltas:
            if d.index in self.dropped:
                continue
            if d.index not in self.kept:
                if not self._keeps(d.name):
                    self.dropped.add(d.index)
                    continue
                self.kept[d.index] = len(self.kept)
            out.append(dataclasses.replace(d, index=self.kept[d.index]))
        return out


def tool_call_dict(call: ToolCall, parser: ToolCallParser) -> dict[str, Any]:
    """A call in OpenAI's shape, with a fresh id of the parser's kind."""
    return {
        "id": parser.new_call_id(),
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }


def chat_message(parsing: ChatParsing, text: str) -> tuple[dict[str, Any], bool]:
    """The assistant message of a finished output, and whether it made tool calls.
    ``content`` is null when the output is only calls (whitespace around them aside)."""
    reasoning: str | None = None
    reasoning_parser = parsing.output_reasoning_parser()
    if reasoning_parser is not None:
        reasoning, text = reasoning_parser.split(text)
    calls: list[ToolCall] = []
    tool_parser = parsing.new_tool_parser()
    if tool_parser is not None:
        result = tool_parser.parse(text)
        text, calls = result.content, OfferedCalls(parsing).calls(result.calls)
    content = None if calls and not text.strip() else text
    message: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None}
    if calls:
        assert tool_parser is not None
        message["tool_calls"] = [tool_call_dict(c, tool_parser) for c in calls]
    if reasoning_parser is not None:
        message["reasoning_content"] = reasoning
    return message, bool(calls)


class ChoiceStream:
    """One streamed choice's parsers: text deltas in, delta fields out (``reasoning_content``,
    ``content``, ``tool_calls`` with ``index`` on each, ``id`` / ``type`` / ``name`` on a
    call's first). Whitespace-only content is held back until more content comes, so a reply
    that is only calls streams no content, as its non-streamed form has none."""

    def __init__(self, parsing: ChatParsing) -> None:
        self.reasoning = parsing.output_reasoning_parser()
        self.tools = parsing.new_tool_parser()
        self.offered = OfferedCalls(parsing)
        self.call_ids: dict[int, str] = {}
        self.held_space = ""

    @property
    def is_plain(self) -> bool:
        """No parser: deltas are the text as it comes."""
        return self.reasoning is None and self.tools is None

    @property
    def has_calls(self) -> bool:
        return bool(self.call_ids)

    def feed(self, text: str) -> dict[str, Any]:
        reasoning, content = self.reasoning.feed(text) if self.reasoning else ("", text)
        calls: list[ToolCallDelta] = []
        if self.tools is not None:
            content, calls = self.tools.feed(content)
        return self._delta(reasoning, content, calls, is_last=False)

    def flush(self) -> dict[str, Any]:
        reasoning, content = self.reasoning.flush() if self.reasoning else ("", "")
        calls: list[ToolCallDelta] = []
        if self.tools is not None:
            content, calls = self.tools.feed(content)
            more_content, more_calls = self.tools.flush()
            content, calls = content + more_content, calls + more_calls
        return self._delta(reasoning, content, calls, is_last=True)

    def _delta(
        self, reasoning: str, content: str, calls: list[ToolCallDelta], is_last: bool
    ) -> dict[str, Any]:
        delta: dict[str, Any] = {}
        if reasoning:
            delta["reasoning_content"] = reasoning
        call_deltas = [
            self._call_delta(c) for c in self.offered.deltas(calls)
        ]  # first: they decide has_calls
        content = self._release_content(content, is_last)
        if content:
            delta["content"] = content
        if call_deltas:
            delta["tool_calls"] = call_deltas
        return delta

    def _release_content(self, content: str, is_last: bool) -> str:
        if self.tools is None:
            return content
        content = self.held_space + content
        self.held_space = ""
        if content.strip():
            return content
        if is_last:
            return "" if self.has_calls else content
        self.held_space = content
        return ""

    def _call_delta(self, d: ToolCallDelta) -> dict[str, Any]:
        out: dict[str, Any] = {"index": d.index}
        function: dict[str, Any] = {"arguments": d.arguments}
        if d.index not in self.call_ids:
            assert self.tools is not None
            self.call_ids[d.index] = self.tools.new_call_id()
            out["id"] = self.call_ids[d.index]
            out["type"] = "function"
            function = {"name": d.name, "arguments": d.arguments}
        out["function"] = function
        return out
