"""The Responses API's request side: the request body, its checks, and its reading into the
chat route's request (``instructions`` and ``input`` items become messages, flat function tools
become chat tools, ``text.format`` becomes ``response_format``); also the request's input as
``input_items`` lists them, and the chat messages of a response's output items."""

from __future__ import annotations

import uuid
from typing import Any

from pydantic import ValidationError

from radixlm.srt.managers.tokenizer_manager import GenerateError
from radixlm.srt.server.chat.request import ChatCompletionRequest, SGLangSamplingExtras
from radixlm.srt.server.http.body import check_list_len, check_tool_count
from radixlm.srt.server.http.errors import describe_validation_error
from radixlm.srt.server.openai.vllm_compat import translate_vllm_fields

# Values of ``include`` accepted: logprobs are returned when asked; the others name outputs of
# hosted tools or encrypted reasoning, which this server never produces (nothing to include).
INCLUDABLE = frozenset(
    {
        "message.output_text.logprobs",
        "reasoning.encrypted_content",
        "file_search_call.results",
        "web_search_call.results",
        "web_search_call.action.sources",
        "code_interpreter_call.outputs",
        "computer_call_output.output.image_url",
        "message.input_image.image_url",
    }
)
TEXT_PART_TYPES = frozenset({"input_text", "output_text", "text", "summary_text", "reasoning_text"})
MESSAGE_ROLES = frozenset({"user", "system", "developer", "assistant"})


class ResponsesRequest(SGLangSamplingExtras):
    """``POST /v1/responses``: OpenAI's fields and SGLang's sampling extras. Items and tools stay
    plain dicts here and are checked one by one (``_messages``, ``_tools``), so an error names
    the item."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = False  # null (sglang-router sends it): not streamed
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: str | None = None
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    top_logprobs: int | None = None
    service_tier: str | None = None
    background: bool | None = None
    max_tool_calls: int | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    stream_options: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None


# Fields whose other values would change what the request means; a 400 names them.
UNSUPPORTED_RESPONSES = {
    "background": (None, False),
    "conversation": (None,),
    "prompt": (None,),
    "truncation": (None, "disabled"),
    "max_tool_calls": (None,),
    "priority": (None, 0),  # SGLang's field; sglang-router sends 0
}


def _bad(message: str, param: str) -> GenerateError:
    return GenerateError(message, 400, param)


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _part_text(part: Any, param: str) -> str:
    if isinstance(part, str):
        return part
    if not isinstance(part, dict):
        raise _bad(f"{param} must be a content part object", param)
    kind = part.get("type")
    if kind == "refusal" and isinstance(part.get("refusal"), str):
        return part["refusal"]
    if kind not in TEXT_PART_TYPES:
        raise _bad(
            f"{param}.type {kind!r} is not supported; this server takes text parts only "
            "(input_text, output_text)",
            f"{param}.type",
        )
    text = part.get("text")
    if not isinstance(text, str):
        raise _bad(f"{param}.text must be a string", f"{param}.text")
    return text


def _content_text(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(_part_text(p, f"{param}[{j}]") for j, p in enumerate(content))
    raise _bad(f"{param} must be a string or a list of content parts", param)


def _string_field(item: dict[str, Any], key: str, param: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise _bad(f"{param}.{key} must be a string", f"{param}.{key}")
    return value


class _Conversation:
    """Chat messages built from Responses items: an assistant's text, its reasoning and the
    calls that follow it form one assistant message, as a chat template expects."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self._reasoning: str | None = None

    def _assistant(self) -> dict[str, Any]:
        last = self.messages[-1] if self.messages else None
        if last is None or last["role"] != "assistant" or last.get("_closed"):
            last = {"role": "assistant", "content": None}
            self.messages.append(last)
        if self._reasoning is not None:
            last["reasoning_content"] = self._reasoning
            self._reasoning = None
        return last

    def add(self, item: Any, param: str) -> None:
        if not isinstance(item, dict):
            raise _bad(f"{param} must be an object", param)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in MESSAGE_ROLES:
                raise _bad(
                    f"{param}.role must be one of user, system, developer, assistant",
                    f"{param}.role",
                )
            text = _content_text(item.get("content"), f"{param}.content")
            if role == "assistant":
                message = self._assistant()
                if message.get("tool_calls"):  # text after calls starts a new message
                    message["_closed"] = True
                    message = self._assistant()
                message["content"] = (message["content"] or "") + text
            else:
                self.messages.append({"role": role, "content": text})
        elif kind == "function_call":
            call = {
                "id": _string_field(item, "call_id", param),
                "type": "function",
                "function": {
                    "name": _string_field(item, "name", param),
                    "arguments": _string_field(item, "arguments", param),
                },
            }
            self._assistant().setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            output = item.get("output")
            text = _content_text(output, f"{param}.output")
            call_id = _string_field(item, "call_id", param)
            self.messages.append({"role": "tool", "tool_call_id": call_id, "content": text})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            self._reasoning = _content_text(parts, f"{param}.content")
        elif kind == "item_reference":
            raise _bad(
                f"{param}: item references are not supported; send the item itself (or "
                "previous_response_id)",
                f"{param}.type",
            )
        else:
            raise _bad(
                f"{param}.type {kind!r} is not supported; input items may be messages, "
                "function_call, function_call_output and reasoning",
                f"{param}.type",
            )

    def finished(self) -> list[dict[str, Any]]:
        for message in self.messages:
            message.pop("_closed", None)
        return self.messages


def input_messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    if isinstance(req.input, str):
        return [{"role": "user", "content": req.input}]
    conversation = _Conversation()
    for i, item in enumerate(req.input):
        conversation.add(item, f"input[{i}]")
    return conversation.finished()


def _tools(req: ResponsesRequest) -> list[dict[str, Any]] | None:
    if req.tools is None:
        return None
    out = []
    for i, tool in enumerate(req.tools):
        param = f"tools[{i}]"
        if tool.get("type") != "function":
            raise _bad(
                f"{param}.type {tool.get('type')!r} is not supported; only function tools "
                "are (hosted tools such as web_search or file_search are OpenAI's)",
                f"{param}.type",
            )
        unknown = set(tool) - {"type", "name", "description", "parameters", "strict"}
        if unknown:
            raise _bad(f"{param} has unsupported fields: {sorted(unknown)}", param)
        if not isinstance(tool.get("name"), str):
            raise _bad(f"{param}.name must be a string", f"{param}.name")
        if not isinstance(tool.get("parameters", {}), dict | None):
            raise _bad(f"{param}.parameters must be a JSON schema object", f"{param}.parameters")
        function = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
        function["strict"] = tool.get("strict", True)  # the Responses API's default
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(raw: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if not isinstance(raw, dict):
        return raw
    if raw.get("type") == "function" and isinstance(raw.get("name"), str):
        return {"type": "function", "function": {"name": raw["name"]}}
    if raw.get("type") == "allowed_tools" and isinstance(raw.get("tools"), list):
        tools = [
            {"type": "function", "function": {"name": t["name"]}}
            if isinstance(t, dict) and t.get("type") == "function" and "name" in t
            else t
            for t in raw["tools"]
        ]
        inner = {k: v for k, v in raw.items() if k != "type"}
        return {"type": "allowed_tools", "allowed_tools": {**inner, "tools": tools}}
    raise _bad(
        "tool_choice must be 'none', 'auto', 'required', {\"type\": \"function\", \"name\": ...} "
        'or {"type": "allowed_tools", "mode": "auto" | "required", "tools": [{"type": '
        '"function", "name": ...}, ...]}',
        "tool_choice",
    )


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    if not text:
        return None
    unknown = set(text) - {"format", "verbosity"}
    if unknown:
        raise _bad(f"text has unsupported fields: {sorted(unknown)}", "text")
    if text.get("verbosity") not in (None, "medium"):
        raise _bad(
            "text.verbosity other than 'medium' is not supported: no model here is trained on "
            "it; leave it out",
            "text.verbosity",
        )
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise _bad("text.format.type must be 'text', 'json_object' or 'json_schema'", "text.format")
    if fmt["type"] != "json_schema":
        return {"type": fmt["type"]}
    if not isinstance(fmt.get("schema"), dict):
        raise _bad("text.format.schema must be a JSON schema object", "text.format.schema")
    inner = {k: fmt[k] for k in ("name", "description", "schema", "strict") if k in fmt}
    return {"type": "json_schema", "json_schema": inner}


def chat_request(
    req: ResponsesRequest, history: list[dict[str, Any]], messages: list[dict[str, Any]]
) -> ChatCompletionRequest:
    include = set(req.include or ())
    unknown = include - INCLUDABLE
    if unknown:
        raise _bad(f"include holds unknown values: {sorted(unknown)}", "include")
    body: dict[str, Any] = {
        "messages": ([{"role": "system", "content": req.instructions}] if req.instructions else [])
        + history
        + messages,
        "tools": _tools(req),
        "tool_choice": _tool_choice(req.tool_choice),
        "parallel_tool_calls": req.parallel_tool_calls,
        "response_format": _response_format(req.text),
        "max_completion_tokens": req.max_output_tokens,
        "stream": req.stream,  # the updates come as they are generated, not all at the end
        "logprobs": "message.output_text.logprobs" in include,
        "top_logprobs": req.top_logprobs if "message.output_text.logprobs" in include else None,
        "chat_template_kwargs": req.chat_template_kwargs,
        "reasoning_effort": (req.reasoning or {}).get("effort"),
    }
    for name in SGLangSamplingExtras.model_fields:
        body[name] = getattr(req, name)
    for name in ("temperature", "top_p", "seed", "stop", "presence_penalty", "frequency_penalty"):
        body[name] = getattr(req, name)
    if req.max_output_tokens is not None and req.max_output_tokens < 1:
        raise _bad("max_output_tokens must be at least 1", "max_output_tokens")
    try:
        return ChatCompletionRequest.model_validate(
            {k: v for k, v in body.items() if v is not None}
        )
    except ValidationError as e:
        message, param = describe_validation_error(e)
        if param and param.startswith("messages"):
            param = "input"
        raise _bad(message, param or "input") from None


# Fields of OpenAI's request that mean nothing here and are accepted as such (OpenAI-side
# caching, moderation and routing hints; the extra_* of the openai client never reach a body).
IGNORED_FIELDS = frozenset({"prompt_cache_retention", "prompt_cache_options", "context_management"})


def precheck(data: dict[str, Any], max_items: int) -> None:
    """Unknown fields are a 400 naming them (the Responses API grows; a field this server does
    not know must not pass unnoticed); no more input items or tools than the context has
    tokens."""
    translate_vllm_fields(data)
    known = set(ResponsesRequest.model_fields) | set(UNSUPPORTED_RESPONSES) | IGNORED_FIELDS
    for name in data:
        if name not in known:
            raise ValueError(f"{name} is not a field this server's Responses API implements")
    items = data.get("input")
    check_list_len(items if isinstance(items, list) else None, max_items, "input")
    check_tool_count(data.get("tools"))


_ITEM_ID_PREFIXES = {
    "message": "msg",
    "function_call": "fc",
    "function_call_output": "fco",
    "reasoning": "rs",
}


def input_items(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's input as ``input_items`` lists them (OpenAI's item shapes): a string input
    is one user message; every item gets its ``type``, an ``id`` and a ``status``; message
    text becomes parts (``input_text``, or ``output_text`` for the assistant's)."""
    raw = req.input if isinstance(req.input, list) else [{"role": "user", "content": req.input}]
    items = []
    for item in raw:
        kind = item.get("type", "message")
        out = {"id": new_id(_ITEM_ID_PREFIXES.get(kind, "item")), "status": "completed"}
        out.update(item, type=kind)
        if kind == "message" and isinstance(out.get("content"), str):
            assistant = out.get("role") == "assistant"
            part = {"type": "output_text" if assistant else "input_text", "text": out["content"]}
            if assistant:
                part["annotations"] = []
            out["content"] = [part]
        items.append(out)
    return items


def output_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chat messages of a response's output (kept for ``previous_response_id``)."""
    conversation = _Conversation()
    for item in items:
        conversation.add(item, "output")
    return conversation.finished()
