"""Incremental JSON reading for streamed model output: a value scanner and a string decoder.

Both read text as it arrives, in pieces of any size, and never look at a character twice, so a
whole output costs linear time. ``scan`` / ``decode`` take ``(text, pos, end)``, consume what
they can of ``text[pos:end]`` and return where they stopped; ``status`` then says whether the
value is complete (``DONE``: it ended just before the returned index), needs more text
(``RUNNING``) or is not JSON (``FAILED``: the character at the returned index is wrong).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable

RUNNING, DONE, FAILED = "running", "done", "failed"
WHITESPACE = " \t\n\r"

_WS_RUN = re.compile(r"[ \t\n\r]*")
_STRING_RUN = re.compile(r'[^"\\\x00-\x1f]*')
_HEX = frozenset("0123456789abcdefABCDEF")
_SIMPLE_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r"}
_SIMPLE_ESCAPES["t"] = "\t"
_CLOSER = {"{": "}", "[": "]"}
_LITERALS = {"t": "rue", "f": "alse", "n": "ull"}
_DIGITS = "0123456789"

# scanner states
_VALUE, _FIRST_ITEM, _FIRST_KEY, _KEY, _COLON, _AFTER = range(6)
_STRING, _ESCAPE, _UNICODE, _NUMBER, _LITERAL = range(6, 11)

# number states: after "-", after a leading "0", integer digits, ".", fraction digits, "e",
# exponent sign, exponent digits
_N_MINUS, _N_ZERO, _N_INT, _N_DOT, _N_FRAC, _N_E, _N_ESIGN, _N_EXP = range(8)
_N_COMPLETE = frozenset((_N_ZERO, _N_INT, _N_FRAC, _N_EXP))


def _number_class(c: str) -> str:
    if c == "0":
        return "0"
    if c in _DIGITS:
        return "1"
    return {"-": "s", "+": "s", ".": ".", "e": "e", "E": "e"}.get(c, "")


_N_NEXT: dict[int, dict[str, int]] = {
    _N_MINUS: {"0": _N_ZERO, "1": _N_INT},
    _N_ZERO: {".": _N_DOT, "e": _N_E},
    _N_INT: {"0": _N_INT, "1": _N_INT, ".": _N_DOT, "e": _N_E},
    _N_DOT: {"0": _N_FRAC, "1": _N_FRAC},
    _N_FRAC: {"0": _N_FRAC, "1": _N_FRAC, "e": _N_E},
    _N_E: {"s": _N_ESIGN, "0": _N_EXP, "1": _N_EXP},
    _N_ESIGN: {"0": _N_EXP, "1": _N_EXP},
    _N_EXP: {"0": _N_EXP, "1": _N_EXP},
}


def loads_strict(text: str) -> object:
    """``json.loads`` without the NaN / Infinity extensions (``ValueError`` for them)."""

    def refuse(name: str) -> object:
        raise ValueError(f"{name} is not JSON")

    return json.loads(text, parse_constant=refuse)


def skip_whitespace(text: str, pos: int, end: int) -> int:
    """The index of the first non-whitespace character of ``text[pos:end]`` (or ``end``)."""
    return _WS_RUN.match(text, pos, end).end()


class JsonScanner:
    """Reads one JSON value (RFC 8259: no NaN, no comments) and tracks a *safe point*.

    ``safe_end`` counts the characters, from the start of the value, after which the text read
    so far becomes valid JSON by appending ``closing()`` alone: the position after an opening
    bracket, after a complete value, or inside a value string (never inside a key, an escape,
    a literal or an unfinished number, nor after a comma or colon). Streaming the text only up
    to the safe point lets a value that breaks (stops being JSON) be closed into valid JSON.

    ``object_only``: the value must be an object (anything else fails at its first character).
    A number at the top level ends only at the character after it (or at ``finish``).
    """

    def __init__(self, object_only: bool = False) -> None:
        self.status = RUNNING
        self.consumed = 0  # characters read so far
        self.safe_end = 0
        self._object_only = object_only
        self._stack: list[str] = []  # closers of the open containers, outermost first
        self._state = _VALUE
        self._is_key = False
        self._hex_left = 0
        self._literal = ""
        self._number = _N_MINUS
        self._safe_depth = 0  # open containers at the safe point (the stack's prefix is kept)
        self._safe_in_string = False
        self._base = 0  # consumed - pos, during one scan

    def scan(self, text: str, pos: int = 0, end: int | None = None) -> int:
        """Reads ``text[pos:end]`` until the value ends or fails; returns where it stopped."""
        end = len(text) if end is None else end
        self._base = self.consumed - pos
        steps = _SCANNER_STEPS
        while pos < end and self.status == RUNNING:
            pos = steps[self._state](self, text, pos, end)
        self.consumed = self._base + pos
        return pos

    def finish(self) -> str:
        """End of input: completes a top-level number; returns the status."""
        if self.status == RUNNING and self._state == _NUMBER and not self._stack:
            if self._number in _N_COMPLETE:
                self.status = DONE
        return self.status

    def closing(self) -> str:
        """What makes the text up to ``safe_end`` a complete JSON value."""
        closers = "".join(reversed(self._stack[: self._safe_depth]))
        return ('"' if self._safe_in_string else "") + closers

    # -- steps: each reads at least one character (or changes state) and returns the index --

    def _mark(self, pos: int, in_string: bool = False) -> None:
        self.safe_end = self._base + pos
        self._safe_depth = len(self._stack)
        self._safe_in_string = in_string

    def _fail(self, pos: int) -> int:
        self.status = FAILED
        return pos

    def _after_value(self, pos: int) -> int:
        if not self._stack:
            self.status = DONE
        self._state = _AFTER
        self._mark(pos)
        return pos

    def _value(self, text: str, pos: int, end: int) -> int:
        c = text[pos]
        if c in WHITESPACE:
            return skip_whitespace(text, pos, end)
        if self._object_only and not self._stack and c != "{":
            return self._fail(pos)
        if c in _CLOSER:
            self._stack.append(_CLOSER[c])
            self._state = _FIRST_KEY if c == "{" else _FIRST_ITEM
            self._mark(pos + 1)
        elif c == '"':
            self._is_key = False
            self._state = _STRING
            self._mark(pos + 1, in_string=True)
        elif c == "-" or c in _DIGITS:
            self._number = _N_MINUS if c == "-" else _N_ZERO if c == "0" else _N_INT
            self._state = _NUMBER
            if c != "-":
                self._mark(pos + 1)
        elif c in _LITERALS:
            self._literal = _LITERALS[c]
            self._state = _LITERAL
        else:
            return self._fail(pos)
        return pos + 1

    def _first_item(self, text: str, pos: int, end: int) -> int:
        if text[pos] in WHITESPACE:
            pos = skip_whitespace(text, pos, end)
            self._mark(pos)
            return pos
        if text[pos] == "]":
            self._stack.pop()
            return self._after_value(pos + 1)
        self._state = _VALUE
        return pos

    def _first_key(self, text: str, pos: int, end: int) -> int:
        c = text[pos]
        if c in WHITESPACE:
            pos = skip_whitespace(text, pos, end)
            self._mark(pos)
            return pos
        if c == "}":
            self._stack.pop()
            return self._after_value(pos + 1)
        return self._key(text, pos, end)

    def _key(self, text: str, pos: int, end: int) -> int:
        c = text[pos]
        if c in WHITESPACE:
            return skip_whitespace(text, pos, end)
        if c != '"':
            return self._fail(pos)
        self._is_key = True
        self._state = _STRING
        return pos + 1

    def _colon(self, text: str, pos: int, end: int) -> int:
        c = text[pos]
        if c in WHITESPACE:
            return skip_whitespace(text, pos, end)
        if c != ":":
            return self._fail(pos)
        self._state = _VALUE
        return pos + 1

    def _after(self, text: str, pos: int, end: int) -> int:
        c = text[pos]
        if c in WHITESPACE:
            pos = skip_whitespace(text, pos, end)
            self._mark(pos)
            return pos
        if c == ",":
            self._state = _KEY if self._stack[-1] == "}" else _VALUE
            return pos + 1
        if c == self._stack[-1]:
            self._stack.pop()
            return self._after_value(pos + 1)
        return self._fail(pos)

    def _string(self, text: str, pos: int, end: int) -> int:
        run_end = _STRING_RUN.match(text, pos, end).end()
        if run_end > pos:
            if not self._is_key:
                self._mark(run_end, in_string=True)
            return run_end
        c = text[pos]
        if c == '"':
            if self._is_key:
                self._state = _COLON
                return pos + 1
            return self._after_value(pos + 1)
        if c == "\\":
            self._state = _ESCAPE
            return pos + 1
        return self._fail(pos)  # a control character

    def _escape(self, text: str, pos: int, end: int) -> int:
        c = text[pos]
        if c == "u":
            self._hex_left = 4
            self._state = _UNICODE
            return pos + 1
        if c not in _SIMPLE_ESCAPES:
            return self._fail(pos)
        return self._end_escape(pos + 1)

    def _unicode(self, text: str, pos: int, end: int) -> int:
        if text[pos] not in _HEX:
            return self._fail(pos)
        self._hex_left -= 1
        return self._end_escape(pos + 1) if self._hex_left == 0 else pos + 1

    def _end_escape(self, pos: int) -> int:
        self._state = _STRING
        if not self._is_key:
            self._mark(pos, in_string=True)
        return pos

    def _number_step(self, text: str, pos: int, end: int) -> int:
        nxt = _N_NEXT[self._number].get(_number_class(text[pos]))
        if nxt is None:
            if self._number in _N_COMPLETE:
                return self._after_value(pos)  # the number ends before this character
            return self._fail(pos)
        self._number = nxt
        if nxt in _N_COMPLETE:
            self._mark(pos + 1)
        return pos + 1

    def _literal_step(self, text: str, pos: int, end: int) -> int:
        if text[pos] != self._literal[0]:
            return self._fail(pos)
        self._literal = self._literal[1:]
        return self._after_value(pos + 1) if not self._literal else pos + 1


_SCANNER_STEPS = {
    _VALUE: JsonScanner._value,
    _FIRST_ITEM: JsonScanner._first_item,
    _FIRST_KEY: JsonScanner._first_key,
    _KEY: JsonScanner._key,
    _COLON: JsonScanner._colon,
    _AFTER: JsonScanner._after,
    _STRING: JsonScanner._string,
    _ESCAPE: JsonScanner._escape,
    _UNICODE: JsonScanner._unicode,
    _NUMBER: JsonScanner._number_step,
    _LITERAL: JsonScanner._literal_step,
}


class StringDecoder:
    """Decodes the body of a JSON string (the text after its opening quote) as it arrives.

    ``decode`` returns the decoded text of what it read; the closing quote ends it (``DONE``,
    the quote consumed). An escape split across pieces is kept until it is complete. Escaped
    surrogate pairs are joined; a lone escaped surrogate becomes U+FFFD, so the text always
    encodes as UTF-8. ``finish`` (end of input) gives what is still pending.
    """

    def __init__(self) -> None:
        self.status = RUNNING
        self._escape = ""  # the escape read so far, after its backslash
        self._high = ""  # a high surrogate waiting for its low half

    def decode(self, text: str, pos: int = 0, end: int | None = None) -> tuple[int, str]:
        end = len(text) if end is None else end
        out: list[str] = []
        while pos < end and self.status == RUNNING:
            if self._escape:
                pos = self._escape_step(text[pos], pos, out)
                continue
            run_end = _STRING_RUN.match(text, pos, end).end()
            if run_end > pos:
                self._put(text[pos:run_end], out)
                pos = run_end
            elif text[pos] == '"':
                self._put("", out)
                self.status = DONE
                pos += 1
            elif text[pos] == "\\":
                self._escape = "\\"
                pos += 1
            else:
                self.status = FAILED  # a control character
        return pos, "".join(out)

    def finish(self) -> str:
        """What is still pending when the string breaks off (end of input or a bad escape):
        a waiting high surrogate as U+FFFD, then the partial escape's raw text."""
        pending = ("\ufffd" if self._high else "") + self._escape
        self._high = self._escape = ""
        return pending

    def _escape_step(self, c: str, pos: int, out: list[str]) -> int:
        esc = self._escape + c
        if len(esc) == 2:
            if c in _SIMPLE_ESCAPES:
                self._escape = ""
                self._put(_SIMPLE_ESCAPES[c], out)
                return pos + 1
            if c != "u":
                self.status = FAILED
                return pos
        elif c not in _HEX:
            self.status = FAILED
            return pos
        if len(esc) < 6:
            self._escape = esc
            return pos + 1
        self._escape = ""
        self._put_code(int(esc[2:], 16), out)
        return pos + 1

    def _put_code(self, code: int, out: list[str]) -> None:
        if 0xD800 <= code < 0xDC00:
            if self._high:
                out.append("\ufffd")
            self._high = chr(code)
        elif 0xDC00 <= code < 0xE000 and self._high:
            pair = (ord(self._high) - 0xD800) * 0x400 + (code - 0xDC00) + 0x10000
            self._high = ""
            out.append(chr(pair))
        else:
            self._put("\ufffd" if 0xDC00 <= code < 0xE000 else chr(code), out)

    def _put(self, decoded: str, out: list[str]) -> None:
        if self._high:
            out.append("\ufffd")
            self._high = ""
        if decoded:
            out.append(decoded)


class ArgumentStream:
    """A tool call's arguments object while it streams: read by a :class:`JsonScanner` and
    handed to ``emit`` up to the scanner's safe point, so that an object that breaks can be
    closed into valid JSON there; the text read past that point is :meth:`held` (a parser writes
    it out as is when the output is cut, or as content when a marker interrupts the object)."""

    def __init__(self, object_only: bool = True) -> None:
        self.scanner = JsonScanner(object_only=object_only)
        self._held: list[str] = []
        self._streamed = 0  # characters handed to emit

    @property
    def status(self) -> str:
        return self.scanner.status

    def feed(self, text: str, pos: int, end: int, emit: Callable[[str], None]) -> int:
        """Reads ``text[pos:end]`` until the object ends or breaks; returns where it stopped."""
        scanner = self.scanner
        stop = scanner.scan(text, pos, end)
        self._held.append(text[pos:stop])
        if scanner.safe_end > self._streamed:
            held = "".join(self._held)
            cut = scanner.safe_end - self._streamed
            emit(held[:cut])
            self._held = [held[cut:]]
            self._streamed = scanner.safe_end
        return stop

    def held(self) -> str:
        return "".join(self._held)
