"""SGLang's ``/generate`` (and Vertex AI's prediction route, which makes a /generate batch). The
other native routes are beside it: sessions.py, admin.py (cache, weights, pause, profile,
abort), health.py (the generation health check), tokenize.py, info.py (model, server and load
info for routers), score.py and parse.py."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from radixlm.srt.managers.caller_scope import scoped
from radixlm.srt.managers.generate_call import (
    MAX_SEQUENCES_PER_REQUEST,
    GenerateCall,
    split_call,
)
from radixlm.srt.managers.request_checks import MAX_TOKEN_IDS_LOGPROB
from radixlm.srt.managers.tokenizer_manager import (
    ClientDisconnected,
    GenerateError,
    RequestGroup,
    TokenizerManager,
)
from radixlm.srt.server.http.body import batch_precheck
from radixlm.srt.server.http.deps import (
    caller_namespace,
    check_model_name,
    get_tm,
    json_response,
)
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
    namespace = caller_namespace(request)
    session = body.session_params.to_params() if body.session_params is not None else None
    if session is not None:  # the caller's session (managers/caller_scope.py)
        session = dataclasses.replace(session, id=scoped(namespace, session.id))
    inputs, is_batch = split_call(
        GenerateCall.from_fields({**dict(body), "session_params": session})
    )
    prepared = await tm.prepare_all(inputs)
    return tm.open(prepared, request, namespace), is_batch


async def _generate(request: Request, body: GenerateReqInput) -> Response:
    group, is_batch = await _open(request, body)
    if body.stream:
        return ClosingStreamingResponse(stream_native(group, is_batch), group.close)
    with group:
        outs = await group.collect()
    return json_response(outs if is_batch else outs[0])
