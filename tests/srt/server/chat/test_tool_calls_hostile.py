"""Hostile tool definitions and tool histories: clear 400s naming the field, never a 500, and
the server stays healthy (fake worker, real HTTP stack)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
from fake_stack import FakeStack

USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeStack]:
    s = FakeStack(tmp_path_factory.mktemp("ipc"), tool_call_parser="hermes")
    yield s
    s.close()


@pytest.fixture(autouse=True)
def _healthy(stack: FakeStack) -> Iterator[None]:
    yield
    assert httpx.get(stack.url + "/health", timeout=5).status_code == 200
    stack.tm.assert_no_requests()


def post(stack: FakeStack, body: str) -> httpx.Response:
    headers = {"content-type": "application/json"}
    return httpx.post(stack.url + "/v1/chat/completions", content=body, headers=headers, timeout=60)


def nested_schema(depth: int) -> str:
    open_ = '{"type": "object", "properties": {"x": '
    return open_ * depth + '{"type": "string"}' + "}}" * depth


@pytest.mark.parametrize("depth", [70, 200])
def test_deeply_nested_parameters_are_a_400(stack: FakeStack, depth: int) -> None:
    tools = '[{"type": "function", "function": {"name": "f", "parameters": ' + nested_schema(depth)
    body = '{"messages": ' + json.dumps(USER) + ', "tools": ' + tools + "}}]"
    body += ', "tool_choice": "required", "max_tokens": 2}'
    r = post(stack, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "tools[0].function.parameters" and "levels deep" in err["message"]


@pytest.mark.parametrize("depth", [200, 50_000])
def test_deeply_nested_history_arguments_are_a_400(stack: FakeStack, depth: int) -> None:
    arguments = '{"a": ' * depth + "1" + "}" * depth
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    messages = [
        *USER,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "done"},
    ]
    tools = [{"type": "function", "function": {"name": "f"}}]
    r = post(stack, json.dumps({"messages": messages, "tools": tools, "max_tokens": 2}))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "messages[1].tool_calls[0].function.arguments"


def test_too_many_tools_are_a_400(stack: FakeStack) -> None:
    tools = [{"type": "function", "function": {"name": f"t{i}"}} for i in range(300)]
    r = post(stack, json.dumps({"messages": USER, "tools": tools, "max_tokens": 2}))
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text
