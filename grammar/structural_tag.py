"""Structural tags: free text with tagged sections whose content is constrained (tool calls,
reasoning blocks), parsed from the request's JSON and compiled to an llguidance grammar.

Two JSON forms are accepted:

* legacy: ``{"type": "structural_tag", "structures": [{"begin", "schema", "end"}, ...],
  "triggers": [...]}``: free text in which each trigger starts one of the structures whose
  begin starts with it (begin, a JSON document valid against the schema, end).
* format style: ``{"type": "structural_tag", "format": F}``, F one of ``const_string``,
  ``json_schema``, ``any_text``, ``regex``, ``grammar``, ``sequence``, ``or``, ``tag``,
  ``triggered_tags``, ``tags_with_separator`` (see structural_tag_nodes.py for each meaning).

``parse_structural_tag`` validates strictly (every error is a ``ValueError`` whose message
starts with ``structural_tag`` and names the offending field); unknown fields are refused, not
ignored. The size, the JSON nesting and the number of format nodes and triggers are bounded by
``GrammarLimits`` before any grammar is built, so a hostile tag is refused in milliseconds.

Where free text may go: ``any_text`` and the free text of ``triggered_tags`` need a delimiter,
so they may stand only at the end of the output or at the end of a tag's content (where the
tag's end string closes them); elsewhere parsing raises ``ValueError``.
"""

from __future__ import annotations

import json
from typing import Any

from radixlm.grammar.limits import (
    GrammarLimits,
    check_controls,
    json_nesting_depth,
)
from radixlm.grammar.regex_text import check_regex_structure
from radixlm.grammar.structural_tag_lark import compile_structural_tag
from radixlm.grammar.structural_tag_nodes import (
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
    check_free_text_closed,
    check_json_beside_literals,
    iter_formats,
)

__all__ = [
    "StructuralTag",
    "parse_structural_tag",
    "structural_tag_grammar",
    "structural_tag_schemas",
]

# Each format type with its required and optional fields (besides "type").
_FIELDS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "const_string": (("value",), ()),
    "json_schema": (("json_schema",), ()),
    "any_text": ((), ()),
    "regex": (("pattern",), ()),
    "grammar": (("grammar",), ()),
    "sequence": (("elements",), ()),
    "or": (("elements",), ()),
    "tag": (("begin", "content", "end"), ()),
    "triggered_tags": (("triggers", "tags"), ("at_least_one", "stop_after_first")),
    "tags_with_separator": (("tags", "separator"), ("at_least_one", "stop_after_first")),
}
_LEGACY_FIELDS = ("begin", "schema", "end")


def parse_structural_tag(value: str | dict, limits: GrammarLimits | None = None) -> StructuralTag:
    """The structural tag ``value`` (JSON text or its parsed dict) as a tree of format nodes;
    ``ValueError`` (message starting with ``structural_tag``) for anything malformed or over
    ``limits``."""
    limits = limits or GrammarLimits()
    text = _as_text(value)
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > limits.max_spec_bytes:
        raise ValueError(
            f"structural_tag is {size:,} bytes long; at most {limits.max_spec_bytes:,} bytes "
            "are allowed"
        )
    depth = json_nesting_depth(text)
    if depth > limits.max_json_depth:
        raise ValueError(
            f"structural_tag nests {depth} levels deep; at most {limits.max_json_depth} nested "
            "objects and arrays are allowed"
        )
    try:
        top = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"structural_tag is not valid JSON ({exc})") from None
    tag = _Parser(limits).top(top)
    check_free_text_closed(tag.format)
    check_json_beside_literals(tag.format)
    return tag


def structural_tag_grammar(
    tag: StructuralTag,
    whitespace_pattern: str | None,
    *,
    lenient: bool = False,
    coerce_one_of: bool = True,
) -> str:
    """llguidance grammar text for ``tag``: a Lark grammar, or llguidance's JSON list of
    grammars when the tag embeds ``grammar`` formats (each one a named sub-grammar).

    JSON inside tags gets the options of the ``json_schema`` kind: ``whitespace_pattern``
    between tokens (None: llguidance's default), ``oneOf`` read as ``anyOf``, ``lenient`` and
    the schema rewrites of schema_rewrite.py. ``ValueError`` where free text has no delimiter
    (see the module docstring) or an embedded grammar does not convert."""
    options: dict[str, Any] = {"coerce_one_of": coerce_one_of, "lenient": lenient}
    if whitespace_pattern is not None:
        options["whitespace_pattern"] = whitespace_pattern
    return compile_structural_tag(tag, options)


def structural_tag_schemas(tag: StructuralTag) -> list[Any]:
    """The parsed JSON schemas of ``tag``'s ``json_schema`` formats."""
    return [n.schema for n in iter_formats(tag.format) if isinstance(n, JsonSchemaFormat)]


def _as_text(value: str | dict) -> str:
    if isinstance(value, str):
        return value
    if not isinstance(value, dict):
        raise ValueError(
            f"structural_tag must be a JSON object or its text, got {type(value).__name__}"
        )
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError, RecursionError) as exc:
        raise ValueError(f"structural_tag is not JSON-serializable ({exc})") from None


class _Parser:
    """One parse: counts format nodes and triggers against the limits on the way."""

    def __init__(self, limits: GrammarLimits) -> None:
        self.limits = limits
        self.num_nodes = 0
        self.num_triggers = 0

    def top(self, top: Any) -> StructuralTag:
        where = "structural_tag"
        if not isinstance(top, dict):
            raise ValueError(f"{where} must be a JSON object, got {_json_type(top)}")
        if top.get("type", "structural_tag") != "structural_tag":
            raise ValueError(f'{where}: "type" must be "structural_tag", got {top["type"]!r}')
        if "format" in top:
            _check_keys(where, top, ("format",), ("type",))
            return StructuralTag(self.format(top["format"], "format"))
        if "structures" in top or "triggers" in top:
            _check_keys(where, top, ("structures", "triggers"), ("type",))
            return StructuralTag(self.legacy(top["structures"], top["triggers"]))
        raise ValueError(
            f'{where} needs "format" (a format object) or "structures" and "triggers" '
            "(the legacy form)"
        )

    def legacy(self, structures: Any, triggers: Any) -> TriggeredTagsFormat:
        names = self.triggers(triggers, "triggers")
        items = _non_empty_list(structures, "structures")
        tags = []
        for i, item in enumerate(items):
            path = f"structures[{i}]"
            if not isinstance(item, dict):
                raise ValueError(f"structural_tag {path} must be an object, got {_json_type(item)}")
            _check_keys(f"structural_tag {path}", item, _LEGACY_FIELDS, ())
            self._count(path)
            content = self.json_schema(item["schema"], f"{path}.schema")
            tag = TagFormat(
                self.string(item["begin"], f"{path}.begin", non_empty=True),
                content,
                self.string(item["end"], f"{path}.end"),
            )
            tags.append(tag)
        return _triggered(names, tuple(tags), False, False, "structures")

    def format(self, node: Any, path: str) -> Format:
        if not isinstance(node, dict):
            raise ValueError(f"structural_tag {path} must be an object, got {_json_type(node)}")
        kind = node.get("type")
        if kind not in _FIELDS:
            raise ValueError(
                f"structural_tag {path}: unknown type {kind!r}; expected one of "
                f"{', '.join(_FIELDS)}"
            )
        required, optional = _FIELDS[kind]
        _check_keys(f"structural_tag {path} ({kind})", node, required, ("type", *optional))
        self._count(path)
        return getattr(self, "_" + kind)(node, path)

    def _const_string(self, node: dict, path: str) -> Format:
        return ConstStringFormat(self.string(node["value"], f"{path}.value"))

    def _json_schema(self, node: dict, path: str) -> Format:
        return self.json_schema(node["json_schema"], f"{path}.json_schema")

    def _any_text(self, node: dict, path: str) -> Format:
        return AnyTextFormat()

    def _regex(self, node: dict, path: str) -> Format:
        pattern = self.string(node["pattern"], f"{path}.pattern", non_empty=True, escapes=True)
        try:
            check_regex_structure(pattern)
        except ValueError as exc:
            raise ValueError(f"structural_tag {path}.pattern: {exc}") from None
        return RegexFormat(pattern)

    def _grammar(self, node: dict, path: str) -> Format:
        text = self.string(node["grammar"], f"{path}.grammar", non_empty=True, escapes=True)
        return GrammarFormat(text)

    def _sequence(self, node: dict, path: str) -> Format:
        return SequenceFormat(self.elements(node["elements"], f"{path}.elements"))

    def _or(self, node: dict, path: str) -> Format:
        return OrFormat(self.elements(node["elements"], f"{path}.elements"))

    def _tag(self, node: dict, path: str) -> TagFormat:
        return TagFormat(
            self.string(node["begin"], f"{path}.begin", non_empty=True),
            self.format(node["content"], f"{path}.content"),
            self.string(node["end"], f"{path}.end"),
        )

    def _triggered_tags(self, node: dict, path: str) -> Format:
        triggers = self.triggers(node["triggers"], f"{path}.triggers")
        tags = self.tags(node["tags"], f"{path}.tags")
        flags = self.flags(node, path)
        return _triggered(triggers, tags, *flags, f"{path}.tags")

    def _tags_with_separator(self, node: dict, path: str) -> Format:
        tags = self.tags(node["tags"], f"{path}.tags")
        separator = self.string(node["separator"], f"{path}.separator")
        return TagsWithSeparatorFormat(tags, separator, *self.flags(node, path))

    def elements(self, items: Any, path: str) -> tuple[Format, ...]:
        items = _non_empty_list(items, path)
        return tuple(self.format(item, f"{path}[{i}]") for i, item in enumerate(items))

    def tags(self, items: Any, path: str) -> tuple[TagFormat, ...]:
        items = _non_empty_list(items, path)
        tags = []
        for i, item in enumerate(items):
            where = f"{path}[{i}]"
            if isinstance(item, dict) and item.get("type", "tag") != "tag":
                raise ValueError(f'structural_tag {where} must be a "tag", got {item["type"]!r}')
            if isinstance(item, dict) and "type" not in item:
                item = {"type": "tag", **item}
            tags.append(self.format(item, where))
        return tuple(tags)

    def triggers(self, items: Any, path: str) -> tuple[str, ...]:
        items = _non_empty_list(items, path)
        self.num_triggers += len(items)
        if self.num_triggers > self.limits.max_structural_triggers:
            raise ValueError(
                f"structural_tag has more than {self.limits.max_structural_triggers:,} "
                "triggers; merge triggers that share a prefix"
            )
        names = [self.string(t, f"{path}[{i}]", non_empty=True) for i, t in enumerate(items)]
        return tuple(dict.fromkeys(names))

    def flags(self, node: dict, path: str) -> tuple[bool, bool]:
        values = []
        for name in ("at_least_one", "stop_after_first"):
            flag = node.get(name, False)
            if not isinstance(flag, bool):
                raise ValueError(
                    f"structural_tag {path}.{name} must be true or false, got {_json_type(flag)}"
                )
            values.append(flag)
        return values[0], values[1]

    def json_schema(self, schema: Any, path: str) -> JsonSchemaFormat:
        if schema is True or (isinstance(schema, dict)):
            return JsonSchemaFormat(json.dumps(schema, separators=(",", ":"), ensure_ascii=False))
        if schema is False:
            raise ValueError(f"structural_tag {path} is false: no JSON document is valid")
        raise ValueError(
            f"structural_tag {path} must be a JSON schema object (or true), "
            f"got {_json_type(schema)}"
        )

    def string(self, value: Any, path: str, non_empty: bool = False, escapes: bool = False) -> str:
        if not isinstance(value, str):
            raise ValueError(f"structural_tag {path} must be a string, got {_json_type(value)}")
        if non_empty and not value:
            raise ValueError(f"structural_tag {path} must not be empty")
        check_controls(f"structural_tag {path}", value, escapes=escapes)
        return value

    def _count(self, path: str) -> None:
        self.num_nodes += 1
        if self.num_nodes > self.limits.max_structural_nodes:
            raise ValueError(
                f"structural_tag has more than {self.limits.max_structural_nodes:,} formats "
                f"(at {path}); send fewer tags or elements"
            )


def _triggered(
    triggers: tuple[str, ...],
    tags: tuple[TagFormat, ...],
    at_least_one: bool,
    stop_after_first: bool,
    path: str,
) -> TriggeredTagsFormat:
    """Checks that every tag starts with a trigger, that every trigger starts a tag and that no
    trigger holds another one past its start (the text could not tell which one occurred)."""
    for i, tag in enumerate(tags):
        if not any(tag.begin.startswith(t) for t in triggers):
            raise ValueError(
                f"structural_tag {path}[{i}].begin {tag.begin!r} starts with none of the "
                f"triggers {list(triggers)}; add its trigger or fix the begin"
            )
    for trigger in triggers:
        if not any(tag.begin.startswith(trigger) for tag in tags):
            raise ValueError(
                f"structural_tag trigger {trigger!r} begins no tag; remove it or add a tag "
                "whose begin starts with it"
            )
        for other in triggers:
            if other != trigger and other in trigger[1:]:
                raise ValueError(
                    f"structural_tag trigger {trigger!r} contains the trigger {other!r} after "
                    "its first character; use triggers that do not overlap"
                )
    return TriggeredTagsFormat(triggers, tags, at_least_one, stop_after_first)


def _non_empty_list(value: Any, path: str) -> list:
    if not isinstance(value, list):
        raise ValueError(f"structural_tag {path} must be a list, got {_json_type(value)}")
    if not value:
        raise ValueError(f"structural_tag {path} must not be empty")
    return value


def _check_keys(where: str, node: dict, required: tuple[str, ...], optional: tuple[str, ...]):
    missing = [k for k in required if k not in node]
    if missing:
        raise ValueError(f"{where} is missing {', '.join(repr(k) for k in missing)}")
    unknown = [k for k in node if k not in required and k not in optional]
    if unknown:
        allowed = ", ".join(repr(k) for k in (*required, *optional))
        raise ValueError(
            f"{where} has unknown field(s) {', '.join(repr(k) for k in unknown)}; "
            f"allowed: {allowed}"
        )


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    return "an object"
