"""Pythonic tool calls (Llama 3.2, Llama 4): a Python list of calls with keyword arguments.

::

    [get_weather(city="Paris", days=3), get_time(zone='CET')]

The list stands at the start of the output (after whitespace) or after ``<|python_start|>``
(Llama 4's special token, often absent from the decoded text); text before the tag and after
the list is content (``<|python_end|>`` right after it and whitespace at the end are markup). A call is a name (dotted
identifiers) and keyword arguments whose values are Python literals, read without evaluating
anything (call_args.py ``literal_value``: strings, numbers, True/False/None and JSON's
true/false/null, lists, tuples, dicts with string keys); a double-quoted string that is also a
JSON string reads as JSON. A list that does not start with ``name(`` is content. Once a call's
``(`` is read the call stands: a positional argument or a value that is not a literal closes
its arguments where they were, and the text from there is content. An output cut off inside
the list shows none of it: a call whose name is complete stands with the arguments streamed
so far (call_args.py).
"""

from __future__ import annotations

from radixlm.srt.parsers.call_args import (
    ArgumentsWriter,
    is_literal,
    literal_value,
    parameters_format,
)
from radixlm.srt.parsers.call_parser import MarkupSteps
from radixlm.srt.parsers.call_stream import HEADER_LIMIT, Emitter
from radixlm.srt.parsers.chat_history import tools_kwargs, with_template_calls
from radixlm.srt.parsers.constraints import CallFormat, choice_format, structural_tag
from radixlm.srt.parsers.json_stream import WHITESPACE
from radixlm.srt.parsers.markers import WS_HOLD, MarkerSplitter
from radixlm.srt.parsers.tool_base import ToolCallDelta, ToolCallParser, ToolChoice, ToolSpec

PYTHON_START = "<|python_start|>"
NAME_LIMIT = 256
# auto with a strict tool: an answer must not start like a call list (after whitespace)
TEXT_PATTERN = r"(?:\s*[^\s\[][\s\S]*)?"
_IDENT_START = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ_")
_IDENT = _IDENT_START | frozenset("0123456789")
_OPENERS, _CLOSERS = "([{", ")]}"

_START, _CONTENT, _TAGGED, _LIST, _NEXT, _FNAME, _ARG, _KEY, _EQUALS = range(9)
_VALUE, _AFTER_CALL, _END_TAG = range(9, 12)
PYTHON_END = "<|python_end|>"


def _content_of(tool: ToolSpec, loose: bool) -> dict:
    def element(name: str, written: dict, schema: object, loose: bool) -> dict:
        content = {"type": "json_schema", "json_schema": True if loose else written}
        return {"type": "tag", "begin": f"{name}=", "content": content, "end": ""}

    return parameters_format(tool, loose, element, ", ")


CALL_FORMAT = CallFormat(
    begin_of=lambda tool: f"{tool.name}(",
    end=")",
    separator=", ",
    text_pattern=TEXT_PATTERN,
    content_of=_content_of,
    opening="[",
    closing="]",
)


class PythonicParser(MarkupSteps, ToolCallParser):
    """``[name(key=literal, ...), ...]`` replies."""

    name = "pythonic"

    def __init__(self, tools: list[ToolSpec]) -> None:
        super().__init__(tools)
        self._em = Emitter()
        self._state = _START
        self._splitter = MarkerSplitter(PYTHON_START)
        self._lead = ""  # whitespace at the start of the output
        self._after_list = False  # no content since the list closed
        self._budget = HEADER_LIMIT
        self._tail = ""  # a name or key being read
        self._args = ArgumentsWriter(self._em)
        self._value: list[str] = []
        self._depth = 0  # open brackets in the value
        self._quote = ""  # the quote of the string the value is in
        self._escaped = False

    # -- streaming --

    def feed(self, delta: str) -> tuple[str, list[ToolCallDelta]]:
        pos = 0
        while pos < len(delta):
            pos = _STEPS[self._state](self, delta, pos)
        return self._em.take()

    def flush(self) -> tuple[str, list[ToolCallDelta]]:
        state = self._state
        if state == _START:
            self._em.content(self._lead)
        elif state == _CONTENT:
            held = self._splitter.flush()
            if not (self._after_list and held.strip(WHITESPACE) == ""):
                self._em.content(held)
        elif state == _END_TAG:
            self._em.release()
        elif state in (_ARG, _KEY, _EQUALS, _VALUE):
            self._em.claim()  # cut off inside a call: the arguments as streamed
            self._em.end_call()
        else:
            self._em.claim()
        self._state = _CONTENT
        return self._em.take()

    def _resume_content(self, pos: int) -> int:
        self._em.release()
        self._state, self._after_list = _CONTENT, False
        return pos

    def _start(self, text: str, pos: int) -> int:
        c = text[pos]
        if c in WHITESPACE and len(self._lead) < WS_HOLD:
            self._lead += c
            return pos + 1
        if c == "[":
            self._em.hold(self._lead + c)
            self._state, self._budget = _LIST, HEADER_LIMIT
            return pos + 1
        self._state = _CONTENT
        before, _, _ = self._splitter.scan(self._lead)
        self._em.content(before)
        return pos

    def _content(self, text: str, pos: int) -> int:
        stop, shown = self._content_until(self._splitter, text, pos, _TAGGED)
        if shown:
            self._after_list = False
        self._budget = HEADER_LIMIT  # for the markup after a marker
        return stop

    def _tagged(self, text: str, pos: int) -> int:
        c = text[pos]
        if c in WHITESPACE:
            return pos + 1 if self._hold(c) else self._resume_content(pos)
        if c != "[":
            return self._resume_content(pos)
        self._em.hold(c)
        self._state = _LIST
        return pos + 1

    def _list(self, text: str, pos: int) -> int:
        """Before a call's name (after ``[`` or a comma)."""
        c = text[pos]
        if c in WHITESPACE:
            return pos + 1 if self._hold(c) else self._resume_content(pos)
        if c not in _IDENT_START:
            return self._resume_content(pos)
        self._state, self._tail = _FNAME, ""
        return pos

    def _fname(self, text: str, pos: int) -> int:
        c = text[pos]
        if c == "(" and self._tail and not self._tail.endswith("."):
            self._em.start_call(self._tail)
            self._args = ArgumentsWriter(self._em)
            self._state = _ARG
            return pos + 1
        after_dot = self._tail.endswith(".")
        fits = c in (_IDENT_START if after_dot else _IDENT) or (c == "." and not after_dot)
        if not fits or len(self._tail) >= NAME_LIMIT:
            return self._resume_content(pos)
        self._tail += c
        self._em.hold(c)
        return pos + 1

    def _break(self, pos: int) -> int:
        """A call's arguments broke: they close where they were, the rest is content."""
        self._args.close()
        return self._resume_content(pos)

    def _arg(self, text: str, pos: int) -> int:
        """After ``(`` or a comma between arguments."""
        c = text[pos]
        if c in WHITESPACE:
            return pos + 1 if self._hold(c) else self._break(pos)
        if c == ")":
            return self._close_call(pos)
        if c not in _IDENT_START:
            return self._break(pos)
        self._state, self._tail = _KEY, ""
        return pos

    def _close_call(self, pos: int) -> int:
        self._args.close()
        self._em.claim()
        self._state, self._budget = _AFTER_CALL, HEADER_LIMIT
        return pos + 1

    def _key(self, text: str, pos: int) -> int:
        c = text[pos]
        if c in _IDENT and len(self._tail) < NAME_LIMIT:
            self._tail += c
            self._em.hold(c)
            return pos + 1
        self._state = _EQUALS
        return pos

    def _equals(self, text: str, pos: int) -> int:
        c = text[pos]
        if c in WHITESPACE:
            return pos + 1 if self._hold(c) else self._break(pos)
        if c != "=":
            return self._break(pos)
        self._em.hold(c)
        self._value, self._depth, self._quote, self._escaped = [], 0, "", False
        self._state = _VALUE
        return pos + 1

    def _value_step(self, text: str, pos: int) -> int:
        """A literal up to the ``,`` or ``)`` after it (outside strings and brackets)."""
        i = pos
        while i < len(text):
            c = text[i]
            if self._quote:
                if self._escaped:
                    self._escaped = False
                elif c == "\\":
                    self._escaped = True
                elif c == self._quote:
                    self._quote = ""
            elif c in "\"'":
                self._quote = c
            elif c in _OPENERS:
                self._depth += 1
            elif c in _CLOSERS or (c == "," and self._depth == 0):
                if self._depth == 0:
                    self._value.append(text[pos:i])
                    self._em.hold(text[pos:i])
                    return self._end_value(text, i)
                self._depth -= 1
            i += 1
        self._value.append(text[pos:])
        self._em.hold(text[pos:])
        return len(text)

    def _end_value(self, text: str, pos: int) -> int:
        value = literal_value("".join(self._value))
        if not is_literal(value) or text[pos] not in ",)":
            return self._break(pos)
        self._args.key(self._tail)
        self._args.value(value)
        self._em.claim()
        if text[pos] == ")":
            return self._close_call(pos)
        self._em.hold(",")
        self._state = _ARG
        return pos + 1

    def _after_call(self, text: str, pos: int) -> int:
        c = text[pos]
        if c in WHITESPACE:
            return pos + 1 if self._hold(c) else self._resume_content(pos)
        if c == ",":
            self._em.hold(c)
            self._state = _NEXT
            return pos + 1
        if c != "]":
            return self._resume_content(pos)
        self._em.claim()
        self._state, self._tail = _END_TAG, ""
        return pos + 1

    def _end_tag(self, text: str, pos: int) -> int:
        """Right after the list: ``<|python_end|>`` is markup too."""
        tail = self._tail + text[pos]
        if PYTHON_END.startswith(tail):
            self._em.hold(text[pos])
            self._tail = tail
            if tail == PYTHON_END:
                self._em.claim()
                self._state, self._after_list = _CONTENT, True
            return pos + 1
        self._em.release()
        self._state, self._after_list = _CONTENT, not self._tail
        return pos

    # -- prompt and constraint --

    def render(
        self, messages: list[dict], tools: list[ToolSpec], choice: ToolChoice
    ) -> tuple[list[dict], dict]:
        """History calls get dict arguments; tools go to the template as OpenAI entries."""
        return with_template_calls(messages), tools_kwargs(tools, choice)

    def constraint(
        self,
        tools: list[ToolSpec],
        choice: ToolChoice,
        parallel: bool,
        response_schema: dict | None,
        names_only: bool = False,
    ) -> dict | None:
        """Structural tags: ``[``, calls ``name(`` + arguments + ``)`` joined by ``, ``, ``]``;
        arguments are the required parameters in schema order, then any others, each value
        JSON of its schema (JSON's literals read as Python's). Under ``"auto"`` with a strict
        tool an answer must not start with ``[``."""
        fmt = choice_format(CALL_FORMAT, tools, choice, parallel, response_schema, names_only)
        return None if fmt is None else structural_tag(fmt)


_STEPS = {
    _START: PythonicParser._start,
    _CONTENT: PythonicParser._content,
    _TAGGED: PythonicParser._tagged,
    _LIST: PythonicParser._list,
    _NEXT: PythonicParser._list,
    _FNAME: PythonicParser._fname,
    _ARG: PythonicParser._arg,
    _KEY: PythonicParser._key,
    _EQUALS: PythonicParser._equals,
    _VALUE: PythonicParser._value_step,
    _AFTER_CALL: PythonicParser._after_call,
    _END_TAG: PythonicParser._end_tag,
}
