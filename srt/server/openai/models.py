"""``/v1/models``: the served model, as OpenAI lists models."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from radixlm.srt.server.http.deps import check_model, get_tm, json_response
from radixlm.srt.server.http.openapi import ERROR_RESPONSES

router = APIRouter(responses=ERROR_RESPONSES)


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
