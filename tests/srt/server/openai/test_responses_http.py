"""The Responses API (/v1/responses) through the real HTTP process over fake_stack's worker,
which replies with a scripted text: request checks (every refusal a 4xx naming its field), what
the worker receives (instructions, input items, tools and history laid out as chat messages),
the response object and the stream of events as the strict openai client reads them, and the
stored responses (previous_response_id, GET, DELETE, bounds). Fast: no model runs."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from fake_stack import FakeStack
from tool_util import FLAT_WEATHER_TOOL, last_params, reply_with

from radixlm.srt.server.openai.responses import ResponseStore

WEATHER = FLAT_WEATHER_TOOL
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


pytestmark = pytest.mark.usefixtures("idle_stack")  # stack, client: conftest.py


def post(stack: FakeStack, body: dict) -> httpx.Response:
    return httpx.post(stack.url + "/v1/responses", json=body, timeout=30)


def last_prompt(stack: FakeStack) -> str:
    msg = list(stack.worker.received.values())[-1]
    return stack.tokenizer.decode(msg.input_ids)


# ---------------------------------------------------------------------- request checks
BAD_REQUESTS = [
    ({"input": "hi", "frobnicate": 1}, "frobnicate", "not a field"),
    ({"input": "hi", "background": True}, "background", "background"),
    ({"input": "hi", "truncation": "auto"}, "truncation", "truncation"),
    ({"input": "hi", "conversation": "conv_1"}, "conversation", "conversation"),
    ({"input": "hi", "max_tool_calls": 2}, "max_tool_calls", "max_tool_calls"),
    ({"input": "hi", "include": ["everything"]}, "include", "unknown values"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type", "only function"),
    ({"input": "hi", "tools": [{**WEATHER, "color": 1}]}, "tools[0]", "unsupported fields"),
    ({"input": "hi", "tools": [{"type": "function"}]}, "tools[0].name", "string"),
    ({"input": "hi", "tools": [{**WEATHER, "parameters": []}]}, "tools[0].parameters", "schema"),
    (
        {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
        "input[0].content[0].type",
        "text parts only",
    ),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type", "references"),
    ({"input": [{"type": "web_search_call"}]}, "input[0].type", "not supported"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role", "one of"),
    ({"input": [{"type": "function_call", "name": "f"}]}, "input[0].call_id", "string"),
    (
        {"input": [{"type": "function_call_output", "call_id": "c", "output": "1"}]},
        "input",
        "answers no tool call",
    ),
    ({"input": "hi", "text": {"format": {"type": "yaml"}}}, "text.format", "json_schema"),
    ({"input": "hi", "text": {"verbosity": "low"}}, "text.verbosity", "not supported"),
    ({"input": "hi", "tool_choice": {"type": "file_search"}}, "tool_choice", "tool_choice"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens", "at least 1"),
    ({"input": "hi", "temperature": "hot"}, "temperature", "number"),
    ({"input": 5}, "input.str", "valid string"),
    ({"input": "hi", "reasoning": {"effort": "extreme"}}, "reasoning.effort", "one of"),
]


@pytest.mark.parametrize(("body", "param", "words"), BAD_REQUESTS)
def test_bad_requests_are_400s_naming_the_field(
    stack: FakeStack, body: dict, param: str, words: str
) -> None:
    r = post(stack, {"max_output_tokens": 4, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    assert words in err["message"], err


def test_what_sglang_router_adds_is_accepted(stack: FakeStack) -> None:
    """sglang-router 0.3.2 re-sends a Responses request with its own defaults filled in."""
    added = {
        "store": True,
        "stream": None,
        "temperature": 1.0,
        "top_p": 1.0,
        "priority": 0,
        "top_k": -1,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
    }
    r = post(stack, {"input": "hi", "max_output_tokens": 2, **added})
    assert r.status_code == 200, r.text
    assert r.json()["object"] == "response"
    err = post(stack, {"input": "hi", "priority": 5}).json()["error"]
    assert err["param"] == "priority"


def test_unknown_previous_response_is_a_404(stack: FakeStack) -> None:
    r = post(stack, {"input": "hi", "previous_response_id": "resp_nope"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id"


def test_unknown_model_is_a_404(stack: FakeStack) -> None:
    assert post(stack, {"input": "hi", "model": "gpt-9"}).status_code == 404


# ---------------------------------------------------------------------- request -> prompt
def test_instructions_and_items_become_chat_messages(stack: FakeStack) -> None:
    items = [
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Q1"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": []},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Let me look."}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"role": "user", "content": "Q2"},
    ]
    body = {"instructions": "You are terse.", "input": items, "tools": [WEATHER]}
    assert post(stack, {**body, "max_output_tokens": 2}).status_code == 200
    prompt = last_prompt(stack)
    order = ["You are terse.", "Be brief.", "Q1", "Let me look.", "sunny", "Q2"]
    positions = [prompt.index(text) for text in order]
    assert positions == sorted(positions), prompt
    assert prompt.count("<|assistant|>") == 2  # the text and the call: one message, then the reply


def test_allowed_tools_choice_constrains_to_the_listed_tools(stack: FakeStack) -> None:
    other = {**WEATHER, "name": "get_time"}
    choice = {
        "type": "allowed_tools",
        "mode": "required",
        "tools": [{"type": "function", "name": "get_time"}],
    }
    body = {"input": "hi", "tools": [WEATHER, other], "tool_choice": choice, "max_output_tokens": 2}
    assert post(stack, body).status_code == 200
    tag = last_params(stack)["structural_tag"]
    assert "get_time" in tag and "get_weather" not in tag
    choice["tools"] = [{"type": "function", "name": "nope"}]
    r = post(stack, body)
    assert (
        r.status_code == 400 and r.json()["error"]["param"] == "tool_choice.allowed_tools.tools[0]"
    )


def test_tools_constrain_like_the_chat_route(stack: FakeStack) -> None:
    named = {"type": "function", "name": "get_weather"}
    assert post(stack, {"input": "hi", "tools": [WEATHER], "tool_choice": named}).status_code == 200
    tag = json.loads(last_params(stack)["structural_tag"])
    assert tag["format"]["stop_after_first"]  # named choice: one call
    # Responses function tools are strict unless they say otherwise: "auto" enforces them too
    assert (
        post(stack, {"input": "hi", "tools": [WEATHER], "max_output_tokens": 2}).status_code == 200
    )
    assert last_params(stack).get("structural_tag") is not None
    loose = {**WEATHER, "strict": False}
    assert post(stack, {"input": "hi", "tools": [loose], "max_output_tokens": 2}).status_code == 200
    assert last_params(stack).get("structural_tag") is None


def test_text_format_and_sampling_reach_the_sampler(stack: FakeStack) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"format": {"type": "json_schema", "name": "x", "schema": schema, "strict": True}}
    body = {"input": "hi", "text": fmt, "temperature": 0.5, "top_p": 0.9, "top_k": 7}
    assert post(stack, {**body, "max_output_tokens": 3}).status_code == 200
    params = last_params(stack)
    assert json.loads(params["json_schema"]) == schema
    assert (params["temperature"], params["top_p"], params["top_k"]) == (0.5, 0.9, 7)
    assert params["max_new_tokens"] == 3


# ---------------------------------------------------------------------- responses
def test_text_reply(stack: FakeStack, client: openai.OpenAI) -> None:
    extra = reply_with(stack, "Hello there.")
    r = client.responses.create(model="fake-model", input="hi", extra_body=extra)
    assert r.status == "completed" and r.output_text == "Hello there."
    (item,) = r.output
    assert item.type == "message" and item.status == "completed" and item.id.startswith("msg_")
    assert r.usage.input_tokens > 0 and r.usage.output_tokens > 0
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens


def test_calls_become_function_call_items(stack: FakeStack, client: openai.OpenAI) -> None:
    extra = reply_with(stack, CALL)
    r = client.responses.create(
        model="fake-model", input="weather?", tools=[WEATHER], extra_body=extra
    )
    (item,) = r.output
    assert item.type == "function_call" and item.name == "get_weather"
    assert json.loads(item.arguments) == {"city": "Paris"} and item.call_id.startswith("call_")
    assert r.output_text == ""


def test_length_limit_gives_an_incomplete_response(stack: FakeStack, client) -> None:
    stack.worker.cont_ids = stack.tokenizer.encode("word " * 20, add_special_tokens=False)
    r = client.responses.create(model="fake-model", input="hi", max_output_tokens=3)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output[0].status == "incomplete" and r.usage.output_tokens == 3


def test_logprobs_when_included(stack: FakeStack, client: openai.OpenAI) -> None:
    extra = reply_with(stack, "Hello")
    r = client.responses.create(
        model="fake-model",
        input="hi",
        include=["message.output_text.logprobs"],
        top_logprobs=2,
        extra_body=extra,
    )
    logprobs = r.output[0].content[0].logprobs
    assert "".join(lp.token for lp in logprobs).startswith("Hello")
    assert all(len(lp.top_logprobs) == 2 for lp in logprobs)


def test_logprobs_of_calls_make_no_message(stack: FakeStack, client: openai.OpenAI) -> None:
    extra = reply_with(stack, CALL)
    r = client.responses.create(
        model="fake-model",
        input="weather?",
        tools=[WEATHER],
        include=["message.output_text.logprobs"],
        extra_body=extra,
    )
    assert [o.type for o in r.output] == ["function_call"]


def test_stream_closed_early_leaves_nothing_behind(stack: FakeStack) -> None:
    body = {"input": "hi", "stream": True, "max_output_tokens": 200}
    with httpx.stream("POST", stack.url + "/v1/responses", json=body, timeout=30) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("event: response.created")
    # the autouse check: the server is healthy and holds no request state


def test_stream_events(stack: FakeStack, client: openai.OpenAI) -> None:
    extra = reply_with(stack, "Sure. " + CALL)
    events = list(
        client.responses.create(
            model="fake-model", input="weather?", tools=[WEATHER], stream=True, extra_body=extra
        )
    )
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    assert [o.type for o in final.output] == ["message", "function_call"]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == final.output[0].content[0].text == "Sure."
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert json.loads(args) == {"city": "Paris"} == json.loads(final.output[1].arguments)
    added = [e.output_index for e in events if e.type == "response.output_item.added"]
    done = [e.output_index for e in events if e.type == "response.output_item.done"]
    assert added == done == [0, 1]


def test_stream_sends_the_text_as_it_is_generated(stack: FakeStack, client) -> None:
    """The worker is asked to stream, and each of its updates becomes a delta (one delta
    holding the whole text at the end is not a stream)."""
    extra = reply_with(stack, "One two three four five six seven.")
    events = list(
        client.responses.create(model="fake-model", input="count", stream=True, extra_body=extra)
    )
    assert list(stack.worker.received.values())[-1].stream
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) >= 5
    assert (
        "".join(deltas) == events[-1].response.output_text == "One two three four five six seven."
    )


def test_stream_helper_accumulates(stack: FakeStack, client: openai.OpenAI) -> None:
    extra = reply_with(stack, CALL)
    with client.responses.stream(
        model="fake-model", input="weather?", tools=[WEATHER], extra_body=extra
    ) as stream:
        for _ in stream:
            pass
        final = stream.get_final_response()
    assert final.output[0].type == "function_call"


# ---------------------------------------------------------------------- stored responses
def test_previous_response_continues_the_conversation(stack: FakeStack, client) -> None:
    extra = reply_with(stack, "First answer.")
    first = client.responses.create(
        model="fake-model", input="First question?", instructions="Old rules.", extra_body=extra
    )
    assert client.responses.retrieve(first.id).output_text == "First answer."
    extra = reply_with(stack, "Second answer.")
    second = client.responses.create(
        model="fake-model",
        input="Second question?",
        previous_response_id=first.id,
        extra_body=extra,
    )
    prompt = last_prompt(stack)
    assert prompt.index("First question?") < prompt.index("First answer.")
    assert prompt.index("First answer.") < prompt.index("Second question?")
    assert "Old rules." not in prompt  # instructions are not carried over
    assert second.previous_response_id == first.id
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(first.id)


def test_input_items_of_a_stored_response(stack: FakeStack, client: openai.OpenAI) -> None:
    items = [
        {"role": "user", "content": "one"},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
    ]
    r = client.responses.create(
        model="fake-model", input=items, tools=[WEATHER], max_output_tokens=2
    )
    listed = client.responses.input_items.list(r.id)
    assert [i.type for i in listed.data] == [
        "function_call_output",
        "function_call",
        "message",
    ]  # newest first by default
    assert listed.has_more is False and listed.first_id == listed.data[0].id
    asc = client.responses.input_items.list(r.id, order="asc", limit=1)
    assert [i.type for i in asc.data] == ["message"] and asc.has_more
    rest = client.responses.input_items.list(r.id, order="asc", after=asc.data[0].id)
    assert [i.type for i in rest.data] == ["function_call", "function_call_output"]
    assert len({i.id for i in listed.data}) == 3  # every item got an id
    plain = client.responses.create(model="fake-model", input="hi", max_output_tokens=2)
    (item,) = client.responses.input_items.list(plain.id).data
    assert item.type == "message" and item.role == "user" and item.content[0].text == "hi"
    bad = httpx.get(f"{stack.url}/v1/responses/{r.id}/input_items?order=sideways", timeout=10)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "order"
    for query in ("limit=abc", "limit=-5", "limit=1000", "after=" + "x" * 5000):
        bad = httpx.get(f"{stack.url}/v1/responses/{r.id}/input_items?{query}", timeout=10)
        assert bad.status_code == 400 and bad.json()["error"]["message"], query
    missing = httpx.get(f"{stack.url}/v1/responses/resp_nope/input_items", timeout=10)
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "response_id"


def test_store_false_keeps_nothing(stack: FakeStack, client: openai.OpenAI) -> None:
    r = client.responses.create(model="fake-model", input="hi", store=False, max_output_tokens=2)
    assert r.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)


def test_response_store_is_bounded() -> None:
    store = ResponseStore(max_items=3, max_bytes=1700)
    for i in range(5):
        store.put({"id": f"r{i}"}, [{"role": "user", "content": "x" * 100}])
    assert len(store) == 3 and store.get("r0") is None and store.get("r4") is not None
    store.put({"id": "big"}, [{"role": "user", "content": "x" * 5000}])  # over the budget
    assert store.get("big") is None
    store.put({"id": "mid"}, [{"role": "user", "content": "x" * 1500}])
    assert store.get("mid") is not None and len(store) == 1  # the others made room
    assert store.delete("mid") and not store.delete("mid") and len(store) == 0


def test_reasoning_effort_none_turns_thinking_off() -> None:
    from radixlm.srt.managers.tokenizer_manager import GenerateError
    from radixlm.srt.server.chat.request import ChatCompletionRequest
    from radixlm.srt.server.chat.tools import template_kwargs

    def kwargs(**fields) -> dict:
        messages = [{"role": "user", "content": "hi"}]
        return template_kwargs(ChatCompletionRequest(messages=messages, **fields))

    assert kwargs(reasoning_effort="none") == {"enable_thinking": False}
    assert kwargs(reasoning_effort="high") == {} == kwargs()
    kept = {"enable_thinking": True}
    assert kwargs(reasoning_effort="none", chat_template_kwargs=kept) == kept
    with pytest.raises(GenerateError) as err:
        kwargs(reasoning_effort="extreme")
    assert err.value.param == "reasoning_effort"
