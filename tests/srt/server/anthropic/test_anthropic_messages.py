"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) driven by the official
``anthropic`` client through the real HTTP process over fake_stack's worker (hermes tool
parser, qwen3 reasoning parser), which replies with a scripted text: text, thinking and
tool_use blocks, stop reasons, usage, the streamed event sequence, tool history, and 400s in
Anthropic's error envelope. Fast: no model runs."""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest
from fake_stack import FakeStack
from tool_util import last_params, reply_with

MODEL = "fake-model"
WEATHER = {
    "name": "get_weather",
    "description": "Weather for a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def stack_options() -> dict:
    return {"tool_call_parser": "hermes", "reasoning_parser": "qwen3"}


@pytest.fixture(scope="module")
def claude(stack: FakeStack) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=stack.url, api_key="unused", max_retries=0)


pytestmark = pytest.mark.usefixtures("idle_stack")  # stack: conftest.py


def hermes_call(name: str, args: dict) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(args)}}}\n</tool_call>'


def test_text_reply_usage_and_sampling(stack: FakeStack, claude) -> None:
    # this client version types no sampling fields; older ones send them in the body
    extra = {**reply_with(stack, "It is sunny."), "temperature": 0.2, "top_p": 0.9, "top_k": 5}
    msg = claude.messages.create(
        model=MODEL,
        max_tokens=50,
        system="Be brief.",
        messages=ASK,
        metadata={"user_id": "u1"},
        cache_control={"type": "ephemeral"},
        extra_body=extra,
    )
    assert msg.type == "message" and msg.role == "assistant" and msg.model == MODEL
    assert [b.type for b in msg.content] == ["text"]
    assert msg.content[0].text == "It is sunny."
    assert msg.stop_reason == "end_turn" and msg.stop_sequence is None
    assert msg.usage.output_tokens > 0
    assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens > 0
    params = last_params(stack)
    assert params["max_new_tokens"] == 50 and params["top_k"] == 5
    assert params["temperature"] == pytest.approx(0.2) and params["top_p"] == pytest.approx(0.9)


def test_max_tokens_and_stop_sequences(stack: FakeStack, claude) -> None:
    msg = claude.messages.create(model=MODEL, max_tokens=3, messages=ASK)
    assert msg.stop_reason == "max_tokens" and msg.usage.output_tokens == 3
    extra = reply_with(stack, "one two STOP three")
    msg = claude.messages.create(
        model=MODEL, max_tokens=50, messages=ASK, stop_sequences=["STOP"], extra_body=extra
    )
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == "STOP"
    assert msg.content[0].text.strip() == "one two"


def test_thinking_and_tool_use_blocks(stack: FakeStack, claude) -> None:
    text = "<think>\nNeed the tool.\n</think>\n\n" + hermes_call("get_weather", {"city": "Paris"})
    msg = claude.messages.create(
        model=MODEL,
        max_tokens=200,
        messages=ASK,
        tools=[WEATHER],
        thinking={"type": "enabled", "budget_tokens": 2048},
        extra_body=reply_with(stack, text),
    )
    assert [b.type for b in msg.content] == ["thinking", "tool_use"]
    assert msg.content[0].thinking == "Need the tool."
    call = msg.content[1]
    assert call.name == "get_weather" and call.input == {"city": "Paris"}
    assert call.id.startswith("toolu_") and msg.stop_reason == "tool_use"
    assert stack.worker.received  # the template saw enable_thinking (rendered prompt)

    # the call and its result go back as history; the next reply is text
    history = ASK + [
        {"role": "assistant", "content": [b.model_dump() for b in msg.content]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "21 C"}],
        },
    ]
    reply = claude.messages.create(
        model=MODEL,
        max_tokens=50,
        messages=history,
        tools=[WEATHER],
        extra_body=reply_with(stack, "21 degrees."),
    )
    assert reply.content[0].text == "21 degrees." and reply.stop_reason == "end_turn"
    prompt = stack.tokenizer.decode(list(stack.worker.received.values())[-1].input_ids)
    assert "21 C" in prompt  # (the fake template shows tool results, not calls)


def test_tool_choice_constrains(stack: FakeStack, claude) -> None:
    extra = reply_with(stack, hermes_call("get_weather", {"city": "Rome"}))
    msg = claude.messages.create(
        model=MODEL,
        max_tokens=200,
        messages=ASK,
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
        extra_body=extra,
    )
    assert msg.content[-1].type == "tool_use" and msg.content[-1].input == {"city": "Rome"}
    params = last_params(stack)
    assert any(params.get(k) for k in ("json_schema", "regex", "ebnf", "structural_tag"))


def test_stream_events_match_the_reply(stack: FakeStack, claude) -> None:
    text = "<think>\nHmm.\n</think>\n\nLooking.\n" + hermes_call("get_weather", {"city": "Oslo"})
    kinds = []
    with claude.messages.stream(
        model=MODEL,
        max_tokens=200,
        messages=ASK,
        tools=[WEATHER],
        extra_body=reply_with(stack, text),
    ) as stream:
        for event in stream:
            kinds.append(event.type)
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "message_delta" in kinds and kinds.count("content_block_start") == 3
    assert [b.type for b in final.content] == ["thinking", "text", "tool_use"]
    assert final.content[0].thinking == "Hmm." and final.content[1].text.strip() == "Looking."
    assert final.content[2].input == {"city": "Oslo"}
    assert final.stop_reason == "tool_use" and final.usage.output_tokens > 0


def test_count_tokens(stack: FakeStack, claude) -> None:
    counted = claude.messages.count_tokens(model=MODEL, messages=ASK, system="Be brief, always.")
    bare = claude.messages.count_tokens(model=MODEL, messages=ASK)
    assert counted.input_tokens > bare.input_tokens > 0
    msg = claude.messages.create(model=MODEL, max_tokens=1, messages=ASK)
    assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens == bare.input_tokens


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": ASK}, "max_tokens"),
        ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image"}]}]},
         "messages[0].content[0].type"),
        ({"max_tokens": 5, "messages": ASK, "tools": [{"type": "web_search_20250305",
          "name": "web_search"}]}, "tools[0].type"),
        ({"max_tokens": 5, "messages": ASK, "container": "x"}, "container"),
        ({"max_tokens": 5, "messages": ASK, "thinking": {"type": "enabled"}},
         "thinking.budget_tokens"),
        ({"max_tokens": 5, "messages": ASK, "tool_choice": {"type": "maybe"}}, "tool_choice.type"),
        ({"max_tokens": 0, "messages": ASK}, "max_tokens"),
        ({"max_tokens": 5, "messages": ASK, "tool_choice": {"type": "auto", "x": 1}},
         "tool_choice.x"),
        ({"max_tokens": 5, "messages": ASK, "thinking": {"type": "disabled", "y": 1}},
         "thinking.y"),
        ({"max_tokens": 5, "messages": ASK, "tools": [{"name": "a b", "input_schema": {}}]},
         "tools[0].name"),
        ({"max_tokens": 5, "messages": ASK, "tools": [{"name": "f", "input_schema":
          {"type": "array"}}]}, "tools[0].input_schema"),
    ],
)  # fmt: skip
def test_refusals_in_anthropic_envelope(stack: FakeStack, body: dict, param: str) -> None:
    r = httpx.post(stack.url + "/v1/messages", json={"model": MODEL, **body}, timeout=30)
    assert r.status_code == 400, r.text
    out = r.json()
    assert out["type"] == "error" and out["error"]["type"] == "invalid_request_error"
    assert out["error"]["param"] == param, out


def test_sdk_raises_bad_request(claude) -> None:
    with pytest.raises(anthropic.BadRequestError, match="max_tokens"):
        claude.messages.create(model=MODEL, max_tokens=0, messages=ASK)


def test_hostile_history_is_a_400(stack: FakeStack) -> None:
    """A tool_use input nested past the JSON encoder's depth, a tool_result without its id,
    thousands of blocks: 400s or answers, never a 500; the server stays idle afterwards."""
    deep = '{"a":' * 1000 + "1" + "}" * 1000  # the client's own json module cannot write it
    call = '{"type": "tool_use", "id": "t", "name": "f", "input": ' + deep + "}"
    turns = [
        '{"role": "assistant", "content": [' + call + "]}",
        json.dumps({"role": "user", "content": [{"type": "tool_result", "content": "x"}]}),
    ]
    for turn in turns:
        head = json.dumps({"model": MODEL, "max_tokens": 4})[:-1]
        body = head + ', "messages": [' + json.dumps(ASK[0]) + ", " + turn + "]}"
        r = httpx.post(
            stack.url + "/v1/messages",
            content=body,
            headers={"content-type": "application/json"},
            timeout=30,
        )
        assert r.status_code == 400, r.text
    schema = '{"type": "object", "properties": {"a": ' + deep + "}}"
    for extra in (
        '"tools": [{"name": "f", "input_schema": ' + schema + "}]",
        '"output_config": {"format": {"type": "json_schema", "schema": ' + schema + "}}",
    ):
        body = json.dumps({"model": MODEL, "max_tokens": 4, "messages": ASK})[:-1]
        r = httpx.post(
            stack.url + "/v1/messages",
            content=body + ", " + extra + "}",
            headers={"content-type": "application/json"},
            timeout=30,
        )
        assert r.status_code == 400, r.text
    many = [{"type": "text", "text": "a"}] * 5000
    r = httpx.post(
        stack.url + "/v1/messages",
        json={"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": many}]},
        timeout=30,
    )
    assert r.status_code in (200, 400), r.text


def test_max_tokens_past_the_context_is_a_cap(stack: FakeStack, claude) -> None:
    """Clients send their model's output limit as max_tokens (pydantic-ai: 16,384); past what
    the context leaves it means "up to the context", not a 400."""
    msg = claude.messages.create(model=MODEL, max_tokens=32000, messages=ASK, timeout=60)
    assert msg.stop_reason == "max_tokens"
    total = msg.usage.input_tokens + msg.usage.cache_read_input_tokens + msg.usage.output_tokens
    assert total == 256  # the fake stack's context length


def test_output_format_constrains_the_reply(stack: FakeStack) -> None:
    """output_config.format (and the beta's output_format) become a JSON-schema grammar."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    fmt = {"type": "json_schema", "schema": schema}
    for extra in ({"output_config": {"format": fmt, "effort": "high"}}, {"output_format": fmt}):
        body = {"model": MODEL, "max_tokens": 5, "messages": ASK, **extra}
        r = httpx.post(stack.url + "/v1/messages", json=body, timeout=30)
        assert r.status_code == 200, r.text
        params = last_params(stack)  # (the reasoning parser wraps the schema in a grammar)
        grammar = next(params[k] for k in ("json_schema", "ebnf", "structural_tag") if params[k])
        assert "integer" in grammar
    both = {"model": MODEL, "max_tokens": 5, "messages": ASK, "output_format": fmt}
    both["output_config"] = {"format": fmt}
    r = httpx.post(stack.url + "/v1/messages", json=both, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "output_format"
    counted = httpx.post(
        stack.url + "/v1/messages/count_tokens",
        json={"model": MODEL, "messages": ASK, "cache_control": {"type": "ephemeral"}},
        timeout=30,
    )
    assert counted.status_code == 200 and counted.json()["input_tokens"] > 0
