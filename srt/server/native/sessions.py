"""SGLang's sessions over HTTP: ``/open_session`` and ``/close_session`` (the turns themselves
are ``session_params`` of /generate; see managers/sessions.py)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from radixlm.srt.managers.tokenizer_manager import GenerateError
from radixlm.srt.server.http.deps import caller_namespace, get_tm, json_response
from radixlm.srt.server.http.errors import parse_body
from radixlm.srt.server.http.openapi import ERROR_RESPONSES, json_body
from radixlm.srt.server.native.protocol import CloseSessionInput, OpenSessionInput

router = APIRouter(responses=ERROR_RESPONSES)


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
    namespace = caller_namespace(request)
    return json_response(
        tm.sessions.open(body.capacity_of_str_len, body.session_id, body.timeout, namespace)
    )


@router.post("/close_session", openapi_extra=json_body(CloseSessionInput))
async def close_session(request: Request) -> Response:
    """Closes a session: its turns are dropped and its running requests aborted. The answer
    is an empty 200, as SGLang's."""
    body = await parse_body(request, CloseSessionInput)
    get_tm(request).sessions.close(body.session_id, caller_namespace(request))
    return Response(status_code=200)
