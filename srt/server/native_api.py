"""SGLang's native HTTP API: /generate, sessions (/open_session, /close_session), cache and
abort control, tokenize/detokenize, generation health check. Model, server and load info for
routers are in info_api.py."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import ValidationError

from radixlm.srt.managers.generate_call import (
    MAX_SEQUENCES_PER_REQUEST,
    GenerateCall,
    split_call,
)
from radixlm.srt.managers.request_checks import MAX_TOKEN_IDS_LOGPROB
from radixlm.srt.managers.tokenizer_manager import (
    ClientDisconnected,
    GenerateError,
    GenerateInput,
    RequestGroup,
    TokenizerManager,
)
from radixlm.srt.server.errors import (
    check_json_content_type,
    describe_validation_error,
    error_body,
    json_object,
    parse_body,
    sse_error,
    validate_data,
)
from radixlm.srt.server.middleware import require_admin
from radixlm.srt.server.openapi_spec import ERROR_RESPONSES, STREAM_RESPONSE, json_body
from radixlm.srt.server.protocol import (
    GENERATE_FIELDS,
    UNSUPPORTED_NATIVE,
    AbortRequestInput,
    CloseSessionInput,
    ContinueGenerationInput,
    DetokenizeInput,
    GenerateReqInput,
    GetWeightsByNameInput,
    OpenSessionInput,
    PauseGenerationInput,
    TokenizeInput,
    UpdateWeightsFromDiskInput,
    UpdateWeightVersionInput,
    check_known_fields,
    check_list_len,
    precheck_batch,
    precheck_token_ids_logprob,
)
from radixlm.srt.server.streaming import SSE_DONE, ClosingStreamingResponse, sse

router = APIRouter(responses=ERROR_RESPONSES)
PAUSE_MODES = ("abort", "retract", "in_place")

HEALTH_GENERATE_TIMEOUT_S = 20.0  # SGLang answers its health check within 20 s too
PROFILE_WRITE_TIMEOUT_S = 120.0  # /stop_profile writes the trace before it answers
# SGLang's ProfileReq fields; the scheduler (srt/scheduler/profiling.py) checks their values
PROFILE_FIELDS = frozenset(
    {
        "output_dir", "start_step", "num_steps", "activities", "profile_by_stage", "with_stack",
        "record_shapes", "profile_id", "merge_profiles", "profile_prefix", "profile_stages",
        "detailed_annotations",
    }
)  # fmt: skip


def json_response(obj: Any, status_code: int = 200) -> Response:
    return Response(orjson.dumps(obj), status_code=status_code, media_type="application/json")


def get_tm(request: Request) -> TokenizerManager:
    return request.app.state.tm


def batch_precheck(tm: TokenizerManager) -> Callable[[dict[str, Any]], None]:
    return lambda data: precheck_batch(data, MAX_SEQUENCES_PER_REQUEST, tm.context_length)


def detokenize_precheck(tm: TokenizerManager) -> Callable[[dict[str, Any]], None]:
    """``tokens``: at most MAX_SEQUENCES_PER_REQUEST rows, each no longer than the context
    (what /generate takes as input_ids), so one call's decoding is bounded."""

    def check(data: dict[str, Any]) -> None:
        tokens = data.get("tokens")
        if isinstance(tokens, list) and tokens and isinstance(tokens[0], list):
            check_list_len(tokens, MAX_SEQUENCES_PER_REQUEST, "tokens")
            rows = tokens
        else:
            rows = [tokens]
        for row in rows:
            check_list_len(row, tm.context_length, "tokens")

    return check


def generate_precheck(tm: TokenizerManager) -> Callable[[dict[str, Any]], None]:
    """Unknown fields first (a 400 naming the field), then the batch sizes."""
    batch = batch_precheck(tm)

    def check(data: dict[str, Any]) -> None:
        check_known_fields(data, GENERATE_FIELDS, "/generate")
        batch(data)
        precheck_token_ids_logprob(data, MAX_TOKEN_IDS_LOGPROB, MAX_SEQUENCES_PER_REQUEST)

    return check


def check_model_name(request: Request, model: str | None) -> None:
    """``model`` (routers add it) is null or names the served model; else the OpenAI routes'
    404, naming only the served name."""
    state = request.app.state
    if model is not None and model not in state.accepted_model_names:
        raise GenerateError(
            f"the model {model!r} does not exist; this server serves "
            f"{state.served_model_name!r} (see /v1/models)",
            404,
            "model",
            "model_not_found",
        )


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
    session = body.session_params.to_params() if body.session_params is not None else None
    inputs, is_batch = split_call(
        GenerateCall.from_fields({**dict(body), "session_params": session})
    )
    prepared = await tm.prepare_all(inputs)
    return tm.open(prepared, request), is_batch


async def _generate(request: Request, body: GenerateReqInput) -> Response:
    group, is_batch = await _open(request, body)
    if body.stream:
        return ClosingStreamingResponse(stream_native(group, is_batch), group.close)
    with group:
        outs = await group.collect()
    return json_response(outs if is_batch else outs[0])


# ---------------------------------------------------------------------- sessions
@router.post("/open_session", openapi_extra=json_body(OpenSessionInput))
async def open_session(request: Request) -> Response:
    """Opens a session (managers/sessions.py); the answer is its id as a JSON string."""
    body = await parse_body(request, OpenSessionInput)
    if body.streaming:
        raise GenerateError(
            "streaming sessions are not supported by this server; open the session without "
            "streaming",
            400,
            "streaming",
            "unsupported_parameter",
        )
    tm = get_tm(request)
    return json_response(tm.sessions.open(body.capacity_of_str_len, body.session_id, body.timeout))


@router.post("/close_session", openapi_extra=json_body(CloseSessionInput))
async def close_session(request: Request) -> Response:
    """Closes a session: its turns are dropped and its running requests aborted. The answer
    is an empty 200, as SGLang's."""
    body = await parse_body(request, CloseSessionInput)
    get_tm(request).sessions.close(body.session_id)
    return Response(status_code=200)


# ---------------------------------------------------------------------- control
@router.post("/flush_cache")
async def flush_cache(request: Request) -> Response:
    """Admin route (POST only: a GET can be triggered by any link or image tag)."""
    require_admin(request)
    reply = await get_tm(request).control("flush_cache")
    if not reply.ok:
        message = reply.data.get("message", "cannot flush")
        raise GenerateError(f"cache not flushed: {message}; retry when idle", 400)
    return json_response({"message": "cache flushed", "kv_pool": reply.data})


@router.post("/update_weights_from_disk")
async def update_weights_from_disk(request: Request) -> Response:
    """Admin route (SGLang's): another checkpoint of the same architecture and sizes, loaded in
    place once the requests in flight have finished (new ones wait meanwhile). SGLang's answer
    shape ``{"success", "message", "num_paused_requests"}``; 400 with the usual ``error``
    object too when nothing was loaded."""
    require_admin(request)
    body = await parse_body(request, UpdateWeightsFromDiskInput)
    refused = body.refused()
    if refused is not None:
        raise GenerateError(f"{refused} is not supported; leave it out or off", 400, refused)
    args = body.model_dump(include={"model_path", "load_format", "flush_cache", "weight_version"})
    ok, message, paused = await get_tm(request).update_weights_from_disk(
        args, abort_all=body.abort_all_requests
    )
    answer = {"success": ok, "message": message, "num_paused_requests": paused}
    if not ok:  # SGLang's fields, and the error object every other 4xx here carries
        answer.update(error_body(message, 400, "model_path"))
    return json_response(answer, 200 if ok else 400)


# SGLang's other weight-sync routes carry tensors as pickled handles (CUDA IPC, shared memory)
# or need a NCCL group with the trainer: not over this server's HTTP. An RL loop that calls one
# gets a 400 saying what works instead, not a bare 404.
WEIGHT_SYNC_ELSEWHERE = (
    "/update_weights_from_tensor",
    "/update_weights_from_distributed",
    "/update_weights_from_ipc",
    "/init_weights_update_group",
    "/destroy_weights_update_group",
)


async def weight_sync_elsewhere(request: Request) -> Response:
    """A 400 naming what works: /update_weights_from_disk, or the Engine in-process."""
    require_admin(request)
    raise GenerateError(
        f"{request.url.path} is not supported by this server (its tensors are pickled "
        "handles or a NCCL group); update from a checkpoint with /update_weights_from_disk, "
        "or in-process with Engine.update_weights_from_tensor",
        400,
        code="unsupported_route",
    )


for _path in WEIGHT_SYNC_ELSEWHERE:
    router.add_api_route(_path, weight_sync_elsewhere, methods=["POST"], include_in_schema=False)


@router.post("/get_weights_by_name", openapi_extra=json_body(GetWeightsByNameInput))
@router.get("/get_weights_by_name", include_in_schema=False)  # one operation in the schema
async def get_weights_by_name(request: Request) -> Response:
    """Admin route (SGLang's): the running weight of a checkpoint tensor (Hugging Face name)
    as float32 values, its first ``truncate_size`` rows; RL loops check a weight sync with it.
    A GET may send the fields as query parameters instead of a body."""
    require_admin(request)
    if request.method == "GET" and not (await request.body()).strip():
        query = dict(request.query_params)
        if "truncate_size" in query:
            try:
                query["truncate_size"] = int(query["truncate_size"])
            except ValueError:
                raise GenerateError(
                    "truncate_size must be an integer", 400, "truncate_size"
                ) from None
        try:
            body = GetWeightsByNameInput.model_validate(query)
        except ValidationError as e:
            message, param = describe_validation_error(e)
            raise GenerateError(message, 400, param) from None
    else:
        body = await parse_body(request, GetWeightsByNameInput)
    reply = await get_tm(request).control(
        "get_weights_by_name", {"name": body.name, "truncate_size": body.truncate_size}
    )
    if not reply.ok:
        message = str(reply.data.get("message", ""))
        raise GenerateError(message, 400, "truncate_size" if "truncate_size" in message else "name")
    return json_response(reply.data["parameter"])


@router.post("/pause_generation")
async def pause_generation(request: Request) -> Response:
    """Admin route (SGLang's): new requests wait until ``/continue_generation`` (a weight
    update may run meanwhile); the ones in flight are aborted (``mode: abort``), kept with
    their KV (``in_place``) or sent back to the waiting queue without it (``retract``)."""
    require_admin(request)
    body = await parse_body(request, PauseGenerationInput)
    if body.mode not in PAUSE_MODES:
        raise GenerateError(
            f"pause mode {body.mode!r} is not one of {list(PAUSE_MODES)}", 400, "mode"
        )
    await get_tm(request).pause_generation(body.mode)
    return json_response({"message": "Generation paused successfully.", "status": "ok"})


@router.post("/continue_generation")
async def continue_generation(request: Request) -> Response:
    """Admin route (SGLang's): requests flow again after ``/pause_generation``."""
    require_admin(request)
    if (await request.body()).strip():
        await parse_body(request, ContinueGenerationInput)  # checked; nothing to apply
    await get_tm(request).continue_generation()
    return json_response({"message": "Generation continued successfully.", "status": "ok"})


@router.post("/update_weight_version")
async def update_weight_version(request: Request) -> Response:
    """Admin route (SGLang's): relabels the loaded weights (``weight_version`` in
    ``/server_info``), optionally aborting every request first."""
    require_admin(request)
    body = await parse_body(request, UpdateWeightVersionInput)
    tm = get_tm(request)
    if body.abort_all_requests:
        tm.abort_all()
    reply = await tm.control("set_weight_version", {"weight_version": body.new_version})
    message = f"Weight version updated to {body.new_version}"
    return json_response({"success": reply.ok, "message": message, "new_version": body.new_version})


@router.post("/start_profile")
@router.get("/start_profile", include_in_schema=False)  # one operation in the schema
async def start_profile(request: Request) -> Response:
    """Admin route: a torch.profiler trace of the scheduler steps (SGLang's ProfileReq body,
    optional; srt/scheduler/profiling.py). GET too: SGLang's ``RuntimeEndpoint.start_profile``
    sends a GET without a body (the trace then goes to the default folder)."""
    require_admin(request)
    args = await _optional_json_object(request)
    reply = await get_tm(request).control("start_profile", args)
    if not reply.ok:
        raise GenerateError(reply.data.get("message", "cannot start the profile"), 400)
    return json_response(reply.data)


@router.post("/stop_profile")
@router.get("/stop_profile", include_in_schema=False)  # one operation in the schema
async def stop_profile(request: Request) -> Response:
    """Admin route: ends the profile and writes its trace (its path in the answer)."""
    require_admin(request)
    reply = await get_tm(request).control("stop_profile", timeout_s=PROFILE_WRITE_TIMEOUT_S)
    if not reply.ok:
        raise GenerateError(reply.data.get("message", "no profile is running"), 400)
    return json_response(reply.data)


async def _optional_json_object(request: Request) -> dict[str, Any]:
    raw = await request.body()
    if not raw.strip():
        return {}
    check_json_content_type(request)
    data = json_object(raw)
    unknown = sorted(set(data) - PROFILE_FIELDS)
    if unknown:
        raise GenerateError(f"{unknown[0]} is not a field of /start_profile", 400, unknown[0])
    return data


@router.post("/abort_request", openapi_extra=json_body(AbortRequestInput))
async def abort_request(request: Request) -> Response:
    """Aborts the requests with exactly this client rid (a batch's or an n > 1 request's rid
    aborts all its samples); ``abort_all`` is an admin action."""
    body = await parse_body(request, AbortRequestInput)
    tm = get_tm(request)
    if body.abort_all:
        require_admin(request)
        tm.abort_all()
        return json_response({"message": "abort sent"})
    if not body.rid:
        raise GenerateError(
            "give the rid of the request to abort (or abort_all: true with the admin key)",
            400,
            "rid",
        )
    return json_response({"message": "abort sent", "num_aborted": tm.abort(body.rid)})


@router.get("/health_generate")
async def health_generate(request: Request) -> Response:
    try:  # on timeout the cancelled request is aborted in the scheduler
        return await asyncio.wait_for(_generate_one_token(request), HEALTH_GENERATE_TIMEOUT_S)
    except asyncio.TimeoutError:
        raise GenerateError(
            f"the scheduler did not generate a token within {HEALTH_GENERATE_TIMEOUT_S:.0f} s", 503
        ) from None


async def _generate_one_token(request: Request) -> Response:
    tm = get_tm(request)
    inp = GenerateInput(input_ids=[0], sampling_params={"max_new_tokens": 1, "temperature": 0})
    with tm.open([await tm.prepare(inp)], request) as group:
        out = await group.collect()
    return json_response(
        {"status": "ok", "completion_tokens": out[0]["meta_info"]["completion_tokens"]}
    )


@router.post("/tokenize", openapi_extra=json_body(TokenizeInput))
async def tokenize(request: Request) -> Response:
    body = await parse_body(request, TokenizeInput, None, batch_precheck(get_tm(request)))
    tm = get_tm(request)
    prompts = body.prompt if isinstance(body.prompt, list) else [body.prompt]
    tokens = [await tm.tokenize_async(p, body.add_special_tokens) for p in prompts]
    if isinstance(body.prompt, list):
        return json_response(
            {
                "tokens": tokens,
                "count": [len(t) for t in tokens],
                "max_model_len": tm.context_length,
            }
        )
    return json_response(
        {"tokens": tokens[0], "count": len(tokens[0]), "max_model_len": tm.context_length}
    )


@router.post("/detokenize", openapi_extra=json_body(DetokenizeInput))
async def detokenize(request: Request) -> Response:
    tm = get_tm(request)
    body = await parse_body(request, DetokenizeInput, None, detokenize_precheck(tm))
    batch = bool(body.tokens) and isinstance(body.tokens[0], list)
    rows: list[list[int]] = body.tokens if batch else [body.tokens]  # type: ignore[assignment]
    texts = await tm.decode_rows_async(rows, body.skip_special_tokens)
    out = texts if batch else texts[0]
    # "text" is SGLang's key, "prompt" vLLM's (lm-eval's remote tokenizer reads that one)
    return json_response({"text": out, "prompt": out})
