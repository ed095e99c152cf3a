"""Reasoning separation and SGLang extras on the OpenAI routes, through the real HTTP process
over fake_stack's scripted worker (``--reasoning-parser qwen3``, ``--tool-call-parser hermes``):
``reasoning_content`` in messages and streams, grammars moved after ``</think>``, and the
extras reaching the native sampling params. Fast: no model runs."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from fake_stack import FakeStack
from tool_util import last_params, reply_with

USER = [{"role": "user", "content": "Weather in Paris?"}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def stack_options() -> dict:
    return {"tool_call_parser": "hermes", "reasoning_parser": "qwen3"}


pytestmark = pytest.mark.usefixtures("idle_stack")  # stack, client: conftest.py


def chat(client: openai.OpenAI, extra: dict, **kw):
    return client.chat.completions.create(
        model="fake-model", messages=USER, max_tokens=200, extra_body=extra, **kw
    )


def test_reasoning_goes_to_reasoning_content(stack: FakeStack, client: openai.OpenAI) -> None:
    extra = reply_with(stack, "<think>Paris is in France.</think>It is sunny.")
    message = chat(client, extra).choices[0].message
    assert message.content == "It is sunny."
    assert message.model_extra["reasoning_content"] == "Paris is in France."


def test_separate_reasoning_false_keeps_it_in_content(
    stack: FakeStack, client: openai.OpenAI
) -> None:
    text = "<think>Paris is in France.</think>It is sunny."
    extra = {**reply_with(stack, text), "separate_reasoning": False}
    message = chat(client, extra).choices[0].message
    assert message.content == text and "reasoning_content" not in message.model_extra


def test_reasoning_then_a_call(stack: FakeStack, client: openai.OpenAI) -> None:
    extra = reply_with(stack, "<think>I need the weather.</think>\n" + CALL)
    choice = chat(client, extra, tools=TOOLS, tool_choice="required").choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.model_extra["reasoning_content"] == "I need the weather."
    assert json.loads(choice.message.tool_calls[0].function.arguments) == {"city": "Paris"}


def test_streamed_reasoning_comes_before_content(stack: FakeStack) -> None:
    text = "<think>Paris is in France.</think>It is sunny."
    body = {"messages": USER, "max_tokens": 200, "stream": True, **reply_with(stack, text)}
    deltas = []
    with httpx.stream("POST", stack.url + "/v1/chat/completions", json=body, timeout=30) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                deltas.append(json.loads(line[6:])["choices"][0])
    reasoning = "".join(d["delta"].get("reasoning_content") or "" for d in deltas)
    content = "".join(d["delta"].get("content") or "" for d in deltas)
    assert reasoning == "Paris is in France." and content == "It is sunny."
    last_reasoning = max(i for i, d in enumerate(deltas) if d["delta"].get("reasoning_content"))
    first_content = min(i for i, d in enumerate(deltas) if d["delta"].get("content"))
    assert last_reasoning < first_content
    assert deltas[-1]["finish_reason"] == "stop"


def _tag_format(params: dict) -> dict:
    assert all(params.get(k) is None for k in ("json_schema", "regex", "ebnf", "choices")), params
    tag = params["structural_tag"]
    return (json.loads(tag) if isinstance(tag, str) else tag)["format"]


@pytest.mark.parametrize(
    "extra",
    [
        {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}},
        {"response_format": {"type": "json_object"}},
        {"regex": "(yes|no)"},
        {"json_schema": '{"type": "object"}'},
        {"guided_choice": ["yes", "no"]},
        {"tools": TOOLS, "tool_choice": "required"},
    ],
)
def test_grammars_apply_after_the_reasoning(stack: FakeStack, extra: dict) -> None:
    body = {"messages": USER, "max_tokens": 2, **extra}
    r = httpx.post(stack.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    assert "</think>" in json.dumps(_tag_format(last_params(stack)))


def test_unreadable_json_schema_is_a_400(stack: FakeStack) -> None:
    body = {"messages": USER, "max_tokens": 2, "json_schema": "{not json"}
    r = httpx.post(stack.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "json_schema", r.text


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_sglang_extras_reach_the_sampling_params(stack: FakeStack, path: str) -> None:
    extras = {"stop_regex": ["\\d{3}"], "custom_params": {"k": 1}, "stream_interval": 3}
    base = {"messages": USER} if "chat" in path else {"prompt": "hi"}
    r = httpx.post(stack.url + path, json={**base, "max_tokens": 2, **extras}, timeout=30)
    assert r.status_code == 200, r.text
    params = last_params(stack)
    assert {k: params[k] for k in extras} == extras


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_structural_tag_response_format(stack: FakeStack, path: str) -> None:
    fmt = {"type": "structural_tag", "format": {"type": "const_string", "value": "ok"}}
    base = {"messages": USER} if "chat" in path else {"prompt": "hi"}
    r = httpx.post(stack.url + path, json={**base, "max_tokens": 2, "response_format": fmt})
    assert r.status_code == 200, r.text
    if "chat" in path:  # after the reasoning block
        assert "const_string" in json.dumps(_tag_format(last_params(stack)))
    else:
        tag = last_params(stack)["structural_tag"]
        assert (json.loads(tag) if isinstance(tag, str) else tag) == fmt
    bad = {**fmt, "format": {"type": "nonsense"}}
    r = httpx.post(stack.url + path, json={**base, "max_tokens": 2, "response_format": bad})
    assert r.status_code == 400, r.text


# ---------------------------------------------------------------------- Responses API
RESPONSES_TOOLS = [{"type": "function", **TOOLS[0]["function"]}]


@pytest.mark.parametrize("stream", [False, True])
def test_responses_reasoning_item_then_a_call(
    stack: FakeStack, client: openai.OpenAI, stream: bool
) -> None:
    """/v1/responses writes the reasoning as a ``reasoning`` item before the call it led to,
    streamed as ``response.reasoning_text`` events; the stored conversation carries it."""
    extra = reply_with(stack, "<think>I need the weather.</think>\n" + CALL)
    kw = {"model": "fake-model", "input": "Weather?", "tools": RESPONSES_TOOLS, "extra_body": extra}
    if stream:
        events = list(client.responses.create(stream=True, **kw))
        deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
        assert "".join(deltas) == "I need the weather."
        response = events[-1].response
    else:
        response = client.responses.create(**kw)
    reasoning, call = response.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == "I need the weather."
    assert call.type == "function_call" and json.loads(call.arguments) == {"city": "Paris"}
    extra = reply_with(stack, "<think>ok</think>Sunny.")
    follow = client.responses.create(
        model="fake-model",
        previous_response_id=response.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
        extra_body=extra,
    )
    assert follow.output_text == "Sunny."
    prompt = stack.tokenizer.decode(list(stack.worker.received.values())[-1].input_ids)
    assert prompt.index("Weather?") < prompt.index("sunny")
