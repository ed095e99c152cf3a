"""OpenAI's Responses API routes: ``POST /v1/responses``, ``GET`` / ``DELETE
/v1/responses/{id}``, ``GET /v1/responses/{id}/input_items``, and the store behind them.
The request side lives in ``responses_input``, the output side in ``responses_output``.

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
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response

from radixlm.srt.managers.tokenizer_manager import ClientDisconnected, GenerateError, RequestGroup
from radixlm.srt.server.chat.plan import chat_plan, name_grammar_error
from radixlm.srt.server.http.deps import (
    caller_namespace,
    check_model,
    get_tm,
    json_response,
    take_routing_key,
)
from radixlm.srt.server.http.errors import error_body, parse_body
from radixlm.srt.server.http.openapi import ERROR_RESPONSES, STREAM_RESPONSE, json_body
from radixlm.srt.server.http.streaming import ClosingStreamingResponse
from radixlm.srt.server.openai.responses_input import (
    UNSUPPORTED_RESPONSES,
    ResponsesRequest,
    chat_request,
    input_items,
    input_messages,
    output_messages,
    precheck,
)
from radixlm.srt.server.openai.responses_output import ResponseCall

router = APIRouter(responses=ERROR_RESPONSES)


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


# ---------------------------------------------------------------------- routes
@router.post("/v1/responses", openapi_extra=json_body(ResponsesRequest), responses=STREAM_RESPONSE)
async def create_response(request: Request) -> Response:
    tm = get_tm(request)
    req = await parse_body(
        request,
        ResponsesRequest,
        UNSUPPORTED_RESPONSES,
        lambda data: precheck(data, tm.context_length),
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
    messages = input_messages(req)
    chat = chat_request(req, history, messages)
    try:
        plan = await chat_plan(chat, tm)
    except GenerateError as e:  # the chat form's field names, told as the request's
        param = "input" if e.param and e.param.startswith("messages") else e.param
        param = "reasoning.effort" if param == "reasoning_effort" else param
        if param != e.param:
            raise GenerateError(e.message, e.status_code, param, e.code) from None
        raise
    prepared = await tm.prepare_all(take_routing_key(plan.inputs, request))
    call = ResponseCall(req, model, plan, chat)
    group = tm.open(prepared, request, caller_namespace(request, req.user))
    conversation = history + messages
    if req.stream is True:
        return ClosingStreamingResponse(_stream(call, group, store, conversation), group.close)
    try:
        with group:
            (out,) = await group.collect()
    except GenerateError as e:  # a grammar that did not compile: the field that asked for it
        name_grammar_error(e, chat, {"response_format": "text.format"})
        raise
    call.feed(out)
    body = call.body("completed", out)
    _keep(store, req, body, conversation)
    return json_response(body)


def _keep(
    store: ResponseStore, req: ResponsesRequest, body: dict[str, Any], conversation: list
) -> None:
    if req.store is not False:
        store.put(body, conversation + output_messages(body["output"]), input_items(req))


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
async def listinput_items(
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
        raise GenerateError(f"order must be 'asc' or 'desc', got {order!r}", 400, "order")
    if not 1 <= limit <= 100:
        raise GenerateError(f"limit must be in [1, 100], got {limit}", 400, "limit")
    items = stored.get("input_items") or []
    if order == "desc":
        items = items[::-1]
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise GenerateError(
                f"after: no input item of this response has the id {after!r}", 400, "after"
            )
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
