"""End to end: tool calling on `radixlm serve` with the default model (SmolLM2-135M-Instruct,
whose template has no tool format: the generic JSON parser, constrained whenever tools are
offered), driven by the strict openai client. Every call's arguments are checked against its
tool's schema with jsonschema."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field
from tool_util import assert_healthy, strict_client

from radixlm.srt.server.process.server_process import ServerProcess

pytestmark = pytest.mark.slow

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"timezone": {"type": "string", "maxLength": 20}},
    "required": ["timezone"],
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city.",
            "parameters": WEATHER,
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The current time in a timezone.",
            "parameters": TIME,
        },
    },
]
# strict tools (under the default model's generic format every tool's arguments are constrained)
STRICT_TOOLS = [{**t, "function": {**t["function"], "strict": True}} for t in TOOLS]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
GREEDY = {"temperature": 0, "max_tokens": 64}


@pytest.fixture(scope="module")
def server(default_server) -> ServerProcess:
    return default_server


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return strict_client(server.url, timeout=120)


@pytest.fixture(autouse=True)
def _healthy(server: ServerProcess):
    yield
    assert_healthy(server.url, timeout=30)


def check_calls(calls, names: set[str] | None = None) -> list[dict]:
    """Each call is well formed, names an offered tool and its arguments match its schema."""
    assert calls, "no tool calls"
    out = []
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in (names or SCHEMAS)
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, SCHEMAS[call.function.name])
        out.append(args)
    assert len({c.id for c in calls}) == len(calls)
    return out


def test_required_makes_valid_calls(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model="default", messages=ASK, tools=TOOLS, tool_choice="required", **GREEDY
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    check_calls(choice.message.tool_calls)


def test_named_choice_calls_that_tool(client: openai.OpenAI) -> None:
    choice = {"type": "function", "function": {"name": "get_time"}}
    r = client.chat.completions.create(
        model="default", messages=ASK, tools=TOOLS, tool_choice=choice, **GREEDY
    )
    assert r.choices[0].finish_reason == "tool_calls"
    check_calls(r.choices[0].message.tool_calls, {"get_time"})


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_streamed_calls_match_the_schema(client: openai.OpenAI, choice) -> None:
    with client.chat.completions.stream(
        model="default", messages=ASK, tools=TOOLS, tool_choice=choice, **GREEDY
    ) as stream:
        chunks = [event.chunk for event in stream if event.type == "chunk"]
        final = stream.get_final_completion()
    deltas = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or ()]
    firsts = {}
    for tc in deltas:
        assert tc.index is not None
        if tc.index not in firsts:
            firsts[tc.index] = tc
            assert tc.id and tc.type == "function" and tc.function.name
        else:
            assert tc.id is None and tc.function.name is None
    assert [c for c in chunks if c.choices][-1].choices[0].finish_reason == "tool_calls"
    args = check_calls(final.choices[0].message.tool_calls)
    assert len(firsts) == len(args)
    # the streamed calls are the ones a non-streamed request makes
    once = client.chat.completions.create(
        model="default", messages=ASK, tools=TOOLS, tool_choice=choice, **GREEDY
    )
    assert check_calls(once.choices[0].message.tool_calls) == args


def test_parallel_tool_calls_false_makes_exactly_one(client: openai.OpenAI) -> None:
    ask = [{"role": "user", "content": "Weather in Paris, and in Rome, and the time in Tokyo?"}]
    for parallel in (False, True):
        r = client.chat.completions.create(
            model="default",
            messages=ask,
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=parallel,
            **{**GREEDY, "max_tokens": 160},
        )
        calls = r.choices[0].message.tool_calls
        check_calls(calls)
        if not parallel:
            assert len(calls) == 1


def get_weather(city: str, unit: str) -> str:
    return json.dumps({"city": city, "temperature": 21 if unit == "celsius" else 70, "unit": unit})


@pytest.mark.parametrize("second_choice", ["none", "auto"])
def test_tool_loop_call_run_answer(client: openai.OpenAI, second_choice: str) -> None:
    messages: list = [
        {"role": "system", "content": "You answer weather questions with the tools."},
        *ASK,
    ]
    first = client.chat.completions.create(
        model="default",
        messages=messages,
        tools=TOOLS[:1],
        tool_choice="required",
        parallel_tool_calls=False,
        **GREEDY,
    )
    (call,) = first.choices[0].message.tool_calls
    result = get_weather(**json.loads(call.function.arguments))
    messages.append(first.choices[0].message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    second = client.chat.completions.create(
        model="default",
        messages=messages,
        tools=STRICT_TOOLS[:1],
        tool_choice=second_choice,
        **GREEDY,
    )
    choice = second.choices[0]
    if second_choice == "auto" and choice.message.tool_calls:  # another call may follow
        check_calls(choice.message.tool_calls)
        assert choice.finish_reason == "tool_calls"
        return
    assert choice.message.tool_calls is None
    assert choice.finish_reason in ("stop", "length")
    answer = choice.message.content
    assert answer and "tool_calls" not in answer, answer  # an answer, not a call written out


def _function(name: str, description: str, parameters: dict) -> dict:
    return {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": parameters},
    }


AUTO_TOOLS = [  # non-strict
    _function(
        "get_weather",
        "The current weather in a city.",
        {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    ),
    _function(
        "search_web",
        "Search the web.",
        {
            "type": "object",
            "properties": {
                "query": {"type": "string"},
                "max_results": {"type": "integer", "minimum": 1, "maximum": 10},
            },
            "required": ["query"],
        },
    ),
]
AUTO_QUESTIONS = [
    "Search the web for the latest news on Mars.",
    "Look up who won the 2018 world cup.",
    "Weather for Rome please.",
]


def test_auto_calls_follow_non_strict_schemas(client: openai.OpenAI) -> None:
    """Under "auto" the default model's calls of non-strict tools have schema-valid arguments
    (left free, it wrote the tool's schema itself back as its arguments)."""
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in AUTO_TOOLS}
    made = 0
    for question in AUTO_QUESTIONS:
        r = client.chat.completions.create(
            model="default",
            messages=[{"role": "user", "content": question}],
            tools=AUTO_TOOLS,
            tool_choice="auto",
            parallel_tool_calls=False,
            temperature=0,
            max_tokens=96,
        )
        choice = r.choices[0]
        if choice.message.tool_calls and choice.finish_reason == "tool_calls":
            (call,) = choice.message.tool_calls
            args = json.loads(call.function.arguments)
            jsonschema.validate(
                args, {**schemas[call.function.name], "additionalProperties": False}
            )
            made += 1
    assert made >= 2, "the model made (almost) no calls: the check checked nothing"


ANSWER = {
    "type": "object",
    "properties": {"answer": {"type": "string", "maxLength": 60}},
    "required": ["answer"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("choice", ["auto", "none", "required"])
def test_tools_with_response_format(client: openai.OpenAI, choice: str) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}}
    r = client.chat.completions.create(
        model="default",
        messages=ASK,
        tools=STRICT_TOOLS,
        tool_choice=choice,
        parallel_tool_calls=False,  # one call: the reply fits max_tokens
        response_format=fmt,
        **GREEDY,
    )
    message = r.choices[0].message
    if message.tool_calls:
        assert choice != "none"
        check_calls(message.tool_calls)
        assert message.content is None and r.choices[0].finish_reason == "tool_calls"
    else:
        assert choice != "required"
        jsonschema.validate(json.loads(message.content), ANSWER)
        assert r.choices[0].finish_reason == "stop"


def test_without_tool_calls_content_is_text(client: openai.OpenAI) -> None:
    for extra in ({}, {"tools": TOOLS, "tool_choice": "none"}):
        r = client.chat.completions.create(model="default", messages=ASK, **GREEDY, **extra)
        choice = r.choices[0]
        assert choice.message.tool_calls is None
        assert isinstance(choice.message.content, str) and choice.message.content
        assert choice.finish_reason in ("stop", "length")


class Weather(BaseModel):
    """The current weather in a city."""

    city: str = Field(max_length=20)
    unit: str = Field(pattern="^(celsius|fahrenheit)$")


def test_parse_with_a_pydantic_tool(client: openai.OpenAI) -> None:
    r = client.chat.completions.parse(
        model="default",
        messages=ASK,
        tools=[openai.pydantic_function_tool(Weather)],
        tool_choice="required",
        **GREEDY,
    )
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "Weather"
    assert isinstance(call.function.parsed_arguments, Weather)
    assert r.choices[0].finish_reason == "tool_calls"


CITY_TOOL = _function(
    "get_weather",
    "The current weather in a city.",
    {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
)


def _reply(message_or_delta) -> tuple[str, list[tuple[str, str]]]:
    calls = message_or_delta.tool_calls or ()
    return message_or_delta.content or "", [(c.function.name, c.function.arguments) for c in calls]


def _streamed_reply(client: openai.OpenAI, **request) -> tuple[str, list, str | None]:
    """Content, calls (name, arguments) and finish reason of a streamed request, from its
    deltas added up."""
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **request):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for tc in choice.delta.tool_calls or ():
                name, arguments = calls.get(tc.index, ("", ""))
                if tc.function is not None:
                    name += tc.function.name or ""
                    arguments += tc.function.arguments or ""
                calls[tc.index] = (name, arguments)
            finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


# where max_tokens cuts the default model's replies (inside the wrapper, the name, the arguments)
CUTS = {"required": (2, 4, 10, 15, 20, 22), "auto": (2, 4, 10)}


@pytest.mark.parametrize("choice", ["required", "auto"])
def test_replies_cut_by_max_tokens(client: openai.OpenAI, choice: str) -> None:
    """The reply cut by max_tokens (at a few lengths and one token short of the whole; the
    parser tests cut at every character): its JSON wrapper is never content; a call whose name
    is complete has exactly the arguments written so far (nothing closed into valid JSON); a
    cut answer is a prefix of the whole one; streamed and plain agree."""
    request = {
        "model": "default",
        "messages": ASK,
        "tools": [CITY_TOOL],
        "tool_choice": choice,
        "temperature": 0,
    }
    whole = client.chat.completions.create(**request, max_tokens=64)
    assert whole.choices[0].finish_reason in ("stop", "tool_calls")
    whole_content, whole_calls = _reply(whole.choices[0].message)
    unfinished = 0  # cuts that left a call's arguments part-written (not valid JSON)
    num_tokens = whole.usage.completion_tokens
    for max_tokens in sorted({*(n for n in CUTS[choice] if n < num_tokens), num_tokens - 1}):
        r = client.chat.completions.create(**request, max_tokens=max_tokens)
        assert r.choices[0].finish_reason == "length"
        content, calls = _reply(r.choices[0].message)
        assert whole_content.startswith(content), (max_tokens, content)
        assert '"tool_calls"' not in content and '{"content"' not in content, content
        assert len(calls) <= len(whole_calls)
        written = whole_calls[: len(calls)]
        assert calls[:-1] == written[:-1], max_tokens  # only the last call can be cut off
        if calls:
            (name, arguments), (whole_name, whole_arguments) = calls[-1], written[-1]
            assert name == whole_name and whole_arguments.startswith(arguments), max_tokens
            unfinished += arguments != whole_arguments
        assert _streamed_reply(client, **request, max_tokens=max_tokens) == (
            content,
            calls,
            "length",
        )
    if whole_calls:
        assert unfinished, "no cut fell inside the arguments: the check checked nothing"
