"""Qwen3-Coder's XML tool calls: a function and its parameters between tags, values as text.

::

    Let me look.
    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

A value is the text between ``<parameter=NAME>`` and the first ``</parameter>``, less one
newline at each end. Its type comes from the tool's schema (call_args.py): a string parameter
(or one whose schema names no type) is the text itself, streamed as it is read; any other is
read when it ends as the first allowed type that fits (``null``, booleans in any case, JSON
numbers, JSON or Python-literal objects and arrays), else as the text. Whitespace between the
tags is markup, and so is whitespace right before ``<tool_call>`` (and after the last block,
at the end). A block may hold several functions; a new ``<tool_call>`` also closes an unclosed
block. A block that does not start with ``<function=NAME>`` is content. Once the name is read
the call stands: markup that breaks inside the function closes its arguments where they were,
and the text from there is content. An output cut off inside a block shows none of it: a call
whose name is complete stands with the arguments streamed so far (call_args.py).
"""

from __future__ import annotations

from radixlm.srt.parsers.call_args import (
    ArgumentsWriter,
    is_text,
    literal_regex,
    parameters_format,
    partial_end,
    string_choices,
    typed_value,
    value_types,
)
from radixlm.srt.parsers.call_parser import MarkupSteps
from radixlm.srt.parsers.call_stream import HEADER_LIMIT, Emitter
from radixlm.srt.parsers.chat_history import tools_kwargs, with_template_calls
from radixlm.srt.parsers.constraints import CallFormat, choice_format, structural_tag
from radixlm.srt.parsers.json_stream import WHITESPACE
from radixlm.srt.parsers.markers import MarkerSplitter
from radixlm.srt.parsers.tool_base import ToolCallDelta, ToolCallParser, ToolChoice, ToolSpec

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"
FUNCTION = "<function="
FUNCTION_END = "</function>"
PARAMETER = "<parameter="
PARAMETER_END = "</parameter>"
NAME_LIMIT = 256  # characters of a function or parameter name

_CONTENT, _OPEN, _FUNC_NAME, _BODY, _PARAM_NAME, _VALUE, _AFTER_FUNC = range(7)


def _parameter(name: str, written: dict, schema: object, loose: bool, root: object) -> dict:
    """One parameter as the template writes it (after a line break): a text value up to
    ``</parameter>``, a typed one as JSON of its schema."""
    begin = f"\n{PARAMETER}{name}>\n"
    types = None if loose else value_types(schema, root)
    choices = None if loose else string_choices(schema, root)
    if types is not None and "string" not in types:
        content: dict = {"type": "json_schema", "json_schema": written}
        end = "\n" + PARAMETER_END
    elif choices is not None and is_text(types):
        pattern = "|".join(literal_regex(c) for c in choices)
        content, end = {"type": "regex", "pattern": f"(?:{pattern})"}, "\n" + PARAMETER_END
    else:
        content, end = {"type": "any_text"}, PARAMETER_END
    return {"type": "tag", "begin": begin, "content": content, "end": end}


def _content_of(tool: ToolSpec, loose: bool) -> dict:
    def element(name: str, written: dict, schema: object, loose: bool) -> dict:
        return _parameter(name, written, schema, loose, tool.parameters)

    return parameters_format(tool, loose, element, "")


CALL_FORMAT = CallFormat(
    begin_of=lambda tool: f"{OPEN_TAG}\n{FUNCTION}{tool.name}>",
    end=f"\n{FUNCTION_END}\n{CLOSE_TAG}",
    separator="\n",
    trigger=OPEN_TAG,
    content_of=_content_of,
)


class Qwen3CoderParser(MarkupSteps, ToolCallParser):
    """``<tool_call>`` blocks of ``<function=NAME>`` with ``<parameter=NAME>`` values."""

    name = "qwen3_coder"

    def __init__(self, tools: list[ToolSpec]) -> None:
        super().__init__(tools)
        self._em = Emitter()
        self._state = _CONTENT
        self._splitter = MarkerSplitter(OPEN_TAG)
        self._after_block = False  # no content since the last block closed
        self._tail = ""  # a literal (tag) or name being read
        self._budget = HEADER_LIMIT  # markup that may still be held before a call stands
        self._args = ArgumentsWriter(self._em)
        self._function = ""
        self._param = ""
        self._types: frozenset[str] | None = None
        self._value: list[str] = []  # a typed value read so far
        self._held = ""  # a value's end that may start </parameter>
        self._value_start = True  # nothing of the value read yet (its first newline drops)

    # -- streaming --

    def feed(self, delta: str) -> tuple[str, list[ToolCallDelta]]:
        pos = 0
        while pos < len(delta):
            pos = _STEPS[self._state](self, delta, pos)
        return self._em.take()

    def flush(self) -> tuple[str, list[ToolCallDelta]]:
        state = self._state
        if state == _CONTENT:
            held = self._splitter.flush()
            if not (self._after_block and held.strip(WHITESPACE) == ""):
                self._em.content(held)
        elif state in (_BODY, _PARAM_NAME, _VALUE):
            if state == _VALUE and is_text(self._types):
                self._args.string_part(self._held)  # the value as written, not closed
            self._em.claim()
            self._em.end_call()
        else:  # cut off before a call's name is complete, or after a function: markup
            self._em.claim()
        self._state = _CONTENT
        return self._em.take()

    def _content(self, text: str, pos: int) -> int:
        before, marker, after = self._splitter.scan(text, pos)
        self._em.content(before)
        if before:
            self._after_block = False
        if after is None:
            return len(text)
        self._open_block(marker)
        return after

    def _open_block(self, marker: str) -> None:
        self._em.hold(marker)
        self._state, self._tail, self._budget = _OPEN, "", HEADER_LIMIT

    def _not_a_call(self, pos: int) -> int:
        """The held markup is content; the text from ``pos`` is read as content."""
        self._em.release()
        self._state, self._after_block = _CONTENT, False
        return pos

    def _literal(self, text: str, pos: int, literals: tuple[str, ...]) -> tuple[int, str | None]:
        """Reads whitespace (before a literal) and the literals' characters; returns the index
        to go on from and the literal completed, ``""`` when none can match at ``pos``."""
        c = text[pos]
        if not self._tail and c in WHITESPACE:
            return (pos + 1, None) if self._hold(c) else (pos, "")
        tail = self._tail + c
        for literal in literals:
            if literal.startswith(tail):
                if not self._hold(c):
                    return pos, ""
                self._tail = tail
                if tail == literal:
                    self._tail = ""
                    return pos + 1, literal
                return pos + 1, None
        return pos, ""

    def _open(self, text: str, pos: int) -> int:
        stop, literal = self._literal(text, pos, (FUNCTION,))
        if literal == "":
            return self._not_a_call(pos)
        if literal is not None:
            self._state = _FUNC_NAME
        return stop

    def _name(self, text: str, pos: int, stops: str) -> tuple[int, str | None]:
        """Reads a name up to ``>``; the name when complete, ``""`` when it cannot be one."""
        c = text[pos]
        if c == ">":
            name, self._tail = self._tail, ""
            return pos + 1, name or ""
        if c in stops or len(self._tail) >= NAME_LIMIT:
            return pos, ""
        self._tail += c
        return pos + 1, None

    def _func_name(self, text: str, pos: int) -> int:
        stop, name = self._name(text, pos, "<" + WHITESPACE)
        if name == "":
            return self._not_a_call(pos)
        self._em.hold(text[pos:stop])
        if name is not None:
            self._em.start_call(name)
            self._function, self._args = name, ArgumentsWriter(self._em)
            self._state, self._budget = _BODY, HEADER_LIMIT
        return stop

    def _body(self, text: str, pos: int) -> int:
        stop, literal = self._literal(text, pos, (PARAMETER, FUNCTION_END))
        if literal == "":
            return self._break(pos)
        if literal == PARAMETER:
            self._state = _PARAM_NAME
        elif literal == FUNCTION_END:
            self._args.close()
            self._em.claim()
            self._state, self._budget = _AFTER_FUNC, HEADER_LIMIT
        return stop

    def _break(self, pos: int) -> int:
        """Markup broke inside a function: its arguments close where they were."""
        self._args.close()
        self._tail = ""
        return self._not_a_call(pos)

    def _param_name(self, text: str, pos: int) -> int:
        stop, name = self._name(text, pos, "<\n")
        if name == "":
            return self._break(pos)
        self._em.hold(text[pos:stop])
        if name is not None:
            self._em.claim()
            self._start_value(name)
        return stop

    def _start_value(self, name: str) -> None:
        tool = next((t for t in self.tools if t.name == self._function), None)
        schema = None
        if tool is not None:
            properties = tool.parameters.get("properties")
            if isinstance(properties, dict):
                schema = properties.get(name)
        self._types = None if tool is None else value_types(schema, tool.parameters)
        self._param, self._value, self._held = name, [], ""
        self._value_start, self._state = True, _VALUE
        if is_text(self._types):
            self._args.key(name)
            self._args.raw('"')

    def _value_step(self, text: str, pos: int) -> int:
        if self._value_start:
            self._value_start = False
            if text[pos] == "\n":
                return pos + 1
        window = self._held + text[pos:]
        found = window.find(PARAMETER_END)
        if found >= 0:
            stop = pos + found + len(PARAMETER_END) - len(self._held)
            body = window[:found]
            self._end_value(body[:-1] if body.endswith("\n") else body)
            return stop
        keep = partial_end(window, PARAMETER_END)
        if len(window) > keep and window[len(window) - keep - 1] == "\n":
            keep += 1  # a last line break that drops if </parameter> follows
        self._held = window[len(window) - keep :]
        self._put_value(window[: len(window) - keep])
        return len(text)

    def _put_value(self, text: str) -> None:
        if is_text(self._types):
            self._args.string_part(text)
        elif text:
            self._value.append(text)

    def _end_value(self, text: str) -> None:
        self._held = ""
        self._put_value(text)
        if is_text(self._types):
            self._args.raw('"')
        else:
            assert self._types is not None
            self._args.key(self._param)
            self._args.value(typed_value("".join(self._value), self._types))
        self._state, self._tail = _BODY, ""

    def _after_func(self, text: str, pos: int) -> int:
        stop, literal = self._literal(text, pos, (CLOSE_TAG, FUNCTION, OPEN_TAG))
        if literal == "":
            return self._not_a_call(pos)
        if literal == CLOSE_TAG:
            self._em.claim()
            self._state, self._after_block = _CONTENT, True
        elif literal == FUNCTION:  # another function in the same block
            self._state = _FUNC_NAME
        elif literal == OPEN_TAG:  # an unclosed block ends where the next one opens
            self._em.claim()
            self._open_block(OPEN_TAG)
        return stop

    # -- prompt and constraint --

    def render(
        self, messages: list[dict], tools: list[ToolSpec], choice: ToolChoice
    ) -> tuple[list[dict], dict]:
        """History calls get dict arguments (the template writes one ``<parameter=>`` per
        item); tools go to the template as OpenAI entries."""
        return with_template_calls(messages), tools_kwargs(tools, choice)

    def constraint(
        self,
        tools: list[ToolSpec],
        choice: ToolChoice,
        parallel: bool,
        response_schema: dict | None,
        names_only: bool = False,
    ) -> dict | None:
        """Structural tags whose call content is the tool's parameters: the required ones in
        schema order, then any others; text values up to ``</parameter>`` (one of an enum's
        strings when it has one), typed values as JSON of their schema. Free arguments (a
        non-strict tool under ``"auto"``): any of the declared parameters, as text."""
        fmt = choice_format(CALL_FORMAT, tools, choice, parallel, response_schema, names_only)
        return None if fmt is None else structural_tag(fmt)


_STEPS = {
    _CONTENT: Qwen3CoderParser._content,
    _OPEN: Qwen3CoderParser._open,
    _FUNC_NAME: Qwen3CoderParser._func_name,
    _BODY: Qwen3CoderParser._body,
    _PARAM_NAME: Qwen3CoderParser._param_name,
    _VALUE: Qwen3CoderParser._value_step,
    _AFTER_FUNC: Qwen3CoderParser._after_func,
}
