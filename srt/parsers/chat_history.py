"""Reshaping OpenAI chat history for chat templates (shared by the parsers' ``render``)."""

from __future__ import annotations

from typing import Any

from radixlm.srt.parsers.tool_base import ToolChoice, ToolSpec, arguments_as_object


def text_of(content: Any) -> str:
    """A message's content as text: None is empty; a list of parts keeps its text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            part.get("text", "") for part in content if isinstance(part, dict) and "text" in part
        )
    return str(content)


def function_of(call: dict) -> dict:
    """The ``function`` of an OpenAI tool call (a bare ``{"name", "arguments"}`` works too)."""
    function = call.get("function")
    return function if isinstance(function, dict) else call


def template_call(call: dict) -> dict:
    """An OpenAI tool call with its arguments as a dict (templates apply ``tojson`` to them);
    the call's other fields (``id``) are kept."""
    function = function_of(call)
    out = {key: value for key, value in call.items() if key != "function"}
    out.setdefault("type", "function")
    out["function"] = {
        **function,
        "name": function.get("name", ""),
        "arguments": arguments_as_object(function.get("arguments", {})),
    }
    return out


def with_template_calls(messages: list[dict]) -> list[dict]:
    """Copies of the messages; assistant tool calls get dict arguments and text content; an
    empty ``tool_calls`` is left out (some templates test only for the key)."""
    out = []
    for message in messages:
        message = dict(message)
        if "tool_calls" in message and not message["tool_calls"]:
            del message["tool_calls"]
        if message.get("role") == "assistant" and message.get("tool_calls"):
            message["tool_calls"] = [template_call(call) for call in message["tool_calls"]]
            if message.get("content") is None:
                message["content"] = ""
        out.append(message)
    return out


def tools_kwargs(tools: list[ToolSpec], choice: ToolChoice) -> dict:
    """``{"tools": [...]}`` for ``apply_chat_template``; nothing under ``"none"``."""
    if choice == "none" or not tools:
        return {}
    return {"tools": [tool.to_openai() for tool in tools]}


def tool_names_by_id(messages: list[dict]) -> dict[str, str]:
    """The tool name of every call id in the assistant messages of the history."""
    names = {}
    for message in messages:
        if message.get("role") != "assistant":
            continue
        for call in message.get("tool_calls") or ():
            if isinstance(call, dict) and call.get("id") is not None:
                names[str(call["id"])] = function_of(call).get("name", "")
    return names
