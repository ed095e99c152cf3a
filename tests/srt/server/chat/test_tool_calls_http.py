"""Tool calling on /v1/chat/completions through the real HTTP process (app, TokenizerManager,
ZMQ, uvicorn) over fake_stack's worker, which replies with a scripted text: request checks
(every refusal a 400 naming its field), the constraint handed to the sampler, and the shape of
responses and streams as the strict openai client reads them. Fast: no model runs."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from fake_stack import FakeStack
from tool_util import last_params, reply_with

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}},
]
USER = [{"role": "user", "content": "Weather in Paris for 2 days?"}]
CALL_ARGS = {"city": "Paris", "days": 2}
GRAMMAR_PARAMS = ("json_schema", "regex", "ebnf", "structural_tag")


def hermes_call(name: str, args: dict) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(args)}}}\n</tool_call>'


pytestmark = pytest.mark.usefixtures("idle_stack")  # stack, client: conftest.py


def post(stack: FakeStack, body: dict) -> httpx.Response:
    return httpx.post(stack.url + "/v1/chat/completions", json=body, timeout=30)


def error_of(r: httpx.Response) -> dict:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    return err


def chat(client: openai.OpenAI, extra: dict, **kw):
    return client.chat.completions.create(
        model="fake-model", messages=USER, tools=TOOLS, max_tokens=200, extra_body=extra, **kw
    )


# ---------------------------------------------------------------------- request checks
def _tool(name: str = "f", parameters: object = None, kind: str = "function") -> dict:
    fn: dict = {"name": name}
    if parameters is not None:
        fn["parameters"] = parameters
    return {"type": kind, "function": fn}


def _allowed(mode: str, *names: str) -> dict:
    tools = [{"type": "function", "function": {"name": n}} for n in names]
    return {"type": "allowed_tools", "allowed_tools": {"mode": mode, "tools": tools}}


BAD_REQUESTS = [
    ({"tools": [_tool(), _tool()]}, "tools", "unique"),
    (
        {"tools": [_tool()], "tool_choice": {"type": "function", "function": {"name": "g"}}},
        "tool_choice",
        "not one of the tools",
    ),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice", "no tools"),
    ({"tools": [_tool()], "tool_choice": "sometimes"}, "tool_choice", "'sometimes'"),
    ({"tools": [_tool()], "tool_choice": {"type": "custom"}}, "tool_choice", "tool_choice must"),
    (
        {"tools": [_tool()], "tool_choice": _allowed("sometimes", "f")},
        "tool_choice.allowed_tools.mode",
        "'auto' or 'required'",
    ),
    (
        {"tools": [_tool()], "tool_choice": _allowed("auto", "g")},
        "tool_choice.allowed_tools.tools[0]",
        "not one of the tools",
    ),
    ({"tools": [_tool()], "tool_choice": _allowed("auto")}, "tool_choice", "allowed_tools"),
    (
        {"tools": [_tool(parameters={"type": "objekt"})]},
        "tools[0].function.parameters",
        "not a valid JSON schema",
    ),
    (
        {"tools": [_tool(parameters={"type": "string"})]},
        "tools[0].function.parameters",
        "type 'object'",
    ),
    (
        {"tools": [_tool(parameters={"properties": {"a": {"$ref": "#/$defs/Missing"}}})]},
        "tools[0].function.parameters",
        "refers to '#/$defs/Missing'",
    ),
    (
        {"tools": [_tool(parameters={"properties": {"a": {"$ref": "https://example.com/a"}}})]},
        "tools[0].function.parameters",
        "only local references",
    ),
    ({"tools": [_tool(name="get weather")]}, "tools[0].function.name", "letters"),
    ({"tools": [_tool(kind="retrieval")]}, "tools[0].type", "only 'function'"),
    (
        {"tools": [{"type": "function", "function": {"description": "no name"}}]},
        "tools.0.function.name",
        "Field required",
    ),
    ({"functions": [{"name": "f"}]}, "functions", "deprecated"),
    ({"function_call": {"name": "f"}}, "function_call", "deprecated"),
    ({"messages": [{"role": "tool", "content": "42"}]}, "messages[0].tool_call_id", "required"),
    (
        {"messages": [{"role": "tool", "content": "42", "tool_call_id": "call_x"}]},
        "messages[0].tool_call_id",
        "answers no tool call",
    ),
    (
        {
            "messages": [
                {
                    "role": "user",
                    "content": "x",
                    "tool_calls": [
                        {
                            "id": "c",
                            "type": "function",
                            "function": {"name": "f", "arguments": "{}"},
                        }
                    ],
                }
            ]
        },
        "messages[0].tool_calls",
        "only assistant",
    ),
    (
        {"tools": [{"type": "function", "function": {"name": "f", "description": "a<eos>b"}}]},
        "tools[0].function.description",
        "special-token",
    ),
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs", "tools"),
    ({"tools": [_tool()], "tool_choice": "required", "regex": "a+"}, "regex", "cannot be combined"),
    (
        {
            "tools": [_tool()],
            "tool_choice": "required",
            "response_format": {"type": "structural_tag", "structures": [], "triggers": []},
        },
        "response_format",
        "structural_tag",
    ),
]


@pytest.mark.parametrize(("extra", "param", "words"), BAD_REQUESTS)
def test_bad_tool_requests_are_400s_naming_the_field(
    stack: FakeStack, extra: dict, param: str, words: str
) -> None:
    err = error_of(post(stack, {"messages": USER, "max_tokens": 4, **extra}))
    assert err["param"] == param, err
    assert words in err["message"], err


def test_tool_choice_without_tools_that_means_nothing_is_accepted(stack: FakeStack) -> None:
    for extra in ({"tools": [], "tool_choice": "none"}, {"tool_choice": "auto"}):
        r = post(stack, {"messages": USER, "max_tokens": 2, **extra})
        assert r.status_code == 200, r.text
        assert "tool_calls" not in r.json()["choices"][0]["message"]


def test_tools_are_still_refused_on_completions(stack: FakeStack) -> None:
    r = httpx.post(stack.url + "/v1/completions", json={"prompt": "hi", "tools": TOOLS}, timeout=30)
    assert error_of(r)["param"] == "tools"


# ---------------------------------------------------------------------- constraint
def test_required_and_named_choices_constrain_none_does_not(stack: FakeStack) -> None:
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        assert (
            post(
                stack, {"messages": USER, "tools": TOOLS, "tool_choice": choice, "max_tokens": 2}
            ).status_code
            == 200
        )
        grammars = [k for k in GRAMMAR_PARAMS if last_params(stack).get(k) is not None]
        assert len(grammars) == 1, last_params(stack)
    post(stack, {"messages": USER, "tools": TOOLS, "tool_choice": "none", "max_tokens": 2})
    assert all(last_params(stack).get(k) is None for k in GRAMMAR_PARAMS)


def test_named_choice_constraint_names_only_that_tool(stack: FakeStack) -> None:
    choice = {"type": "function", "function": {"name": "get_time"}}
    post(stack, {"messages": USER, "tools": TOOLS, "tool_choice": choice, "max_tokens": 2})
    grammar = next(str(last_params(stack)[k]) for k in GRAMMAR_PARAMS if last_params(stack).get(k))
    assert "get_time" in grammar and "get_weather" not in grammar


def test_allowed_tools_choice_offers_and_constrains_only_those_tools(stack: FakeStack) -> None:
    """OpenAI's allowed_tools: ``required`` constrains to calls of the listed tools only;
    ``auto`` leaves the model free to answer, and a call it starts names a listed tool (the
    prompt lays out only the listed tools; this stack's template shows none). Listing every
    tool is plain ``auto``: no constraint."""
    post(stack, {"messages": USER, "tools": TOOLS, "tool_choice": _allowed("required", "get_time")})
    grammar = next(str(last_params(stack)[k]) for k in GRAMMAR_PARAMS if last_params(stack).get(k))
    assert "get_time" in grammar and "get_weather" not in grammar
    body = {"messages": USER, "tools": TOOLS, "tool_choice": _allowed("auto", "get_weather")}
    extra = reply_with(stack, hermes_call("get_weather", CALL_ARGS))
    r = post(stack, {**body, **extra})
    tag = json.loads(last_params(stack)["structural_tag"])["format"]
    assert tag["type"] == "triggered_tags" and not tag["at_least_one"]
    assert "get_weather" in str(tag["tags"]) and "get_time" not in str(tag["tags"])
    (call,) = r.json()["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    every = _allowed("auto", *(t["function"]["name"] for t in TOOLS))
    post(stack, {"messages": USER, "tools": TOOLS, "tool_choice": every, "max_tokens": 2})
    assert all(last_params(stack).get(k) is None for k in GRAMMAR_PARAMS)


def _stops_after_first_call(stack: FakeStack, body: dict) -> bool:
    assert (
        post(stack, {"messages": USER, "tools": TOOLS, "max_tokens": 2, **body}).status_code == 200
    )
    tag = json.loads(last_params(stack)["structural_tag"])
    return tag["format"]["stop_after_first"]


def test_named_choice_makes_one_call_unless_parallel_is_sent(stack: FakeStack) -> None:
    """A named tool_choice without parallel_tool_calls makes exactly one call (instructor and
    LangChain's structured output read one); parallel_tool_calls sent is obeyed."""
    named = {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    assert _stops_after_first_call(stack, named)
    assert not _stops_after_first_call(stack, {**named, "parallel_tool_calls": True})
    assert _stops_after_first_call(stack, {**named, "parallel_tool_calls": False})
    assert not _stops_after_first_call(stack, {"tool_choice": "required"})
    assert _stops_after_first_call(stack, {"tool_choice": "required", "parallel_tool_calls": False})


def test_response_format_with_tools_is_one_constraint(stack: FakeStack) -> None:
    fmt = {
        "type": "json_schema",
        "json_schema": {
            "name": "a",
            "schema": {"type": "object", "properties": {"answer": {"type": "string"}}},
        },
    }
    body = {"messages": USER, "tools": TOOLS, "tool_choice": "auto", "response_format": fmt}
    assert post(stack, {**body, "max_tokens": 2}).status_code == 200
    params = last_params(stack)
    grammars = [k for k in GRAMMAR_PARAMS if params.get(k) is not None]
    assert len(grammars) == 1 and "answer" in str(params[grammars[0]]), params
    body["tool_choice"] = "none"  # the response format alone
    assert post(stack, {**body, "max_tokens": 2}).status_code == 200
    assert json.loads(last_params(stack)["json_schema"]) == fmt["json_schema"]["schema"]


def test_completions_take_response_format(stack: FakeStack) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    body = {
        "prompt": "hi",
        "max_tokens": 2,
        "response_format": {"type": "json_schema", "json_schema": {"schema": schema}},
    }
    r = httpx.post(stack.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    assert json.loads(last_params(stack)["json_schema"]) == schema


# ---------------------------------------------------------------------- responses
def test_call_becomes_tool_calls_with_null_content(stack: FakeStack, client: openai.OpenAI) -> None:
    extra = reply_with(stack, hermes_call("get_weather", CALL_ARGS))
    r = chat(client, extra, tool_choice="required")
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, WEATHER)
    assert args == CALL_ARGS


def test_text_before_a_call_is_content(stack: FakeStack, client: openai.OpenAI) -> None:
    extra = reply_with(stack, "Let me look.\n" + hermes_call("get_time", {}))
    choice = chat(client, extra).choices[0]
    assert choice.message.content.strip() == "Let me look."
    assert [c.function.name for c in choice.message.tool_calls] == ["get_time"]
    assert choice.finish_reason == "tool_calls"


def test_parallel_calls_get_distinct_ids(stack: FakeStack, client: openai.OpenAI) -> None:
    text = hermes_call("get_weather", CALL_ARGS) + "\n" + hermes_call("get_time", {})
    calls = chat(client, reply_with(stack, text)).choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["get_weather", "get_time"]
    assert len({c.id for c in calls}) == 2


def test_plain_answer_has_no_tool_calls(stack: FakeStack, client: openai.OpenAI) -> None:
    choice = chat(client, reply_with(stack, "It is sunny.")).choices[0]
    assert choice.message.content == "It is sunny." and choice.message.tool_calls is None
    assert choice.finish_reason == "stop"


def test_tool_choice_none_leaves_call_text_as_content(
    stack: FakeStack, client: openai.OpenAI
) -> None:
    text = hermes_call("get_time", {})
    choice = chat(client, reply_with(stack, text), tool_choice="none").choices[0]
    assert choice.message.content == text and choice.message.tool_calls is None
    assert choice.finish_reason == "stop"


def test_call_cut_by_max_tokens_finishes_with_length(
    stack: FakeStack, client: openai.OpenAI
) -> None:
    extra = reply_with(stack, hermes_call("get_weather", CALL_ARGS))
    choice = chat(client, extra, tool_choice="required", max_completion_tokens=6).choices[0]
    assert choice.finish_reason == "length"


def test_history_with_calls_and_results_reaches_the_prompt(
    stack: FakeStack, client: openai.OpenAI
) -> None:
    messages = [
        *USER,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": json.dumps(CALL_ARGS)},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 24C"},
    ]
    r = client.chat.completions.create(
        model="fake-model", messages=messages, tools=TOOLS, tool_choice="none", max_tokens=3
    )
    assert r.choices[0].message.tool_calls is None
    prompt = stack.tokenizer.decode(list(stack.worker.received.values())[-1].input_ids)
    assert "sunny, 24C" in prompt


# ---------------------------------------------------------------------- streams
def sse_events(stack: FakeStack, body: dict) -> list:
    events = []
    with httpx.stream("POST", stack.url + "/v1/chat/completions", json=body, timeout=30) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                data = line[6:]
                events.append(data if data == "[DONE]" else json.loads(data))
    return events


def test_stream_sends_call_deltas_then_finish_usage_done(stack: FakeStack) -> None:
    text = "Sure.\n" + hermes_call("get_weather", CALL_ARGS) + "\n" + hermes_call("get_time", {})
    body = {
        "messages": USER,
        "tools": TOOLS,
        "max_tokens": 200,
        "stream": True,
        "stream_options": {"include_usage": True},
        **reply_with(stack, text),
    }
    events = sse_events(stack, body)
    assert events[-1] == "[DONE]"
    usage, finish = events[-2], events[-3]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] > 0
    assert finish["choices"][0]["finish_reason"] == "tool_calls"
    assert finish["choices"][0]["delta"] == {}
    deltas = [e["choices"][0]["delta"] for e in events[:-3]]
    assert deltas[0]["role"] == "assistant"
    assert all(e["choices"][0]["finish_reason"] is None for e in events[:-3])
    content = "".join(d.get("content") or "" for d in deltas)
    assert content.strip() == "Sure."
    calls: dict[int, dict] = {}
    for d in deltas:
        for tc in d.get("tool_calls") or ():
            if tc["index"] not in calls:  # the first delta of a call names it
                assert tc["id"].startswith("call_") and tc["type"] == "function"
                calls[tc["index"]] = {"name": tc["function"]["name"], "args": ""}
            else:
                assert "id" not in tc and "name" not in tc["function"]
            calls[tc["index"]]["args"] += tc["function"]["arguments"]
    assert [c["name"] for c in calls.values()] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["args"]) == CALL_ARGS and json.loads(calls[1]["args"]) == {}
    last_content = max(i for i, d in enumerate(deltas) if d.get("content"))
    first_call = min(i for i, d in enumerate(deltas) if d.get("tool_calls"))
    assert last_content < first_call


def test_stream_helper_accumulates_the_calls(stack: FakeStack, client: openai.OpenAI) -> None:
    extra = reply_with(stack, hermes_call("get_weather", CALL_ARGS))
    with client.chat.completions.stream(
        model="fake-model",
        messages=USER,
        tools=TOOLS,
        tool_choice="required",
        max_tokens=200,
        extra_body=extra,
    ) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == CALL_ARGS


def test_stream_without_calls_is_plain_content(stack: FakeStack, client: openai.OpenAI) -> None:
    extra = reply_with(stack, "No tools needed here.")
    chunks = list(chat(client, extra, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "No tools needed here."
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert not any(c.choices[0].delta.tool_calls for c in chunks)


def test_each_streamed_choice_has_its_own_parser(stack: FakeStack) -> None:
    text = hermes_call("get_weather", CALL_ARGS)
    body = {
        "messages": USER,
        "tools": TOOLS,
        "max_tokens": 200,
        "stream": True,
        "n": 2,
        **reply_with(stack, text),
    }
    events = [e for e in sse_events(stack, body) if e != "[DONE]"]
    for i in range(2):
        mine = [e["choices"][0] for e in events if e["choices"][0]["index"] == i]
        args = "".join(
            tc["function"]["arguments"] for c in mine for tc in c["delta"].get("tool_calls") or ()
        )
        assert json.loads(args) == CALL_ARGS
        assert mine[-1]["finish_reason"] == "tool_calls"
