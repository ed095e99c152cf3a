"""The middleware that observes generate calls while ``--enable-trace`` or
``--dump-requests-dir`` is on (installed only then): a ``CallRecord``
(srt/observability/http_call.py) is the current call while the route runs, and is closed once
the response has been sent: the root span ends, the dump line is written."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from radixlm.srt.observability.http_call import CURRENT_CALL, CallRecord
from radixlm.srt.observability.request_dump import RequestDump
from radixlm.srt.observability.tracing import Tracer, TraceSettings, make_tracer

# the routes that generate (every dialect); other routes pass through untouched
GENERATE_PATHS = frozenset(
    {"/generate", "/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages"}
)


class CallObserverMiddleware:
    def __init__(
        self, app: Any, tracer: Tracer, settings: TraceSettings, dump: RequestDump | None
    ) -> None:
        self.app = app
        self.tracer = tracer
        self.settings = settings
        self.dump = dump

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if (
            scope["type"] != "http"
            or scope["method"] != "POST"
            or scope["path"] not in GENERATE_PATHS
        ):
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        call = CallRecord(scope["path"], "POST", headers, self.tracer, self.settings, self.dump)
        body: list[bytes] = []

        async def recording_receive() -> dict:
            message = await receive()
            if message["type"] == "http.request":
                body.append(message.get("body", b""))
            return message

        async def recording_send(message: dict) -> None:
            if message["type"] == "http.response.start":
                call.status = message["status"]
            await send(message)

        token = CURRENT_CALL.set(call)
        try:
            await self.app(scope, recording_receive, recording_send)
        finally:
            CURRENT_CALL.reset(token)
            call.close(b"".join(body) if self.dump is not None else None)


def install_call_observer(app: Any, cfg: Any) -> None:
    """Adds the middleware when tracing or the request dump is on (nothing otherwise).
    Raises ValueError when tracing is asked for without the OpenTelemetry SDK."""
    if not (cfg.enable_trace or cfg.dump_requests_dir):
        return
    settings = TraceSettings.from_config(cfg)
    dump = None
    if cfg.dump_requests_dir:
        dump = RequestDump(cfg.dump_requests_dir, int(cfg.dump_requests_max_mb * 2**20))
    app.add_middleware(
        CallObserverMiddleware, tracer=make_tracer(settings, "http"), settings=settings, dump=dump
    )
