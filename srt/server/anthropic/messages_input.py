"""Anthropic's Messages API, request side: the body, its checks, and its reading into the chat
route's request, so a Messages request runs through the same plan, tool-call and reasoning
parsers as ``/v1/chat/completions``.

- ``system`` (text or text blocks) becomes a system message; ``messages`` content is text or
  blocks: ``text``; ``tool_use`` (assistant) becomes a call, its ``input`` the JSON arguments;
  ``tool_result`` (user) becomes a ``tool`` message answering its ``tool_use_id`` (text or text
  blocks; ``is_error`` puts ``Error:`` before it); ``thinking`` (assistant) becomes the
  message's reasoning; ``redacted_thinking`` carries nothing readable and is left out.
  ``cache_control`` marks are accepted: every prompt prefix is cached anyway.
- custom ``tools`` (``name``, ``description``, ``input_schema``) become function tools;
  ``tool_choice`` ``auto`` / ``any`` / ``tool`` / ``none`` become ``auto`` / ``required`` / the
  named function / ``none``; ``disable_parallel_tool_use`` allows one call.
- ``thinking`` ``enabled`` / ``adaptive`` / ``disabled`` set the template's ``enable_thinking``
  (``budget_tokens`` is checked as Anthropic does but caps nothing: ``max_tokens`` does);
  ``output_config.effort`` is the chat route's ``reasoning_effort``, ``output_config.format``
  (``json_schema``; ``output_format``, the beta's name for it) its ``response_format``.
- ``max_tokens``, ``stop_sequences``, ``temperature``, ``top_p``, ``top_k`` as sampling (the
  newest clients send the last three only through ``extra_body``); ``metadata``, ``betas``,
  ``service_tier``, ``cache_control``, ``inference_geo``, ``user_profile_id``,
  ``workspace_id`` and ``output_config.task_budget`` are accepted and change nothing here.
  SGLang's sampling extras of the chat route (``min_p``, ``regex``, ``stop_token_ids``...) are
  taken too.

Images, documents, server tools (web search, bash, computer, text editor, MCP) and any field
not listed are a 400 naming them.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import ConfigDict, Field, ValidationError

from radixlm.srt.managers.tokenizer_manager import GenerateError
from radixlm.srt.server.chat.request import ChatCompletionRequest, SGLangSamplingExtras
from radixlm.srt.server.http.body import StrictBody, check_list_len, check_tool_count
from radixlm.srt.server.http.errors import describe_validation_error

THINKING_TYPES = ("enabled", "disabled", "adaptive")
TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}
SERVICE_TIERS = ("auto", "standard_only")


class CountTokensRequest(StrictBody):
    """``POST /v1/messages/count_tokens``: what a Messages request sends, less sampling."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    output_format: dict[str, Any] | None = None  # the structured-outputs beta's name of format
    betas: list[str] | None = None
    # hints of Anthropic's own service: prompt caching (every prefix is cached here anyway),
    # on whose behalf
    cache_control: dict[str, Any] | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None


class MessagesRequest(CountTokensRequest, SGLangSamplingExtras):
    """``POST /v1/messages``, with the SGLang sampling extras the chat route takes too."""

    model_config = ConfigDict(extra="forbid", strict=True)
    max_tokens: int
    stop_sequences: list[str] | None = None
    stream: bool | None = False
    temperature: float | None = None
    top_p: float | None = None  # (top_k is one of the SGLang extras)
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    inference_geo: str | None = None  # where Anthropic would run it: a hint


def precheck(data: dict[str, Any], max_items: int) -> None:
    """Sizes before the body is validated (and before any per-tool or per-block work): at most
    MAX_TOOLS tools; no more messages, nor content blocks, than the context has tokens."""
    check_tool_count(data.get("tools"))
    messages = data.get("messages")
    check_list_len(messages, max_items, "messages")
    blocks = sum(
        len(m["content"])
        for m in (messages if isinstance(messages, list) else ())
        if isinstance(m, dict) and isinstance(m.get("content"), list)
    )
    system = data.get("system")
    blocks += len(system) if isinstance(system, list) else 0
    if blocks > max_items:
        raise ValueError(f"messages hold {blocks} content blocks; at most {max_items}")


def _bad(message: str, param: str) -> GenerateError:
    return GenerateError(message, 400, param)


def _texts(value: Any, where: str) -> str:
    """Text, or a list of text blocks, as one text."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise _bad(f"{where} must be text or a list of text blocks", where)
    parts = []
    for i, block in enumerate(value):
        if not isinstance(block, dict) or block.get("type") != "text":
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise _bad(
                f"{where}[{i}] is a {kind!r} block; only text blocks can go here "
                "(the model reads text only)",
                f"{where}[{i}].type",
            )
        if not isinstance(block.get("text"), str):
            raise _bad(f"{where}[{i}].text must be a string", f"{where}[{i}].text")
        parts.append(block["text"])
    return "".join(parts)


def _tool_result(block: dict[str, Any], where: str) -> dict[str, Any]:
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str) or not call_id:
        raise _bad(f"{where}.tool_use_id must name the tool_use it answers", f"{where}.tool_use_id")
    content = block.get("content")
    text = "" if content is None else _texts(content, f"{where}.content")
    if block.get("is_error"):
        text = "Error: " + text
    return {"role": "tool", "tool_call_id": call_id, "content": text}


def _tool_use(block: dict[str, Any], where: str) -> dict[str, Any]:
    name, call_id, args = block.get("name"), block.get("id"), block.get("input", {})
    if not isinstance(name, str) or not isinstance(call_id, str):
        raise _bad(f"{where} needs a string id and name", where)
    if not isinstance(args, dict):
        raise _bad(f"{where}.input must be an object", f"{where}.input")
    try:
        arguments = json.dumps(args)
    except (RecursionError, ValueError) as e:  # nested past what the encoder takes
        raise _bad(f"{where}.input cannot be read: {e}", f"{where}.input") from None
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _message(msg: Any, where: str) -> list[dict[str, Any]]:
    """One Messages message as chat messages (tool results come first, as their own)."""
    if not isinstance(msg, dict):
        raise _bad(f"{where} must be an object", where)
    role = msg.get("role")
    if role not in ("user", "assistant"):
        raise _bad(f"{where}.role must be 'user' or 'assistant', got {role!r}", f"{where}.role")
    content = msg.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise _bad(f"{where}.content must be text or a list of blocks", f"{where}.content")
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    reasoning: list[str] = []
    for j, block in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_use" and role == "assistant":
            calls.append(_tool_use(block, at))
        elif kind == "tool_result" and role == "user":
            results.append(_tool_result(block, at))
        elif kind == "thinking" and role == "assistant":
            reasoning.append(str(block.get("thinking") or ""))
        elif kind == "redacted_thinking" and role == "assistant":
            continue  # encrypted by another server: nothing this model can read
        else:
            raise _bad(
                f"{at} ({kind!r} in a {role} message) is not supported: text, and tool_use / "
                "thinking in assistant messages, tool_result in user messages (the model reads "
                "text only)",
                f"{at}.type",
            )
    if role == "user":
        return results + ([{"role": "user", "content": "".join(texts)}] if texts else [])
    out: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or None}
    if calls:
        out["tool_calls"] = calls
    if reasoning:
        out["reasoning_content"] = "".join(reasoning)
    return [out]


def _tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise _bad(f"{where} must be an object", where)
        kind = tool.get("type")
        if kind not in (None, "custom"):
            raise _bad(
                f"{where}.type {kind!r} is a server tool, which this server does not run; "
                "define a custom tool (name, description, input_schema) instead",
                f"{where}.type",
            )
        unknown = set(tool) - {"type", "name", "description", "input_schema", "strict",
                               "cache_control"}  # fmt: skip
        if unknown:
            raise _bad(f"{where} has unknown fields {sorted(unknown)}", f"{where}.{min(unknown)}")
        schema = tool.get("input_schema")
        if not isinstance(schema, dict):
            raise _bad(
                f"{where}.input_schema must be a JSON schema object", f"{where}.input_schema"
            )
        function = {"name": tool.get("name"), "parameters": {"type": "object", **schema}}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        if tool.get("strict") is not None:
            function["strict"] = tool["strict"]
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: dict[str, Any] | None) -> tuple[Any, bool | None]:
    """(the chat route's tool_choice, parallel_tool_calls)."""
    if choice is None:
        return None, None
    unknown = sorted(set(choice) - {"type", "name", "disable_parallel_tool_use"})
    if unknown:
        raise _bad(f"tool_choice has unknown fields {unknown}", f"tool_choice.{unknown[0]}")
    kind = choice.get("type")
    parallel = False if choice.get("disable_parallel_tool_use") else None
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise _bad("tool_choice of type 'tool' needs the tool's name", "tool_choice.name")
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    if kind not in TOOL_CHOICES:
        raise _bad(
            f"tool_choice.type must be auto, any, tool or none, got {kind!r}", "tool_choice.type"
        )
    return TOOL_CHOICES[kind], parallel


def _thinking(thinking: dict[str, Any] | None) -> bool | None:
    """The template's ``enable_thinking``, after Anthropic's own checks of the block."""
    if thinking is None:
        return None
    unknown = sorted(set(thinking) - {"type", "budget_tokens", "display"})
    if unknown:
        raise _bad(f"thinking has unknown fields {unknown}", f"thinking.{unknown[0]}")
    kind, budget = thinking.get("type"), thinking.get("budget_tokens")
    if kind not in THINKING_TYPES:
        raise _bad(f"thinking.type must be one of {list(THINKING_TYPES)}", "thinking.type")
    if kind == "enabled" and (not isinstance(budget, int) or budget < 1024):
        raise _bad("thinking.budget_tokens must be an integer >= 1024", "thinking.budget_tokens")
    if kind != "enabled" and budget is not None:
        raise _bad(f"thinking.budget_tokens is not allowed with type {kind!r}", "thinking")
    return kind != "disabled"


def _format(fmt: Any, where: str) -> dict | None:
    """A ``{"type": "json_schema", "schema": ...}`` format as the chat route's response_format."""
    if fmt is None:
        return None
    if (
        not isinstance(fmt, dict)
        or fmt.get("type") != "json_schema"
        or set(fmt) - {"type", "schema"}
    ):
        raise _bad(f"{where} must be {{'type': 'json_schema', 'schema': {{...}}}}", where)
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt.get("schema")}}


def _output_config(req: CountTokensRequest) -> tuple[str | None, dict | None]:
    """(reasoning_effort, response_format) from ``output_config`` and ``output_format``."""
    config = req.output_config or {}
    unknown = set(config) - {"effort", "format", "task_budget"}
    if unknown:
        raise _bad(f"output_config has unknown fields {sorted(unknown)}", "output_config")
    if config.get("format") is not None and req.output_format is not None:
        raise _bad("send output_config.format or output_format, not both", "output_format")
    response_format = _format(config.get("format"), "output_config.format") or _format(
        req.output_format, "output_format"
    )
    return config.get("effort"), response_format


def chat_request(req: CountTokensRequest) -> ChatCompletionRequest:
    """The chat route's request for a Messages (or count_tokens) request."""
    messages: list[dict[str, Any]] = []
    if req.system is not None:
        system = _texts(req.system, "system")
        if system:
            messages.append({"role": "system", "content": system})
    for i, msg in enumerate(req.messages):
        messages += _message(msg, f"messages[{i}]")
    choice, parallel = _tool_choice(req.tool_choice)
    effort, response_format = _output_config(req)
    thinking = _thinking(req.thinking)
    body: dict[str, Any] = {
        "model": req.model,
        "messages": messages,
        "tools": _tools(req.tools),
        "tool_choice": choice,
        "parallel_tool_calls": parallel,
        "reasoning_effort": effort,
        "response_format": response_format,
        "chat_template_kwargs": None if thinking is None else {"enable_thinking": thinking},
    }
    if isinstance(req, MessagesRequest):
        if req.max_tokens < 1:
            raise _bad("max_tokens must be at least 1", "max_tokens")
        if req.service_tier not in (None, *SERVICE_TIERS):
            raise _bad(f"service_tier must be one of {list(SERVICE_TIERS)}", "service_tier")
        body.update({name: getattr(req, name) for name in SGLangSamplingExtras.model_fields})
        body.update(
            max_tokens=req.max_tokens,
            stop=req.stop_sequences,
            stream=bool(req.stream),
            temperature=req.temperature,
            top_p=req.top_p,
        )
    try:
        return ChatCompletionRequest.model_validate(
            {k: v for k, v in body.items() if v is not None}
        )
    except ValidationError as e:
        message, param = describe_validation_error(e)
        raise _bad(message, param or "messages") from None
