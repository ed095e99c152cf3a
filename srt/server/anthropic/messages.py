"""Anthropic's Messages API: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

The request is read into the chat route's request (``messages_input``) and runs through the
same plan, tool-call and reasoning parsers; the reply is a Messages ``message``: ``thinking``,
``text`` and ``tool_use`` blocks in the order the model wrote them, ``stop_reason``
(``end_turn``, ``max_tokens``, ``stop_sequence`` with the ``stop_sequence`` that matched,
``tool_use``) and ``usage`` (``input_tokens`` not read from the prefix cache,
``cache_read_input_tokens`` that were, ``output_tokens``). Streamed, it is Anthropic's event
sequence: ``message_start``, per block ``content_block_start`` / ``content_block_delta``
(``thinking_delta``, ``text_delta``, ``input_json_delta``) / ``content_block_stop``, then
``message_delta`` (stop reason, output tokens) and ``message_stop``; an error after the
stream started is an ``error`` event. ``max_tokens`` (required, and a cap: clients send their
model's output limit) past what the context leaves means "up to the context". Errors on these
routes carry Anthropic's ``{"type": "error", "error": {...}}`` envelope (the OpenAI fields are
inside too).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response

from radixlm.srt.managers.tokenizer_manager import ClientDisconnected, GenerateError, RequestGroup
from radixlm.srt.server.anthropic.messages_input import (
    CountTokensRequest,
    MessagesRequest,
    chat_request,
    precheck,
)
from radixlm.srt.server.chat.plan import chat_plan, finish_reason, name_grammar_error
from radixlm.srt.server.chat.tool_stream import ChoiceStream, chat_message
from radixlm.srt.server.http.deps import (
    caller_namespace,
    check_model,
    get_tm,
    json_response,
    take_routing_key,
)
from radixlm.srt.server.http.errors import parse_body
from radixlm.srt.server.http.openapi import ERROR_RESPONSES, STREAM_RESPONSE, json_body
from radixlm.srt.server.http.streaming import ClosingStreamingResponse, started_updates

router = APIRouter(responses=ERROR_RESPONSES)


def _tool_use_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


def _input_of(arguments: str) -> Any:
    """A call's arguments as the ``input`` object (text cut off mid-JSON stays a string)."""
    try:
        value = json.loads(arguments) if arguments else {}
    except ValueError:
        return arguments
    return value if isinstance(value, dict) else arguments


def _usage(out: dict[str, Any]) -> dict[str, int]:
    meta = out["meta_info"]
    cached = meta.get("cached_tokens") or 0
    return {
        "input_tokens": meta["prompt_tokens"] - cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": meta["completion_tokens"],
    }


def _stop(out: dict[str, Any], req: MessagesRequest, has_calls: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence)."""
    reason = finish_reason(out)  # an abort raises
    if has_calls:
        return "tool_use", None
    if reason == "length":
        return "max_tokens", None
    matched = (out["meta_info"]["finish_reason"] or {}).get("matched")
    if isinstance(matched, str) and matched in (req.stop_sequences or ()):
        return "stop_sequence", matched
    return "end_turn", None


# the chat form's field names, as the Messages request spells them
FIELD_NAMES = (
    (".function.parameters", ".input_schema"),
    (".function.name", ".name"),
    ("response_format", "output_config.format"),
    ("reasoning_effort", "output_config.effort"),
)


def _messages_fields(e: GenerateError) -> GenerateError:
    """``e`` naming the Messages field where it names the chat route's."""
    for chat_name, name in FIELD_NAMES:
        if e.param and chat_name in e.param:
            e.param = e.param.replace(chat_name, name)
            e.message = e.message.replace(chat_name, name)
    return e


def _precheck(request: Request) -> Callable[[dict[str, Any]], None]:
    return lambda data: precheck(data, get_tm(request).context_length)


async def _plan(request: Request, req: CountTokensRequest):
    state = request.app.state
    check_model(req.model, state.accepted_model_names, state.served_model_name)
    tm = get_tm(request)
    chat = chat_request(req)
    try:
        return tm, chat, await chat_plan(chat, tm)
    except GenerateError as e:
        raise _messages_fields(e) from None


def _message_body(
    message_id: str, req: MessagesRequest, content: list, stop: tuple, usage: dict
) -> dict[str, Any]:
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": req.model,
        "content": content,
        "stop_reason": stop[0],
        "stop_sequence": stop[1],
        "usage": usage,
    }


@router.post("/v1/messages", openapi_extra=json_body(MessagesRequest), responses=STREAM_RESPONSE)
async def messages(request: Request) -> Response:
    req = await parse_body(request, MessagesRequest, None, _precheck(request))
    tm, chat, plan = await _plan(request, req)
    take_routing_key(plan.inputs, request)
    try:
        prepared = await tm.prepare_all(plan.inputs)
    except GenerateError as e:
        if e.param != "max_new_tokens":
            raise
        # Anthropic's max_tokens is required and a cap: clients send their model's output
        # limit (16K, 32K); past what the context leaves it means "up to the context" (any
        # other fault of the request is raised again by the second try)
        for inp in plan.inputs:
            inp.sampling_params = {**(inp.sampling_params or {}), "max_new_tokens": None}
        prepared = await tm.prepare_all(plan.inputs)
    user = (req.metadata or {}).get("user_id")
    group = tm.open(
        prepared, request, caller_namespace(request, user if isinstance(user, str) else None)
    )
    message_id = f"msg_{uuid.uuid4().hex}"
    try:  # a grammar that does not compile: a 400 naming the field that asked for it
        if req.stream:
            updates = await started_updates(group)
            stream = MessageStream(req, plan.parsing, message_id)
            return ClosingStreamingResponse(stream.events(group, updates), group.close)
        with group:
            (out,) = await group.collect()
    except GenerateError as e:
        name_grammar_error(e, chat)
        raise _messages_fields(e) from None
    message, has_calls = chat_message(plan.parsing, out["text"])
    blocks: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        blocks.append(
            {"type": "thinking", "thinking": message["reasoning_content"], "signature": ""}
        )
    if message.get("content"):
        blocks.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls", ()):
        function = call["function"]
        blocks.append(
            {
                "type": "tool_use",
                "id": _tool_use_id(),
                "name": function["name"],
                "input": _input_of(function["arguments"]),
            }
        )
    stop = _stop(out, req, has_calls)
    return json_response(_message_body(message_id, req, blocks, stop, _usage(out)))


@router.post("/v1/messages/count_tokens", openapi_extra=json_body(CountTokensRequest))
async def count_tokens(request: Request) -> Response:
    """The prompt's tokens as the Messages route would send it (template, tools, system)."""
    req = await parse_body(request, CountTokensRequest, None, _precheck(request))
    tm, _, plan = await _plan(request, req)
    (prepared,) = await tm.prepare_all(plan.inputs)
    return json_response({"input_tokens": len(prepared.msg.input_ids)})


def _event(kind: str, **fields: Any) -> bytes:
    return (
        b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, **fields}) + b"\n\n"
    )


class MessageStream:
    """One streamed message: the chat parsers' deltas become Anthropic's content blocks (a new
    block starts when the kind of delta changes, or with each tool call)."""

    def __init__(self, req: MessagesRequest, parsing: Any, message_id: str) -> None:
        self.req = req
        self.stream = ChoiceStream(parsing)
        self.message_id = message_id
        self.num_chars = 0
        self.index = -1
        self.open: tuple[str, int | None] | None = None  # (block kind, tool call index)

    def _start(self, kind: str, block: dict[str, Any], call: int | None = None) -> list[bytes]:
        out = self._stop_open()
        self.index += 1
        self.open = (kind, call)
        return out + [_event("content_block_start", index=self.index, content_block=block)]

    def _stop_open(self) -> list[bytes]:
        if self.open is None:
            return []
        self.open = None
        return [_event("content_block_stop", index=self.index)]

    def _delta(self, kind: str, delta: dict[str, Any]) -> bytes:
        return _event("content_block_delta", index=self.index, delta={"type": kind, **delta})

    def translate(self, delta: dict[str, Any]) -> list[bytes]:
        out: list[bytes] = []
        if delta.get("reasoning_content"):
            if self.open is None or self.open[0] != "thinking":
                out += self._start(
                    "thinking", {"type": "thinking", "thinking": "", "signature": ""}
                )
            out.append(self._delta("thinking_delta", {"thinking": delta["reasoning_content"]}))
        if delta.get("content"):
            if self.open is None or self.open[0] != "text":
                out += self._start("text", {"type": "text", "text": ""})
            out.append(self._delta("text_delta", {"text": delta["content"]}))
        for call in delta.get("tool_calls", ()):
            function = call.get("function", {})
            if self.open != ("tool_use", call["index"]):
                block = {
                    "type": "tool_use",
                    "id": _tool_use_id(),
                    "name": function.get("name"),
                    "input": {},
                }
                out += self._start("tool_use", block, call["index"])
            if function.get("arguments"):
                out.append(self._delta("input_json_delta", {"partial_json": function["arguments"]}))
        return out

    async def events(self, group: RequestGroup, updates: Any) -> AsyncIterator[bytes]:
        out: dict[str, Any] | None = None
        started = False
        try:
            async for _, out in updates:
                if not started:
                    usage = {**_usage(out), "output_tokens": 0}
                    message = _message_body(self.message_id, self.req, [], (None, None), usage)
                    yield _event("message_start", message=message)
                    started = True
                text = out["text"][self.num_chars :]
                self.num_chars = len(out["text"])
                for chunk in self.translate(self.stream.feed(text)):
                    yield chunk
                if out["meta_info"]["finish_reason"] is not None:
                    for chunk in self.translate(self.stream.flush()):
                        yield chunk
            assert out is not None
            for chunk in self._stop_open():
                yield chunk
            stop_reason, stop_sequence = _stop(out, self.req, self.stream.has_calls)
            yield _event(
                "message_delta",
                delta={"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                usage={"output_tokens": out["meta_info"]["completion_tokens"]},
            )
            yield _event("message_stop")
        except GenerateError as e:
            kind = "invalid_request_error" if e.status_code < 500 else "api_error"
            yield _event("error", error={"type": kind, "message": e.message})
        except ClientDisconnected:
            return
        finally:
            group.close()
