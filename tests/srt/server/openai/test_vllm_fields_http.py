"""vLLM's structured-output fields (``guided_*``, ``structured_outputs``) on the OpenAI routes
through the real HTTP process over fake_stack's worker: each reaches the sampler as this
server's own grammar field, and what cannot be honoured is a 400 naming it. Fast: no model
runs."""

from __future__ import annotations

import json

import httpx
import pytest
from fake_stack import FakeStack
from tool_util import last_params

pytestmark = pytest.mark.usefixtures("idle_stack")  # stack: conftest.py

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
ROUTES = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    "/v1/completions": {"prompt": "hi", "max_tokens": 2},
    "/v1/responses": {"input": "hi", "max_output_tokens": 2},
}


def post(stack: FakeStack, route: str, extra: dict) -> httpx.Response:
    return httpx.post(stack.url + route, json={**ROUTES[route], **extra}, timeout=30)


@pytest.mark.parametrize("route", sorted(ROUTES))
@pytest.mark.parametrize(
    ("extra", "field", "value"),
    [
        ({"guided_json": SCHEMA}, "json_schema", SCHEMA),
        ({"guided_json": json.dumps(SCHEMA)}, "json_schema", SCHEMA),
        ({"guided_regex": "[0-9]+"}, "regex", "[0-9]+"),
        ({"guided_grammar": 'start: "yes" | "no"'}, "ebnf", 'start: "yes" | "no"'),
        ({"guided_choice": ["red", "blue"]}, "choices", ["red", "blue"]),
        ({"guided_choice": ["x"], "guided_decoding_backend": "xgrammar"}, "choices", ["x"]),
        ({"structured_outputs": {"json": SCHEMA}}, "json_schema", SCHEMA),
        ({"structured_outputs": {"regex": "a+", "backend": "guidance"}}, "regex", "a+"),
        ({"structured_outputs": {"choice": ["a", "b"]}}, "choices", ["a", "b"]),
        ({"structured_outputs": {"grammar": 'start: "a"'}}, "ebnf", 'start: "a"'),
    ],
)
def test_vllm_fields_reach_the_sampler(
    stack: FakeStack, route: str, extra: dict, field: str, value: object
) -> None:
    r = post(stack, route, extra)
    assert r.status_code == 200, r.text
    got = last_params(stack)[field]
    assert (json.loads(got) if field == "json_schema" else got) == value


def test_structured_outputs_json_object(stack: FakeStack) -> None:
    route = "/v1/chat/completions"
    assert post(stack, route, {"structured_outputs": {"json_object": True}}).status_code == 200
    assert last_params(stack)["json_schema"] is not None  # any JSON object


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"guided_json": SCHEMA, "json_schema": SCHEMA}, "guided_json"),
        ({"guided_regex": "a", "structured_outputs": {"regex": "b"}}, "structured_outputs.regex"),
        ({"guided_whitespace_pattern": " *"}, "guided_whitespace_pattern"),
        ({"structured_outputs": {"disable_fallback": True}}, "structured_outputs.disable_fallback"),
        (
            {"structured_outputs": {"whitespace_pattern": " "}},
            "structured_outputs.whitespace_pattern",
        ),
        ({"structured_outputs": {"jsonn": SCHEMA}}, "structured_outputs.jsonn"),
        ({"structured_outputs": "json"}, "structured_outputs"),
        ({"guided_choice": "red"}, "choices"),
        ({"guided_regex": "a", "guided_json": SCHEMA}, None),
        (
            {
                "guided_json": SCHEMA,
                "response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}},
            },
            "json_schema",
        ),
    ],
)
def test_what_cannot_be_honoured_is_a_400(stack: FakeStack, extra: dict, param) -> None:
    r = post(stack, "/v1/chat/completions", extra)
    assert r.status_code == 400, r.text
    if param is not None:
        assert r.json()["error"]["param"] == param, r.json()
