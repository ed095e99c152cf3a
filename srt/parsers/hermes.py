"""Hermes-style tool calls (Qwen2.5, Qwen3, Hermes): JSON objects between tags.

::

    Let me check.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
    <tool_call>
    {"name": "get_time", "arguments": {"zone": "CET"}}
    </tool_call>

Text outside the blocks is content; whitespace right before ``<tool_call>`` (and after the last
block, at the end) is markup. A block may hold several call objects, and a new ``<tool_call>``
also closes an unclosed block. A block that is not a call object (not JSON, no name, an
unknown key before the arguments) is content, the whole block text. Once the arguments object
has begun, the call stands (its deltas are out): arguments that stop being JSON are closed into
valid JSON where they last were, and the text after that point is content. An output that ends
inside a block (cut off by max_tokens) shows none of it as content: a call whose name is
complete stands with its arguments exactly as written so far (possibly not valid JSON), one
without a complete name is dropped. A call naming a tool that was not offered is still a call
here (the chat route drops it). Any JSON whitespace is accepted.
"""

from __future__ import annotations

from radixlm.srt.parsers.call_parser import CallStreamParser
from radixlm.srt.parsers.chat_history import tools_kwargs, with_template_calls
from radixlm.srt.parsers.constraints import CallFormat, choice_format, quoted, structural_tag
from radixlm.srt.parsers.json_stream import WHITESPACE
from radixlm.srt.parsers.markers import MarkerSplitter
from radixlm.srt.parsers.tool_base import ToolCallDelta, ToolChoice, ToolSpec

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"

CALL_FORMAT = CallFormat(
    begin_of=lambda tool: f'{OPEN_TAG}\n{{"name": {quoted(tool.name)}, "arguments": ',
    end="}\n" + CLOSE_TAG,
    separator="\n",
    trigger=OPEN_TAG,
)

_CONTENT, _OPEN, _READER, _AFTER_OBJECT = range(4)


class HermesParser(CallStreamParser):
    """``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` blocks."""

    name = "hermes"
    READER = _READER

    def __init__(self, tools: list[ToolSpec]) -> None:
        super().__init__(tools, _CONTENT)
        self._splitter = MarkerSplitter(OPEN_TAG)
        self._tail = ""  # text after a call object: a prefix of a closing or opening tag
        self._after_block = False  # no content since the last block closed

    # -- streaming --

    def flush(self) -> tuple[str, list[ToolCallDelta]]:
        if self._state == _CONTENT:
            held = self._splitter.flush()
            if not (self._after_block and held.strip(WHITESPACE) == ""):
                self._em.content(held)
        elif self._state == _OPEN:
            self._em.claim()  # cut off right after the tag: the tag is markup
        elif self._state == _READER:
            self._finish_call()
        else:  # after a call object: the block is over
            self._em.claim()
        self._state = _CONTENT
        return self._em.take()

    def _content(self, text: str, pos: int) -> int:
        stop, shown = self._content_until(self._splitter, text, pos, _OPEN)
        if shown:
            self._after_block = False
        return stop

    def _call_finished(self) -> None:
        self._state, self._tail = _AFTER_OBJECT, ""

    def _after_object(self, text: str, pos: int) -> int:
        c = text[pos]
        if not self._tail and c in WHITESPACE:
            return self._hold_whitespace(text, pos)
        if not self._tail and c == "{":  # another call object in the same block
            return self._start_call(pos)
        tail = self._tail + c
        if tail == CLOSE_TAG:
            self._em.claim()
            self._state, self._after_block = _CONTENT, True
        elif tail == OPEN_TAG:  # an unclosed block ends where the next one opens
            self._em.claim()
            self._em.hold(tail)
            self._state = _OPEN
        elif CLOSE_TAG.startswith(tail) or OPEN_TAG.startswith(tail):
            self._em.hold(c)
            self._tail = tail
            return pos + 1
        else:
            return self._resume_content(pos)
        return pos + 1

    def _resume_content(self, pos: int) -> int:
        self._em.release()
        self._state, self._after_block = _CONTENT, False
        return pos

    # -- prompt and constraint --

    def render(
        self, messages: list[dict], tools: list[ToolSpec], choice: ToolChoice
    ) -> tuple[list[dict], dict]:
        """History calls get dict arguments (Qwen templates apply ``tojson``); tools go to the
        template as OpenAI entries (``tools=[{"type": "function", "function": ...}]``)."""
        return with_template_calls(messages), tools_kwargs(tools, choice)

    def constraint(
        self,
        tools: list[ToolSpec],
        choice: ToolChoice,
        parallel: bool,
        response_schema: dict | None,
        names_only: bool = False,
    ) -> dict | None:
        fmt = choice_format(CALL_FORMAT, tools, choice, parallel, response_schema, names_only)
        return None if fmt is None else structural_tag(fmt)


HermesParser.STEPS = {
    _CONTENT: HermesParser._content,
    _OPEN: HermesParser._await_call,
    _READER: HermesParser._read_call,
    _AFTER_OBJECT: HermesParser._after_object,
}
