"""Errors as OpenAI error objects, on every route: ``{"error": {message, type, param, code}}``."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from radixlm.srt.managers.tokenizer_manager import ClientDisconnected, GenerateError

logger = logging.getLogger(__name__)

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
}
CLIENT_CLOSED_REQUEST = 499


def error_body(
    message: str, status_code: int, param: str | None = None, code: str | int | None = None
) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": ERROR_TYPES.get(status_code, "server_error"),
            "param": param,
            "code": code if code is not None else status_code,
        }
    }


def error_response(
    message: str, status_code: int, param: str | None = None, code: str | int | None = None
) -> JSONResponse:
    return JSONResponse(error_body(message, status_code, param, code), status_code=status_code)


def sse_error(e: GenerateError) -> bytes:
    """The mid-stream form of an error: one SSE event carrying the error object."""
    body = error_body(e.message, e.status_code, e.param, e.code)
    return b"data: " + orjson.dumps(body) + b"\n\n"


def describe_validation_error(
    exc: RequestValidationError | ValidationError,
) -> tuple[str, str | None]:
    """A one-line message (and the offending field) from pydantic's error list."""
    parts, first_param = [], None
    for err in exc.errors():
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        param = ".".join(loc) or None
        first_param = first_param or param
        if err.get("type") == "json_invalid":
            parts.append(f"the request body is not valid JSON ({err.get('msg')})")
        else:
            parts.append(f"{param or 'body'}: {err.get('msg')}")
    return "; ".join(parts[:5]) or "invalid request", first_param


def check_json_content_type(request: Request) -> None:
    """JSON bodies only as ``application/json``: a browser sends ``text/plain`` and form bodies
    cross-origin without a CORS preflight, so serving them would let any web page drive the
    API."""
    raw = request.headers.get("content-type")
    media = (raw or "").split(";", 1)[0].strip().lower()
    if media != "application/json":
        got = repr(raw) if raw else "none"
        raise GenerateError(
            f"send the body as JSON with Content-Type: application/json (got {got})",
            415,
            code="unsupported_media_type",
        )


def reject_unsupported(data: dict[str, Any], unsupported: dict[str, tuple[Any, ...]]) -> None:
    """A 400 for a field this server does not implement, unless it holds its "off" value."""
    for name, off_values in unsupported.items():
        if name in data and data[name] not in off_values:
            raise GenerateError(
                f"{name} is not supported by this server; leave it out",
                400,
                name,
                "unsupported_parameter",
            )


# Parsing runs on the event loop and holds the GIL: its time grows with the number of arrays
# and objects (8M one-element arrays, 30 MiB, take seconds), not with the bytes (40 MiB of
# integers in 1,024 rows take 0.7 s). More brackets than this (counted in the raw bytes, a
# few ms, so brackets inside strings count too) is a 400 before anything is parsed.
MAX_JSON_CONTAINERS = 262_144


def json_object(raw: bytes) -> dict[str, Any]:
    """A body that must be one JSON object; GenerateError 400 otherwise."""
    containers = raw.count(b"[") + raw.count(b"{")
    if containers > MAX_JSON_CONTAINERS:
        raise GenerateError(
            f"the request body holds {containers} JSON arrays or objects (counting brackets); "
            f"at most {MAX_JSON_CONTAINERS}: split the batch",
            400,
        )
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise GenerateError(f"the request body is not valid JSON: {e}", 400) from None
    if not isinstance(data, dict):
        raise GenerateError("the request body must be a JSON object", 400)
    return data


def _nulls_as_defaults(data: dict[str, Any], model: type[BaseModel]) -> dict[str, Any]:
    """``data`` without the nulls sent for optional fields whose default is not null: clients
    send ``"n": null`` or ``"stream": null`` for "the default" (OpenAI's types mark them
    Optional), and the strict model would refuse them."""
    fields = model.model_fields
    return {
        k: v
        for k, v in data.items()
        if not (
            v is None
            and k in fields
            and not fields[k].is_required()
            and fields[k].default is not None
        )
    }


async def parse_body(
    request: Request,
    model: type[BaseModel],
    unsupported: dict[str, tuple[Any, ...]] | None = None,
    precheck: Callable[[dict[str, Any]], None] | None = None,
) -> Any:
    """The JSON body validated as ``model`` (strict types); GenerateError 415 for another
    content type, 413 (from the body-size middleware) for a body over the limit, 400 for
    malformed JSON or wrong fields."""
    check_json_content_type(request)
    return validate_data(json_object(await request.body()), model, unsupported, precheck)


def validate_data(
    data: dict[str, Any],
    model: type[BaseModel],
    unsupported: dict[str, tuple[Any, ...]] | None = None,
    precheck: Callable[[dict[str, Any]], None] | None = None,
) -> Any:
    """``parse_body``'s checks of a JSON object already read (a body built from another)."""
    reject_unsupported(data, unsupported or {})
    data = _nulls_as_defaults(data, model)
    if precheck is not None:
        try:
            precheck(data)
        except ValueError as e:
            param = str(e).split(" ", 1)[0]
            raise GenerateError(str(e), 400, param) from None
    try:
        return model.model_validate(data)
    except ValidationError as e:
        message, param = describe_validation_error(e)
        raise GenerateError(message, 400, param) from None


ANTHROPIC_PATHS = "/v1/messages"  # Anthropic's clients read {"type": "error", "error": {...}}


def _answer(
    request: Request,
    message: str,
    status_code: int,
    param: str | None = None,
    code: str | int | None = None,
) -> JSONResponse:
    """The OpenAI error shape; on Anthropic's routes with its ``"type": "error"`` beside."""
    body = error_body(message, status_code, param, code)
    if request.url.path.startswith(ANTHROPIC_PATHS):
        body = {"type": "error", **body}
    return JSONResponse(body, status_code=status_code)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = describe_validation_error(exc)
        return _answer(request, message, 400, param)

    @app.exception_handler(GenerateError)
    async def _generate(request: Request, exc: GenerateError) -> JSONResponse:
        return _answer(request, exc.message, exc.status_code, exc.param, exc.code)

    @app.exception_handler(ClientDisconnect)
    async def _body_cut(_: Request, exc: ClientDisconnect) -> Response:
        # the client went away while sending its body: nothing to answer, nothing to log loudly
        return Response(status_code=CLIENT_CLOSED_REQUEST)

    @app.exception_handler(ClientDisconnected)
    async def _disconnected(_: Request, exc: ClientDisconnected) -> Response:
        logger.info("client disconnected; request %s aborted", exc)
        return Response(status_code=CLIENT_CLOSED_REQUEST)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _answer(request, str(exc.detail), exc.status_code)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        # the details go to the log only: they may name local paths or internals
        logger.exception("unhandled error")
        return _answer(
            request, f"internal server error ({type(exc).__name__}); see the server log", 500
        )
