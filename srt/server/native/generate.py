"""SGLang's ``/generate`` (and Vertex AI's prediction route, which makes a /generate batch). The
other native routes are beside it: sessions.py, admin.py (cache, weights, pause, profile,
abort), health.py (the generation health check), tokenize.py, info.py (model, server and load
info for routers), score.py and parse.py."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from radixlm.srt.managers.request_checks import MAX_TOKEN_IDS_LOGPROB, token_ids_logprob_per_prompt
from radixlm.srt.managers.tokenizer_manager import (
    ClientDisconnected,
    GenerateError,
    GenerateInput,
    RequestGroup,
    TokenizerManager,
)
from radixlm.srt.sampling.params import MAX_N
from radixlm.srt.server.http.body import (
    MAX_SEQUENCES_PER_REQUEST,
    batch_precheck,
    check_num_sequences,
)
from radixlm.srt.server.http.deps import check_model_name, get_tm, json_response
from radixlm.srt.server.http.errors import (
    check_json_content_type,
    json_object,
    parse_body,
    sse_error,
    validate_data,
)
from radixlm.srt.server.http.openapi import ERROR_RESPONSES, STREAM_RESPONSE, json_body
from radixlm.srt.server.http.streaming import SSE_DONE, ClosingStreamingResponse, sse
from radixlm.srt.server.native.protocol import (
    GENERATE_FIELDS,
    UNSUPPORTED_NATIVE,
    GenerateReqInput,
    check_known_fields,
    precheck_token_ids_logprob,
)

router = APIRouter(responses=ERROR_RESPONSES)


def generate_precheck(tm: TokenizerManager) -> Callable[[dict[str, Any]], None]:
    """Unknown fields first (a 400 naming the field), then the batch sizes."""
    batch = batch_precheck(tm)

    def check(data: dict[str, Any]) -> None:
        check_known_fields(data, GENERATE_FIELDS, "/generate")
        batch(data)
        precheck_token_ids_logprob(data, MAX_TOKEN_IDS_LOGPROB, MAX_SEQUENCES_PER_REQUEST)

    return check


# ---------------------------------------------------------------------- /generate
def _pick(value: Any, i: int, n: int, name: str, default: Any = None) -> Any:
    """The i-th entry of a per-prompt list field, or the shared scalar; null is ``default``."""
    if isinstance(value, list):
        if len(value) != n:
            raise GenerateError(f"{name} has {len(value)} entries for {n} prompts", 400, name)
        value = value[i]
    return default if value is None else value


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
        return f"{body.rid}_{i}"
    return _pick(body.rid, i, n, "rid")


def _num_samples(sp: dict[str, Any]) -> int:
    n = sp.get("n")
    if n is None:
        return 1
    if type(n) is not int or not 1 <= n <= MAX_N:
        raise GenerateError(f"n must be an integer in [1, {MAX_N}], got {n!r}", 400, "n")
    return n


def split_batch(body: GenerateReqInput) -> tuple[list[GenerateInput], bool]:
    """One GenerateInput per prompt and per sample (``sampling_params.n``); whether the answer
    is a list. Sample j of a prompt with rid r shows rid ``r_j`` (as SGLang); aborting r (or the batch's
    rid) aborts all of them."""
    prompts, is_batch = _prompts(body)
    n = len(prompts)
    token_ids = token_ids_logprob_per_prompt(body.token_ids_logprob, n)
    session = body.session_params.to_params() if body.session_params is not None else None
    inputs: list[GenerateInput] = []
    for i, prompt in enumerate(prompts):
        sp = dict(_pick(body.sampling_params, i, n, "sampling_params") or {})
        num_samples = _num_samples(sp)
        is_batch = is_batch or num_samples > 1
        check_num_sequences(len(inputs) + num_samples)
        rid = _prompt_rid(body, i, n)
        parents = tuple(dict.fromkeys(r for r in (body.rid, rid) if isinstance(r, str)))
        for j in range(num_samples):
            sample_rid = f"{rid}_{j}" if rid is not None and num_samples > 1 else rid
            inputs.append(
                GenerateInput(
                    text=prompt if body.text is not None else None,
                    input_ids=prompt if body.input_ids is not None else None,
                    sampling_params=sp,
                    rid=sample_rid,
                    abort_keys=tuple(p for p in parents if p != sample_rid),
                    return_logprob=_pick(body.return_logprob, i, n, "return_logprob", False),
                    logprob_start_len=_pick(body.logprob_start_len, i, n, "logprob_start_len", -1),
                    top_logprobs_num=_pick(body.top_logprobs_num, i, n, "top_logprobs_num", 0),
                    token_ids_logprob=token_ids[i],
                    return_text_in_logprobs=body.return_text_in_logprobs,
                    stream=body.stream,
                    session_params=session,
                    log_metrics=body.log_metrics,
                    return_prompt_token_ids=body.return_prompt_token_ids,
                )
            )
    rids = [inp.rid for inp in inputs if inp.rid is not None]
    if len(set(rids)) != len(rids):
        raise GenerateError("rids must be unique within a batch", 400, "rid")
    return inputs, is_batch


async def stream_native(group: RequestGroup, is_batch: bool) -> AsyncIterator[bytes]:
    try:
        async for i, out in group.updates():
            yield sse({**out, "index": i} if is_batch else out)
    except GenerateError as e:
        yield sse_error(e)
        yield SSE_DONE
        return
    except ClientDisconnected:
        return
    finally:
        group.close()
    yield SSE_DONE


@router.post("/generate", openapi_extra=json_body(GenerateReqInput), responses=STREAM_RESPONSE)
async def generate(request: Request) -> Response:
    body = await parse_body(
        request, GenerateReqInput, UNSUPPORTED_NATIVE, generate_precheck(get_tm(request))
    )
    return await _generate(request, body)


# Vertex AI's prediction route (its AIP_PREDICT_ROUTE, SGLang's default otherwise)
VERTEX_ROUTE = os.environ.get("AIP_PREDICT_ROUTE") or "/vertex_generate"
VERTEX_INPUTS = ("text", "input_ids")


@router.post(VERTEX_ROUTE, include_in_schema=False)
async def vertex_generate(request: Request) -> Response:
    """Vertex AI's ``{"instances": [...], "parameters": {...}}``: the first instance's input
    field (``text`` or ``input_ids``) taken from every instance makes a /generate batch, the
    parameters its other fields; the answer is ``{"predictions": [...]}``."""
    check_json_content_type(request)
    data = json_object(await request.body())
    unknown = sorted(set(data) - {"instances", "parameters"})
    if unknown:
        raise GenerateError(f"{unknown[0]} is not a field of a prediction request", 400, unknown[0])
    instances, parameters = data.get("instances"), data.get("parameters") or {}
    if not isinstance(instances, list) or not all(isinstance(i, dict) for i in instances):
        raise GenerateError("instances must be a list of objects", 400, "instances")
    streamed = isinstance(parameters, dict) and parameters.get("stream") not in (None, False)
    if not isinstance(parameters, dict) or set(parameters) & set(VERTEX_INPUTS) or streamed:
        raise GenerateError(
            "parameters must be an object of /generate fields other than the input and stream",
            400,
            "parameters",
        )
    if not instances:
        return json_response({"predictions": []})
    key = next((k for k in VERTEX_INPUTS if instances[0].get(k) is not None), None)
    if key is None:
        raise GenerateError("instances[0] has no text or input_ids", 400, "instances")
    for i, inst in enumerate(instances):
        other = sorted(set(inst) - {key})
        if other:
            raise GenerateError(
                f"instances[{i}].{other[0]}: every instance holds only {key!r}, as the first",
                400,
                f"instances[{i}].{other[0]}",
            )
    fields = {key: [inst.get(key) for inst in instances], **parameters}
    body = validate_data(
        fields, GenerateReqInput, UNSUPPORTED_NATIVE, generate_precheck(get_tm(request))
    )
    group, _ = await _open(request, body)
    with group:
        return json_response({"predictions": await group.collect()})


async def _open(request: Request, body: GenerateReqInput) -> tuple[RequestGroup, bool]:
    """The checked body's requests sent; their group, and whether the body was a batch."""
    body.check()
    check_model_name(request, body.model)
    tm = get_tm(request)
    inputs, is_batch = split_batch(body)
    prepared = await tm.prepare_all(inputs)
    return tm.open(prepared, request), is_batch


async def _generate(request: Request, body: GenerateReqInput) -> Response:
    group, is_batch = await _open(request, body)
    if body.stream:
        return ClosingStreamingResponse(stream_native(group, is_batch), group.close)
    with group:
        outs = await group.collect()
    return json_response(outs if is_batch else outs[0])
