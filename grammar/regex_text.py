"""Regex text helpers shared by the backends (both parse the Rust ``regex`` syntax)."""

from __future__ import annotations

_REGEX_META = set("\\.^$|?*+()[]{}-&~#")


def escape_regex_literal(text: str) -> str:
    """Escapes ``text`` so the Rust regex syntax reads it literally."""
    return "".join("\\" + ch if ch in _REGEX_META else ch for ch in text)


def choices_regex(choices: tuple[str, ...] | list[str]) -> str:
    """An alternation of the literal choices."""
    return "(?:" + "|".join(escape_regex_literal(c) for c in choices) + ")"


def _class_body_start(regex: str, open_index: int) -> int:
    """Index of the first character that may close the class opened at ``open_index``
    (``]`` right after ``[`` or ``[^`` is a literal)."""
    i = open_index + 1
    if regex[i : i + 1] == "^":
        i += 1
    if regex[i : i + 1] == "]":
        i += 1
    return i


def ascii_digit_classes(regex: str) -> str:
    """Rewrites ``\\d`` as ``[0-9]`` (and ``\\D`` outside classes as ``[^0-9]``).

    The Rust syntax reads ``\\d`` as any Unicode decimal digit (about 700 characters); grammar
    users mean ASCII digits, as ``\\d`` does in JSON Schema (ECMAScript) patterns.
    """
    out: list[str] = []
    depth = 0  # nesting depth of character classes
    may_close_at = 0
    i = 0
    while i < len(regex):
        ch = regex[i]
        if ch == "\\" and i + 1 < len(regex):
            escaped = regex[i + 1]
            if escaped == "d":
                out.append("0-9" if depth else "[0-9]")
            elif escaped == "D" and not depth:
                out.append("[^0-9]")
            else:
                out.append(regex[i : i + 2])
            i += 2
            continue
        if ch == "[":
            depth += 1
            may_close_at = _class_body_start(regex, i)
            out.append(regex[i:may_close_at])
            i = may_close_at
            continue
        if ch == "]" and depth and i >= may_close_at:
            depth -= 1
        out.append(ch)
        i += 1
    return "".join(out)


def check_regex_structure(regex: str) -> None:
    """Raises ``ValueError`` when ``regex`` has an unbalanced ``(`` or ``)``, an unclosed
    character class or a trailing lone backslash.

    The backends wrap a user regex (``(?:regex)$`` for outlines-core), and a regex that is
    invalid on its own can become a valid one with another language once wrapped: ``a)|(b``
    reads as ``(?:a)|(b)$``. This check keeps the user's text one group; the backends' own
    parsers judge everything else.
    """
    groups = classes = 0
    may_close_at = 0
    i = 0
    while i < len(regex):
        ch = regex[i]
        if ch == "\\":
            if i + 1 == len(regex):
                raise ValueError("regex ends with a lone backslash; write \\\\ for a literal one")
            i += 2
            continue
        if ch == "[":
            classes += 1
            may_close_at = _class_body_start(regex, i)
            i = may_close_at
            continue
        if classes:
            if ch == "]" and i >= may_close_at:
                classes -= 1
        elif ch == "(":
            groups += 1
        elif ch == ")":
            groups -= 1
            if groups < 0:
                raise ValueError(f"regex has an unbalanced ')' at position {i}")
        i += 1
    if classes:
        raise ValueError("regex has an unclosed character class '['")
    if groups:
        raise ValueError(f"regex has {groups} unclosed '(' group(s)")


def anchor_regex(regex: str) -> str:
    r"""Wraps ``regex`` as ``(?:regex)$`` (dropping a leading ``^``); ``ValueError`` for a
    regex whose structure the wrapping would change (:func:`check_regex_structure`).

    outlines-core builds its DFA with leftmost-first match semantics: without the end anchor,
    tokens leading out of an accepting state into a non-accepting one are missing from the
    index (``a(bc)?`` never continues after ``a``, ``0(\.[0-9]+)?`` never after ``0``, and in
    ``cat|category`` the second choice is unreachable). Anchoring at the end of the text makes
    every complete match count, which is the full-match semantics a grammar needs.
    """
    check_regex_structure(regex)
    body = regex[1:] if regex.startswith("^") else regex
    return f"(?:{body})$"
