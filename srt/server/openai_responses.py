"""OpenAI's Responses API: ``POST /v1/responses``, ``GET`` / ``DELETE /v1/responses/{id}``.

A Responses request is read into the chat route's request (``instructions`` and ``input`` items
become messages, flat function tools become chat tools, ``text.format`` becomes
``response_format``) and runs through the same plan, tool-call and reasoning parsers. Its output
is written back as Responses items: ``reasoning``, ``message`` (``output_text``) and
``function_call`` items, in the order the model wrote them; streamed as Responses events
(``response.created`` ... ``response.completed``), each with its ``sequence_number``.

Stored responses (``store``, on by default as OpenAI's) live in a bounded in-memory store
(``ResponseStore``: count and size limits, oldest dropped first), so ``previous_response_id``
continues a conversation and ``GET`` returns a response while it is kept. Fields the server
cannot honour are a 400 naming them (hosted tools, multimodal parts, ``background``,
``conversation``, ``prompt``, ``truncation: "auto"``...), never dropped.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import ValidationError

from radixlm.srt.managers.tokenizer_manager import (
    ClientDisconnected,
    GenerateError,
    RequestGroup,
)
from radixlm.srt.server.errors import describe_validation_error, error_body, parse_body
from radixlm.srt.server.native_api import get_tm, json_response
from radixlm.srt.server.openai_convert import (
    OpenAIPlan,
    chat_logprobs,
    chat_plan,
    check_model,
    finish_reason,
)
from radixlm.srt.server.openai_protocol import ChatCompletionRequest, SGLangSamplingExtras
from radixlm.srt.server.openai_tool_stream import ChoiceStream
from radixlm.srt.server.openapi_spec import ERROR_RESPONSES, STREAM_RESPONSE, json_body
from radixlm.srt.server.protocol import check_list_len
from radixlm.srt.server.streaming import ClosingStreamingResponse
from radixlm.srt.server.vllm_compat import translate_vllm_fields

router = APIRouter(responses=ERROR_RESPONSES)

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


# ---------------------------------------------------------------------- stored responses
class ResponseStore:
    """Responses kept for ``previous_response_id`` and ``GET``: at most ``max_items``, and at
    most ``max_bytes`` of their JSON (the conversation and the response object); the oldest go
    first. A response larger than the whole budget is not kept."""

    def __init__(self, max_items: int = 1024, max_bytes: int = 64 << 20) -> None:
        self.max_items = max_items
        self.max_bytes = max_bytes
        self._items: OrderedDict[str, tuple[bytes, int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def put(
        self,
        response: dict[str, Any],
        conversation: list[dict[str, Any]],
        input_items: list[dict[str, Any]] = (),  # type: ignore[assignment]
    ) -> None:
        """Keeps ``response``, the chat messages of its whole ``conversation`` (what a
        continuation starts from) and the request's own ``input_items``."""
        record = {"response": response, "conversation": conversation, "input_items": input_items}
        blob = orjson.dumps(record)
        if len(blob) > self.max_bytes:
            return
        with self._lock:
            self._drop(response["id"])
            self._items[response["id"]] = (blob, len(blob))
            self._bytes += len(blob)
            while len(self._items) > self.max_items or self._bytes > self.max_bytes:
                self._drop(next(iter(self._items)))

    def get(self, response_id: str) -> dict[str, Any] | None:
        with self._lock:
            entry = self._items.get(response_id)
        return None if entry is None else orjson.loads(entry[0])

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._drop(response_id)

    def _drop(self, response_id: str) -> bool:
        entry = self._items.pop(response_id, None)
        if entry is not None:
            self._bytes -= entry[1]
        return entry is not None

    def __len__(self) -> int:
        return len(self._items)


def get_store(request: Request) -> ResponseStore:
    state = request.app.state
    store = getattr(state, "response_store", None)
    if store is None:
        store = state.response_store = ResponseStore()
    return store


def _not_found(response_id: str, param: str = "response_id") -> GenerateError:
    return GenerateError(
        f"no stored response has the id {response_id!r} (responses are kept in memory, a "
        "bounded number, until the server restarts)",
        404,
        param,
        "response_not_found",
    )


# ---------------------------------------------------------------------- request -> chat
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


def _input_messages(req: ResponsesRequest) -> list[dict[str, Any]]:
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
    raise _bad(
        "tool_choice must be 'none', 'auto', 'required' or {\"type\": \"function\", \"name\": ...}",
        "tool_choice",
    )


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    if not text:
        return None
    unknown = set(text) - {"format", "verbosity"}
    if unknown:
        raise _bad(f"text has unsupported fields: {sorted(unknown)}", "text")
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


def _chat_request(
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


# ---------------------------------------------------------------------- output items
def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputBuilder:
    """Chat deltas (``reasoning_content``, ``content``, ``tool_calls``) in; Responses output
    items and the stream events that build them out. The non-streamed route feeds the whole
    output once, so both forms hold the same items."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self.events: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None  # the item being written
        self._calls: dict[int, dict[str, Any]] = {}  # tool-call index -> its item
        self._logprobs: list[dict[str, Any]] = []  # of tokens whose text has not come out yet

    def _emit(self, kind: str, **fields: Any) -> None:
        self.events.append({"type": kind, **fields})

    def _index(self, item: dict[str, Any]) -> int:
        return next(i for i, it in enumerate(self.items) if it is item)

    def _ref(self, item: dict[str, Any]) -> dict[str, Any]:
        """The fields locating a content event: its item and the item's place in the output."""
        return {"item_id": item["id"], "output_index": self._index(item)}

    def _start(self, item: dict[str, Any]) -> None:
        self._close()
        self.items.append(item)
        self._open = item
        self._emit("response.output_item.added", output_index=len(self.items) - 1, item=dict(item))

    def _close(self, status: str = "completed") -> None:
        item, self._open = self._open, None
        if item is None:
            return
        ref = self._ref(item)
        if item["type"] == "message":
            part = item["content"][0]
            self._emit(
                "response.output_text.done",
                **ref,
                content_index=0,
                text=part["text"],
                logprobs=part["logprobs"],
            )
            self._emit("response.content_part.done", **ref, content_index=0, part=dict(part))
        elif item["type"] == "reasoning":
            text = item["content"][0]["text"]
            self._emit("response.reasoning_text.done", **ref, content_index=0, text=text)
        else:
            self._emit(
                "response.function_call_arguments.done",
                **ref,
                name=item["name"],
                arguments=item["arguments"],
            )
        item["status"] = status
        self._emit("response.output_item.done", output_index=ref["output_index"], item=item)

    def feed(self, delta: dict[str, Any], logprobs: list[dict[str, Any]]) -> None:
        """One delta; ``logprobs`` of the tokens behind it wait for the next text (a parser may
        hold text back), and go with it."""
        self._logprobs += logprobs
        if delta.get("reasoning_content"):
            self._reasoning(delta["reasoning_content"])
        if delta.get("content"):
            self._text(delta["content"], self._logprobs)
            self._logprobs = []
        for call in delta.get("tool_calls", ()):
            self._call(call)

    def _reasoning(self, text: str) -> None:
        item = self._open
        if item is None or item["type"] != "reasoning":
            item = {
                "id": _new_id("rs"),
                "type": "reasoning",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": ""}],
                "status": "in_progress",
            }
            self._start(item)
        item["content"][0]["text"] += text
        self._emit(
            "response.reasoning_text.delta",
            **self._ref(item),
            content_index=0,
            delta=text,
        )

    def _text(self, text: str, logprobs: list[dict[str, Any]]) -> None:
        item = self._open
        if item is None or item["type"] != "message":
            item = {
                "id": _new_id("msg"),
                "type": "message",
                "status": "in_progress",
                "role": "assistant",
                "content": [],
            }
            self._start(item)
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            item["content"].append(part)
            self._emit(
                "response.content_part.added",
                **self._ref(item),
                content_index=0,
                part=dict(part, logprobs=[]),
            )
        part = item["content"][0]
        part["text"] += text
        part["logprobs"] += logprobs
        self._emit(
            "response.output_text.delta",
            **self._ref(item),
            content_index=0,
            delta=text,
            logprobs=logprobs,
        )

    def _call(self, call: dict[str, Any]) -> None:
        item = self._calls.get(call["index"])
        function = call.get("function", {})
        if item is None:
            item = {
                "id": _new_id("fc"),
                "type": "function_call",
                "status": "in_progress",
                "call_id": call["id"],
                "name": function.get("name", ""),
                "arguments": "",
            }
            self._calls[call["index"]] = item
            self._start(item)
        arguments = function.get("arguments") or ""
        if arguments:
            item["arguments"] += arguments
            self._emit(
                "response.function_call_arguments.delta",
                **self._ref(item),
                delta=arguments,
            )

    def finish(self, cut: bool) -> None:
        """Closes the item being written (``incomplete`` when the length limit cut it). Logprobs
        still waiting (the end-of-sequence token's) join the last message's text; with no
        message they were the calls' tokens, which carry none."""
        messages = [it for it in self.items if it["type"] == "message"]
        if messages and self._logprobs:
            messages[-1]["content"][0]["logprobs"] += self._logprobs
        self._logprobs = []
        self._close("incomplete" if cut else "completed")

    def take_events(self) -> list[dict[str, Any]]:
        events, self.events = self.events, []
        return events


def _output_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chat messages of a response's output (kept for ``previous_response_id``)."""
    conversation = _Conversation()
    for item in items:
        conversation.add(item, "output")
    return conversation.finished()


# ---------------------------------------------------------------------- response object
class ResponseCall:
    """One Responses request in flight: its echo fields, plan and output."""

    def __init__(
        self, req: ResponsesRequest, model: str, plan: OpenAIPlan, chat: ChatCompletionRequest
    ) -> None:
        self.req = req
        self.plan = plan
        self.id = _new_id("resp")
        self.created = int(time.time())
        self.model = model
        self.chat = chat
        self.builder = OutputBuilder()
        self.stream = ChoiceStream(plan.parsing)
        self.num_chars = 0
        self.num_logprobs = 0
        self.seq = 0

    def feed(self, out: dict[str, Any]) -> None:
        """One update of the output: its new text (and logprobs) through the parsers."""
        reason = finish_reason(out)
        text = out["text"][self.num_chars :]
        self.num_chars = len(out["text"])
        logprobs: list[dict[str, Any]] = []
        if self.chat.logprobs:
            meta = out["meta_info"]
            entries = meta.get("output_token_logprobs", [])[self.num_logprobs :]
            tops = meta["output_top_logprobs"][self.num_logprobs :]
            self.num_logprobs += len(entries)
            logprobs = chat_logprobs(entries, tops)["content"]
        self.builder.feed(self.stream.feed(text), logprobs)
        if reason is not None:
            self.builder.feed(self.stream.flush(), [])
            self.builder.finish(cut=reason == "length")

    def body(self, status: str, out: dict[str, Any] | None) -> dict[str, Any]:
        req = self.req
        cut = out is not None and finish_reason(out) == "length"
        fmt = (req.text or {}).get("format") or {"type": "text"}
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": "incomplete" if cut else status,
            "completed_at": int(time.time()) if status == "completed" and not cut else None,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "max_tool_calls": None,
            "model": self.model,
            "output": self.builder.items if out is not None else [],
            "parallel_tool_calls": self.plan.parsing.parallel,
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": (req.reasoning or {}).get("effort"), "summary": None},
            "store": req.store is not False,
            "temperature": req.temperature,
            "text": {"format": fmt, "verbosity": (req.text or {}).get("verbosity")},
            "tool_choice": req.tool_choice or ("auto" if req.tools else "none"),
            "tools": [_echo_tool(t) for t in req.tools or ()],
            "top_logprobs": req.top_logprobs,
            "top_p": req.top_p,
            "truncation": "disabled",
            "usage": _usage(out) if out is not None else None,
            "user": req.user,
            "metadata": req.metadata or {},
            "background": False,
            "service_tier": "default",
        }

    def event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


def _echo_tool(tool: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "function",
        "name": tool.get("name"),
        "description": tool.get("description"),
        "parameters": tool.get("parameters"),
        "strict": tool.get("strict", True),
    }


def _usage(out: dict[str, Any]) -> dict[str, Any]:
    meta = out["meta_info"]
    prompt, completion = meta["prompt_tokens"], meta["completion_tokens"]
    cached = meta.get("cached_tokens", 0)
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": prompt - cached},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }


# ---------------------------------------------------------------------- routes
# Fields of OpenAI's request that mean nothing here and are accepted as such (OpenAI-side
# caching, moderation and routing hints; the extra_* of the openai client never reach a body).
IGNORED_FIELDS = frozenset(
    {"prompt_cache_retention", "prompt_cache_options", "context_management", "safety_identifier"}
)


def _precheck(data: dict[str, Any], max_items: int) -> None:
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
    check_list_len(data.get("tools"), max_items, "tools")


@router.post("/v1/responses", openapi_extra=json_body(ResponsesRequest), responses=STREAM_RESPONSE)
async def create_response(request: Request) -> Response:
    tm = get_tm(request)
    req = await parse_body(
        request,
        ResponsesRequest,
        UNSUPPORTED_RESPONSES,
        lambda data: _precheck(data, tm.context_length),
    )
    state = request.app.state
    check_model(req.model, state.accepted_model_names, state.served_model_name)
    model = req.model or state.served_model_name
    store = get_store(request)
    history: list[dict[str, Any]] = []
    if req.previous_response_id is not None:
        previous = store.get(req.previous_response_id)
        if previous is None:
            raise _not_found(req.previous_response_id, "previous_response_id")
        history = previous["conversation"]
    messages = _input_messages(req)
    chat = _chat_request(req, history, messages)
    try:
        plan = await chat_plan(chat, tm)
    except GenerateError as e:  # the chat form's field names, told as the request's
        param = "input" if e.param and e.param.startswith("messages") else e.param
        param = "reasoning.effort" if param == "reasoning_effort" else param
        if param != e.param:
            raise GenerateError(e.message, e.status_code, param, e.code) from None
        raise
    prepared = await tm.prepare_all(plan.inputs)
    call = ResponseCall(req, model, plan, chat)
    group = tm.open(prepared, request)
    conversation = history + messages
    if req.stream is True:
        return ClosingStreamingResponse(_stream(call, group, store, conversation), group.close)
    with group:
        (out,) = await group.collect()
    call.feed(out)
    body = call.body("completed", out)
    _keep(store, req, body, conversation)
    return json_response(body)


def _keep(
    store: ResponseStore, req: ResponsesRequest, body: dict[str, Any], conversation: list
) -> None:
    if req.store is not False:
        store.put(body, conversation + _output_messages(body["output"]), _input_items(req))


_ITEM_ID_PREFIXES = {
    "message": "msg",
    "function_call": "fc",
    "function_call_output": "fco",
    "reasoning": "rs",
}


def _input_items(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's input as ``input_items`` lists them (OpenAI's item shapes): a string input
    is one user message; every item gets its ``type``, an ``id`` and a ``status``; message
    text becomes parts (``input_text``, or ``output_text`` for the assistant's)."""
    raw = req.input if isinstance(req.input, list) else [{"role": "user", "content": req.input}]
    items = []
    for item in raw:
        kind = item.get("type", "message")
        out = {"id": _new_id(_ITEM_ID_PREFIXES.get(kind, "item")), "status": "completed"}
        out.update(item, type=kind)
        if kind == "message" and isinstance(out.get("content"), str):
            assistant = out.get("role") == "assistant"
            part = {"type": "output_text" if assistant else "input_text", "text": out["content"]}
            if assistant:
                part["annotations"] = []
            out["content"] = [part]
        items.append(out)
    return items


async def _stream(
    call: ResponseCall, group: RequestGroup, store: ResponseStore, conversation: list
) -> AsyncIterator[bytes]:
    """``response.created``, ``response.in_progress``, the items' events, then
    ``response.completed`` (``response.incomplete`` when cut at the length limit); an error
    becomes an ``error`` event followed by ``response.failed``."""
    yield call.event("response.created", response=call.body("in_progress", None))
    yield call.event("response.in_progress", response=call.body("in_progress", None))
    out: dict[str, Any] | None = None
    try:
        async for _, out in group.updates():
            call.feed(out)
            for event in call.builder.take_events():
                kind = event.pop("type")
                yield call.event(kind, **event)
        assert out is not None
        body = call.body("completed", out)
        _keep(store, call.req, body, conversation)
        kind = "response.incomplete" if body["status"] == "incomplete" else "response.completed"
        yield call.event(kind, response=body)
    except GenerateError as e:
        error = error_body(e.message, e.status_code, e.param, e.code)["error"]
        yield call.event("error", code=error["code"], message=e.message, param=e.param)
        failed = call.body("failed", None)
        failed["error"] = {"code": "server_error", "message": e.message}
        yield call.event("response.failed", response=failed)
    except ClientDisconnected:
        return
    finally:
        group.close()


@router.get("/v1/responses/{response_id}")
async def retrieve_response(response_id: str, request: Request) -> Response:
    stored = get_store(request).get(response_id)
    if stored is None:
        raise _not_found(response_id)
    return json_response(stored["response"])


@router.get("/v1/responses/{response_id}/input_items")
async def list_input_items(
    response_id: str,
    request: Request,
    after: str | None = None,
    limit: int = 20,
    order: str = "desc",
) -> Response:
    """A page of a stored response's input items: ``order`` ``desc`` (newest first, OpenAI's
    default) or ``asc``, ``limit`` 1 to 100, starting after the item ``after``."""
    stored = get_store(request).get(response_id)
    if stored is None:
        raise _not_found(response_id)
    if order not in ("asc", "desc"):
        raise _bad(f"order must be 'asc' or 'desc', got {order!r}", "order")
    if not 1 <= limit <= 100:
        raise _bad(f"limit must be in [1, 100], got {limit}", "limit")
    items = stored.get("input_items") or []
    if order == "desc":
        items = items[::-1]
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise _bad(f"after: no input item of this response has the id {after!r}", "after")
        items = items[ids.index(after) + 1 :]
    page = items[:limit]
    return json_response(
        {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(items) > limit,
        }
    )


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request) -> Response:
    if not get_store(request).delete(response_id):
        raise _not_found(response_id)
    return json_response({"id": response_id, "object": "response", "deleted": True})
