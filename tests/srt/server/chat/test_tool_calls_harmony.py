"""gpt-oss's harmony format on the OpenAI chat route, through the real HTTP process over
fake_stack's scripted worker (``--tool-call-parser gpt-oss --reasoning-parser gpt-oss``): the
analysis channel in ``reasoning_content``, calls from the commentary channel, the final
channel as content, streamed as whole, special tokens kept in the decoded text, and the
grammar of a forced call after an optional analysis message. Fast: no model runs."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from fake_stack import FakeStack
from tool_util import last_params, reply_with

from radixlm.srt.server.chat.request import ChatCompletionRequest
from radixlm.srt.server.chat.tools import ChatParsing, reads_harmony, template_kwargs

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
THINK = "<|channel|>analysis<|message|>Wants weather.<|end|><|start|>assistant"
CALL = (
    "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
    '{"city": "Paris"}<|call|>'
)
FINAL = "<|channel|>final<|message|>It is sunny.<|return|>"


@pytest.fixture(scope="module")
def stack_options() -> dict:
    return {"tool_call_parser": "gpt-oss", "reasoning_parser": "gpt-oss"}


pytestmark = pytest.mark.usefixtures("idle_stack")  # stack, client: conftest.py


def chat(client: openai.OpenAI, extra: dict, **kw):
    return client.chat.completions.create(
        model="fake-model", messages=USER, max_tokens=220, extra_body=extra, **kw
    )


def test_analysis_is_reasoning_and_final_is_content(
    stack: FakeStack, client: openai.OpenAI
) -> None:
    message = chat(client, reply_with(stack, THINK + FINAL)).choices[0].message
    assert message.content == "It is sunny."
    assert message.model_extra["reasoning_content"] == "Wants weather."
    assert last_params(stack)["skip_special_tokens"] is False  # the channels reach the parser


def test_a_call_after_the_analysis(stack: FakeStack, client: openai.OpenAI) -> None:
    choice = chat(client, reply_with(stack, THINK + CALL), tools=TOOLS).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.model_extra["reasoning_content"] == "Wants weather."
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == {"city": "Paris"}


def test_streamed_equals_whole(stack: FakeStack) -> None:
    text = THINK + "<|channel|>commentary<|message|>Ok.<|end|><|start|>assistant" + CALL
    body = {"messages": USER, "max_tokens": 220, "stream": True, "tools": TOOLS}
    deltas = []
    with httpx.stream(
        "POST", stack.url + "/v1/chat/completions", json={**body, **reply_with(stack, text)}
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                deltas.append(json.loads(line[6:])["choices"][0])
    reasoning = "".join(d["delta"].get("reasoning_content") or "" for d in deltas)
    content = "".join(d["delta"].get("content") or "" for d in deltas)
    calls = [c for d in deltas for c in d["delta"].get("tool_calls") or ()]
    assert reasoning == "Wants weather." and content == "Ok."
    assert calls[0]["function"]["name"] == "get_weather"
    assert json.loads("".join(c["function"]["arguments"] for c in calls)) == {"city": "Paris"}
    assert deltas[-1]["finish_reason"] == "tool_calls"


def test_required_grammar_allows_the_analysis_first(stack: FakeStack) -> None:
    body = {"messages": USER, "max_tokens": 2, "tools": TOOLS, "tool_choice": "required"}
    r = httpx.post(stack.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    tag = last_params(stack)["structural_tag"]
    text = json.dumps(json.loads(tag) if isinstance(tag, str) else tag)
    assert "<|channel|>analysis<|message|>" in text and "to=functions.get_weather" in text


def test_reasoning_effort_reaches_the_harmony_template() -> None:
    def kwargs(effort: str | None, harmony: bool) -> dict:
        req = ChatCompletionRequest(messages=USER, reasoning_effort=effort)
        return template_kwargs(req, harmony)

    assert kwargs("high", True) == {"reasoning_effort": "high"}
    assert kwargs("minimal", True) == {"reasoning_effort": "low"}
    assert kwargs("none", True) == {"enable_thinking": False, "reasoning_effort": "low"}
    assert kwargs(None, True) == {} == kwargs("high", False)
    assert reads_harmony(ChatParsing(tool_parser="gpt-oss"))
    assert reads_harmony(ChatParsing(tool_parser="none", reasoning_parser="openai_gptoss"))
    assert not reads_harmony(ChatParsing(tool_parser="hermes", reasoning_parser="qwen3"))


def test_special_markers_leave_the_grammar_to_the_reply_as_written() -> None:
    """With gpt-oss's own tokenizer the markers are special tokens no grammar writes: harmony
    adds nothing to a constraint, and forced choices are refused."""
    from dataclasses import replace
    from types import SimpleNamespace

    from radixlm.srt.managers.tokenizer_manager import GenerateError
    from radixlm.srt.parsers.tool_base import ToolSpec
    from radixlm.srt.server.chat.tools import check_forced_markers, output_constraint

    strict = ToolSpec("get_weather", None, {"type": "object"}, strict=True)
    base = ChatParsing(
        specs=[strict], choice="auto", tool_parser="gpt-oss", reasoning_parser="gpt-oss"
    )
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}}
    assert "<|channel|>final<|message|>" in json.dumps(output_constraint(base, schema, None))
    assert "to=functions.get_weather" in json.dumps(output_constraint(base, None, None))
    special = replace(base, harmony_special=True)
    assert output_constraint(special, schema, None) == {"json_schema": json.dumps(schema)}
    assert output_constraint(special, None, None) == {}
    gpt_oss_tokenizer = SimpleNamespace(all_special_tokens=["<|channel|>", "<|call|>"])
    check_forced_markers(special, gpt_oss_tokenizer)  # "auto": nothing forced
    with pytest.raises(GenerateError) as err:
        check_forced_markers(replace(special, choice="required"), gpt_oss_tokenizer)
    assert err.value.param == "tool_choice"
