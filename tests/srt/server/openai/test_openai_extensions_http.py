"""The OpenAI routes and the fields clients send beyond OpenAI's core: nulls meaning the default,
SGLang's and vLLM's extensions (implemented, or a 400 naming them, never dropped silently),
``stream_options`` (``continuous_usage_stats``; refused without ``stream``) and a request refused
before its first token answering an HTTP error even when streamed. Fast tests over the fake stack;
the last ones run the default model (`slow`)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest
from fake_stack import CONTINUATION, FakeStack
from tool_util import assert_server_idle

MESSAGES = [{"role": "user", "content": "hi"}]
CHAT = {"model": "fake-model", "messages": MESSAGES, "max_tokens": 3}
COMPLETION = {"model": "fake-model", "prompt": "hi", "max_tokens": 3}


def post(url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=60)


def error_of(r: httpx.Response) -> dict[str, Any]:
    assert r.status_code == 400, r.text
    return r.json()["error"]


def received_by(stack: FakeStack, path: str, body: dict[str, Any]):
    """Posts ``body``; the one message the fake worker received for it."""
    before = set(stack.worker.received)
    r = post(stack.url, path, body)
    assert r.status_code == 200, r.text
    (rid,) = set(stack.worker.received) - before
    return r, stack.worker.received[rid]


def stream_events(url: str, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    events = []
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line[6:]))
    return events


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/chat/completions", {**CHAT, "n": None, "logprobs": None, "stream": None}),
        ("/v1/chat/completions", {**CHAT, "parallel_tool_calls": None, "top_logprobs": None}),
        ("/v1/completions", {**COMPLETION, "echo": None, "n": None, "stream": None}),
    ],
)
def test_null_means_the_default(idle_stack: FakeStack, path, body) -> None:
    r = post(idle_stack.url, path, body)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 1


def test_openai_client_sending_explicit_nones(idle_stack: FakeStack) -> None:
    client = openai.OpenAI(base_url=idle_stack.url + "/v1", api_key="x", max_retries=0)
    out = client.chat.completions.create(
        model="fake-model", messages=MESSAGES, max_tokens=3, n=None, logprobs=None, stream=None
    )
    assert out.choices[0].message.content


@pytest.mark.parametrize(
    "field, value",
    [
        ("moderation", {"model": "omni-moderation-latest"}),
        ("lora_path", "adapter"),
        ("return_hidden_states", True),
        ("bad_words", ["x"]),
        ("allowed_token_ids", [1, 2]),
        ("prompt_logprobs", 1),
        ("truncate_prompt_tokens", 10),
        ("use_beam_search", True),
        ("chat_template", "{{ messages }}"),
        ("echo", True),
        ("return_token_ids", True),
        ("thinking", {"type": "enabled"}),
        ("stream_reasoning", False),
    ],
)
def test_extensions_not_implemented_are_400s_naming_them(idle_stack, field, value) -> None:
    err = error_of(post(idle_stack.url, "/v1/chat/completions", {**CHAT, field: value}))
    assert err["param"] == field and err["code"] == "unsupported_parameter"


@pytest.mark.parametrize(
    "field, value",
    [
        ("lora_path", None),
        ("priority", 0),
        ("priority", 3),  # ordering only with --enable-priority-scheduling; else ignored
        ("echo", False),
        ("return_hidden_states", False),
        ("user", "u1"),
        ("session_id", "s"),
        ("request_id", "r"),
        ("stream_reasoning", True),
        ("sampling_logprobs_mode", "selected"),
        ("cache_salt", "tenant"),  # implemented (tests/srt/scheduler/test_cache_salt.py)
        ("cache_salt", ""),
    ],
)
def test_extensions_at_their_off_values_or_labels_pass(idle_stack, field, value) -> None:
    assert post(idle_stack.url, "/v1/chat/completions", {**CHAT, field: value}).status_code == 200


def test_completions_refuse_extensions_too(idle_stack: FakeStack) -> None:
    for field, value in [("lora_path", "a"), ("moderation", {}), ("prompt_logprobs", 2)]:
        err = error_of(post(idle_stack.url, "/v1/completions", {**COMPLETION, field: value}))
        assert err["param"] == field


def test_include_stop_str_in_output_is_no_stop_trim(idle_stack: FakeStack) -> None:
    for path, base in (("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)):
        body = {**base, "stop": ["!"], "max_tokens": 8, "include_stop_str_in_output": True}
        r, msg = received_by(idle_stack, path, body)
        assert msg.sampling_params["no_stop_trim"] is True
        choice = r.json()["choices"][0]
        text = choice.get("text", (choice.get("message") or {}).get("content"))
        assert text == "Hello world!"  # the stop string kept
    err = error_of(
        post(
            idle_stack.url,
            "/v1/chat/completions",
            {**CHAT, "include_stop_str_in_output": True, "no_stop_trim": False},
        )
    )
    assert err["param"] == "include_stop_str_in_output"


def test_stream_options_need_stream(idle_stack: FakeStack) -> None:
    body = {**CHAT, "stream_options": {"include_usage": True}}
    assert error_of(post(idle_stack.url, "/v1/chat/completions", body))["param"] == (
        "stream_options"
    )
    body = {**COMPLETION, "stream": False, "stream_options": {"include_usage": True}}
    assert error_of(post(idle_stack.url, "/v1/completions", body))["param"] == "stream_options"


@pytest.mark.parametrize(
    "path, base", [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)]
)
def test_continuous_usage_stats(idle_stack: FakeStack, path, base) -> None:
    options = {"include_usage": True, "continuous_usage_stats": True}
    events = stream_events(idle_stack.url, path, {**base, "n": 2, "stream_options": options})
    *chunks, final = events
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 6
    for chunk in chunks:
        usage = chunk["usage"]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        assert 0 <= usage["completion_tokens"] <= 3
    assert {c["usage"]["completion_tokens"] for c in chunks} >= {3}
    plain = stream_events(idle_stack.url, path, {**base, "stream_options": {"include_usage": True}})
    assert all(e["usage"] is None for e in plain[:-1])


def test_continue_final_message_renders_the_last_message_open(idle_stack: FakeStack) -> None:
    tok, path = idle_stack.tokenizer, "/v1/chat/completions"
    messages = [*MESSAGES, {"role": "assistant", "content": "Hello wor"}]
    body = {**CHAT, "messages": messages, "continue_final_message": True}
    body["add_generation_prompt"] = False
    _, msg = received_by(idle_stack, path, body)
    prompt = tok.decode(msg.input_ids)
    assert prompt.endswith("<|assistant|>Hello wor"), prompt  # no end of turn, no new header
    _, msg = received_by(idle_stack, path, {**CHAT, "add_generation_prompt": False})
    assert not tok.decode(msg.input_ids).endswith("<|assistant|>")
    _, msg = received_by(idle_stack, path, CHAT)
    assert tok.decode(msg.input_ids).endswith("<|assistant|>")
    err = error_of(post(idle_stack.url, path, {**body, "messages": MESSAGES}))
    assert err["param"] == "continue_final_message"
    both = {**body, "add_generation_prompt": True}
    assert error_of(post(idle_stack.url, "/v1/chat/completions", both))["param"] == (
        "add_generation_prompt"
    )


def test_reasoning_effort_max_is_accepted(idle_stack: FakeStack) -> None:
    r = post(idle_stack.url, "/v1/chat/completions", {**CHAT, "reasoning_effort": "max"})
    assert r.status_code == 200, r.text


# ---------------------------------------------------------------------- the default model
BAD_SCHEMA = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}


@pytest.mark.slow
@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/chat/completions", {"messages": MESSAGES, "response_format": BAD_SCHEMA}),
        ("/v1/chat/completions", {"messages": MESSAGES, "ebnf": "root ::= undefined_rule"}),
        ("/v1/completions", {"prompt": "hi", "ebnf": "root ::= undefined_rule"}),
    ],
)
def test_a_grammar_that_fails_is_a_400_streamed_too(idle_server, path, body) -> None:
    body = {"model": "default", "max_tokens": 4, **body}
    plain = post(idle_server.url, path, body)
    streamed = post(idle_server.url, path, {**body, "stream": True})
    assert plain.status_code == streamed.status_code == 400, streamed.text
    assert streamed.headers["content-type"].startswith("application/json")
    assert streamed.json()["error"]["message"] == plain.json()["error"]["message"]
    client = openai.OpenAI(base_url=idle_server.url + "/v1", api_key="x", max_retries=0)
    if path == "/v1/chat/completions":
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(
                model="default",
                max_tokens=4,
                stream=True,
                **{k: v for k, v in body.items() if k in ("messages", "response_format")},
                extra_body={k: v for k, v in body.items() if k == "ebnf"},
            )
    assert_server_idle(idle_server.url)


@pytest.mark.slow
def test_continue_final_message_on_the_default_model(idle_server) -> None:
    messages = [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "The capital of France is"},
    ]
    body = {"model": "default", "messages": messages, "max_tokens": 4, "temperature": 0}
    r = post(idle_server.url, "/v1/chat/completions", {**body, "continue_final_message": True})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"].lstrip().startswith("Paris")


def test_continuation_text_is_what_the_fake_worker_sends() -> None:
    assert CONTINUATION.startswith("Hello world!")  # the stop tests above rely on it


def test_assistant_refusal_part_is_history(idle_stack: FakeStack) -> None:
    said = {"role": "assistant", "content": [{"type": "refusal", "refusal": "I can't help."}]}
    body = {**CHAT, "messages": [*MESSAGES, said, {"role": "user", "content": "ok"}]}
    _, msg = received_by(idle_stack, "/v1/chat/completions", body)
    assert "<|assistant|>I can't help.\n" in idle_stack.tokenizer.decode(msg.input_ids)
    user_refusal = {"role": "user", "content": [{"type": "refusal", "refusal": "x"}]}
    err = error_of(
        post(idle_stack.url, "/v1/chat/completions", {**CHAT, "messages": [user_refusal]})
    )
    assert err["param"] == "messages"


def test_errors_name_the_openai_fields(idle_stack: FakeStack) -> None:
    chat = "/v1/chat/completions"
    err = error_of(post(idle_stack.url, chat, {**CHAT, "max_tokens": 9000}))
    assert err["param"] == "max_tokens" and "max_tokens" in err["message"]
    err = error_of(post(idle_stack.url, chat, {**CHAT, "max_completion_tokens": 9000}))
    assert err["param"] == "max_completion_tokens"
    err = error_of(post(idle_stack.url, "/v1/completions", {**COMPLETION, "max_tokens": 9000}))
    assert err["param"] == "max_tokens"
    long_prompt = {**COMPLETION, "prompt": "hi " * 400, "max_tokens": 1}
    assert error_of(post(idle_stack.url, "/v1/completions", long_prompt))["param"] == "prompt"
    long_chat = {**CHAT, "messages": [{"role": "user", "content": "hi " * 400}], "max_tokens": 1}
    assert error_of(post(idle_stack.url, chat, long_chat))["param"] == "messages"


def test_model_card_root_is_not_a_cache_path(idle_stack: FakeStack) -> None:
    card = httpx.get(idle_stack.url + "/v1/models").json()["data"][0]
    assert card["root"] == "/models/fake-model"  # the path the operator gave


def test_a_cache_salt_too_long_is_a_400_naming_it(idle_stack: FakeStack) -> None:
    for route, body in [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)]:
        err = error_of(post(idle_stack.url, route, {**body, "cache_salt": "s" * 257}))
        assert err["param"] == "cache_salt", err


def test_the_routing_key_reaches_the_scheduler_from_the_header_and_the_body(
    idle_stack: FakeStack,
) -> None:
    """SGLang's ``x-smg-routing-key`` header on the OpenAI and Anthropic routes, its
    ``routing_key`` field on ``/generate``: the scheduler's message carries it
    (``--schedule-policy routing-key``)."""
    received = idle_stack.worker.received
    key = {"x-smg-routing-key": "conv-1"}
    responses = {"model": "fake-model", "input": "hi", "max_output_tokens": 3}
    messages = {**CHAT, "max_tokens": 3}
    for path, body, headers in [
        ("/v1/chat/completions", CHAT, key),
        ("/v1/completions", COMPLETION, key),
        ("/v1/responses", responses, key),
        ("/v1/messages", messages, key),
        ("/generate", {"text": "hi", "routing_key": "conv-1"}, {}),
    ]:
        received.clear()
        r = httpx.post(idle_stack.url + path, json=body, headers=headers, timeout=60)
        assert r.status_code == 200, r.text
        assert [m.routing_key for m in received.values()] == ["conv-1"], path
    received.clear()
    assert post(idle_stack.url, "/v1/chat/completions", CHAT).status_code == 200
    assert [m.routing_key for m in received.values()] == [None]
    long_key = {"x-smg-routing-key": "k" * 257}
    r = httpx.post(idle_stack.url + "/v1/chat/completions", json=CHAT, headers=long_key, timeout=60)
    assert error_of(r)["param"] == "routing_key"
    r = httpx.post(idle_stack.url + "/generate", json={"text": "hi", "routing_key": 5}, timeout=60)
    assert r.status_code == 400 and "routing_key" in r.text
