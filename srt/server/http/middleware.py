"""ASGI middleware and checks in front of the routes: API keys, the admin key, body size.

Keys (``Authorization: Bearer <key>``, or ``x-api-key: <key>`` as Anthropic's clients send;
constant-time comparison, never logged):
- ``--api-key`` guards every route except OPEN_PATHS;
- ``--admin-api-key`` guards the admin routes (``/flush_cache``, ``abort_all``); it is accepted
  on the other routes too. Without it, the API key (when set) guards the admin routes as well.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from typing import Any

import orjson
from fastapi import Request

from radixlm.srt.config import ServerConfig
from radixlm.srt.managers.tokenizer_manager import GenerateError
from radixlm.srt.server.http.errors import ANTHROPIC_PATHS, error_body

OPEN_PATHS = frozenset({"/health", "/ready", "/ping", "/metrics"})


def bearer_token(headers: Any) -> bytes:
    """The key of ``Authorization: Bearer <key>``, else of ``x-api-key: <key>`` (what
    Anthropic's clients send)."""
    if not isinstance(headers, dict):
        return b""
    scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
    if scheme.lower() == b"bearer":
        return token.strip()
    return headers.get(b"x-api-key", b"").strip()


def _matches(token: bytes, key: str | None) -> bool:
    return key is not None and hmac.compare_digest(token, key.encode())


async def _send_error(
    scope: dict,
    send: Callable,
    message: str,
    status: int,
    code: str,
    extra_headers: list[tuple[bytes, bytes]] = (),
) -> None:
    """The OpenAI error shape; on Anthropic's routes with its ``"type": "error"`` beside (as
    the route handlers answer there)."""
    body = error_body(message, status, code=code)
    if scope.get("path", "").startswith(ANTHROPIC_PATHS):
        body = {"type": "error", **body}
    body = orjson.dumps(body)
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), *extra_headers],
        }
    )
    await send({"type": "http.response.body", "body": body})


class ApiKeyMiddleware:
    """Every route except OPEN_PATHS needs the API key (or the admin key)."""

    def __init__(self, app: Any, api_key: str, admin_api_key: str | None = None) -> None:
        self.app = app
        self._key = api_key
        self._admin_key = admin_api_key

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        token = bearer_token(dict(scope.get("headers") or []))
        if _matches(token, self._key) or _matches(token, self._admin_key):
            await self.app(scope, receive, send)
            return
        await _send_error(
            scope,
            send,
            "missing or wrong API key: send Authorization: Bearer <key>",
            401,
            "invalid_api_key",
            [(b"www-authenticate", b"Bearer")],
        )


def require_admin(request: Request) -> None:
    """Raises GenerateError 401/403 unless the request may use admin routes."""
    cfg: ServerConfig = request.app.state.tm.cfg
    if cfg.admin_api_key is None:
        return  # the API key middleware already checked --api-key, if there is one
    token = bearer_token(dict(request.scope.get("headers") or []))
    if _matches(token, cfg.admin_api_key):
        return
    if token and _matches(token, cfg.api_key):
        raise GenerateError(
            "this route needs the admin API key (--admin-api-key)", 403, code="admin_key_required"
        )
    raise GenerateError(
        "this route needs the admin API key: send Authorization: Bearer <admin key>",
        401,
        code="invalid_api_key",
    )


class BodyLimitMiddleware:
    """Rejects request bodies over ``max_bytes`` with 413: at once when Content-Length says so,
    else as soon as the received bytes pass the limit (chunked bodies)."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _too_large(self) -> GenerateError:
        return GenerateError(
            f"the request body is larger than the limit of "
            f"{self.max_bytes / 2**20:g} MiB (--max-request-body-mb)",
            413,
            code="request_too_large",
        )

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            err = self._too_large()
            await _send_error(scope, send, err.message, 413, "request_too_large")
            return
        received = 0

        async def limited_receive() -> dict:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise self._too_large()  # raised inside request.body(): a 413 answer
            return message

        await self.app(scope, limited_receive, send)
