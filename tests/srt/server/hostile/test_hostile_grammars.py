"""Hostile clients (see conftest.py): invalid and hostile grammars on every route."""

from __future__ import annotations

import time

import pytest
from hostile_util import (
    GREEDY,
    Failures,
    LiveServer,
    assert_4xx,
    assert_ok_or_4xx,
    openai_prompt,
)

pytestmark = pytest.mark.slow


# ---------------------------------------------------------------------- grammars
def _deep_schema(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


BAD_GRAMMARS = {  # must be a 4xx
    "unbalanced-regex": {"regex": "("},
    "bad-class-regex": {"regex": "[a-"},
    "bad-escape-regex": {"regex": "\\"},
    "unbalanced-close-regex": {"regex": "a)|(b"},  # valid only once wrapped as (?:...)$
    "schema-not-json": {"json_schema": "{not json"},
    "schema-bad-type": {"json_schema": {"type": "nonsense"}},
    "schema-not-object": {"json_schema": "42"},
    "schema-bad-pattern": {"json_schema": {"type": "string", "pattern": "("}},
    "ebnf-garbage": {"ebnf": "this is not a grammar ::= ::="},
    "ebnf-no-root": {"ebnf": 'start ::= "a"'},
    "ebnf-undefined-rule": {"ebnf": "root ::= missing"},
    "two-grammars": {"regex": "a+", "json_schema": {"type": "string"}},
    "empty-choices": {"choices": []},
}
HOSTILE_GRAMMARS = {  # a 4xx or a finished answer, in bounded time
    "left-recursion": {"ebnf": "root ::= root"},
    "mutual-recursion": {"ebnf": "root ::= a\na ::= root"},
    "recursive-ref": {"json_schema": {"$ref": "#"}},
    "recursive-defs": {
        "json_schema": {
            "$defs": {
                "n": {
                    "type": "object",
                    "properties": {"next": {"$ref": "#/$defs/n"}},
                    "required": ["next"],
                }
            },
            "$ref": "#/$defs/n",
        }
    },
    "dangling-ref": {"json_schema": {"$ref": "#/$defs/nowhere"}},
    "remote-ref": {"json_schema": {"$ref": "http://127.0.0.1:9/schema.json"}},
    "huge-schema": {
        "json_schema": {
            "type": "object",
            "properties": {f"field_{i}": {"type": "integer"} for i in range(3000)},
        }
    },
    "deep-schema": {"json_schema": _deep_schema(300)},
    "huge-repeat-regex": {"regex": "a{100000}"},
    "nested-repeat-regex": {"regex": "((a{1,50}){1,50}){1,50}"},
    "empty-regex": {"regex": ""},
    "impossible-schema": {"json_schema": {"allOf": [{"type": "string"}, {"type": "integer"}]}},
    "huge-enum": {"json_schema": {"enum": [f"value-{i}" for i in range(20000)]}},
}


@pytest.mark.parametrize("name", sorted(BAD_GRAMMARS))
def test_invalid_grammar_is_4xx(server: LiveServer, name: str) -> None:
    body = {"text": "Answer:", "sampling_params": {"max_new_tokens": 8, **BAD_GRAMMARS[name]}}
    assert_4xx(server.post("/generate", body, timeout=30))


@pytest.mark.parametrize("name", sorted(HOSTILE_GRAMMARS))
def test_hostile_grammar_is_bounded(server: LiveServer, name: str) -> None:
    body = {
        "text": "Answer:",
        "sampling_params": {"max_new_tokens": 8, **GREEDY, **HOSTILE_GRAMMARS[name]},
    }
    t0 = time.monotonic()
    assert_ok_or_4xx(server.post("/generate", body, timeout=40))
    assert time.monotonic() - t0 < 30


def test_invalid_grammar_on_openai_routes(server: LiveServer) -> None:
    failures = Failures()
    chat = {"model": "default", "max_tokens": 4, **openai_prompt("chat")}
    formats = [
        {"type": "json_schema"},
        {"type": "json_schema", "json_schema": {"name": "x"}},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}},
        {"type": "xml"},
        "json",
        {
            "type": "json_schema",
            "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "("}},
        },
    ]
    for fmt in formats:
        failures.check(
            fmt,
            lambda b={**chat, "response_format": fmt}: assert_4xx(
                server.post("/v1/chat/completions", b, timeout=30)
            ),
        )
    comp = {"model": "default", "max_tokens": 4, "prompt": "x"}
    for extra in [{"regex": "("}, {"json_schema": "{"}, {"ebnf": "::="}]:
        failures.check(
            extra,
            lambda b={**comp, **extra}: assert_4xx(server.post("/v1/completions", b, timeout=30)),
        )
    failures.assert_none()
