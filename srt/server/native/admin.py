"""SGLang's admin routes of the native API: cache flush, weight updates and reads, pause and
continue, the weight version, profiling, and aborting requests (``abort_all`` needs the admin
key; aborting one rid does not)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import ValidationError

from radixlm.srt.managers.tokenizer_manager import GenerateError
from radixlm.srt.messages import (
    PROFILE_FIELDS,
    FlushCacheReq,
    GetWeightsByNameReq,
    SetWeightVersionReq,
    StartProfileReq,
    StopProfileReq,
    UpdateWeightsFromDiskReq,
)
from radixlm.srt.server.http.access import require_admin
from radixlm.srt.server.http.deps import caller_namespace, get_tm, json_response
from radixlm.srt.server.http.errors import (
    check_json_content_type,
    describe_validation_error,
    error_body,
    json_object,
    parse_body,
)
from radixlm.srt.server.http.openapi import ERROR_RESPONSES, json_body
from radixlm.srt.server.http.paths import checkpoint_path, profile_output_dir
from radixlm.srt.server.native.protocol import (
    AbortRequestInput,
    ContinueGenerationInput,
    GetWeightsByNameInput,
    PauseGenerationInput,
    UpdateWeightsFromDiskInput,
    UpdateWeightVersionInput,
)

router = APIRouter(responses=ERROR_RESPONSES)


PAUSE_MODES = ("abort", "retract", "in_place")


PROFILE_WRITE_TIMEOUT_S = 120.0  # /stop_profile writes the trace before it answers


@router.post("/flush_cache")
async def flush_cache(request: Request) -> Response:
    """Admin route (POST only: a GET can be triggered by any link or image tag)."""
    require_admin(request)
    reply = await get_tm(request).control(FlushCacheReq())
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
    try:
        args["model_path"] = checkpoint_path(request.app.state.weight_update_roots, body.model_path)
    except GenerateError as e:  # one message for every path it may not load
        return _weights_answer(False, e.message, 0)
    ok, message, paused = await get_tm(request).update_weights_from_disk(
        UpdateWeightsFromDiskReq(**args), abort_all=body.abort_all_requests
    )
    return _weights_answer(ok, message, paused)


def _weights_answer(ok: bool, message: str, num_paused: int) -> Response:
    answer = {"success": ok, "message": message, "num_paused_requests": num_paused}
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
    reply = await get_tm(request).control(GetWeightsByNameReq(body.name, body.truncate_size))
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
    reply = await tm.control(SetWeightVersionReq(body.new_version))
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
    args["output_dir"] = profile_output_dir(request.app.state.profile_dir, args.get("output_dir"))
    reply = await get_tm(request).control(StartProfileReq(**args))
    if not reply.ok:
        raise GenerateError(reply.data.get("message", "cannot start the profile"), 400)
    return json_response(reply.data)


@router.post("/stop_profile")
@router.get("/stop_profile", include_in_schema=False)  # one operation in the schema
async def stop_profile(request: Request) -> Response:
    """Admin route: ends the profile and writes its trace (its path in the answer)."""
    require_admin(request)
    reply = await get_tm(request).control(StopProfileReq(), timeout_s=PROFILE_WRITE_TIMEOUT_S)
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
    num = tm.abort(body.rid, caller_namespace(request))  # the caller's own rids only
    return json_response({"message": "abort sent", "num_aborted": num})
