"""The parsed form of a structural tag: a small tree of frozen format nodes.

``parse_structural_tag`` (structural_tag.py) builds it from the request's JSON and
``structural_tag_lark`` compiles it. Every node is hashable (strings, booleans and tuples only),
so the compiler can share the rule of a node that occurs more than once.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

UNCLOSED_TEXT_MESSAGE = (
    "structural_tag: {what} must come last, at the end of the output or of a tag's content "
    "(where the tag's end string closes it); here more formats follow it and nothing marks "
    "where the text ends"
)


@dataclass(frozen=True)
class ConstStringFormat:
    """Exactly ``value``."""

    value: str


@dataclass(frozen=True)
class JsonSchemaFormat:
    """A JSON document valid against the schema; ``schema_json`` is its compact JSON text (an
    object or ``true``)."""

    schema_json: str

    @property
    def schema(self) -> Any:
        return json.loads(self.schema_json)


@dataclass(frozen=True)
class AnyTextFormat:
    """Any text. Inside a tag it stops at (and never contains) the tag's end string."""


@dataclass(frozen=True)
class RegexFormat:
    """Text matching ``pattern`` (Rust regex syntax, ``\\d`` read as ``[0-9]``)."""

    pattern: str


@dataclass(frozen=True)
class GrammarFormat:
    """Text of the Lark or GBNF grammar ``grammar`` (its ``start`` / ``root`` rule)."""

    grammar: str


@dataclass(frozen=True)
class SequenceFormat:
    """Each element in turn."""

    elements: tuple[Format, ...]


@dataclass(frozen=True)
class OrFormat:
    """Any one of the elements."""

    elements: tuple[Format, ...]


@dataclass(frozen=True)
class TagFormat:
    """``begin``, then the content, then ``end`` (``begin`` is never empty)."""

    begin: str
    content: Format
    end: str


@dataclass(frozen=True)
class TriggeredTagsFormat:
    """Free text in which each occurrence of a trigger starts one of the tags whose begin
    starts with that trigger; after the tag, free text again.

    ``at_least_one``: the output starts with a tag (no free text before the first one).
    ``stop_after_first``: the output ends right after the first tag. Every tag's begin starts
    with one of the triggers.
    """

    triggers: tuple[str, ...]
    tags: tuple[TagFormat, ...]
    at_least_one: bool = False
    stop_after_first: bool = False


@dataclass(frozen=True)
class TagsWithSeparatorFormat:
    """Tags only, joined by ``separator`` (no free text). Without ``at_least_one`` the output
    may hold no tag at all; ``stop_after_first`` allows one tag at most."""

    tags: tuple[TagFormat, ...]
    separator: str
    at_least_one: bool = False
    stop_after_first: bool = False


Format = (
    ConstStringFormat
    | JsonSchemaFormat
    | AnyTextFormat
    | RegexFormat
    | GrammarFormat
    | SequenceFormat
    | OrFormat
    | TagFormat
    | TriggeredTagsFormat
    | TagsWithSeparatorFormat
)


@dataclass(frozen=True)
class StructuralTag:
    """A whole structural tag; the legacy form (structures + triggers) is a
    ``TriggeredTagsFormat`` of tags whose content is a JSON schema."""

    format: Format


def iter_formats(root: Format) -> list[Format]:
    """Every node under ``root`` (``root`` included), without recursion."""
    found, stack = [], [root]
    while stack:
        node = stack.pop()
        found.append(node)
        if isinstance(node, (SequenceFormat, OrFormat)):
            stack.extend(node.elements)
        elif isinstance(node, TagFormat):
            stack.append(node.content)
        elif isinstance(node, (TriggeredTagsFormat, TagsWithSeparatorFormat)):
            stack.extend(node.tags)
    return found


def check_free_text_closed(root: Format) -> None:
    """``ValueError`` for free text (``any_text``, the text of ``triggered_tags``) that nothing
    closes: neither the end of the output nor a tag's end string follows it."""
    stack: list[tuple[Format, str]] = [(root, "last")]  # context: last, closed or followed
    while stack:
        node, ctx = stack.pop()
        if isinstance(node, SequenceFormat):
            stack.append((node.elements[-1], ctx))
            stack.extend((e, "followed") for e in node.elements[:-1])
        elif isinstance(node, OrFormat):
            stack.extend((e, ctx) for e in node.elements)
        elif isinstance(node, TagFormat):
            stack.append((node.content, "closed" if node.end else ctx))
        elif isinstance(node, TagsWithSeparatorFormat):
            stack.extend((t, "followed") for t in node.tags)
        elif isinstance(node, TriggeredTagsFormat):
            only_one_tag = node.at_least_one and node.stop_after_first
            if ctx == "followed" and not only_one_tag:
                raise ValueError(
                    UNCLOSED_TEXT_MESSAGE.format(what="triggered_tags (its free text)")
                )
            stack.extend((t, ctx if only_one_tag else "followed") for t in node.tags)
        elif isinstance(node, AnyTextFormat) and ctx == "followed":
            raise ValueError(UNCLOSED_TEXT_MESSAGE.format(what="any_text"))


# What may follow a JSON document's opening bracket (llguidance lexes "{" and "[" alone).
_AFTER_OPENING = frozenset('"}] \t\n\r{[-0123456789tfn')


def check_json_beside_literals(root: Format) -> None:
    """``ValueError`` for an ``or`` where a JSON schema that may be an object (or array) meets
    an alternative starting with that bracket and a character JSON allows next, e.g. a tag
    beginning ``{"name": ``. llguidance's lexer is greedy: it reads such text as the longer
    literal and drops the JSON's one-character ``{`` lexeme, so the JSON alternative could
    never be generated."""
    for node in iter_formats(root):
        if not isinstance(node, OrFormat):
            continue
        brackets = set().union(*(_json_openings(e) for e in node.elements))
        for element in node.elements:
            for text in _leading_texts(element):
                if len(text) > 1 and text[0] in brackets and text[1] in _AFTER_OPENING:
                    raise ValueError(
                        f'structural_tag: an "or" offers a json_schema and an element '
                        f"starting with {text[:12]!r}; llguidance cannot keep both open (the "
                        "longer literal wins), so describe both with one json_schema (anyOf) "
                        "or start the element with another character"
                    )


def _json_openings(fmt: Format) -> set[str]:
    """The brackets a JSON document ``fmt`` starts with may open."""
    if isinstance(fmt, SequenceFormat):
        return _json_openings(fmt.elements[0])
    if isinstance(fmt, OrFormat):
        return set().union(*(_json_openings(e) for e in fmt.elements))
    if not isinstance(fmt, JsonSchemaFormat):
        return set()
    schema = fmt.schema
    kind = schema.get("type") if isinstance(schema, dict) else None
    kinds = set(kind) if isinstance(kind, list) else {kind}
    if kind is None or not kinds <= {"string", "number", "integer", "boolean", "null"}:
        return {b for b, k in (("{", "object"), ("[", "array")) if kind is None or k in kinds}
    return set()


def _leading_texts(fmt: Format) -> list[str]:
    """The fixed texts ``fmt`` may start with (none where it starts with something else)."""
    if isinstance(fmt, ConstStringFormat):
        return [fmt.value]
    if isinstance(fmt, TagFormat):
        return [fmt.begin]
    if isinstance(fmt, SequenceFormat):
        return _leading_texts(fmt.elements[0])
    if isinstance(fmt, OrFormat):
        return [text for e in fmt.elements for text in _leading_texts(e)]
    if isinstance(fmt, (TriggeredTagsFormat, TagsWithSeparatorFormat)):
        return [t.begin for t in fmt.tags] if fmt.at_least_one else []
    return []
