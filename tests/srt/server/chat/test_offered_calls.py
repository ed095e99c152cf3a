"""Calls naming a tool the request did not offer are dropped from chat replies (SGLang's rule),
streamed or not, and the calls after them are numbered on; SGLANG_FORWARD_UNKNOWN_TOOLS keeps
them. Hermes markup, parsed by the real parser."""

from __future__ import annotations

import json

import pytest

from radixlm.srt.parsers.tool_base import ToolSpec
from radixlm.srt.server.chat.tool_stream import ChoiceStream, chat_message
from radixlm.srt.server.chat.tools import ChatParsing

PARSING = ChatParsing(
    specs=[ToolSpec("get_weather"), ToolSpec("get_time")], choice="auto", tool_parser="hermes"
)


def _call(name: str, args: dict) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"


OUTPUT = "\n".join(
    [
        _call("delete_everything", {"really": True}),
        _call("get_weather", {"city": "Paris"}),
        _call("rm_rf", {}),
        _call("get_time", {"zone": "UTC"}),
    ]
)


def _streamed(parsing: ChatParsing, text: str, piece: int) -> tuple[str, dict[int, dict]]:
    stream = ChoiceStream(parsing)
    deltas = [stream.feed(text[i : i + piece]) for i in range(0, len(text), piece)]
    deltas.append(stream.flush())
    content, calls = "", {}
    for d in deltas:
        content += d.get("content", "")
        for c in d.get("tool_calls", []):
            call = calls.setdefault(c["index"], {"name": None, "arguments": ""})
            if "name" in c["function"]:
                assert call["name"] is None  # the name comes once, on the first delta
                call["name"] = c["function"]["name"]
            call["arguments"] += c["function"]["arguments"]
    return content, calls


def test_unoffered_calls_are_dropped_whole():
    message, has_calls = chat_message(PARSING, OUTPUT)
    names = [c["function"]["name"] for c in message["tool_calls"]]
    assert names == ["get_weather", "get_time"] and has_calls
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}
    assert message["content"] is None  # the dropped calls' markup is not content either


@pytest.mark.parametrize("piece", [1, 3, 7, 1000])
def test_streamed_calls_match_the_whole_reply(piece):
    content, calls = _streamed(PARSING, OUTPUT, piece)
    assert content == ""
    assert sorted(calls) == [0, 1]  # renumbered: no gap where the dropped calls were
    assert [calls[i]["name"] for i in (0, 1)] == ["get_weather", "get_time"]
    assert json.loads(calls[1]["arguments"]) == {"zone": "UTC"}


def test_only_unoffered_calls_is_a_reply_without_calls():
    message, has_calls = chat_message(PARSING, "Sure. " + _call("rm_rf", {}))
    assert not has_calls and "tool_calls" not in message
    assert message["content"].strip() == "Sure."
    content, calls = _streamed(PARSING, "Sure. " + _call("rm_rf", {}), 4)
    assert calls == {} and content.strip() == "Sure."


def test_forwarding_switch_keeps_them(monkeypatch):
    monkeypatch.setenv("SGLANG_FORWARD_UNKNOWN_TOOLS", "1")
    message, _ = chat_message(PARSING, OUTPUT)
    assert [c["function"]["name"] for c in message["tool_calls"]] == [
        "delete_everything",
        "get_weather",
        "rm_rf",
        "get_time",
    ]
    _, calls = _streamed(PARSING, OUTPUT, 5)
    assert len(calls) == 4
