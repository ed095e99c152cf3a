"""OpenAI's chat completions: ``/v1/chat/completions`` (and SageMaker's ``/invocations``, the
same route). /v1/completions is completions.py, /v1/models models.py; call.py holds what the
chat and completion calls share."""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from radixlm.srt.server.chat.plan import chat_logprobs, chat_plan, finish_reason, usage
from radixlm.srt.server.chat.request import ChatCompletionRequest
from radixlm.srt.server.chat.tool_stream import ChoiceStream, chat_message
from radixlm.srt.server.http.deps import caller_namespace, get_tm, json_response
from radixlm.srt.server.http.errors import parse_body
from radixlm.srt.server.http.openapi import ERROR_RESPONSES, STREAM_RESPONSE, json_body
from radixlm.srt.server.http.streaming import ClosingStreamingResponse
from radixlm.srt.server.openai.call import (
    Call,
    ChoiceCursor,
    answered,
    matched_stop,
    open_call,
    prepared_inputs,
    stream_choices,
    stream_options,
)
from radixlm.srt.server.openai.protocol import UNSUPPORTED_CHAT, precheck_chat

router = APIRouter(responses=ERROR_RESPONSES)


# ---------------------------------------------------------------------- chat
def _chat_finish(out: dict[str, Any], has_calls: bool) -> str | None:
    """``tool_calls`` when the reply made calls and was not cut off by the length limit."""
    reason = finish_reason(out)
    return "tool_calls" if has_calls and reason == "stop" else reason


def chat_choice(call: Call, i: int, out: dict[str, Any]) -> dict[str, Any]:
    meta = out["meta_info"]
    logprobs = None
    if call.logprobs:
        logprobs = chat_logprobs(
            meta["output_token_logprobs"], meta["output_top_logprobs"], call.plan.token_bytes
        )
    message, has_calls = chat_message(call.plan.parsing, out["text"])
    return {
        "index": i,
        "message": message,
        "logprobs": logprobs,
        "finish_reason": _chat_finish(out, has_calls),
        "matched_stop": matched_stop(out),
    }


def _chat_piece(call: Call, i: int, delta: dict, logprobs: Any, reason: str | None) -> dict:
    choice = {"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
    return call.envelope([choice], **({"usage": None} if call.include_usage else {}))


def chat_chunks(call: Call, i: int, out: dict[str, Any], cur: ChoiceCursor) -> list[dict]:
    """The chunks one update of choice ``i`` makes: deltas, and the finish chunk at its end."""
    meta = out["meta_info"]
    reason = finish_reason(out)
    text = out["text"][cur.num_chars :]
    entries = meta.get("output_token_logprobs", [])[cur.num_logprobs :] if call.logprobs else []
    logprobs = None
    if call.logprobs:
        logprobs = chat_logprobs(
            entries, meta["output_top_logprobs"][cur.num_logprobs :], call.plan.token_bytes
        )
    cur.num_chars = len(out["text"])
    cur.num_logprobs += len(entries)
    if cur.parsers is None:
        cur.parsers = ChoiceStream(call.plan.parsing)
    if cur.parsers.is_plain:
        return _plain_chat_chunks(call, i, out, cur, text, logprobs, reason)
    deltas = [cur.parsers.feed(text)] + ([cur.parsers.flush()] if reason is not None else [])
    chunks = []
    for delta in deltas:
        if not cur.started:
            delta = {"role": "assistant", **delta, "refusal": None}
        if delta or logprobs is not None and logprobs["content"]:
            chunks.append(_chat_piece(call, i, delta, logprobs, None))
            cur.started, logprobs = True, None
    if reason is not None:
        finish = _chat_piece(call, i, {}, None, _chat_finish(out, cur.parsers.has_calls))
        finish["choices"][0]["matched_stop"] = matched_stop(out)
        chunks.append(finish)
    return chunks


def _plain_chat_chunks(
    call: Call,
    i: int,
    out: dict[str, Any],
    cur: ChoiceCursor,
    text: str,
    logprobs: Any,
    reason: str | None,
) -> list[dict]:
    """No parser: each update is one chunk, the last one carrying the finish reason."""
    if cur.started and not text and not (logprobs and logprobs["content"]) and reason is None:
        return []
    delta: dict[str, Any] = {"content": text}
    if not cur.started:
        delta["role"] = "assistant"
        delta["refusal"] = None
    cur.started = True
    chunk = _chat_piece(call, i, delta, logprobs, reason)
    if reason is not None:
        chunk["choices"][0]["matched_stop"] = matched_stop(out)
    return [chunk]


@router.post(
    "/v1/chat/completions",
    openapi_extra=json_body(ChatCompletionRequest),
    responses=STREAM_RESPONSE,
)
# SageMaker's inference route (SGLang serves chat completions there too)
@router.post("/invocations", include_in_schema=False)
async def chat_completions(request: Request) -> Response:
    body = await parse_body(
        request,
        ChatCompletionRequest,
        UNSUPPORTED_CHAT,
        lambda data: precheck_chat(data, get_tm(request).context_length),
    )
    tm, model = open_call(request, body.model)
    plan = await chat_plan(body, tm)
    limit = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    prepared = await prepared_inputs(tm, plan, limit, "messages", request)
    call = Call(
        tm,
        plan,
        f"chatcmpl-{uuid.uuid4().hex}",
        int(time.time()),
        model,
        "chat.completion",
        logprobs=body.logprobs,
        **stream_options(body),
    )
    group = tm.open(prepared, request, caller_namespace(request, body.user))
    if body.stream:
        call.object = "chat.completion.chunk"
        updates = await answered(group, body, stream=True)
        return ClosingStreamingResponse(
            stream_choices(call, group, chat_chunks, updates), group.close
        )
    outs = await answered(group, body, stream=False)
    choices = [chat_choice(call, i, out) for i, out in enumerate(outs)]
    return json_response(call.envelope(choices, usage=usage(outs, plan)))
