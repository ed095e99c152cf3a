"""Llama 3.1 / 3.2 JSON tool calls: the reply is the call object itself.

::

    {"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", ...}

A call stands at the start of the output (after whitespace) or after ``<|python_tag|>`` (the
text before the tag is content; the tag is a special token, so it is often absent from the
decoded text). Several calls are separated by ``;`` (or only by whitespace). ``"arguments"``
is read like ``"parameters"``. An output that starts with ``{`` but is not a call object is
content, and so is anything after the calls that is not another call. Calls naming a tool
that was not offered stay calls here (the chat route drops them). An output that ends inside a call (cut
off by max_tokens): a call whose name is complete stands with its arguments exactly as written
so far (possibly not valid JSON); without a complete name the call and the tag are dropped.
"""

from __future__ import annotations

from radixlm.srt.parsers.call_parser import CallStreamParser
from radixlm.srt.parsers.chat_history import text_of, tools_kwargs, with_template_calls
from radixlm.srt.parsers.constraints import (
    CallFormat,
    call_object_schema,
    choice_format,
    placed,
    quoted,
    structural_tag,
    with_defs,
)
from radixlm.srt.parsers.json_stream import WHITESPACE
from radixlm.srt.parsers.markers import WS_HOLD, MarkerSplitter
from radixlm.srt.parsers.tool_base import ToolCallDelta, ToolChoice, ToolSpec

PYTHON_TAG = "<|python_tag|>"
SEPARATOR = ";"
# auto with a strict tool: an answer must not start like a call (after whitespace)
TEXT_PATTERN = r"(?:\s*[^\s{][\s\S]*)?"

CALL_FORMAT = CallFormat(
    begin_of=lambda tool: f'{{"name": {quoted(tool.name)}, "parameters": ',
    end="}",
    separator=SEPARATOR + " ",
    text_pattern=TEXT_PATTERN,
)

_START, _CONTENT, _AFTER_TAG, _READER, _AFTER_CALL, _SEPARATED = range(6)


class Llama3Parser(CallStreamParser):
    """``{"name": ..., "parameters": {...}}`` replies, several joined by ``;``."""

    name = "llama3"
    READER = _READER

    def __init__(self, tools: list[ToolSpec]) -> None:
        super().__init__(tools, _START)
        self._splitter = MarkerSplitter(PYTHON_TAG)
        self._lead = ""  # whitespace at the start of the output

    def flush(self) -> tuple[str, list[ToolCallDelta]]:
        if self._state == _START:
            self._em.content(self._lead)
        elif self._state == _CONTENT:
            self._em.content(self._splitter.flush())
        elif self._state == _AFTER_TAG:
            self._em.claim()  # cut off right after the tag: the tag is markup
        elif self._state == _READER:
            self._finish_call()
        else:
            self._em.claim()
        self._state = _CONTENT
        return self._em.take()

    def _start(self, text: str, pos: int) -> int:
        c = text[pos]
        if c in WHITESPACE and len(self._lead) < WS_HOLD:
            self._lead += c
            return pos + 1
        if c == "{":
            self._em.hold(self._lead)
            return self._start_call(pos)
        self._state = _CONTENT
        before, _, _ = self._splitter.scan(self._lead)
        self._em.content(before)
        return pos

    def _content(self, text: str, pos: int) -> int:
        return self._content_until(self._splitter, text, pos, _AFTER_TAG)[0]

    def _call_finished(self) -> None:
        self._state = _AFTER_CALL

    def _after_call(self, text: str, pos: int) -> int:
        if text[pos] == SEPARATOR and self._state == _AFTER_CALL:
            self._em.hold(SEPARATOR)
            self._state = _SEPARATED
            return pos + 1
        return self._await_call(text, pos)

    def _resume_content(self, pos: int) -> int:
        self._em.release()
        self._state = _CONTENT
        return pos

    def render(
        self, messages: list[dict], tools: list[ToolSpec], choice: ToolChoice
    ) -> tuple[list[dict], dict]:
        """Tools go to the template (which lists them in the first user message); an assistant
        message with several calls becomes one message per call (the template refuses more
        than one), after a message with its text if it had any."""
        out: list[dict] = []
        for message in with_template_calls(messages):
            calls = message.get("tool_calls")
            if message.get("role") != "assistant" or not calls:
                out.append(message)
                continue
            if text_of(message.get("content")):
                out.append({"role": "assistant", "content": message["content"]})
            out += [{**message, "content": "", "tool_calls": [call]} for call in calls]
        return out, tools_kwargs(tools, choice)

    def constraint(
        self,
        tools: list[ToolSpec],
        choice: ToolChoice,
        parallel: bool,
        response_schema: dict | None,
        names_only: bool = False,
    ) -> dict | None:
        """Structural tags, except for ``"auto"`` with a ``response_schema``: an answer and a
        call both start with ``{``, which a structural tag's ``or`` cannot tell apart early
        enough, so that case is one JSON schema (the answer, or exactly one call)."""
        if response_schema is not None and choice == "auto" and tools:
            defs: dict = {}
            calls = [call_object_schema(t, choice, "parameters", defs) for t in tools]
            answer = placed(response_schema, "answer", defs)
            return {"json_schema": with_defs({"anyOf": [answer, *calls]}, defs)}
        fmt = choice_format(CALL_FORMAT, tools, choice, parallel, response_schema, names_only)
        return None if fmt is None else structural_tag(fmt)


Llama3Parser.STEPS = {
    _START: Llama3Parser._start,
    _CONTENT: Llama3Parser._content,
    _AFTER_TAG: Llama3Parser._await_call,
    _READER: Llama3Parser._read_call,
    _AFTER_CALL: Llama3Parser._after_call,
    _SEPARATED: Llama3Parser._after_call,
}
