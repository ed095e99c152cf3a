"""The OpenAPI document: request bodies and error responses the routes really have.

The routes read their bodies themselves (strict JSON, content type, size limits; see
errors.parse_body), so FastAPI cannot see them; ``json_body`` declares each body's model and
``install_openapi`` adds those models' schemas to the document's components.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel


# ---------------------------------------------------------------------- errors (OpenAPI only)
class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


_BODY_MODELS: dict[str, type[BaseModel]] = {}
REF_TEMPLATE = "#/components/schemas/{model}"

ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse, "description": description}
    for code, description in [
        (400, "invalid request (the message names the parameter)"),
        (401, "missing or wrong API key"),
        (403, "the route needs the admin API key"),
        (404, "unknown model or route"),
        (413, "request body over --max-request-body-mb"),
        (415, "the body is not sent as application/json"),
        (503, "the server cannot serve (a worker process died, or a timeout)"),
    ]
}
STREAM_RESPONSE: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "JSON, or server-sent events when stream is true",
        "content": {"application/json": {}, "text/event-stream": {}},
    },
}


def json_body(model: type[BaseModel]) -> dict[str, Any]:
    """``openapi_extra`` for a route whose JSON body is ``model``."""
    _BODY_MODELS[model.__name__] = model
    ref = {"$ref": REF_TEMPLATE.format(model=model.__name__)}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


def install_openapi(app: FastAPI) -> None:
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for name, model in _BODY_MODELS.items():
                model_schema = model.model_json_schema(ref_template=REF_TEMPLATE)
                components.update(model_schema.pop("$defs", {}))
                components[name] = model_schema
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
