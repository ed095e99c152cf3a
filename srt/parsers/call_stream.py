"""Streaming pieces shared by the tool-call parsers: the output collector and the call reader.

``Emitter`` collects what one ``feed`` produces: content text, call deltas, and *pending* text
(markup read but not yet attributed). Pending text becomes content when the markup turns out
malformed (``release``) and disappears when a call claims it (``claim``).

``CallReader`` reads one call object, ``{"name": "...", "arguments": {...}}``, from streamed
text. The name's key may also be followed by ``"parameters"`` instead of ``"arguments"``; the
arguments may be a JSON object or a JSON string holding one; ``"type"`` and ``"id"`` keys are
skipped; a call without arguments has ``{}``. The call is *committed* (its first delta is sent)
when the arguments object starts and the name is known; from then on the arguments stream as
they are read, up to the scanner's safe point, so an object that breaks (stops being JSON) is
closed into valid JSON there. Before the commit, at most ``HEADER_LIMIT`` characters are held.

Input that ends inside the call object (an output cut off by max_tokens) is not a break: see
``CallReader.finish``. The arguments are then exactly the text written so far, never closed.
"""

from __future__ import annotations

from radixlm.srt.parsers.json_stream import (
    DONE,
    FAILED,
    RUNNING,
    WHITESPACE,
    JsonScanner,
    StringDecoder,
    loads_strict,
    skip_whitespace,
)
from radixlm.srt.parsers.tool_base import ToolCallDelta

HEADER_LIMIT = 16384  # characters of call markup held before the call is decided

_ARGUMENT_KEYS = ("arguments", "parameters")
_SKIPPED_KEYS = ("type", "id")

# reader states
_OPEN, _FIRST_KEY, _NEXT_KEY, _KEY, _COLON, _VALUE, _AFTER = range(7)
_NAME, _SKIP, _ARGS_STREAM, _ARGS_BUFFER, _ARGS_STRING = range(7, 12)


class Emitter:
    """The output of one ``feed``/``flush``: content, call deltas and pending markup."""

    def __init__(self) -> None:
        self.num_calls = 0  # calls started so far (the index of the next one)
        self._content: list[str] = []
        self._deltas: list[ToolCallDelta] = []
        self._pending: list[str] = []
        self._in_call = False

    def content(self, text: str) -> None:
        assert not self._pending, "pending markup must be decided before more content"
        if text:
            self._content.append(text)

    def hold(self, text: str) -> None:
        if text:
            self._pending.append(text)

    def release(self) -> None:
        """Pending markup was not a call after all: it is content."""
        self._content.extend(self._pending)
        self._pending.clear()

    def claim(self) -> None:
        """Pending markup belongs to a call: it is not shown."""
        self._pending.clear()

    def start_call(self, name: str) -> None:
        self.claim()
        self._deltas.append(ToolCallDelta(self.num_calls, name))
        self._in_call = True

    def arguments(self, text: str) -> None:
        assert self._in_call
        if not text:
            return
        last = self._deltas[-1] if self._deltas else None
        if last is not None and last.index == self.num_calls:
            last.arguments += text
        else:
            self._deltas.append(ToolCallDelta(self.num_calls, None, text))

    def end_call(self) -> None:
        assert self._in_call
        self._in_call = False
        self.num_calls += 1

    def take(self) -> tuple[str, list[ToolCallDelta]]:
        """Content and deltas produced since the last take (pending text stays)."""
        content, deltas = "".join(self._content), self._deltas
        self._content, self._deltas = [], []
        return content, deltas


class CallReader:
    """Reads one call object; see the module docstring. ``status``: RUNNING, DONE (the object
    closed just before the index ``feed`` returned) or FAILED (the character at that index does
    not fit; the text before it is pending in the emitter, an open call is closed)."""

    def __init__(self, emitter: Emitter) -> None:
        self.status = RUNNING
        self.committed = False
        self._em = emitter
        self._state = _OPEN
        self._budget = HEADER_LIMIT
        self._key = ""
        self._seen: set[str] = set()
        self._name: str | None = None
        self._arguments: str | None = None  # complete arguments read before the commit
        self._decoder = StringDecoder()
        self._decoded: list[str] = []
        self._scanner = JsonScanner()
        self._buffer: list[str] = []  # arguments read but not yet streamed or decided
        self._streamed = 0  # characters of streamed arguments sent

    def feed(self, text: str, pos: int, end: int) -> int:
        while pos < end and self.status == RUNNING:
            if self._state == _ARGS_STREAM:
                pos = self._stream(text, pos, end)
                continue
            limit = min(end, pos + self._budget)
            if limit == pos:
                return self._fail(pos)  # too much markup held: it is not a call
            new = _READER_STEPS[self._state](self, text, pos, limit)
            self._em.hold(text[pos:new])
            self._budget -= new - pos
            pos = new
        return pos

    def finish(self) -> bool:
        """End of input inside the object (the output was cut off); whether the pending markup
        is the call's (not content). A call whose name is complete stands, its arguments exactly
        the text written so far (streaming arguments get the text held after the safe point;
        arguments not begun are ``""``): nothing is closed or invented. Markup that may still
        become a call but has no complete name yet is dropped. Only markup that can no longer
        be a call object (a partial key that no call key starts with) is content."""
        if self.status != RUNNING:
            return self.committed
        if self.committed:
            if self._state == _ARGS_STREAM:
                self._end_arguments("".join(self._buffer))
            return True
        if not self._may_be_call():
            return False
        if self._name is not None:
            self._commit(self._arguments_so_far())
        return True

    def _may_be_call(self) -> bool:
        """Whether the markup read so far (uncommitted) may still continue into a call."""
        decoded = "".join(self._decoded)
        if self._state == _KEY:  # a key that no unseen key of a call object starts with fails
            for key in ("name", *_ARGUMENT_KEYS, *_SKIPPED_KEYS):
                group = "arguments" if key in _ARGUMENT_KEYS else key
                if key.startswith(decoded) and group not in self._seen:
                    return True
            return False
        if self._state == _ARGS_STRING:  # the string must be able to hold just an object
            scanner = JsonScanner(object_only=True)
            stop = scanner.scan(decoded)
            return scanner.status != FAILED and not decoded[stop:].strip(WHITESPACE)
        return True

    def _arguments_so_far(self) -> str:
        """The arguments read before the commit, as far as they were written."""
        if self._arguments is not None:
            return self._arguments
        if self._state == _ARGS_STRING:  # a JSON string holding the object, cut inside it
            return "".join(self._decoded).lstrip(WHITESPACE)
        return ""

    def _fail(self, pos: int) -> int:
        self.status = FAILED
        return pos

    def _commit(self, arguments: str | None) -> None:
        assert self._name is not None
        self.committed = True
        self._em.start_call(self._name)
        if arguments is not None:
            self._end_arguments(arguments)

    def _end_arguments(self, tail: str) -> None:
        self._em.arguments(tail)
        self._em.end_call()
        self._state = _AFTER
        self._budget = HEADER_LIMIT

    def _stream(self, text: str, pos: int, end: int) -> int:
        scanner = self._scanner
        stop = scanner.scan(text, pos, end)
        self._buffer.append(text[pos:stop])
        if scanner.safe_end > self._streamed:
            held = "".join(self._buffer)
            cut = scanner.safe_end - self._streamed
            self._em.arguments(held[:cut])
            self._buffer = [held[cut:]]
            self._streamed = scanner.safe_end
        if scanner.status == DONE:
            self._buffer = []
            self._end_arguments("")
        elif scanner.status == FAILED:
            self._end_arguments(scanner.closing())
            self._em.hold("".join(self._buffer))
            return self._fail(stop)
        return stop

    # -- header steps: read text[pos:end], return the new index (the caller holds the text) --

    def _open(self, text: str, pos: int, end: int) -> int:
        if text[pos] in WHITESPACE:
            return skip_whitespace(text, pos, end)
        if text[pos] != "{":
            return self._fail(pos)
        self._state = _FIRST_KEY
        return pos + 1

    def _first_key(self, text: str, pos: int, end: int) -> int:
        if text[pos] == "}":
            return self._close(pos)
        return self._next_key(text, pos, end)

    def _next_key(self, text: str, pos: int, end: int) -> int:
        if text[pos] in WHITESPACE:
            return skip_whitespace(text, pos, end)
        if text[pos] != '"':
            return self._fail(pos)
        self._start_string(_KEY)
        return pos + 1

    def _start_string(self, state: int) -> None:
        self._decoder, self._decoded, self._state = StringDecoder(), [], state

    def _read_string(self, text: str, pos: int, end: int) -> tuple[int, str | None]:
        stop, decoded = self._decoder.decode(text, pos, end)
        self._decoded.append(decoded)
        if self._decoder.status == FAILED:
            return self._fail(stop), None
        if self._decoder.status == DONE:
            return stop, "".join(self._decoded)
        return stop, None

    def _read_key(self, text: str, pos: int, end: int) -> int:
        stop, key = self._read_string(text, pos, end)
        if key is None:
            return stop
        if not self.committed:
            known = key == "name" or key in _ARGUMENT_KEYS or key in _SKIPPED_KEYS
            group = "arguments" if key in _ARGUMENT_KEYS else key
            if not known or group in self._seen:
                return self._fail(stop)  # not a call object (or an ambiguous one)
            self._seen.add(group)
        self._key = key
        self._state = _COLON
        return stop

    def _colon(self, text: str, pos: int, end: int) -> int:
        if text[pos] in WHITESPACE:
            return skip_whitespace(text, pos, end)
        if text[pos] != ":":
            return self._fail(pos)
        self._state = _VALUE
        return pos + 1

    def _value(self, text: str, pos: int, end: int) -> int:
        c = text[pos]
        if c in WHITESPACE:
            return skip_whitespace(text, pos, end)
        if self.committed or self._key in _SKIPPED_KEYS:
            self._scanner, self._state = JsonScanner(), _SKIP
        elif self._key == "name":
            if c != '"':
                return self._fail(pos)
            self._start_string(_NAME)
            return pos + 1
        elif c == "{":
            self._scanner, self._buffer = JsonScanner(object_only=True), []
            if self._name is None:
                self._state = _ARGS_BUFFER
            else:
                self._state = _ARGS_STREAM
                self._commit(None)
        elif c == '"':
            self._start_string(_ARGS_STRING)
            return pos + 1
        else:
            return self._fail(pos)
        return pos

    def _read_name(self, text: str, pos: int, end: int) -> int:
        stop, name = self._read_string(text, pos, end)
        if name is not None:
            if not name:
                return self._fail(stop)
            self._name, self._state = name, _AFTER
        return stop

    def _skip(self, text: str, pos: int, end: int) -> int:
        stop = self._scanner.scan(text, pos, end)
        if self._scanner.status == FAILED:
            return self._fail(stop)
        if self._scanner.status == DONE:
            self._state = _AFTER
        return stop

    def _buffer_arguments(self, text: str, pos: int, end: int) -> int:
        stop = self._skip(text, pos, end)
        self._buffer.append(text[pos:stop])
        if self._state == _AFTER:
            self._arguments = "".join(self._buffer)
        return stop

    def _string_arguments(self, text: str, pos: int, end: int) -> int:
        stop, decoded = self._read_string(text, pos, end)
        if decoded is None:
            return stop
        try:
            value = loads_strict(decoded)
        except ValueError:
            value = None
        if not isinstance(value, dict):
            return self._fail(stop)  # a string that holds no object: not a call
        self._arguments = decoded.strip(WHITESPACE)
        self._state = _AFTER
        return stop

    def _after(self, text: str, pos: int, end: int) -> int:
        c = text[pos]
        if c in WHITESPACE:
            return skip_whitespace(text, pos, end)
        if c == ",":
            self._state = _NEXT_KEY
            return pos + 1
        if c == "}":
            return self._close(pos)
        return self._fail(pos)

    def _close(self, pos: int) -> int:
        if not self.committed:
            if self._name is None:
                return self._fail(pos)
            self._commit(self._arguments if self._arguments is not None else "{}")
        self.status = DONE
        return pos + 1


_READER_STEPS = {
    _OPEN: CallReader._open,
    _FIRST_KEY: CallReader._first_key,
    _NEXT_KEY: CallReader._next_key,
    _KEY: CallReader._read_key,
    _COLON: CallReader._colon,
    _VALUE: CallReader._value,
    _AFTER: CallReader._after,
    _NAME: CallReader._read_name,
    _SKIP: CallReader._skip,
    _ARGS_BUFFER: CallReader._buffer_arguments,
    _ARGS_STRING: CallReader._string_arguments,
}
