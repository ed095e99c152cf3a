"""Compiles a parsed structural tag (structural_tag_nodes.py) to llguidance's Lark dialect.

How the free text is built, with ``ANY_TEXT: /(?s:.*)/``:

* at the end of the output: the greedy ``ANY_TEXT`` (EOS may come anywhere);
* closed by a string ``E`` (a tag's end): a lazy lexeme ``x[lazy]: ANY_TEXT "E"``, which ends
  at the first ``E``, so the text never contains ``E``;
* up to a trigger ``T`` in ``triggered_tags``: the lazy ``hd[lazy]: ANY_TEXT "T"``. llguidance
  ends a lazy lexeme as soon as it matches, which also ends the competing free-text lexeme, so
  once a trigger has been written a tag must follow.

Each node is compiled for a context: what follows it (nothing: the end of the output; the
enclosing tag's end string, which the node's rule then also matches; or more formats). Free
text followed by more formats has no delimiter: ``parse_structural_tag`` refuses it, and so
does the compiler (``ValueError``).

Rules of identical (node, context) pairs are shared, so a tag offered both as a first tag and
after a trigger compiles its JSON schema once.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import llguidance

from radixlm.grammar.lark_json import bound_json_whitespace
from radixlm.grammar.regex_text import ascii_digit_classes
from radixlm.grammar.schema_rewrite import rewrite_schema
from radixlm.grammar.structural_tag_nodes import (
    UNCLOSED_TEXT_MESSAGE,
    AnyTextFormat,
    ConstStringFormat,
    Format,
    GrammarFormat,
    JsonSchemaFormat,
    OrFormat,
    RegexFormat,
    SequenceFormat,
    StructuralTag,
    TagFormat,
    TagsWithSeparatorFormat,
    TriggeredTagsFormat,
)

ANY_TEXT = "ANY_TEXT"


@dataclass(frozen=True)
class _Context:
    """What follows a node: ``end`` (a tag's end string the node's rule matches too) or, when
    ``end`` is empty, the end of the output (``is_last``) or more formats."""

    end: str = ""
    is_last: bool = False


_FOLLOWED = _Context()
_LAST = _Context(is_last=True)


def compile_structural_tag(tag: StructuralTag, json_options: dict[str, Any]) -> str:
    """llguidance grammar text for ``tag``; ``json_options`` go into every ``%json`` schema's
    ``x-guidance`` (and replace the author's values of the same options)."""
    writer = _LarkWriter(json_options)
    start = writer.node(tag.format, _LAST)
    lark = "\n".join([f"start: {start}", *writer.rules, f"{ANY_TEXT}: /(?s:.*)/", ""])
    if not writer.side_grammars:
        return lark
    return json.dumps({"grammars": [{"lark_grammar": lark}, *writer.side_grammars]})


def lark_literal(text: str) -> str:
    """``text`` as a Lark string literal (empty text: nothing)."""
    return json.dumps(text, ensure_ascii=False) if text else ""


def lark_regex(pattern: str) -> str:
    """``pattern`` as a Lark ``/regex/`` literal: one group, ``/`` and line breaks escaped, a
    leading ``^`` and trailing ``$`` dropped (a format matches its whole text anyway)."""
    if pattern.startswith("^"):
        pattern = pattern[1:]
    if pattern.endswith("$") and not _is_escaped(pattern, len(pattern) - 1):
        pattern = pattern[:-1]
    out, i = [], 0
    while i < len(pattern):
        ch = pattern[i]
        if ch == "\\" and i + 1 < len(pattern):
            out.append(pattern[i : i + 2])
            i += 2
            continue
        out.append({"/": "\\/", "\n": "\\n", "\r": "\\r"}.get(ch, ch))
        i += 1
    return "/(?:" + ascii_digit_classes("".join(out)) + ")/"


def _is_escaped(text: str, index: int) -> bool:
    backslashes = len(text[:index]) - len(text[:index].rstrip("\\"))
    return backslashes % 2 == 1


def _join(*parts: str) -> str:
    return " ".join(p for p in parts if p)


class _LarkWriter:
    """Accumulates the rules of one grammar."""

    def __init__(self, json_options: dict[str, Any]) -> None:
        self.json_options = json_options
        self.rules: list[str] = []
        self.side_grammars: list[dict[str, str]] = []
        self._memo: dict[tuple[Any, ...], str] = {}

    def rule(self, body: str, lazy: bool = False) -> str:
        """A new rule matching ``body``; its name."""
        name = f"st_{len(self.rules)}"
        self.rules.append(f"{name}{'[lazy]' if lazy else ''}: {body}")
        return name

    def choice(self, alternatives: list[str]) -> str:
        """A rule for the alternatives (the one alternative itself when it is a name)."""
        if len(alternatives) == 1 and alternatives[0].isidentifier():
            return alternatives[0]
        return self.rule(" | ".join(alternatives))

    def node(self, fmt: Format, ctx: _Context) -> str:
        """A Lark expression matching ``fmt`` followed by ``ctx.end``."""
        key = (fmt, ctx)
        if key not in self._memo:
            self._memo[key] = self._compile(fmt, ctx)
        return self._memo[key]

    def _compile(self, fmt: Format, ctx: _Context) -> str:
        end = lark_literal(ctx.end)
        if isinstance(fmt, ConstStringFormat):
            return _join(lark_literal(fmt.value), end) or '""'
        if isinstance(fmt, JsonSchemaFormat):
            return _join(self._json(fmt), end)
        if isinstance(fmt, RegexFormat):
            return _join(lark_regex(fmt.pattern), end)
        if isinstance(fmt, GrammarFormat):
            return _join(self._grammar(fmt), end)
        if isinstance(fmt, AnyTextFormat):
            return self.free_text(ctx, "any_text")
        if isinstance(fmt, SequenceFormat):
            head = [self.node(e, _FOLLOWED) for e in fmt.elements[:-1]]
            return self.rule(_join(*head, self.node(fmt.elements[-1], ctx)))
        if isinstance(fmt, OrFormat):
            return self.choice([self.node(e, ctx) for e in fmt.elements])
        if isinstance(fmt, TagFormat):
            return self.rule(_join(lark_literal(fmt.begin), self.tag_rest(fmt, ctx)))
        if isinstance(fmt, TriggeredTagsFormat):
            return self._triggered(fmt, ctx)
        assert isinstance(fmt, TagsWithSeparatorFormat), fmt
        return self._separated(fmt, ctx)

    def free_text(self, ctx: _Context, what: str) -> str:
        """Free text followed by ``ctx.end`` (lazy) or by the end of the output (greedy)."""
        if ctx.end:
            return self.rule(f"{ANY_TEXT} {lark_literal(ctx.end)}", lazy=True)
        if ctx.is_last:
            return ANY_TEXT
        raise ValueError(UNCLOSED_TEXT_MESSAGE.format(what=what))

    def tag_rest(self, tag: TagFormat, ctx: _Context) -> str:
        """What follows the tag's begin: the content, the tag's end, then ``ctx.end``."""
        if not tag.end:  # nothing closes the content: it meets the tag's own context
            return self.node(tag.content, ctx)
        return _join(self.node(tag.content, _Context(end=tag.end)), lark_literal(ctx.end))

    def _json(self, fmt: JsonSchemaFormat) -> str:
        schema = json.loads(rewrite_schema(fmt.schema_json))
        if schema is True:
            schema = {}
        options = schema.get("x-guidance")
        options = dict(options) if isinstance(options, dict) else {}
        schema["x-guidance"] = {**options, **self.json_options}
        key = ("json", json.dumps(schema, sort_keys=False))
        if key not in self._memo:
            self._memo[key] = self.rule(f"%json {key[1]}")
        return self._memo[key]

    def _grammar(self, fmt: GrammarFormat) -> str:
        whitespace = self.json_options.get("whitespace_pattern")
        text = bound_json_whitespace(fmt.grammar, whitespace) if whitespace else fmt.grammar
        name = f"st_grammar_{len(self.side_grammars)}"
        self.side_grammars.append(
            {"name": name, "lark_grammar": llguidance.grammar_from("ebnf", text)}
        )
        return "@" + name

    def _triggered(self, fmt: TriggeredTagsFormat, ctx: _Context) -> str:
        if fmt.at_least_one and fmt.stop_after_first:  # exactly one tag
            return self.choice([self.node(t, ctx) for t in fmt.tags])
        first = self.choice([self.node(t, _FOLLOWED) for t in fmt.tags])
        segment = self._segment(fmt)
        tail = self.free_text(ctx, "triggered_tags (its free text)")
        if fmt.stop_after_first:  # free text only, or up to the first tag and no further
            return self.rule(f"{tail} | {_join(segment, lark_literal(ctx.end))}")
        return self.rule(_join(first if fmt.at_least_one else "", f"{segment}*", tail))

    def _segment(self, fmt: TriggeredTagsFormat) -> str:
        """Free text up to a trigger, then the rest of a tag beginning with that trigger.

        A trigger that starts with a shorter trigger never completes first: its tags join the
        shorter one's."""
        triggers = [
            t for t in fmt.triggers if not any(o != t and t.startswith(o) for o in fmt.triggers)
        ]
        alternatives = []
        for trigger in triggers:
            head = self.rule(f"{ANY_TEXT} {lark_literal(trigger)}", lazy=True)
            rests = [
                _join(lark_literal(t.begin[len(trigger) :]), self.tag_rest(t, _FOLLOWED))
                for t in fmt.tags
                if t.begin.startswith(trigger)
            ]
            alternatives.append(f"{head} ({' | '.join(rests)})")
        return self.choice(alternatives)

    def _separated(self, fmt: TagsWithSeparatorFormat, ctx: _Context) -> str:
        one = self.choice([self.node(t, _FOLLOWED) for t in fmt.tags])
        many = (
            one if fmt.stop_after_first else f"{one} ({_join(lark_literal(fmt.separator), one)})*"
        )
        body = many if fmt.at_least_one else f"({many})?"
        return self.rule(_join(body, lark_literal(ctx.end)))
