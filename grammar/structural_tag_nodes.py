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
