"""End to end: a Qwen2.5-style (hermes) chat template on a tiny random Qwen2 (tool_models.py).
``--tool-call-parser auto`` reads ``<tool_call>`` in the template and picks the hermes parser; a
random model writes a call only because the grammar forces the ``<tool_call>`` block, so every
call here shows the constraint and the hermes parser working together, streamed and not."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from tool_models import hermes_tokenizer
from tool_util import assert_healthy, strict_client

from radixlm.srt.server.process.server_process import ServerProcess

pytestmark = pytest.mark.slow

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome", "Tokyo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
                "required": ["zone"],
                "additionalProperties": False,
            },
        },
    },
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
MODEL = "tiny-qwen"


@pytest.fixture(scope="module")
def server(start_server, tmp_path_factory, default_model_dir, tiny_model_writer) -> ServerProcess:
    path = tiny_model_writer(
        tmp_path_factory.mktemp("tiny-qwen2"),
        hermes_tokenizer(default_model_dir),
        architecture="qwen2",
        max_position_embeddings=4096,
    )
    return start_server(
        "--model-path", path, "--served-model-name", MODEL, "--max-total-tokens", 4096
    )


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return strict_client(server.url, timeout=120)


@pytest.fixture(autouse=True)
def _healthy(server: ServerProcess):
    yield
    assert_healthy(server.url, timeout=30)


def valid_args(call) -> dict:
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, SCHEMAS[call.function.name])
    return args


def raw_text(choice) -> str:
    return "".join(t.token for t in choice.logprobs.content)


def one_call(client: openai.OpenAI, tool_choice: str | dict = "required", **options):
    """A greedy request for exactly one call to ASK (``options``: more request fields)."""
    return client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        tool_choice=tool_choice,
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=60,
        **options,
    )


def test_required_forces_a_tool_call_block(client: openai.OpenAI) -> None:
    r = one_call(client, logprobs=True)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    valid_args(call)
    text = raw_text(choice)
    assert text.lstrip().startswith("<tool_call>") and "</tool_call>" in text, text


def test_streamed_hermes_calls(client: openai.OpenAI) -> None:
    choice = {"type": "function", "function": {"name": "get_weather"}}
    stream = one_call(client, choice, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[-1].usage is not None and chunks[-1].choices == []
    finish = chunks[-2].choices[0]
    assert finish.finish_reason == "tool_calls"
    args, names = {}, {}
    for c in chunks[:-2]:
        delta = c.choices[0].delta
        assert not delta.content  # a forced call: no content at all
        for tc in delta.tool_calls or ():
            if tc.index not in names:
                assert tc.id.startswith("call_") and tc.type == "function"
                names[tc.index] = tc.function.name
                args[tc.index] = ""
            args[tc.index] += tc.function.arguments or ""
    assert list(names.values()) == ["get_weather"]
    jsonschema.validate(json.loads(args[0]), WEATHER)
    same = one_call(client, choice)
    assert json.loads(same.choices[0].message.tool_calls[0].function.arguments) == json.loads(
        args[0]
    )


def call_counts(client: openai.OpenAI, parallel: bool) -> list[int]:
    r = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=parallel,
        n=8,
        temperature=1.0,
        seed=3,
        max_tokens=200,
    )
    counts = []
    for choice in r.choices:
        if choice.finish_reason == "length":
            continue
        assert choice.finish_reason == "tool_calls"
        for call in choice.message.tool_calls:
            valid_args(call)
        counts.append(len(choice.message.tool_calls))
    assert counts
    return counts


def test_parallel_tool_calls(client: openai.OpenAI) -> None:
    assert set(call_counts(client, parallel=False)) == {1}
    assert max(call_counts(client, parallel=True)) >= 2


def test_tool_loop_on_the_hermes_template(client: openai.OpenAI) -> None:
    first = one_call(client)
    (call,) = first.choices[0].message.tool_calls
    args = valid_args(call)
    messages = [
        *ASK,
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": f"sunny in {args.get('city')}"},
    ]
    second, alone = (
        client.chat.completions.create(
            model=MODEL, messages=m, tools=TOOLS, tool_choice="none", temperature=0, max_tokens=8
        )
        for m in (messages, ASK)
    )
    assert second.choices[0].message.tool_calls is None
    assert isinstance(second.choices[0].message.content, str)
    # the call and its result are in the prompt: the call's JSON and the result's text
    extra = len(call.function.arguments) // 4 + 4
    assert second.usage.prompt_tokens > alone.usage.prompt_tokens + extra


def test_anthropic_client_gets_tool_use_blocks(server: ServerProcess) -> None:
    """Anthropic's Messages API on the same server: ``any`` forces a call, its ``input`` fits
    the tool's schema, streamed and not; the answer to it goes back as a tool_result."""
    import anthropic

    claude = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    tools = [
        {"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in TOOLS
    ]
    kwargs = dict(
        model=MODEL,
        max_tokens=60,
        messages=ASK,
        tools=tools,
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        extra_body={"temperature": 0},
    )
    msg = claude.messages.create(**kwargs)
    (call,) = [b for b in msg.content if b.type == "tool_use"]
    jsonschema.validate(call.input, SCHEMAS[call.name])
    assert msg.stop_reason == "tool_use"
    with claude.messages.stream(**kwargs) as stream:
        final = stream.get_final_message()
    assert [b.input for b in final.content if b.type == "tool_use"] == [call.input]
    follow = claude.messages.create(
        model=MODEL,
        max_tokens=8,
        tools=tools,
        messages=ASK
        + [
            {"role": "assistant", "content": [call.model_dump()]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "sunny"}],
            },
        ],  # fmt: skip
    )
    assert follow.usage.output_tokens > 0
