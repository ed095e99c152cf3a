"""The generic tool format's prompt side: the system prompt that describes the tools and the
reply format, the history in that format, and the JSON schema of a valid reply.

A reply is one JSON object: ``{"tool_calls": [{"name": ..., "arguments": {...}}, ...]}`` to
call tools, or ``{"content": ...}`` to answer (a string, or an object matching the response
format's schema when there is one).

Under ``"none"`` (or without tools) nothing of that format is shown: the history is told in
prose (``I called get_weather with {...}.``, ``The tool get_weather returned: ...``), so the
model answers in words instead of writing a call again.
"""

from __future__ import annotations

import json

from radixlm.srt.parsers.chat_history import (
    function_of,
    text_of,
    tool_names_by_id,
    with_template_calls,
)
from radixlm.srt.parsers.constraints import call_object_schema, placed, with_defs
from radixlm.srt.parsers.tool_base import (
    ToolChoice,
    ToolSpec,
    check_choice,
    chosen_tools,
    forces_calls,
    named_tool,
)

CALL_FORM = '{"tool_calls": [{"name": "<tool name>", "arguments": {<arguments>}}]}'
ANSWER_FORM = '{"content": "<your answer>"}'


def _dumps(value: object) -> str:
    return json.dumps(value, ensure_ascii=False)


def system_prompt(tools: list[ToolSpec], choice: ToolChoice) -> str:
    """The instructions added to the system message when tools are offered."""
    lines = [
        "You can call tools. Each tool is listed with its name, what it does and the JSON "
        "Schema of its arguments:",
        "",
    ]
    for tool in tools:
        entry = {
            "name": tool.name,
            "description": tool.description or "",
            "parameters": tool.parameters,
        }
        lines.append(_dumps(entry))
    lines += ["", "Reply with a single JSON object and nothing else."]
    name = named_tool(choice)
    if name is not None:
        lines.append(f"You must call the tool {_dumps(name)}, in this form: {CALL_FORM}")
    elif choice == "required":
        lines.append(f"You must call one or more tools, in this form: {CALL_FORM}")
    else:
        lines.append(f"To call one or more tools: {CALL_FORM}")
        lines.append(f"To answer without calling a tool: {ANSWER_FORM}")
        lines.append(
            f"Once the tool results answer the question, answer in this form: {ANSWER_FORM}"
        )
    lines.append(
        "The arguments of a call must match its tool's schema. Tool results come back "
        "in user messages that name the tool and the call id."
    )
    return "\n".join(lines)


def reply_of_calls(calls: list[dict]) -> str:
    """An assistant message's tool calls as the reply text the model would have written."""
    items = []
    for call in calls:
        function = function_of(call)
        items.append({"name": function.get("name", ""), "arguments": function.get("arguments")})
    return _dumps({"tool_calls": items})


def prose_of_calls(calls: list[dict]) -> str:
    """An assistant message's tool calls told in words, one sentence per call."""
    sentences = []
    for call in calls:
        function = function_of(call)
        arguments = function.get("arguments")
        shown = arguments if isinstance(arguments, str) else _dumps(arguments)
        sentences.append(f"I called {function.get('name', '')} with {shown}.")
    return "\n".join(sentences)


def tool_result_text(message: dict, names: dict[str, str]) -> str:
    call_id = str(message.get("tool_call_id", ""))
    name = message.get("name") or names.get(call_id, "")
    return f"Result of the tool {_dumps(name)} (call id {_dumps(call_id)}):\n" + text_of(
        message.get("content")
    )


def tool_result_prose(message: dict, names: dict[str, str]) -> str:
    name = message.get("name") or names.get(str(message.get("tool_call_id", "")), "")
    subject = f"The tool {name}" if name else "A tool"
    return f"{subject} returned: {text_of(message.get('content'))}"


def history(messages: list[dict], as_prose: bool) -> list[dict]:
    """Messages every template accepts: assistant calls become their JSON reply text (after the
    message's own text, if any), tool results become one user message per run of results, and
    earlier plain answers are shown in the reply format too; with ``as_prose`` calls and results
    are told in words and answers stay as they are."""
    names = tool_names_by_id(messages)
    result_text = tool_result_prose if as_prose else tool_result_text
    calls_text = prose_of_calls if as_prose else reply_of_calls
    out: list[dict] = []
    for message in with_template_calls(messages):
        role = message.get("role")
        if role == "tool":
            _add_tool_result(out, result_text(message, names))
        elif role == "assistant" and message.get("tool_calls"):
            text = text_of(message.get("content"))
            reply = calls_text(message.pop("tool_calls"))
            out.append({**message, "content": f"{text}\n\n{reply}" if text else reply})
        elif role == "assistant" and not as_prose:
            out.append({**message, "content": _dumps({"content": text_of(message.get("content"))})})
        else:
            out.append(message)
    for message in out:
        message.pop("_tool_results", None)
    return out


def _add_tool_result(out: list[dict], text: str) -> None:
    """A result joins the user message of the results right before it, or starts one."""
    if out and out[-1].get("role") == "user" and out[-1].get("_tool_results"):
        out[-1]["content"] += "\n\n" + text
    else:
        out.append({"role": "user", "content": text, "_tool_results": True})


def with_system_prompt(messages: list[dict], prompt: str) -> list[dict]:
    """The prompt appended to the first system message, or a system message in front."""
    if messages and messages[0].get("role") == "system":
        first = messages[0]
        text = text_of(first.get("content"))
        return [{**first, "content": f"{text}\n\n{prompt}" if text else prompt}, *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]


def reply_schema(
    tools: list[ToolSpec], choice: ToolChoice, parallel: bool, response_schema: dict | None
) -> dict | None:
    """The JSON schema of a valid reply under ``choice``; None under ``"none"``."""
    check_choice(tools, choice)
    if choice == "none" or not tools:
        return None
    defs: dict = {}
    # every tool's arguments follow its schema, strict or not: the reply is one JSON schema
    # anyway, and a small model left free writes the schema back as its arguments
    tools = chosen_tools(tools, choice)
    items = [call_object_schema(t, choice, "arguments", defs, always=True) for t in tools]
    calls: dict = {"type": "array", "items": {"anyOf": items}, "minItems": 1}
    if not parallel:
        calls["maxItems"] = 1
    call_reply = _one_key_object("tool_calls", calls)
    if forces_calls(choice):
        return with_defs(call_reply, defs)
    answer = {"type": "string"}
    if response_schema is not None:
        answer = placed(response_schema, "answer", defs)
    return with_defs({"anyOf": [call_reply, _one_key_object("content", answer)]}, defs)


def _one_key_object(key: str, schema: dict) -> dict:
    return {
        "type": "object",
        "properties": {key: schema},
        "required": [key],
        "additionalProperties": False,
    }
