"""ASGI middleware in front of the routes: the Host allow-list, API keys, body size.

Keys (``Authorization: Bearer <key>``, or ``x-api-key: <key>`` as Anthropic's clients send;
constant-time comparison, never logged): ``--api-key`` guards every route except OPEN_PATHS, and
``--admin-api-key`` is accepted wherever it is. Which admin routes need which key: access.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson

from radixlm.srt.config import OPEN_PATHS as OPEN_PATH_LIST
from radixlm.srt.managers.tokenizer_manager import GenerateError
from radixlm.srt.server.http.access import bearer_token, matches
from radixlm.srt.server.http.errors import ANTHROPIC_PATHS, error_body

OPEN_PATHS = frozenset(OPEN_PATH_LIST)
MAX_HOST_SHOWN = 100  # characters of a refused Host header echoed in the error


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
        if matches(token, self._key) or matches(token, self._admin_key):
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


def host_name(host: str) -> str:
    """The name of a Host header, lower case, without its port or a final dot:
    ``[::1]:30000`` -> ``::1``, ``LocalHost.:80`` -> ``localhost``."""
    host = host.strip().lower()
    if host.startswith("["):
        name = host[1:].partition("]")[0]
    elif host.count(":") == 1:
        name = host.partition(":")[0]
    else:
        name = host  # a bare name, or a bare IPv6 address (not a valid Host, kept as is)
    return name.rstrip(".")


class HostAllowListMiddleware:
    """400 for a request whose Host header names another host (DNS rebinding: a web page of
    evil.example whose name now resolves to 127.0.0.1 sends ``Host: evil.example``)."""

    def __init__(self, app: Any, names: frozenset[str]) -> None:
        self.app = app
        self.names = names

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        raw = dict(scope.get("headers") or []).get(b"host", b"").decode("latin-1")
        if host_name(raw) in self.names:
            await self.app(scope, receive, send)
            return
        shown = raw[:MAX_HOST_SHOWN] if raw else "none"
        await _send_error(
            scope,
            send,
            f"this server does not answer for the host {shown!r} (--allowed-hosts)",
            400,
            "host_not_allowed",
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
