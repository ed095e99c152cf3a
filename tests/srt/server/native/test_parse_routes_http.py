"""SGLang's /parse_function_call, /separate_reasoning, /invocations and the Vertex route over
the real HTTP process (fake_stack's worker: nothing is generated), and the chat route dropping
calls of tools it was not offered, streamed and not. Fast: no model runs."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from fake_stack import FakeStack
from tool_util import reply_with

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}},
]


def hermes_call(name: str, args: dict) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(args)}}}\n</tool_call>'


pytestmark = pytest.mark.usefixtures("idle_stack")  # stack, client: conftest.py


def post(stack: FakeStack, path: str, body: dict) -> httpx.Response:
    return httpx.post(stack.url + path, json=body, timeout=30)


def test_parse_function_call(stack: FakeStack) -> None:
    text = "Checking.\n" + hermes_call("get_time", {"zone": "UTC"}) + hermes_call("nope", {})
    for parser in ("hermes", "qwen25", None):  # None: the server's --tool-call-parser
        body = {"text": text, "tools": TOOLS}
        if parser:
            body["tool_call_parser"] = parser
        r = post(stack, "/parse_function_call", body)
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["normal_text"].strip() == "Checking."
        (call,) = out["calls"]  # "nope" was not offered
        assert call["tool_index"] == 1 and call["name"] == "get_time"
        assert json.loads(call["parameters"]) == {"zone": "UTC"}
    r = post(stack, "/parse_function_call", {"text": "plain", "tools": TOOLS})
    assert r.json() == {"normal_text": "plain", "calls": []}


@pytest.mark.parametrize(
    ("parser", "text"),
    [
        ("qwen3_coder", "<tool_call>\n<function=get_time>\n<parameter=zone>\nUTC\n</parameter>\n"
         "</function>\n</tool_call>"),
        ("mistral", '[TOOL_CALLS] [{"name": "get_time", "arguments": {"zone": "UTC"}}]'),
        ("mistral", '[TOOL_CALLS]get_time[ARGS]{"zone": "UTC"}'),
        ("pythonic", '<|python_start|>[get_time(zone="UTC")]'),
    ],
)  # fmt: skip
def test_parse_function_call_in_the_model_formats(stack: FakeStack, parser, text) -> None:
    body = {"text": "Checking. " + text, "tools": TOOLS, "tool_call_parser": parser}
    out = post(stack, "/parse_function_call", body).json()
    assert out["normal_text"].strip() == "Checking."
    (call,) = out["calls"]
    assert call["name"] == "get_time" and json.loads(call["parameters"]) == {"zone": "UTC"}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"text": "x", "tool_call_parser": "kimi_k2"}, "tool_call_parser"),
        ({"text": "x", "tool_call_parser": "none"}, "tool_call_parser"),
        ({"tools": []}, "text"),
        ({"text": "x", "tools": [{"type": "function", "function": {"name": "a b"}}]}, None),
        ({"text": "x", "tool_parser": "hermes"}, "tool_parser"),
    ],
)
def test_parse_function_call_refusals(stack: FakeStack, body: dict, param: str | None) -> None:
    r = post(stack, "/parse_function_call", body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["message"]
    if param:
        assert param in (error["param"] or "") or param in error["message"]


def test_separate_reasoning(stack: FakeStack) -> None:
    text = "<think>\nweigh it\n</think>\n\nThe answer."
    r = post(stack, "/separate_reasoning", {"text": text, "reasoning_parser": "qwen3"})
    assert r.json() == {"reasoning_text": "weigh it", "text": "The answer."}
    # DeepSeek-R1 outputs start inside the block (the template opened it)
    r = post(
        stack,
        "/separate_reasoning",
        {"text": "weigh it</think>The answer.", "reasoning_parser": "deepseek-r1"},
    )
    assert r.json() == {"reasoning_text": "weigh it", "text": "The answer."}
    r = post(
        stack,
        "/separate_reasoning",
        {"text": text, "reasoning_parser": "qwen3", "return_blocks": True},
    )
    out = r.json()
    assert out["blocks"] == [
        {"type": "reasoning", "text": "weigh it"},
        {"type": "text", "text": "The answer."},
    ]
    assert out["reasoning_blocks"] == ["weigh it"] and out["text_blocks"] == ["The answer."]
    r = post(stack, "/separate_reasoning", {"text": "No block.", "reasoning_parser": "qwen3"})
    assert r.json() == {"reasoning_text": "", "text": "No block."}
    # gpt-oss: the analysis channel is the reasoning, the final channel the text
    harmony = (
        "<|channel|>analysis<|message|>weigh it<|end|><|start|>assistant<|channel|>final"
        "<|message|>The answer."
    )
    r = post(stack, "/separate_reasoning", {"text": harmony, "reasoning_parser": "gpt-oss"})
    assert r.json() == {"reasoning_text": "weigh it", "text": "The answer."}


def test_separate_reasoning_refusals(stack: FakeStack) -> None:
    r = post(stack, "/separate_reasoning", {"text": "x", "reasoning_parser": "glm45"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_parser"
    assert "qwen3" in r.json()["error"]["message"]
    r = post(stack, "/separate_reasoning", {"text": "x"})
    assert r.status_code == 400 and "reasoning_parser" in r.text


@pytest.mark.slow
def test_chat_drops_calls_of_tools_not_offered(stack: FakeStack, client: openai.OpenAI) -> None:
    text = hermes_call("rm_rf", {}) + "\n" + hermes_call("get_weather", {"city": "Rome"})
    extra = reply_with(stack, text)
    kwargs = dict(
        model="fake-model",
        max_tokens=200,
        messages=[{"role": "user", "content": "hi"}],
        tools=TOOLS,
    )
    choice = client.chat.completions.create(**kwargs, extra_body=extra).choices[0]
    assert [c.function.name for c in choice.message.tool_calls] == ["get_weather"]
    assert choice.finish_reason == "tool_calls"
    names, indices = [], set()
    for chunk in client.chat.completions.create(**kwargs, extra_body=extra, stream=True):
        for c in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            indices.add(c.index)
            if c.function and c.function.name:
                names.append(c.function.name)
    assert names == ["get_weather"] and indices == {0}
    only_unknown = reply_with(stack, hermes_call("rm_rf", {}))
    choice = client.chat.completions.create(**kwargs, extra_body=only_unknown).choices[0]
    assert choice.message.tool_calls is None and choice.finish_reason == "stop"


def test_invocations_is_chat_completions(stack: FakeStack) -> None:
    """SageMaker's /invocations answers as /v1/chat/completions (SGLang's alias)."""
    body = {
        "model": "fake-model",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 5,
        "temperature": 0,
    }
    r = post(stack, "/invocations", body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "chat.completion" and out["usage"]["completion_tokens"] == 5
    assert (
        out["choices"][0]["message"]["content"]
        == post(stack, "/v1/chat/completions", body).json()["choices"][0]["message"]["content"]
    )
    bad = post(stack, "/invocations", {"messages": []})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages"


def test_vertex_prediction_route(stack: FakeStack) -> None:
    """Vertex AI's instances/parameters body runs as a /generate batch (SGLang's route)."""
    body = {
        "instances": [{"text": "a"}, {"text": "b b"}],
        "parameters": {"sampling_params": {"max_new_tokens": 3}},
    }
    r = post(stack, "/vertex_generate", body)
    assert r.status_code == 200, r.text
    predictions = r.json()["predictions"]
    assert [p["meta_info"]["completion_tokens"] for p in predictions] == [3, 3]
    ids = post(stack, "/vertex_generate", {"instances": [{"input_ids": [5, 6]}]})
    assert len(ids.json()["predictions"]) == 1
    assert post(stack, "/vertex_generate", {"instances": []}).json() == {"predictions": []}
    for bad, param in [
        ({"instances": "a"}, "instances"),
        ({"instances": [{"image": "x"}]}, "instances"),
        ({"instances": [{"text": "a"}], "parameters": {"stream": True}}, "parameters"),
        ({"instances": [{"text": "a"}], "deployed_model": "x"}, "deployed_model"),
        (
            {"instances": [{"text": "a"}, {"text": "b", "image_data": "x"}]},
            "instances[1].image_data",
        ),
        ({"instances": [{"text": "a"}], "parameters": {"sampling_params": {"bogus": 1}}}, None),
    ]:
        r = post(stack, "/vertex_generate", bad)
        assert r.status_code == 400, (bad, r.text)
        if param:
            assert r.json()["error"]["param"] == param
