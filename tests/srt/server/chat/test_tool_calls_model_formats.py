"""End to end, per tool format: a tiny random Qwen2 over SmolLM2's tokenizer with the chat
template of the qwen3_coder, mistral or pythonic family (format_templates.py), served with
``--tool-call-parser auto``, which must pick that format from the template. A random model
writes a call only because the grammar forces it, so every call here shows the constraint and
the parser working together, streamed and not, and the history going back through the
family's template (Mistral's checks its call ids)."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from format_templates import format_tokenizer
from tool_util import ASK, SCHEMAS, TOOLS, WEATHER, assert_healthy, strict_client

from radixlm.srt.server.process.server_process import ServerProcess

pytestmark = pytest.mark.slow

MARKERS = {"qwen3_coder": "<function=get_", "mistral": "[TOOL_CALLS]", "pythonic": "[get_"}


@pytest.fixture(scope="module", params=sorted(MARKERS))
def fmt(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def server(fmt, tmp_path_factory, default_model_dir, tiny_model_writer):
    """The format's own server (no other module serves its model), stopped when the format's
    tests are done: the session's shared servers stay as they are."""
    path = tiny_model_writer(
        tmp_path_factory.mktemp(f"tiny-{fmt}"),
        format_tokenizer(default_model_dir, fmt),
        architecture="qwen2",
        max_position_embeddings=4096,
    )
    log = tmp_path_factory.mktemp(f"server-{fmt}") / "server.log"
    args = ["--model-path", str(path), "--max-total-tokens", "4096"]
    with ServerProcess(args, log_path=log) as server:
        yield server


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return strict_client(server.url, timeout=120)


@pytest.fixture(autouse=True)
def _healthy(server):
    yield
    assert_healthy(server.url, timeout=30)


def valid_args(call) -> dict:
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, SCHEMAS[call.function.name])
    return args


def check_id(fmt: str, call_id: str) -> None:
    if fmt == "mistral":
        assert len(call_id) == 9 and call_id.isalnum(), call_id
    else:
        assert call_id.startswith("call_"), call_id


def one_call(client: openai.OpenAI, tool_choice="required", **options):
    return client.chat.completions.create(
        model="default",
        messages=ASK,
        tools=TOOLS,
        tool_choice=tool_choice,
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=120,
        **options,
    )


def test_required_forces_a_call_in_the_format(fmt: str, client: openai.OpenAI) -> None:
    r = one_call(client, logprobs=True)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    valid_args(call)
    check_id(fmt, call.id)
    raw = "".join(t.token for t in choice.logprobs.content)
    assert MARKERS[fmt] in raw, raw


def test_streamed_call_equals_the_whole_one(fmt: str, client: openai.OpenAI) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    chunks = list(one_call(client, named, stream=True))
    args, names = {}, {}
    for chunk in chunks:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        assert not delta.content
        for tc in delta.tool_calls or ():
            if tc.index not in names:
                check_id(fmt, tc.id)
                names[tc.index], args[tc.index] = tc.function.name, ""
            args[tc.index] += tc.function.arguments or ""
    assert list(names.values()) == ["get_weather"]
    whole = one_call(client, named).choices[0].message.tool_calls[0]
    assert json.loads(args[0]) == json.loads(whole.function.arguments)
    jsonschema.validate(json.loads(args[0]), WEATHER)


def test_parallel_calls(fmt: str, client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model="default",
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=True,
        n=6,
        temperature=1.0,
        seed=5,
        max_tokens=240,
    )
    counts = []
    for choice in r.choices:
        if choice.finish_reason == "length":
            continue
        assert choice.finish_reason == "tool_calls"
        for call in choice.message.tool_calls:
            valid_args(call)
        counts.append(len(choice.message.tool_calls))
    assert counts and max(counts) >= 2, counts


def test_tool_loop_through_the_template(fmt: str, client: openai.OpenAI) -> None:
    first = one_call(client, {"type": "function", "function": {"name": "get_weather"}})
    (call,) = first.choices[0].message.tool_calls
    args = valid_args(call)
    messages = [
        *ASK,
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": f"sunny in {args['city']}"},
    ]
    second, alone = (
        client.chat.completions.create(
            model="default", messages=m, tools=TOOLS, tool_choice="none", max_tokens=8
        )
        for m in (messages, ASK)
    )
    assert second.choices[0].message.tool_calls is None
    assert second.usage.prompt_tokens > alone.usage.prompt_tokens + 8
