"""Tool calls for chat templates without a tool format: the reply is one JSON object.

``{"tool_calls": [{"name": ..., "arguments": {...}}, ...]}`` holds calls;
``{"content": "..."}`` holds the answer, streamed decoded as it arrives (a non-string value,
as with a response format's schema, is content as its JSON text). Anything else, such as text
that is not JSON or an object of neither shape, is plain content. Once the reply is known to
be an answer or calls, what has been read is kept: text after the reply object that is not
whitespace, or a call list that breaks off, continues as plain content from there.

An output that ends inside the reply (cut off by max_tokens) shows none of its markup: an
answer gives the text decoded so far; a call whose name is complete stands with its arguments
exactly as written so far (possibly not valid JSON); a call without a complete name is dropped.
"""

from __future__ import annotations

from radixlm.srt.parsers.call_parser import CallStreamParser
from radixlm.srt.parsers.call_stream import HEADER_LIMIT
from radixlm.srt.parsers.generic_prompt import (
    history,
    reply_schema,
    system_prompt,
    with_system_prompt,
)
from radixlm.srt.parsers.json_stream import (
    DONE,
    FAILED,
    WHITESPACE,
    JsonScanner,
    StringDecoder,
    skip_whitespace,
)
from radixlm.srt.parsers.tool_base import ToolCallDelta, ToolChoice, ToolSpec

_KEYS = ("tool_calls", "content")
_VALUE_STARTS = '{["-0123456789tfn'

# states
_START, _KEY, _KEY_STRING, _COLON, _CALLS, _FIRST_ITEM, _ITEM, _READER, _AFTER_ITEM = range(9)
_ANSWER, _ANSWER_STRING, _ANSWER_VALUE, _REPLY_END, _END, _PLAIN = range(9, 15)


class GenericParser(CallStreamParser):
    """The JSON reply format of generic_prompt.py."""

    name = "generic"
    READER = _READER

    def __init__(self, tools: list[ToolSpec]) -> None:
        super().__init__(tools, _START)
        self._budget = HEADER_LIMIT  # characters of markup that may still be held
        self._key = ""
        self._decoder = StringDecoder()
        self._decoded: list[str] = []
        self._scanner = JsonScanner()

    def flush(self) -> tuple[str, list[ToolCallDelta]]:
        state = self._state
        if state == _READER:
            self._finish_call()
        elif state == _START or state == _KEY_STRING and not self._is_key_start():
            self._em.release()  # only whitespace, or an object of another shape
        elif state != _ANSWER_STRING:  # a cut answer keeps its text, less a partial escape
            self._em.claim()  # the reply's markup, complete or cut off: never content
        self._state = _PLAIN
        return self._em.take()

    # -- helpers --

    def _hold_whitespace(self, text: str, pos: int) -> int:
        if self._budget == 0:
            return self._fail(pos)
        stop = skip_whitespace(text, pos, min(len(text), pos + self._budget))
        return self._hold(text, pos, stop)

    def _hold(self, text: str, pos: int, stop: int) -> int:
        self._em.hold(text[pos:stop])
        self._budget -= stop - pos
        return stop

    def _claim(self) -> None:
        self._em.claim()
        self._budget = HEADER_LIMIT

    def _expect(self, text: str, pos: int, char: str, state: int) -> int:
        """Whitespace, then ``char`` (held) moving to ``state``; anything else fails."""
        if text[pos] in WHITESPACE:
            return self._hold_whitespace(text, pos)
        if text[pos] != char:
            return self._fail(pos)
        self._state = state
        return self._hold(text, pos, pos + 1)

    def _is_key_start(self) -> bool:
        """Whether the key read so far starts one of the reply's keys."""
        key = "".join(self._decoded)
        return any(k.startswith(key) for k in _KEYS)

    def _fail(self, pos: int) -> int:
        """Not (or no longer) the reply format: the held text and the rest are content."""
        self._em.release()
        self._state = _PLAIN
        return pos

    _resume_content = _fail  # a call object that fails: the reply format is given up

    # -- steps --

    def _start(self, text: str, pos: int) -> int:
        return self._expect(text, pos, "{", _KEY)

    def _key_start(self, text: str, pos: int) -> int:
        stop = self._expect(text, pos, '"', _KEY_STRING)
        if self._state == _KEY_STRING:
            self._decoder, self._decoded = StringDecoder(), []
        return stop

    def _key_string(self, text: str, pos: int) -> int:
        longest = max(len(k) for k in _KEYS) + 1
        stop, decoded = self._decoder.decode(text, pos, min(len(text), pos + longest))
        self._decoded.append(decoded)
        key = "".join(self._decoded)
        if self._decoder.status == FAILED or len(key) >= longest:
            return self._fail(pos)
        self._hold(text, pos, stop)
        if self._decoder.status != DONE:
            return stop
        if key not in _KEYS:
            return self._fail(stop)
        self._key, self._state = key, _COLON
        return stop

    def _colon(self, text: str, pos: int) -> int:
        return self._expect(text, pos, ":", _CALLS if self._key == "tool_calls" else _ANSWER)

    def _calls(self, text: str, pos: int) -> int:
        return self._expect(text, pos, "[", _FIRST_ITEM)

    def _item(self, text: str, pos: int) -> int:
        c = text[pos]
        if c in WHITESPACE:
            return self._hold_whitespace(text, pos)
        if c == "]" and self._state == _FIRST_ITEM:
            self._state = _REPLY_END
            return self._hold(text, pos, pos + 1)
        if c != "{":
            return self._fail(pos)
        return self._start_call(pos)

    def _call_finished(self) -> None:
        self._budget = HEADER_LIMIT
        self._state = _AFTER_ITEM

    def _after_item(self, text: str, pos: int) -> int:
        c = text[pos]
        if c in WHITESPACE:
            return self._hold_whitespace(text, pos)
        if c not in ",]":
            return self._fail(pos)
        self._state = _ITEM if c == "," else _REPLY_END
        return self._hold(text, pos, pos + 1)

    def _answer(self, text: str, pos: int) -> int:
        c = text[pos]
        if c in WHITESPACE:
            return self._hold_whitespace(text, pos)
        if c == '"':
            self._claim()
            self._decoder, self._state = StringDecoder(), _ANSWER_STRING
            return pos + 1
        if c not in _VALUE_STARTS:
            return self._fail(pos)
        self._claim()
        self._scanner, self._state = JsonScanner(), _ANSWER_VALUE
        return pos

    def _answer_string(self, text: str, pos: int) -> int:
        stop, decoded = self._decoder.decode(text, pos, len(text))
        self._em.content(decoded)
        if self._decoder.status == DONE:
            self._state = _REPLY_END
        elif self._decoder.status == FAILED:
            self._em.content(self._decoder.finish())
            self._state = _PLAIN
        return stop

    def _answer_value(self, text: str, pos: int) -> int:
        stop = self._scanner.scan(text, pos, len(text))
        self._em.content(text[pos:stop])
        if self._scanner.status == DONE:
            self._state = _REPLY_END
        elif self._scanner.status == FAILED:
            self._state = _PLAIN
        return stop

    def _reply_end(self, text: str, pos: int) -> int:
        if self._state == _END:
            if text[pos] in WHITESPACE:
                return self._hold_whitespace(text, pos)
            return self._fail(pos)
        return self._expect(text, pos, "}", _END)

    def _plain(self, text: str, pos: int) -> int:
        self._em.content(text[pos:])
        return len(text)

    # -- prompt and constraint --

    def render(
        self, messages: list[dict], tools: list[ToolSpec], choice: ToolChoice
    ) -> tuple[list[dict], dict]:
        """The tools and the reply format in the system message; calls and results of the
        history in that format. Under ``"none"`` (or without tools) the reply format is not
        shown at all: the history's calls and results are told in prose."""
        if choice == "none" or not tools:
            return history(messages, as_prose=True), {}
        converted = history(messages, as_prose=False)
        return with_system_prompt(converted, system_prompt(tools, choice)), {}

    def constraint(
        self,
        tools: list[ToolSpec],
        choice: ToolChoice,
        parallel: bool,
        response_schema: dict | None,
        names_only: bool = False,
    ) -> dict | None:
        """``{"json_schema": ...}`` of a valid reply whenever tools are offered (see
        ``generic_prompt.reply_schema``; it names the tools, so ``names_only`` changes
        nothing)."""
        schema = reply_schema(tools, choice, parallel, response_schema)
        return None if schema is None else {"json_schema": schema}


GenericParser.STEPS = {
    _START: GenericParser._start,
    _KEY: GenericParser._key_start,
    _KEY_STRING: GenericParser._key_string,
    _COLON: GenericParser._colon,
    _CALLS: GenericParser._calls,
    _FIRST_ITEM: GenericParser._item,
    _ITEM: GenericParser._item,
    _READER: GenericParser._read_call,
    _AFTER_ITEM: GenericParser._after_item,
    _ANSWER: GenericParser._answer,
    _ANSWER_STRING: GenericParser._answer_string,
    _ANSWER_VALUE: GenericParser._answer_value,
    _REPLY_END: GenericParser._reply_end,
    _END: GenericParser._reply_end,
    _PLAIN: GenericParser._plain,
}
