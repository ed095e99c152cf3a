"""SGLang's native HTTP API: /generate, model and server info, cache and abort control,
tokenize/detokenize, generation health check."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from radixlm.srt.managers.tokenizer_manager import (
    ClientDisconnected,
    GenerateError,
    GenerateInput,
    PreparedReq,
    TokenizerManager,
)
from radixlm.srt.server.errors import parse_body, sse_error
from radixlm.srt.server.protocol import (
    AbortRequestInput,
    DetokenizeInput,
    GenerateReqInput,
    TokenizeInput,
)
from radixlm.srt.server.streaming import SSE_DONE, SSE_HEADERS, collect_all, merge, sse

router = APIRouter()

HEALTH_GENERATE_TIMEOUT_S = 20.0  # SGLang answers its health check within 20 s too


def json_response(obj: Any, status_code: int = 200) -> Response:
    return Response(orjson.dumps(obj), status_code=status_code, media_type="application/json")


def get_tm(request: Request) -> TokenizerManager:
    return request.app.state.tm


# ---------------------------------------------------------------------- /generate
def _pick(value: Any, i: int, n: int, name: str) -> Any:
    """The i-th entry of a per-prompt list field, or the shared scalar."""
    if not isinstance(value, list):
        return value
    if len(value) != n:
        raise GenerateError(f"{name} has {len(value)} entries for {n} prompts", 400, name)
    return value[i]


def _prompts(body: GenerateReqInput) -> tuple[list[Any], bool]:
    if (body.text is None) == (body.input_ids is None):
        raise GenerateError("send exactly one of text and input_ids", 400)
    if body.text is not None:
        is_batch = isinstance(body.text, list)
        prompts = list(body.text) if is_batch else [body.text]
    else:
        ids = body.input_ids or []
        is_batch = bool(ids) and isinstance(ids[0], list)
        prompts = list(ids) if is_batch else [ids]
    if not prompts:
        raise GenerateError("the batch is empty", 400)
    return prompts, is_batch


def _prompt_rid(body: GenerateReqInput, i: int, n: int) -> str | None:
    if isinstance(body.rid, str) and n > 1:
        return f"{body.rid}-{i}"
    return _pick(body.rid, i, n, "rid")


def split_batch(body: GenerateReqInput) -> tuple[list[GenerateInput], bool]:
    """One GenerateInput per prompt and per sample (``sampling_params.n``); whether the answer
    is a list."""
    prompts, is_batch = _prompts(body)
    n = len(prompts)
    inputs: list[GenerateInput] = []
    for i, prompt in enumerate(prompts):
        sp = dict(_pick(body.sampling_params, i, n, "sampling_params") or {})
        num_samples = sp.get("n") or 1
        if not isinstance(num_samples, int) or num_samples < 1:
            raise GenerateError(f"n must be an integer >= 1, got {num_samples!r}", 400, "n")
        is_batch = is_batch or num_samples > 1
        rid = _prompt_rid(body, i, n)
        for j in range(num_samples):
            inputs.append(GenerateInput(
                text=prompt if body.text is not None else None,
                input_ids=prompt if body.input_ids is not None else None,
                sampling_params=sp,
                rid=f"{rid}-{j}" if rid is not None and num_samples > 1 else rid,
                return_logprob=_pick(body.return_logprob, i, n, "return_logprob"),
                logprob_start_len=_pick(body.logprob_start_len, i, n, "logprob_start_len"),
                top_logprobs_num=_pick(body.top_logprobs_num, i, n, "top_logprobs_num"),
                return_text_in_logprobs=body.return_text_in_logprobs,
                stream=body.stream,
            ))
    rids = [inp.rid for inp in inputs if inp.rid is not None]
    if len(set(rids)) != len(rids):
        raise GenerateError("rids must be unique within a batch", 400, "rid")
    return inputs, is_batch


async def stream_native(
    tm: TokenizerManager, prepared: list[PreparedReq], is_batch: bool, request: Request
) -> AsyncIterator[bytes]:
    gens = [tm.generate(p, request) for p in prepared]
    try:
        if is_batch:
            async for i, out in merge(gens):
                yield sse({**out, "index": i})
        else:
            async for out in gens[0]:
                yield sse(out)
    except GenerateError as e:
        yield sse_error(e)
    except ClientDisconnected:
        return
    yield SSE_DONE


@router.post("/generate")
async def generate(request: Request) -> Response:
    body = await parse_body(request, GenerateReqInput)
    tm = get_tm(request)
    inputs, is_batch = split_batch(body)
    prepared = [tm.prepare(inp) for inp in inputs]
    if body.stream:
        return StreamingResponse(
            stream_native(tm, prepared, is_batch, request),
            media_type="text/event-stream", headers=SSE_HEADERS,
        )
    outs = await collect_all([tm.generate(p, request) for p in prepared])
    return json_response(outs if is_batch else outs[0])


# ---------------------------------------------------------------------- info and control
def model_info(tm: TokenizerManager, served_model_name: str) -> dict[str, Any]:
    info = tm.info
    return {
        "model_path": info.get("model_path"),
        "tokenizer_path": tm.cfg.tokenizer_path or info.get("model_path"),
        "served_model_name": served_model_name,
        "is_generation": True,
        "architecture": info.get("architecture"),
        "context_length": info.get("context_length"),
        "vocab_size": info.get("vocab_size"),
    }


@router.get("/get_model_info")
@router.get("/model_info")
async def get_model_info(request: Request) -> Response:
    return json_response(model_info(get_tm(request), request.app.state.served_model_name))


@router.get("/get_server_info")
@router.get("/server_info")
async def get_server_info(request: Request) -> Response:
    tm = get_tm(request)
    reply = await tm.control("server_info")
    config = {k: v for k, v in dataclasses.asdict(tm.cfg).items() if k != "api_key"}
    return json_response({
        **config,
        **tm.info,
        "served_model_name": request.app.state.served_model_name,
        "kv_pool": reply.data,
        "num_inflight_requests": len(tm.states),
        "version": request.app.version,
    })


@router.post("/flush_cache")
@router.get("/flush_cache")
async def flush_cache(request: Request) -> Response:
    reply = await get_tm(request).control("flush_cache")
    if not reply.ok:
        message = reply.data.get("message", "cannot flush")
        raise GenerateError(f"cache not flushed: {message}; retry when idle", 400)
    return json_response({"message": "cache flushed", "kv_pool": reply.data})


@router.post("/abort_request")
async def abort_request(request: Request) -> Response:
    body = await parse_body(request, AbortRequestInput)
    if not body.rid and not body.abort_all:
        raise GenerateError("give a rid (prefix) or abort_all: true", 400, "rid")
    get_tm(request).abort(body.rid, body.abort_all)
    return json_response({"message": "abort sent"})


@router.get("/health_generate")
async def health_generate(request: Request) -> Response:
    try:  # on timeout the cancelled request is aborted in the scheduler
        return await asyncio.wait_for(_generate_one_token(request), HEALTH_GENERATE_TIMEOUT_S)
    except asyncio.TimeoutError:
        raise GenerateError(f"the scheduler did not generate a token within "
                            f"{HEALTH_GENERATE_TIMEOUT_S:.0f} s", 503) from None


async def _generate_one_token(request: Request) -> Response:
    tm = get_tm(request)
    inp = GenerateInput(input_ids=[0], sampling_params={"max_new_tokens": 1, "temperature": 0})
    out = await collect_all([tm.generate(tm.prepare(inp), request)])
    return json_response({"status": "ok", "completion_tokens": out[0]["meta_info"]["completion_tokens"]})


@router.post("/tokenize")
async def tokenize(request: Request) -> Response:
    body = await parse_body(request, TokenizeInput)
    tm = get_tm(request)
    if isinstance(body.prompt, list):
        tokens: Any = [tm.tokenize(p, body.add_special_tokens) for p in body.prompt]
        count: Any = [len(t) for t in tokens]
    else:
        tokens = tm.tokenize(body.prompt, body.add_special_tokens)
        count = len(tokens)
    return json_response({"tokens": tokens, "count": count, "max_model_len": tm.context_length})


@router.post("/detokenize")
async def detokenize(request: Request) -> Response:
    body = await parse_body(request, DetokenizeInput)
    tm = get_tm(request)
    batch = body.tokens and isinstance(body.tokens[0], list)
    rows = body.tokens if batch else [body.tokens]
    for row in rows:
        bad = [t for t in row if not 0 <= t < tm.vocab_size]
        if bad:
            raise GenerateError(f"token ids must be in [0, {tm.vocab_size}), got {bad[:5]}", 400)
    texts = [tm.decode(row, body.skip_special_tokens) for row in rows]
    return json_response({"text": texts if batch else texts[0]})
