"""What the routes of every dialect read from the app and answer with: the tokenizer manager,
JSON responses, the check of a request's ``model``."""

from __future__ import annotations

import hashlib
from typing import Any

import orjson
from fastapi import Request
from fastapi.responses import Response

from radixlm.srt.managers.tokenizer_manager import GenerateError, TokenizerManager
from radixlm.srt.server.http.middleware import bearer_token


def json_response(obj: Any, status_code: int = 200) -> Response:
    return Response(orjson.dumps(obj), status_code=status_code, media_type="application/json")


def get_tm(request: Request) -> TokenizerManager:
    return request.app.state.tm


def caller_namespace(request: Request, user: str | None = None) -> str:
    """The namespace of the caller's rids and session ids (managers/caller_scope.py): a digest
    of the API key it sent when the server has keys (the key itself is never kept), else of
    the ``user`` it names (OpenAI's ``user``, Anthropic's ``metadata.user_id``), else the
    empty namespace, which every anonymous caller shares."""
    cfg = request.app.state.tm.cfg
    if cfg.api_key is not None or cfg.admin_api_key is not None:
        token = bearer_token(dict(request.scope.get("headers") or []))
        return "k" + hashlib.blake2b(token, digest_size=12).hexdigest()
    if user:
        return (
            "u" + hashlib.blake2b(user.encode("utf-8", "surrogatepass"), digest_size=12).hexdigest()
        )
    return ""


def check_model_name(request: Request, model: str | None) -> None:
    """``model`` (routers add it) is null or names the served model; else the OpenAI routes'
    404, naming only the served name."""
    state = request.app.state
    check_model(model, state.accepted_model_names, state.served_model_name)


def check_model(requested: str | None, accepted: set[str], served: str) -> None:
    """A missing model means the served one; an unknown one is a 404 that names only the
    served name (never the local path it was loaded from)."""
    if requested is not None and requested not in accepted:
        raise GenerateError(
            f"the model {requested!r} does not exist; this server serves "
            f"{served!r} (see /v1/models)",
            404,
            "model",
            "model_not_found",
        )


ROUTING_KEY_HEADER = "x-smg-routing-key"  # SGLang's OpenAI and Anthropic routes read it


def take_routing_key(inputs: list[Any], request: Request | None) -> list[Any]:
    """The request's ``x-smg-routing-key`` header (SGLang's, on its OpenAI and Anthropic routes;
    ``/generate`` takes a ``routing_key`` field instead) as every sequence's ``routing_key``
    (checked by the front door); ``inputs``."""
    key = request.headers.get(ROUTING_KEY_HEADER) if request is not None else None
    if key is not None:
        for inp in inputs:
            inp.routing_key = key
    return inputs
