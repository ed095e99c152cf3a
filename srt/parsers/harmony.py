"""gpt-oss's harmony format: messages on channels, read as reasoning, content and tool calls.

::

    <|channel|>analysis<|message|>Need the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>
    {"city": "Paris"}<|call|>

    <|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>Hi!

(the line breaks are for reading: the model writes none between messages). The prompt ends
with ``<|start|>assistant``, so the output starts in the first message's header. A header runs
to ``<|message|>``: after ``<|start|>`` a role word, then ``<|channel|>`` and the channel's name,
a recipient ``to=NAME`` (before or after the channel), and a content type (``json`` or
``<|constrain|>json``). The body runs to ``<|end|>``, ``<|call|>`` or ``<|return|>`` (the last
two are gpt-oss's stop tokens, so an output usually just ends there), or to a ``<|start|>`` or
``<|channel|>`` that opens the next message unannounced.

What a message is, by its header:

* a recipient (any channel): a tool call; ``to=functions.get_weather`` calls ``get_weather``
  (another namespace keeps its whole name, which the chat route drops as not offered). The body
  is the arguments object, streamed as it is read (json_stream's safe point);
* the ``analysis`` channel: reasoning (``reasoning_content`` with the ``gpt-oss`` reasoning
  parser; the tool-call parser alone drops it, as SGLang's does);
* ``final``, ``commentary`` without a recipient (a preamble shown to the user) and any other
  channel: content.

Text outside messages (an output with no harmony markup at all) is content. A stray
terminator (``<|end|>``, ``<|call|>``, ``<|return|>`` outside a body) is markup. A header that
is not one (no ``<|message|>`` before a terminator or another ``<|start|>``, a word before the
channel that is not ``to=...``, more than ``HEADER_LIMIT`` characters) is content, as written.
A call body that does not start with ``{`` is content, header and all; arguments that stop
being JSON close where they last were and the rest of the body is content; text after a
complete object in the body is content. A terminator or the next message inside the arguments object
breaks it the same way. An output cut off inside the object (gpt-oss stops at ``<|call|>``, a
stop token that the decoded text usually leaves out, so that is how most calls end) is a call
with its arguments exactly as written, not closed; a call body ended with no object has
``{}`` (``""`` when cut off); a header cut off with the recipient's name complete (something
follows it) is a call with ``""`` arguments, one cut inside the name is dropped.

The markers are special tokens of gpt-oss's tokenizer (``special_markers``: chat requests then
keep them in the decoded text). ``HarmonyReasoningParser`` is the reasoning parser of the same
format: it takes the analysis messages out as reasoning, gives the final and preamble texts as
plain content and passes call messages on as written, for the tool-call parser after it.
"""

from __future__ import annotations

import re

from radixlm.srt.parsers.call_stream import Emitter
from radixlm.srt.parsers.chat_history import tools_kwargs, with_template_calls
from radixlm.srt.parsers.constraints import CallFormat, choice_format, structural_tag
from radixlm.srt.parsers.json_stream import DONE, FAILED, WHITESPACE, ArgumentStream
from radixlm.srt.parsers.markers import WS_HOLD
from radixlm.srt.parsers.reasoning import constraint_format, text_without
from radixlm.srt.parsers.tool_base import (
    ToolCallDelta,
    ToolCallParser,
    ToolChoice,
    ToolSpec,
    forces_calls,
)

START = "<|start|>"
CHANNEL = "<|channel|>"
MESSAGE = "<|message|>"
CONSTRAIN = "<|constrain|>"
END = "<|end|>"
CALL = "<|call|>"
RETURN = "<|return|>"
MARKERS = (START, CHANNEL, MESSAGE, CONSTRAIN, END, CALL, RETURN)
TERMINATORS = (END, CALL, RETURN)
HEADER_LIMIT = 512  # characters of a header held before it is decided (past that: content)
FUNCTIONS = "functions."
RECIPIENT = "to="
ASSISTANT = "assistant"

CALL_FORMAT = CallFormat(
    begin_of=lambda tool: (
        f"{CHANNEL}commentary {RECIPIENT}{FUNCTIONS}{tool.name} {CONSTRAIN}json{MESSAGE}"
    ),
    end=CALL,
    separator=START + ASSISTANT,
    trigger=f"{CHANNEL}commentary {RECIPIENT}{FUNCTIONS}",
)
FINAL_HEADER = f"{CHANNEL}final{MESSAGE}"

_MAX_MARKER = max(len(m) for m in MARKERS)

# reader states
_START, _TEXT, _HEAD, _BODY, _ARGS_LEAD, _ARGS, _AFTER_ARGS = range(7)
# what a body is
_CONTENT, _REASONING, _CALL, _PASS = range(4)


def _find(s: str, start: int) -> tuple[int, str | None]:
    """The earliest marker in ``s[start:]`` (its index and text), or a proper prefix of one
    that ``s`` ends in (its index and None), or ``(-1, None)``."""
    i = s.find("<", start)
    while i >= 0:
        if s.startswith("<|", i) or i == len(s) - 1:
            for marker in MARKERS:
                if s.startswith(marker, i):
                    return i, marker
            if len(s) - i < _MAX_MARKER and any(m.startswith(s[i:]) for m in MARKERS):
                return i, None
        i = s.find("<", i + 1)
    return -1, None


class MarkerScanner:
    """Splits streamed text at harmony's markers; holds back a partial marker (at most 12
    characters) between pieces."""

    def __init__(self) -> None:
        self._held = ""

    def scan(self, text: str, pos: int) -> tuple[str, str | None, int]:
        """``(before, marker, index)``: the text up to the next marker (None: none in the
        piece, which is then all read, a partial marker held) and where reading goes on."""
        held, self._held = self._held, ""
        if held:  # only the first scan of a piece has held text: one copy per piece
            s, offset, start = held + text[pos:], pos - len(held), 0
        else:
            s, offset, start = text, 0, pos
        i, marker = _find(s, start)
        if i < 0:
            return s[start:], None, len(text)
        if marker is None:
            self._held = s[i:]
            return s[start:i], None, len(text)
        return s[start:i], marker, offset + i + len(marker)

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held


class _Header:
    """A complete or cut-off header, read from its raw text."""

    def __init__(self, raw: str) -> None:
        self.channel: str | None = None
        self.recipient: str | None = None
        has_role = raw.startswith(START)
        role_part, mark, channel_part = raw[len(START) if has_role else 0 :].partition(CHANNEL)
        words = role_part.split()[1:] if has_role else role_part.split()
        valid = CHANNEL not in channel_part  # one channel
        for word in words:  # after the role: only a recipient
            valid = valid and word.startswith(RECIPIENT)
            self._recipient(word)
        if mark:
            parts = channel_part.replace(CONSTRAIN, " ").split()
            if parts and not parts[0].startswith(RECIPIENT):
                self.channel = parts[0]
            valid = valid and self.channel is not None
            for word in parts[1:]:  # a recipient, a content type
                self._recipient(word)
        valid = valid and (has_role or bool(mark) or self.recipient is not None)
        self.valid = valid and (self.recipient is None or bool(self.name))
        # cut off: a name is complete when something follows it
        self.recipient_complete = self.recipient is not None and not raw.endswith(
            RECIPIENT + self.recipient
        )

    def _recipient(self, word: str) -> None:
        if word.startswith(RECIPIENT) and self.recipient is None:
            self.recipient = word[len(RECIPIENT) :]

    @property
    def name(self) -> str:
        """The called function's name (``functions.`` dropped)."""
        recipient = self.recipient or ""
        return recipient[len(FUNCTIONS) :] if recipient.startswith(FUNCTIONS) else recipient

    def kind(self, reasoning_mode: bool) -> int:
        if self.recipient is not None:
            return _PASS if reasoning_mode else _CALL
        if self.channel == "analysis":
            return _REASONING
        return _CONTENT


class HarmonyReader:
    """The streaming machine of both parsers. ``reasoning_mode``: analysis bodies go to
    ``reasoning`` and call messages pass on as content (as written); else analysis bodies are
    dropped and call messages become calls."""

    def __init__(self, reasoning_mode: bool) -> None:
        self.reasoning_mode = reasoning_mode
        self.em = Emitter()
        self.reasoning: list[str] = []
        self.has_reasoning = False
        self._state = _START
        self._start_held = ""
        self._markers = MarkerScanner()
        self._header: list[str] = []
        self._header_len = 0
        self._kind = _CONTENT
        self._name = ""
        self._call_args = ArgumentStream()

    # -- driving --

    def feed(self, text: str) -> None:
        pos = 0
        while pos < len(text):
            if self._state == _START:
                pos = self._start(text, pos)
                continue
            before, marker, pos = self._markers.scan(text, pos)
            if self._state == _TEXT:
                self.em.content(before)
                if marker is not None:
                    self._text_marker(marker)
            elif self._state == _HEAD:
                self._head(before, marker)
            else:
                self._body(before)
                if marker is not None:
                    self._body_marker(marker)

    def flush(self) -> None:
        state = self._state
        if state == _START:
            self._state = _TEXT
            self.em.content(self._start_held)
        elif state == _TEXT:
            self.em.content(self._markers.flush())
        elif state == _HEAD:
            self._header_cut(self._markers.flush())
        else:
            self._body(self._markers.flush())
            self._end_body(cut=True)
        self._state = _TEXT

    # -- outside messages --

    def _start(self, text: str, pos: int) -> int:
        """At the output's start: whitespace and ``to=`` begin the first header (its role is
        in the prompt); anything else is read as text outside messages."""
        held = self._start_held + text[pos]
        body = held.lstrip(WHITESPACE)
        if len(held) - len(body) <= WS_HOLD and RECIPIENT.startswith(body[: len(RECIPIENT)]):
            if len(body) < len(RECIPIENT):
                self._start_held = held
                return pos + 1
            self._start_held = ""
            self._open_header(held)
            return pos + 1
        old, self._start_held = self._start_held, ""
        self._state = _TEXT
        self.feed(old)  # read again as text (no marker starts in it but a "<" at its end)
        return pos

    def _text_marker(self, marker: str) -> None:
        if marker in (START, CHANNEL):
            self._open_header(marker)
        elif marker in (MESSAGE, CONSTRAIN):
            self.em.content(marker)
        # a stray terminator is markup

    def _open_header(self, text: str) -> None:
        self._state = _HEAD
        self._header, self._header_len = [text], len(text)
        self.em.hold(text)

    # -- headers --

    def _head(self, before: str, marker: str | None) -> None:
        if not self._add_header(before):
            return self._header_failed(before, marker)
        if marker is None:
            return None
        if marker in (CHANNEL, CONSTRAIN):
            if not self._add_header(marker):
                self._header_failed("", marker)
            return None
        header = _Header("".join(self._header)) if marker == MESSAGE else None
        if header is None or not header.valid:
            return self._header_failed("", marker)
        self._open_body(header)
        return None

    def _add_header(self, text: str) -> bool:
        if self._header_len + len(text) > HEADER_LIMIT:
            return False
        self._header.append(text)
        self._header_len += len(text)
        self.em.hold(text)
        return True

    def _header_failed(self, text: str, marker: str | None) -> None:
        """Not a header: what was held is content, and ``text`` (which did not fit) too; the
        marker that broke it is read as outside messages."""
        self.em.release()
        self._state = _TEXT
        self.em.content(text)
        if marker is not None:
            self._text_marker(marker)

    def _header_cut(self, tail: str) -> None:
        """The output ends inside a header: a call whose name is complete stands (passed on as
        written by the reasoning parser); anything else is dropped."""
        header = _Header("".join(self._header))  # tail: a partial marker, which ends a name
        named = header.recipient is not None and (header.recipient_complete or bool(tail))
        if not (header.valid and named):
            self.em.claim()
        elif self.reasoning_mode:
            self.em.hold(tail)
            self.em.release()
        else:
            self.em.start_call(header.name)
            self.em.end_call()

    def _open_body(self, header: _Header) -> None:
        self._kind = header.kind(self.reasoning_mode)
        self._name = header.name
        if self._kind == _PASS:
            self.em.release()
            self.em.content(MESSAGE)
            self._state = _BODY
        elif self._kind == _CALL:
            self.em.hold(MESSAGE)
            self._state = _ARGS_LEAD
        else:
            self.em.claim()
            self._state = _BODY
            if self._kind == _REASONING:
                self.has_reasoning = True

    # -- bodies --

    def _body(self, text: str) -> None:
        pos = 0
        while pos < len(text):
            state = self._state
            if state == _BODY:
                self._body_text(text[pos:])
                return
            if state == _ARGS_LEAD:
                pos = self._args_lead(text, pos)
            elif state == _ARGS:
                pos = self._args(text, pos)
            else:
                pos = self._after_args(text, pos)

    def _body_text(self, text: str) -> None:
        if self._kind == _REASONING:
            if self.reasoning_mode:
                self.reasoning.append(text)
        else:
            self.em.content(text)

    def _args_lead(self, text: str, pos: int) -> int:
        c = text[pos]
        if c in WHITESPACE:
            stop = pos + 1
            while stop < len(text) and text[stop] in WHITESPACE:
                stop += 1
            self.em.hold(text[pos:stop])
            return stop
        if c != "{":  # not an arguments object: the message is content, as written
            self.em.release()
            self._state, self._kind = _BODY, _CONTENT
            return pos
        self.em.start_call(self._name)
        self._call_args = ArgumentStream()
        self._state = _ARGS
        return pos

    def _args(self, text: str, pos: int) -> int:
        args = self._call_args
        stop = args.feed(text, pos, len(text), self.em.arguments)
        if args.status == DONE:
            self.em.end_call()
            self._state = _AFTER_ARGS
        elif args.status == FAILED:
            self.em.arguments(args.scanner.closing())
            self.em.end_call()
            self.em.content(args.held())
            self._state, self._kind = _BODY, _CONTENT
        return stop

    def _after_args(self, text: str, pos: int) -> int:
        c = text[pos]
        if c in WHITESPACE:
            self.em.hold(c)
            return pos + 1
        self.em.release()
        self._state, self._kind = _BODY, _CONTENT
        return pos

    def _body_marker(self, marker: str) -> None:
        if marker in (MESSAGE, CONSTRAIN):
            self._body(marker)  # text of the body
            return
        self._end_body(cut=False)
        if marker in TERMINATORS:
            if self._kind == _PASS:
                self.em.content(marker)
            self._state = _TEXT
        else:  # the next message starts without a terminator
            self._open_header(marker)

    def _end_body(self, cut: bool) -> None:
        """The body ends (a terminator, the next message, or the end of the output)."""
        state = self._state
        if state == _ARGS_LEAD:  # no arguments object: {} when ended, as written when cut
            self.em.start_call(self._name)
            self.em.arguments("" if cut else "{}")
            self.em.end_call()
        elif state == _ARGS and cut:  # the output ends inside the object: as written
            self.em.arguments(self._call_args.held())
            self.em.end_call()
        elif state == _ARGS:  # a marker inside the object: closed there, the rest is content
            self.em.arguments(self._call_args.scanner.closing())
            self.em.end_call()
            self.em.content(self._call_args.held())
        self.em.claim()  # whitespace after the arguments
        self._state = _TEXT


class HarmonyParser(ToolCallParser):
    """Tool calls of the harmony format (``gpt-oss``); analysis messages are dropped."""

    name = "gpt-oss"
    special_markers = MARKERS

    def __init__(self, tools: list[ToolSpec]) -> None:
        super().__init__(tools)
        self._reader = HarmonyReader(reasoning_mode=False)

    def feed(self, delta: str) -> tuple[str, list[ToolCallDelta]]:
        self._reader.feed(delta)
        return self._reader.em.take()

    def flush(self) -> tuple[str, list[ToolCallDelta]]:
        self._reader.flush()
        return self._reader.em.take()

    def render(
        self, messages: list[dict], tools: list[ToolSpec], choice: ToolChoice
    ) -> tuple[list[dict], dict]:
        """gpt-oss's template writes one call per assistant message and names a tool result
        after the call before it: an assistant message of several calls becomes one message
        per call, each followed by its result (where the history has it); ``reasoning_content``
        becomes the template's ``thinking`` (where the message has no content: the template
        writes either as the analysis message); arguments are objects (the template applies
        ``tojson``)."""
        return harmony_history(with_template_calls(messages)), tools_kwargs(tools, choice)

    def constraint(
        self,
        tools: list[ToolSpec],
        choice: ToolChoice,
        parallel: bool,
        response_schema: dict | None,
        names_only: bool = False,
    ) -> dict | None:
        """Calls as ``<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>``,
        the arguments, ``<|call|>``, several joined by ``<|start|>assistant``; a response
        schema's answer is a final-channel message."""
        fmt = choice_format(CALL_FORMAT, tools, choice, parallel, response_schema, names_only)
        if fmt is None:
            return None
        if response_schema is not None and not forces_calls(choice):
            answer, calls = fmt["elements"]
            final = {"type": "const_string", "value": FINAL_HEADER}
            fmt = {"type": "or", "elements": [_sequence(final, answer), calls]}
        return structural_tag(fmt)


def _sequence(*elements: dict) -> dict:
    return {"type": "sequence", "elements": list(elements)}


def harmony_history(messages: list[dict]) -> list[dict]:
    """One call per assistant message, each call's result right after it."""
    results: dict[str, dict] = {}
    for message in messages:
        if message.get("role") == "tool" and message.get("tool_call_id") is not None:
            results.setdefault(str(message["tool_call_id"]), message)
    placed: set[int] = set()
    out: list[dict] = []
    for message in messages:
        if message.get("role") == "tool":
            if id(message) not in placed:
                out.append(message)
            continue
        calls = message.get("tool_calls") or []
        if message.get("role") != "assistant" or not calls:
            out.append(message)
            continue
        base = {k: v for k, v in message.items() if k not in ("tool_calls", "reasoning_content")}
        if message.get("reasoning_content") and not message.get("content"):
            base["thinking"] = message["reasoning_content"]  # gpt-oss's template takes one
        for i, call in enumerate(calls):
            part = dict(base) if i == 0 else {"role": "assistant", "content": ""}
            part["tool_calls"] = [call]
            out.append(part)
            result = results.get(str(call.get("id")))
            if result is not None and id(result) not in placed:
                placed.add(id(result))
                out.append(result)
    return out


class HarmonyReasoningParser:
    """The ``gpt-oss`` reasoning parser: analysis messages are the reasoning; final and
    preamble texts are content; call messages pass on as written (the tool-call parser reads
    them). Same interface as ``ReasoningParser``."""

    name = "gpt-oss"

    def __init__(self, name: str = "gpt-oss", starts_in_reasoning: bool = False) -> None:
        self.starts_in_reasoning = starts_in_reasoning  # unused: harmony marks its channels
        self._reader = HarmonyReader(reasoning_mode=True)

    def split(self, text: str) -> tuple[str | None, str]:
        fresh = HarmonyReasoningParser()
        reasoning, content = fresh.feed(text)
        more_reasoning, more_content = fresh.flush()
        if not fresh._reader.has_reasoning:
            return None, content + more_content
        return reasoning + more_reasoning, content + more_content

    def feed(self, delta: str) -> tuple[str, str]:
        self._reader.feed(delta)
        return self._take()

    def flush(self) -> tuple[str, str]:
        self._reader.flush()
        return self._take()

    def _take(self) -> tuple[str, str]:
        content, _ = self._reader.em.take()
        reasoning = "".join(self._reader.reasoning)
        self._reader.reasoning.clear()
        return reasoning, content

    def wrap_constraint(self, fragment: dict | None) -> dict | None:
        """``fragment`` after an optional analysis message: a constraint that writes its own
        channel headers (the tool calls') follows it as it is; any other (a response format,
        a raw grammar) is the body of a final-channel message."""
        if fragment is None:
            return None
        after = constraint_format(fragment)
        if CHANNEL not in repr(after):
            after = _sequence({"type": "const_string", "value": FINAL_HEADER}, after)
        opening = {"type": "const_string", "value": f"{CHANNEL}analysis{MESSAGE}"}
        body = {"type": "regex", "pattern": text_without(END) + re.escape(END + START + ASSISTANT)}
        return structural_tag({"type": "or", "elements": [_sequence(opening, body, after), after]})
