"""The OpenAI-compatible API: /v1/models, /v1/chat/completions, /v1/completions."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from radixlm.srt.managers.tokenizer_manager import (
    ClientDisconnected,
    GenerateError,
    RequestGroup,
    TokenizerManager,
)
from radixlm.srt.server.chat.plan import (
    OpenAIPlan,
    chat_logprobs,
    chat_plan,
    check_model,
    completion_entries,
    completion_logprobs,
    completion_plan,
    finish_reason,
    name_grammar_error,
    usage,
)
from radixlm.srt.server.chat.tool_stream import ChoiceStream, chat_message
from radixlm.srt.server.http.errors import parse_body, sse_error
from radixlm.srt.server.http.openapi import ERROR_RESPONSES, STREAM_RESPONSE, json_body
from radixlm.srt.server.http.streaming import SSE_DONE, ClosingStreamingResponse, sse
from radixlm.srt.server.native.generate import batch_precheck, get_tm, json_response
from radixlm.srt.server.openai.protocol import (
    UNSUPPORTED_CHAT,
    UNSUPPORTED_COMPLETION,
    ChatCompletionRequest,
    CompletionRequest,
    precheck_chat,
)
from radixlm.srt.server.openai.vllm_compat import translate_vllm_fields

router = APIRouter(responses=ERROR_RESPONSES)


@dataclass
class Call:
    """What every response piece of one OpenAI call shares."""

    tm: TokenizerManager
    plan: OpenAIPlan
    id: str
    created: int
    model: str
    object: str
    echo: bool = False
    logprobs: bool = False
    top_logprobs: bool = False
    include_usage: bool = False
    continuous_usage: bool = False  # stream_options.continuous_usage_stats

    def envelope(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }


@dataclass
class ChoiceCursor:
    """How much of one choice a stream has sent."""

    num_chars: int = 0
    num_logprobs: int = 0
    text_offset: int = 0
    started: bool = False
    parsers: ChoiceStream | None = None  # chat: this choice's tool-call / reasoning parsers


def _matched_stop(out: dict[str, Any]) -> Any:
    reason = out["meta_info"]["finish_reason"] or {}
    return reason.get("matched")


# ---------------------------------------------------------------------- models
@router.get("/v1/models")
async def list_models(request: Request) -> Response:
    return json_response({"object": "list", "data": [model_card(request)]})


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(model_id: str, request: Request) -> Response:
    check_model(
        model_id, request.app.state.accepted_model_names, request.app.state.served_model_name
    )
    return json_response(model_card(request))


def model_card(request: Request) -> dict[str, Any]:
    tm = get_tm(request)
    return {
        "id": request.app.state.served_model_name,
        "object": "model",
        "created": request.app.state.created,
        "owned_by": "radixlm",
        # the path the operator named (never the cache path of the embedded default model)
        "root": tm.cfg.model_path or request.app.state.served_model_name,
        "max_model_len": tm.info.get("context_length"),
    }


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
        "matched_stop": _matched_stop(out),
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
        finish["choices"][0]["matched_stop"] = _matched_stop(out)
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
        chunk["choices"][0]["matched_stop"] = _matched_stop(out)
    return [chunk]


def _stream_options(body: Any) -> dict[str, bool]:
    """The ``Call`` fields ``stream_options`` sets; a 400 without ``stream: true`` (OpenAI
    and vLLM refuse it there too)."""
    options = body.stream_options
    if options is None:
        return {}
    if not body.stream:
        raise GenerateError(
            "stream_options is only allowed with stream: true", 400, "stream_options"
        )
    return {
        "include_usage": options.include_usage,
        "continuous_usage": options.continuous_usage_stats,
    }


async def _prepared(tm: TokenizerManager, plan: Any, limit: str, prompt: str) -> list[Any]:
    """``tm.prepare_all`` whose errors name the OpenAI fields: ``limit`` for the native
    ``max_new_tokens``, ``prompt`` for a prompt that is empty or too long."""
    try:
        return await tm.prepare_all(plan.inputs)
    except GenerateError as e:
        if e.param == "max_new_tokens":
            e.param = limit
            e.message = e.message.replace("max_new_tokens", limit)
        elif e.param is None and e.message.startswith("the prompt"):
            e.param = prompt
        raise


def _open_call(request: Request, model: str | None) -> tuple[TokenizerManager, str]:
    state = request.app.state
    check_model(model, state.accepted_model_names, state.served_model_name)
    return get_tm(request), model or state.served_model_name


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
    tm, model = _open_call(request, body.model)
    plan = await chat_plan(body, tm)
    limit = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    prepared = await _prepared(tm, plan, limit, "messages")
    call = Call(
        tm,
        plan,
        f"chatcmpl-{uuid.uuid4().hex}",
        int(time.time()),
        model,
        "chat.completion",
        logprobs=body.logprobs,
        **_stream_options(body),
    )
    group = tm.open(prepared, request)
    if body.stream:
        call.object = "chat.completion.chunk"
        updates = await _answered(group, body, stream=True)
        return ClosingStreamingResponse(
            stream_choices(call, group, chat_chunks, updates), group.close
        )
    outs = await _answered(group, body, stream=False)
    choices = [chat_choice(call, i, out) for i, out in enumerate(outs)]
    return json_response(call.envelope(choices, usage=usage(outs, plan)))


# ---------------------------------------------------------------------- completions
def completion_choice(call: Call, i: int, out: dict[str, Any]) -> dict[str, Any]:
    prompt = call.plan.prompt_texts[call.plan.prompt_of(i)]
    logprobs = None
    if call.logprobs:
        entries, tops = completion_entries(out, call.echo)
        offset = 0 if call.echo else len(prompt)
        logprobs = completion_logprobs(entries, tops, call.top_logprobs, offset)
    return {
        "index": i,
        "text": (prompt if call.echo else "") + out["text"],
        "logprobs": logprobs,
        "finish_reason": finish_reason(out),
        "matched_stop": _matched_stop(out),
    }


def completion_chunks(call: Call, i: int, out: dict[str, Any], cur: ChoiceCursor) -> list[dict]:
    reason = finish_reason(out)
    prompt = call.plan.prompt_texts[call.plan.prompt_of(i)]
    text = out["text"][cur.num_chars :]
    entries, tops = completion_entries(out, call.echo) if call.logprobs else ([], [])
    entries, tops = entries[cur.num_logprobs :], tops[cur.num_logprobs :]
    if cur.started and not text and not entries and reason is None:
        return []
    if not cur.started:
        cur.text_offset = 0 if call.echo else len(prompt)
        text = (prompt if call.echo else "") + text
    logprobs = None
    if call.logprobs:
        logprobs = completion_logprobs(entries, tops, call.top_logprobs, cur.text_offset)
        cur.text_offset += sum(len(e[2] or "") for e in entries)
    cur.started, cur.num_chars = True, len(out["text"])
    cur.num_logprobs += len(entries)
    choice = {"index": i, "text": text, "logprobs": logprobs, "finish_reason": reason}
    if reason is not None:
        choice["matched_stop"] = _matched_stop(out)
    return [call.envelope([choice], **({"usage": None} if call.include_usage else {}))]


def completion_precheck(tm: TokenizerManager) -> Callable[[dict[str, Any]], None]:
    """vLLM's structured-output fields read as ours, then the batch sizes."""
    batch = batch_precheck(tm)

    def check(data: dict[str, Any]) -> None:
        translate_vllm_fields(data)
        batch(data)

    return check


@router.post(
    "/v1/completions", openapi_extra=json_body(CompletionRequest), responses=STREAM_RESPONSE
)
async def completions(request: Request) -> Response:
    body = await parse_body(
        request, CompletionRequest, UNSUPPORTED_COMPLETION, completion_precheck(get_tm(request))
    )
    tm, model = _open_call(request, body.model)
    plan = await completion_plan(body, tm)
    prepared = await _prepared(tm, plan, "max_tokens", "prompt")
    call = Call(
        tm,
        plan,
        f"cmpl-{uuid.uuid4().hex}",
        int(time.time()),
        model,
        "text_completion",
        echo=body.echo,
        logprobs=body.logprobs is not None,
        top_logprobs=bool(body.logprobs),
        **_stream_options(body),
    )
    group = tm.open(prepared, request)
    if body.stream:
        updates = await _answered(group, body, stream=True)
        return ClosingStreamingResponse(
            stream_choices(call, group, completion_chunks, updates), group.close
        )
    outs = await _answered(group, body, stream=False)
    choices = [completion_choice(call, i, out) for i, out in enumerate(outs)]
    return json_response(call.envelope(choices, usage=usage(outs, plan)))


async def _answered(group: RequestGroup, body: Any, *, stream: bool) -> Any:
    """The group's started updates (``stream``) or its collected outputs; a grammar's 400
    (it did not compile) names the OpenAI request field it came from."""
    try:
        if stream:
            return await started_updates(group)
        with group:
            return await group.collect()
    except GenerateError as e:
        name_grammar_error(e, body)
        raise


# ---------------------------------------------------------------------- streaming
def _choice_usage(out: dict[str, Any]) -> dict[str, int]:
    """One choice's usage so far (``continuous_usage_stats``, as SGLang counts it)."""
    meta = out["meta_info"]
    prompt, completion = meta["prompt_tokens"], meta["completion_tokens"]
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


ChunkFn = Callable[[Call, int, dict[str, Any], ChoiceCursor], "list[dict]"]


Updates = AsyncIterator[tuple[int, dict[str, Any]]]


async def started_updates(group: RequestGroup) -> Updates:
    """``group.updates()`` once its first update is in: a request refused before its first
    token (a grammar that does not compile, an abort with a status) raises here, so the client
    gets an HTTP error (the same 400 as without ``stream``) instead of a 200 stream holding an
    error event. The first update comes with the first token, so no chunk is delayed."""
    updates = group.updates()
    try:
        first = await anext(updates)
    except StopAsyncIteration:
        first = None
    except BaseException:
        group.close()
        raise

    async def chained() -> Updates:
        if first is not None:
            yield first
            async for update in updates:
                yield update

    return chained()


async def stream_choices(
    call: Call, group: RequestGroup, make_chunk: ChunkFn, updates: Updates
) -> AsyncIterator[bytes]:
    """One chunk per update of any choice (from ``updates``: :func:`started_updates`), one
    ``finish_reason`` per choice, then the usage chunk (when asked for) and ``[DONE]``; an
    error after the first update becomes an error event."""
    cursors = [ChoiceCursor() for _ in group.states]
    finals: list[dict[str, Any]] = [{} for _ in group.states]
    try:
        async for i, out in updates:
            for chunk in make_chunk(call, i, out, cursors[i]):
                if call.continuous_usage:
                    chunk["usage"] = _choice_usage(out)
                yield sse(chunk)
            finals[i] = out
        if call.include_usage:
            yield sse(call.envelope([], usage=usage(finals, call.plan)))
    except GenerateError as e:
        yield sse_error(e)
    except ClientDisconnected:
        return
    finally:
        group.close()
    yield SSE_DONE
