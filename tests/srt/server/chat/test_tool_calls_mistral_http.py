"""The mistral parser on the chat route over fake_stack's scripted worker: the calls' markup
is special tokens, so requests with tools keep special tokens in the decoded text unless the
request says otherwise, and calls get Mistral's ids (9 letters and digits), streamed and not.
Fast: no model runs."""

from __future__ import annotations

import json

import openai
import pytest
from fake_stack import FakeStack
from tool_util import last_params, reply_with

TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
USER = [{"role": "user", "content": "Time?"}]
CALL = '[TOOL_CALLS] [{"name": "get_time", "arguments": {"zone": "UTC"}}]'

pytestmark = pytest.mark.usefixtures("idle_stack")  # stack, client: conftest.py


@pytest.fixture(scope="module")
def stack_options() -> dict:
    return {"tool_call_parser": "mistral"}


def is_mistral_id(call_id: str) -> bool:
    return len(call_id) == 9 and call_id.isalnum()


def test_special_tokens_are_kept_for_the_calls(stack: FakeStack, client: openai.OpenAI) -> None:
    extra = reply_with(stack, CALL)
    client.chat.completions.create(model="fake-model", messages=USER, tools=TOOLS, extra_body=extra)
    assert last_params(stack)["skip_special_tokens"] is False
    sent = {**extra, "skip_special_tokens": True}  # the request's own choice stands
    client.chat.completions.create(model="fake-model", messages=USER, tools=TOOLS, extra_body=sent)
    assert last_params(stack)["skip_special_tokens"] is True
    client.chat.completions.create(model="fake-model", messages=USER, extra_body=extra)  # no tools
    assert last_params(stack).get("skip_special_tokens", True) is True


def test_calls_get_mistral_ids(stack: FakeStack, client: openai.OpenAI) -> None:
    extra = reply_with(stack, CALL)
    r = client.chat.completions.create(
        model="fake-model", messages=USER, tools=TOOLS, extra_body=extra
    )
    (call,) = r.choices[0].message.tool_calls
    assert is_mistral_id(call.id) and json.loads(call.function.arguments) == {"zone": "UTC"}
    chunks = client.chat.completions.create(
        model="fake-model",
        messages=USER,
        tools=TOOLS,
        extra_body=reply_with(stack, CALL),
        stream=True,
    )
    ids = [
        tc.id for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or () if tc.id
    ]
    assert len(ids) == 1 and is_mistral_id(ids[0])


def test_forcing_calls_whose_marker_is_a_special_token_is_a_clear_400() -> None:
    from dataclasses import replace
    from types import SimpleNamespace

    from radixlm.srt.managers.tokenizer_manager import GenerateError
    from radixlm.srt.parsers.tool_base import ToolSpec
    from radixlm.srt.server.chat.tools import ChatParsing, check_forced_markers

    parsing = ChatParsing(specs=[ToolSpec("get_time")], choice="required", tool_parser="mistral")
    mistral_like = SimpleNamespace(all_special_tokens=["</s>", "[TOOL_CALLS]"])
    with pytest.raises(GenerateError, match=r"\[TOOL_CALLS\] is a special token") as refused:
        check_forced_markers(parsing, mistral_like)
    assert refused.value.status_code == 400 and refused.value.param == "tool_choice"
    check_forced_markers(replace(parsing, choice="auto"), mistral_like)  # nothing forced
    check_forced_markers(parsing, SimpleNamespace(all_special_tokens=["</s>"]))  # plain text
    check_forced_markers(replace(parsing, tool_parser="hermes"), mistral_like)
