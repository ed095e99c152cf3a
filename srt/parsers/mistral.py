"""Mistral tool calls after ``[TOOL_CALLS]``, in either of Mistral's two forms.

::

    [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": ...}]
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{"zone": "CET"}

The first (tokenizer v3 to v7 templates: Mistral 7B v0.3, Mixtral 8x22B, Mistral Small 3.1) is
a JSON array of call objects (an ``"id"`` in them is skipped); the second (tokenizer v11 and
later: Mistral Small 3.2, Magistral, Devstral) is the name, ``[ARGS]`` and the arguments object,
one ``[TOOL_CALLS]`` per call (a ``[CALL_ID]id`` before ``[ARGS]`` is skipped). Both parsers read
both forms; ``mistral`` writes (and constrains) the array form, ``mistral_v11`` the other.

Text before ``[TOOL_CALLS]`` and after the calls is content; whitespace right before it (and
after the last call, at the end) is markup. Markup that is not one of the forms is content;
once a call's arguments object has begun the call stands, arguments that stop being JSON are
closed where they last were and the text after that point is content. An output cut off
inside the markup shows none of it: a call whose name is complete (in the second form, read up
to ``[ARGS]``) stands with its arguments exactly as written so far; one without is dropped.

``[TOOL_CALLS]`` and ``[ARGS]`` are special tokens of Mistral's tokenizers, which decoding
drops by default, so chat requests served with these parsers keep special tokens in the text
(``special_markers``). Mistral's templates accept only call ids of 9 letters and digits:
``render`` gives the history's calls such ids (the same id for the same call every time, so
prompts stay cacheable), and the server's new calls get them (``new_call_id``).
"""

from __future__ import annotations

import hashlib
import secrets
import string

from radixlm.srt.parsers.call_parser import CallStreamParser
from radixlm.srt.parsers.call_stream import HEADER_LIMIT
from radixlm.srt.parsers.chat_history import tools_kwargs, with_template_calls
from radixlm.srt.parsers.constraints import CallFormat, choice_format, quoted, structural_tag
from radixlm.srt.parsers.json_stream import DONE, FAILED, WHITESPACE, ArgumentStream
from radixlm.srt.parsers.markers import MarkerSplitter
from radixlm.srt.parsers.tool_base import ToolCallDelta, ToolChoice, ToolSpec

TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"
CALL_ID = "[CALL_ID]"
ID_ALPHABET = string.ascii_letters + string.digits
ID_LENGTH = 9
NAME_LIMIT = 256  # characters of a call name (the second form) or a call id

ARRAY_FORMAT = CallFormat(
    begin_of=lambda tool: f'{{"name": {quoted(tool.name)}, "arguments": ',
    end="}",
    separator=", ",
    trigger=TOOL_CALLS,
    opening=TOOL_CALLS + " [",
    closing="]",
)
ARGS_FORMAT = CallFormat(
    begin_of=lambda tool: f"{TOOL_CALLS}{tool.name}{ARGS}",
    end="",
    separator="",
    trigger=TOOL_CALLS,
)

# states
_CONTENT, _MARKED, _FIRST_ITEM, _ITEM, _READER, _AFTER_ITEM = range(6)
_NAME, _NAME_MARK, _CALL_ID, _ARGS, _STREAM = range(6, 11)


def mistral_id(call_id: str) -> str:
    """A call id Mistral's templates accept: ``call_id`` itself when it is 9 letters and
    digits, else 9 derived from it (the same every time)."""
    if len(call_id) == ID_LENGTH and call_id.isascii() and call_id.isalnum():
        return call_id
    digest = int.from_bytes(hashlib.sha256(call_id.encode("utf-8")).digest(), "big")
    out = []
    for _ in range(ID_LENGTH):
        digest, k = divmod(digest, len(ID_ALPHABET))
        out.append(ID_ALPHABET[k])
    return "".join(out)


class MistralParser(CallStreamParser):
    """Both forms; writes the JSON array (``[TOOL_CALLS] [...]``)."""

    name = "mistral"
    READER = _READER
    special_markers = (TOOL_CALLS, ARGS, CALL_ID)
    CALL_FORMAT = ARRAY_FORMAT

    def __init__(self, tools: list[ToolSpec]) -> None:
        super().__init__(tools, _CONTENT)
        self._splitter = MarkerSplitter(TOOL_CALLS)
        self._after_block = False  # no content since the last calls ended
        self._tail = ""  # a name, id or marker being read
        self._name = ""
        self._budget = HEADER_LIMIT
        self._call_args = ArgumentStream()

    def new_call_id(self) -> str:
        return "".join(secrets.choice(ID_ALPHABET) for _ in range(ID_LENGTH))

    # -- streaming --

    def flush(self) -> tuple[str, list[ToolCallDelta]]:
        state = self._state
        if state == _CONTENT:
            held = self._splitter.flush()
            if not (self._after_block and held.strip(WHITESPACE) == ""):
                self._em.content(held)
        elif state == _READER:
            self._finish_call()
        elif state == _STREAM:
            self._em.arguments(self._call_args.held())  # as written, not closed
            self._em.end_call()
            self._em.claim()
        elif state in (_CALL_ID, _ARGS):
            self._em.start_call(self._name)  # the name is complete: the call stands
            self._em.end_call()
        else:
            self._em.claim()
        self._state = _CONTENT
        return self._em.take()

    def _content(self, text: str, pos: int) -> int:
        stop, shown = self._content_until(self._splitter, text, pos, _MARKED)
        if shown:
            self._after_block = False
        self._budget = HEADER_LIMIT  # for the markup after a marker
        return stop

    def _marked(self, text: str, pos: int) -> int:
        """After ``[TOOL_CALLS]``: the array's ``[`` or a call's name."""
        c = text[pos]
        if c in WHITESPACE:
            return pos + 1 if self._hold(c) else self._resume_content(pos)
        if c == "[":
            self._em.hold(c)
            self._state = _FIRST_ITEM
            return pos + 1
        self._state, self._tail = _NAME, ""
        return pos

    def _item(self, text: str, pos: int) -> int:
        c = text[pos]
        if c == "]" and self._state == _FIRST_ITEM:
            return self._end_block(pos)
        if c in WHITESPACE:
            return pos + 1 if self._hold(c) else self._resume_content(pos)
        return self._start_call(pos) if c == "{" else self._resume_content(pos)

    def _call_finished(self) -> None:
        self._state, self._budget = _AFTER_ITEM, HEADER_LIMIT

    def _after_item(self, text: str, pos: int) -> int:
        c = text[pos]
        if c in WHITESPACE:
            return pos + 1 if self._hold(c) else self._resume_content(pos)
        if c == ",":
            self._em.hold(c)
            self._state = _ITEM
            return pos + 1
        if c == "]":
            return self._end_block(pos)
        return self._resume_content(pos)

    def _end_block(self, pos: int) -> int:
        self._em.claim()
        self._state, self._after_block = _CONTENT, True
        return pos + 1

    def _resume_content(self, pos: int) -> int:
        self._em.release()
        self._state, self._after_block = _CONTENT, False
        return pos

    # -- the second form: name[CALL_ID]id[ARGS]{...} --

    def _read_name(self, text: str, pos: int) -> int:
        c = text[pos]
        if c == "[" and self._tail:
            self._name, self._tail = self._tail, ""
            self._state = _NAME_MARK
            return pos
        if c in WHITESPACE + '[]{}"' or len(self._tail) >= NAME_LIMIT:
            return self._resume_content(pos)
        self._tail += c
        self._em.hold(c)
        return pos + 1

    def _name_mark(self, text: str, pos: int) -> int:
        tail = self._tail + text[pos]
        for marker, state in ((ARGS, _ARGS), (CALL_ID, _CALL_ID)):
            if marker.startswith(tail):
                self._em.hold(text[pos])
                self._tail = tail
                if tail == marker:
                    self._state, self._tail = state, ""
                return pos + 1
        return self._resume_content(pos)

    def _call_id(self, text: str, pos: int) -> int:
        c = text[pos]
        if c == "[" and self._tail:
            self._state, self._tail = _NAME_MARK, ""
            return pos
        if not c.isalnum() or len(self._tail) >= NAME_LIMIT:
            return self._resume_content(pos)
        self._tail += c
        self._em.hold(c)
        return pos + 1

    def _args(self, text: str, pos: int) -> int:
        c = text[pos]
        if c in WHITESPACE:
            return pos + 1 if self._hold(c) else self._resume_content(pos)
        if c != "{":
            return self._resume_content(pos)
        self._em.start_call(self._name)
        self._call_args = ArgumentStream()
        self._state = _STREAM
        return pos

    def _stream(self, text: str, pos: int) -> int:
        """The arguments object, streamed up to the scanner's safe point."""
        args = self._call_args
        stop = args.feed(text, pos, len(text), self._em.arguments)
        if args.status == DONE:
            self._em.end_call()
            self._state, self._after_block = _CONTENT, True
        elif args.status == FAILED:
            self._em.arguments(args.scanner.closing())
            self._em.end_call()
            self._em.hold(args.held())
            return self._resume_content(stop)
        return stop

    # -- prompt and constraint --

    def render(
        self, messages: list[dict], tools: list[ToolSpec], choice: ToolChoice
    ) -> tuple[list[dict], dict]:
        """History calls get dict arguments and ids of 9 letters and digits (tool results the
        same id as their call); tools go to the template as OpenAI entries."""
        out = []
        for message in with_template_calls(messages):
            if message.get("tool_calls"):
                calls = [
                    {**call, "id": mistral_id(str(call["id"]))} if "id" in call else call
                    for call in message["tool_calls"]
                ]
                message = {**message, "tool_calls": calls}
            if message.get("role") == "tool" and message.get("tool_call_id") is not None:
                message = {**message, "tool_call_id": mistral_id(str(message["tool_call_id"]))}
            out.append(message)
        return out, tools_kwargs(tools, choice)

    def constraint(
        self,
        tools: list[ToolSpec],
        choice: ToolChoice,
        parallel: bool,
        response_schema: dict | None,
        names_only: bool = False,
    ) -> dict | None:
        fmt = choice_format(self.CALL_FORMAT, tools, choice, parallel, response_schema, names_only)
        return None if fmt is None else structural_tag(fmt)


class MistralV11Parser(MistralParser):
    """Both forms; writes ``[TOOL_CALLS]name[ARGS]{...}`` per call."""

    name = "mistral_v11"
    CALL_FORMAT = ARGS_FORMAT


MistralParser.STEPS = MistralV11Parser.STEPS = {
    _CONTENT: MistralParser._content,
    _MARKED: MistralParser._marked,
    _FIRST_ITEM: MistralParser._item,
    _ITEM: MistralParser._item,
    _READER: MistralParser._read_call,
    _AFTER_ITEM: MistralParser._after_item,
    _NAME: MistralParser._read_name,
    _NAME_MARK: MistralParser._name_mark,
    _CALL_ID: MistralParser._call_id,
    _ARGS: MistralParser._args,
    _STREAM: MistralParser._stream,
}
