"""Which JSON Schema keywords and formats each engine enforces (the grammar README's keyword
table, as data), and the list of those a compiled schema leaves unenforced.

A schema using a keyword its engine does not implement still compiles where the keyword can
only loosen nothing else (lenient llguidance, outlines-core): the documents it admits may then
fail that keyword. ``unenforced_keywords`` names them, so the backends can put them on the
``CompiledGrammar`` (``unenforced``) and ``auto`` can log them. Unknown ``format`` values are
removed before compiling (``schema_rewrite``: the value is then any string) and listed as
``format:<name>``.
"""

from __future__ import annotations

from typing import Any

from radixlm.grammar.schema_checks import schema_nodes

# ``format`` values llguidance 1.9.1 implements (measured: every other value is "Unknown
# format"); outlines-core implements fewer and rejects the rest, so ``auto`` falls back.
KNOWN_FORMATS = frozenset(
    {
        "date-time",
        "time",
        "date",
        "duration",
        "email",
        "hostname",
        "ipv4",
        "ipv6",
        "uri",
        "uuid",
        "unknown",
    }
)
# llguidance's "Unimplemented keys" (measured on 1.9.1): strict llguidance rejects them,
# lenient llguidance ignores them.
LLGUIDANCE_UNIMPLEMENTED = frozenset(
    {
        "not",
        "uniqueItems",
        "contains",
        "minContains",
        "maxContains",
        "propertyNames",
        "if",
        "then",
        "else",
        "dependentRequired",
        "dependentSchemas",
        "dependencies",
        "unevaluatedProperties",
        "unevaluatedItems",
    }
)
# Keywords outlines-core compiles without effect (``auto`` sends most of these schemas to
# llguidance first; they stay unenforced only when outlines-core is what compiled them).
OUTLINES_IGNORED = LLGUIDANCE_UNIMPLEMENTED.union(
    {
        "minimum",
        "maximum",
        "exclusiveMinimum",
        "exclusiveMaximum",
        "multipleOf",
        "minProperties",
        "maxProperties",
    }
)
ENGINES = ("llguidance", "llguidance-lenient", "outlines")


def unknown_formats(schema: Any) -> list[str]:
    """The ``format`` values of ``schema`` no engine here implements, sorted."""
    return sorted(
        {
            node["format"]
            for node in schema_nodes(schema)
            if isinstance(node.get("format"), str) and node["format"] not in KNOWN_FORMATS
        }
    )


def unenforced_keywords(schema: Any, engine: str, original: Any = None) -> tuple[str, ...]:
    """The keywords of ``schema`` (the rewritten schema the engine compiled) that ``engine``
    (one of ``ENGINES``) does not enforce, then ``format:<name>`` for each unknown format of
    ``original`` (the schema as sent; formats are removed by the rewrite)."""
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    ignored: frozenset[str] = frozenset()
    if engine == "llguidance-lenient":
        ignored = LLGUIDANCE_UNIMPLEMENTED
    elif engine == "outlines":
        ignored = OUTLINES_IGNORED
    found = set()
    for node in schema_nodes(schema):
        found.update(key for key in node if key in ignored)
        if engine == "outlines" and "allOf" in node and "properties" in node:
            found.add("allOf")
    formats = unknown_formats(schema if original is None else original)
    return (*sorted(found), *(f"format:{name}" for name in formats))
