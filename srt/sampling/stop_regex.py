"""Stop regexes (``stop_regex``): validation, match-length bounds and compiled patterns.

A request stops when one of its patterns matches its decoded output (srt/scheduler/stop.py
runs the search after each token). Patterns are written in Python's ``re`` syntax, as SGLang
documents them; they are matched with the ``regex`` package, whose searches take a timeout,
so a pattern that backtracks exponentially costs bounded time instead of a stuck scheduler.

Bounds, all checked before anything compiles a pattern:

- at most :data:`MAX_STOP_REGEXES` patterns of at most :data:`MAX_STOP_REGEX_CHARS` characters;
- a pattern must not match empty text (it would stop every request at its first token);
- its shortest match is at most :data:`STOP_REGEX_WINDOW_CHARS` characters: the scheduler
  searches only the text of the last tokens, as many as the pattern's longest match spans
  (lookarounds included) and at most that many for unbounded patterns (``\\d+``, ``.*``), so a
  longer match could never be seen. A match of an unbounded pattern is found as its last
  :data:`STOP_REGEX_WINDOW_CHARS` characters or so;
- it nests at most :data:`MAX_STOP_REGEX_DEPTH` groups deep;
- its size with fixed repeats unrolled (``(?:a?){1000}`` counts 1000) is at most
  :data:`MAX_STOP_REGEX_UNROLLED`: the ``regex`` package unrolls them when it compiles, and a
  few nested counts would take seconds.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import regex

try:  # Python 3.11+
    import re._constants as _sre
    import re._parser as _sre_parse
except ImportError:  # Python 3.10
    import sre_constants as _sre  # type: ignore[no-redef]
    import sre_parse as _sre_parse  # type: ignore[no-redef]

MAX_STOP_REGEXES = 16
MAX_STOP_REGEX_CHARS = 1024
# The most characters of decoded output a stop regex is matched against each step (counted as
# tokens when the scheduler picks its window: almost every token spells at least one char).
STOP_REGEX_WINDOW_CHARS = 256
MAX_STOP_REGEX_UNROLLED = 4096
MAX_STOP_REGEX_DEPTH = 32  # nested groups, repeats and lookarounds
# A stop-regex finish reason carries, under this key, how many characters of the decoded output
# start at the match (srt/scheduler/stop.py sets it; the detokenizer trims there and removes it).
MATCH_FROM_END_KEY = "_match_chars_from_end"
# ... and under this one the matched text (the public ``matched`` is the pattern, as SGLang's)
MATCH_TEXT_KEY = "_match_text"

_ONE_CHAR = frozenset(
    {_sre.LITERAL, _sre.NOT_LITERAL, _sre.IN, _sre.ANY, _sre.CATEGORY, _sre.RANGE, _sre.NEGATE}
)
_REPEATS = frozenset(
    {_sre.MAX_REPEAT, _sre.MIN_REPEAT, getattr(_sre, "POSSESSIVE_REPEAT", _sre.MAX_REPEAT)}
)
_ATOMIC = getattr(_sre, "ATOMIC_GROUP", None)


@dataclass(frozen=True)
class PatternShape:
    """What a stop regex can match: ``min_chars`` (fewest characters a match spans),
    ``max_span`` (most characters a match and its lookarounds look at; None: unbounded) and
    ``unrolled`` (the pattern's size with its fixed repeats unrolled)."""

    min_chars: int
    max_span: int | None
    unrolled: int


def pattern_shape(pattern: str) -> PatternShape:
    """The :class:`PatternShape` of ``pattern``; ValueError when it does not parse."""
    try:
        parsed = _sre_parse.parse(pattern)
        return _shape(parsed)
    except RecursionError:
        raise ValueError("nests too deeply") from None
    except _sre.error as e:
        raise ValueError(f"is not a valid regular expression: {e}") from None


def _shape(items: Any, depth: int = 0) -> PatternShape:
    if depth > MAX_STOP_REGEX_DEPTH:
        raise ValueError(f"nests more than {MAX_STOP_REGEX_DEPTH} groups deep")
    lo, hi, size = 0, 0, 0
    for op, av in items:
        item = _item_shape(op, av, depth + 1)
        lo += item.min_chars
        hi = None if hi is None or item.max_span is None else hi + item.max_span
        size += item.unrolled
    return PatternShape(lo, hi, size)


def _item_shape(op: Any, av: Any, depth: int) -> PatternShape:
    if op in _ONE_CHAR:
        return PatternShape(1, 1, 1)
    if op is _sre.AT:
        return PatternShape(0, 0, 1)
    if op in (_sre.ASSERT, _sre.ASSERT_NOT):  # zero width, but the window must hold it
        inner = _shape(av[1], depth)
        return PatternShape(0, inner.max_span, inner.unrolled)
    if op is _sre.SUBPATTERN:
        return _shape(av[-1], depth)
    if _ATOMIC is not None and op is _ATOMIC:
        return _shape(av, depth)
    if op is _sre.BRANCH:
        return _either([_shape(branch, depth) for branch in av[1]])
    if op is _sre.GROUPREF_EXISTS:
        _, yes, no = av
        no_shape = _shape(no, depth) if no is not None else PatternShape(0, 0, 0)
        return _either([_shape(yes, depth), no_shape])
    if op in _REPEATS:
        return _repeat(*av, depth)
    return PatternShape(0, None, 1)  # a back-reference (or anything else): no upper bound


def _either(options: list[PatternShape]) -> PatternShape:
    spans = [o.max_span for o in options]
    return PatternShape(
        min(o.min_chars for o in options),
        None if None in spans else max(s for s in spans if s is not None),
        sum(o.unrolled for o in options),
    )


def _repeat(min_count: int, max_count: int, items: Any, depth: int) -> PatternShape:
    inner = _shape(items, depth)
    unbounded = max_count == _sre.MAXREPEAT or inner.max_span is None
    return PatternShape(
        min_count * inner.min_chars,
        None if unbounded else max_count * inner.max_span,
        max(min_count, 1) * inner.unrolled,
    )


def check_stop_regexes(patterns: list[str]) -> None:
    """Raise ValueError naming ``stop_regex`` (and the pattern's index) when the list or a
    pattern breaks one of the bounds of this module, or a pattern does not compile."""
    if len(patterns) > MAX_STOP_REGEXES:
        raise ValueError(
            f"stop_regex may hold at most {MAX_STOP_REGEXES} patterns, got {len(patterns)}"
        )
    for i, pattern in enumerate(patterns):
        _check_one(f"stop_regex[{i}]", pattern)


def _check_one(name: str, pattern: str) -> None:
    if len(pattern) > MAX_STOP_REGEX_CHARS:
        raise ValueError(
            f"{name} has {len(pattern)} characters; at most {MAX_STOP_REGEX_CHARS} are allowed"
        )
    try:
        shape = pattern_shape(pattern)
    except ValueError as e:
        raise ValueError(f"{name} {e}") from None
    if shape.min_chars == 0:
        raise ValueError(
            f"{name} {pattern!r} can match empty text, so it would stop every request at "
            "once; make it match at least one character"
        )
    if shape.min_chars > STOP_REGEX_WINDOW_CHARS:
        raise ValueError(
            f"{name} matches at least {shape.min_chars} characters, more than the "
            f"{STOP_REGEX_WINDOW_CHARS} the stop check looks at"
        )
    if shape.unrolled > MAX_STOP_REGEX_UNROLLED:
        raise ValueError(
            f"{name} is {shape.unrolled} elements long with its fixed repeats unrolled; at "
            f"most {MAX_STOP_REGEX_UNROLLED} are allowed (lower the repeat counts)"
        )
    try:
        compile_stop_regex(pattern)
    except RecursionError:
        raise ValueError(f"{name} nests too deeply") from None
    except (regex.error, OverflowError) as e:
        raise ValueError(f"{name} is not a valid regular expression: {e}") from None


@functools.lru_cache(maxsize=512)
def compile_stop_regex(pattern: str) -> regex.Pattern:
    """The compiled pattern (cached: the scheduler searches the same patterns every step).
    Call it only on patterns :func:`check_stop_regexes` accepted."""
    return regex.compile(pattern)


@functools.lru_cache(maxsize=512)
def window_chars(patterns: tuple[str, ...]) -> int:
    """How many characters at the end of the output the patterns need to see: the longest
    span of any of them, capped at :data:`STOP_REGEX_WINDOW_CHARS`."""
    spans = [pattern_shape(p).max_span for p in patterns]
    if not spans:
        return 0
    if None in spans:
        return STOP_REGEX_WINDOW_CHARS
    return min(max(s for s in spans if s is not None), STOP_REGEX_WINDOW_CHARS)
