"""OpenAI logprobs through the HTTP process. Chat (plain and streamed) and the Responses API:
each token's ``bytes`` are its raw bytes, so that joined they are the reply's UTF-8 even where a
token holds part of a character (its ``token`` then shows U+FFFD, as in SGLang and vLLM). Legacy
completions: ``top_logprobs`` as OpenAI and vLLM send them, ``null`` for the first echoed prompt
token and, with ``logprobs: 0``, a one-entry dict of the sampled token per token. Over
fake_stack's worker (fast) and on the default model (slow)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import orjson
import pytest
from fake_stack import FakeStack
from tool_util import reply_with, strict_client

REPLY = "Hi 😀😀 你好, café 𠮷!"
REPLACEMENT = list("\ufffd".encode())
CHAT = {"model": "default", "messages": [{"role": "user", "content": "hi"}]}
MODEL_STOP_TOKENS = ("<|im_end|>", "<|endoftext|>")


def post(url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(url + path, json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def stream(url: str, path: str, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                yield orjson.loads(line[len("data: ") :])


def assert_bytes_rebuild(entries: list[dict[str, Any]], text: str, stop_tokens=("<eos>",)):
    """Joined ``bytes`` are ``text``'s UTF-8. A stop token sampled last has an entry of its own
    (as SGLang and vLLM send it) but no text."""
    if entries and entries[-1]["token"] in stop_tokens:
        assert entries[-1]["bytes"] == list(entries[-1]["token"].encode())
        entries = entries[:-1]
    assert b"".join(bytes(e["bytes"]) for e in entries) == text.encode()
    for e in entries:
        assert e["token"] == "\ufffd" or e["bytes"] == list(e["token"].encode())
        for top in e["top_logprobs"]:
            assert (
                top["token"] != e["token"] or top["bytes"] == e["bytes"] or "\ufffd" in top["token"]
            )


def dumped(entries: list[Any]) -> list[dict[str, Any]]:
    return [e.model_dump() if hasattr(e, "model_dump") else dict(e) for e in entries]


# ---------------------------------------------------------------------- fake stack: chat
def test_chat_bytes_rebuild_the_reply(idle_stack: FakeStack) -> None:
    body = {**CHAT, "logprobs": True, "top_logprobs": 2, **reply_with(idle_stack, REPLY)}
    choice = post(idle_stack.url, "/v1/chat/completions", body)["choices"][0]
    entries = choice["logprobs"]["content"]
    assert choice["message"]["content"] == REPLY and choice["finish_reason"] == "stop"
    assert any(e["token"] == "\ufffd" for e in entries)  # fragments of 😀, 你, 𠮷
    assert all(e["bytes"] != REPLACEMENT for e in entries)
    assert_bytes_rebuild(entries, REPLY)
    for e in entries:  # the fake worker's best alternative is the sampled token
        assert e["top_logprobs"][0]["bytes"] == e["bytes"]


def test_chat_stream_bytes_rebuild_the_reply(idle_stack: FakeStack, client: openai.OpenAI):
    extra = reply_with(idle_stack, REPLY)
    chunks = client.chat.completions.create(
        **CHAT, logprobs=True, top_logprobs=1, stream=True, extra_body=extra
    )
    text, entries = "", []
    for chunk in chunks:
        for choice in chunk.choices:
            text += choice.delta.content or ""
            entries += dumped(choice.logprobs.content or []) if choice.logprobs else []
    assert text == REPLY
    assert_bytes_rebuild(entries, REPLY)


def test_responses_logprob_bytes_rebuild_the_text(idle_stack: FakeStack, client: openai.OpenAI):
    r = client.responses.create(
        model="default",
        input="hi",
        include=["message.output_text.logprobs"],
        top_logprobs=1,
        extra_body=reply_with(idle_stack, REPLY),
    )
    part = r.output[0].content[0]
    assert part.text == REPLY
    assert_bytes_rebuild(dumped(part.logprobs), REPLY)


# ---------------------------------------------------------------------- fake stack: completions
def test_completions_echo_first_prompt_token_is_null(idle_stack: FakeStack) -> None:
    ids = idle_stack.tokenizer.encode("Hello world")
    body = {"model": "default", "prompt": ids, "max_tokens": 3, "echo": True, "logprobs": 1}
    lp = post(idle_stack.url, "/v1/completions", body)["choices"][0]["logprobs"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert len(lp["top_logprobs"]) == len(ids) + 3
    rows = zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True)
    for token, logprob, top in list(rows)[1:]:
        assert top[token] == logprob and len(top) <= 2


@pytest.mark.parametrize("echo", [False, True])
def test_completions_logprobs_zero_lists_the_sampled_token(idle_stack: FakeStack, echo: bool):
    body = {"model": "default", "prompt": "Hello", "max_tokens": 3, "echo": echo, "logprobs": 0}
    lp = post(idle_stack.url, "/v1/completions", body)["choices"][0]["logprobs"]
    assert_sampled_alone(lp, echo)
    pieces = list(stream(idle_stack.url, "/v1/completions", body))
    merged = {k: sum((p["choices"][0]["logprobs"][k] for p in pieces), []) for k in lp}
    assert merged["top_logprobs"] == lp["top_logprobs"] and merged["tokens"] == lp["tokens"]


def assert_sampled_alone(lp: dict[str, Any], echo: bool) -> None:
    rows = list(zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True))
    if echo:
        assert rows[0][1] is None and rows[0][2] is None
        rows = rows[1:]
    assert rows and all(top == {token: logprob} for token, logprob, top in rows)


# ---------------------------------------------------------------------- the default model
EMOJI_CHAT = {
    "model": "default",
    "messages": [{"role": "user", "content": "Repeat exactly: 😀😀😀 你好"}],
    "logprobs": True,
    "top_logprobs": 1,
    "max_tokens": 12,
    "temperature": 0,
}


@pytest.mark.slow
def test_model_chat_bytes_rebuild_the_reply(idle_server) -> None:
    choice = post(idle_server.url, "/v1/chat/completions", EMOJI_CHAT)["choices"][0]
    content = choice["message"]["content"]
    entries = choice["logprobs"]["content"]
    assert "\ufffd" not in content and len(entries) > 1
    assert_bytes_rebuild(entries, content, MODEL_STOP_TOKENS)
    if any(ord(ch) > 0x7FF for ch in content):  # a character split over tokens: raw bytes
        assert any(e["token"] == "\ufffd" and e["bytes"] != REPLACEMENT for e in entries)
    chunks = strict_client(idle_server.url).chat.completions.create(**EMOJI_CHAT, stream=True)
    text, streamed = "", []
    for chunk in chunks:
        for c in chunk.choices:
            text += c.delta.content or ""
            streamed += dumped(c.logprobs.content or []) if c.logprobs else []
    assert text == content  # logprobs may differ in the last bits: the prompt is cached now
    assert [(e["token"], e["bytes"]) for e in streamed] == [
        (e["token"], e["bytes"]) for e in entries
    ]


@pytest.mark.slow
def test_model_completions_top_logprobs_shape(idle_server) -> None:
    body = {"model": "default", "prompt": "The capital of France is", "max_tokens": 4}
    body = {**body, "temperature": 0, "echo": True, "logprobs": 1}
    lp = post(idle_server.url, "/v1/completions", body)["choices"][0]["logprobs"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(isinstance(top, dict) and 1 <= len(top) <= 2 for top in lp["top_logprobs"][1:])
    for echo in (False, True):
        body = {**body, "echo": echo, "logprobs": 0}
        assert_sampled_alone(
            post(idle_server.url, "/v1/completions", body)["choices"][0]["logprobs"], echo
        )
