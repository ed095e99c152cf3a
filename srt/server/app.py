"""The FastAPI application: routes, errors, API-key check, /health and /metrics."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response

from radixlm.srt.config import ServerConfig, allowed_host_names, torch_profiler_dir
from radixlm.srt.managers.model_info import served_model_name
from radixlm.srt.managers.tokenizer_manager import GenerateError, TokenizerManager
from radixlm.srt.server.anthropic import messages as anthropic_messages
from radixlm.srt.server.http.access import log_access_warnings
from radixlm.srt.server.http.deps import json_response
from radixlm.srt.server.http.errors import error_response, install_error_handlers
from radixlm.srt.server.http.metrics import CONTENT_TYPE_LATEST, ServerMetrics
from radixlm.srt.server.http.middleware import (  # noqa: F401  (OPEN_PATHS: re-exported)
    OPEN_PATHS,
    ApiKeyMiddleware,
    BodyLimitMiddleware,
    HostAllowListMiddleware,
)
from radixlm.srt.server.http.observe import install_call_observer
from radixlm.srt.server.http.openapi import install_openapi
from radixlm.srt.server.http.paths import weight_update_roots
from radixlm.srt.server.native import admin as native_admin
from radixlm.srt.server.native import generate as native_generate
from radixlm.srt.server.native import health as native_health
from radixlm.srt.server.native import info as native_info
from radixlm.srt.server.native import parse as native_parse
from radixlm.srt.server.native import score as native_score
from radixlm.srt.server.native import sessions as native_sessions
from radixlm.srt.server.native import tokenize as native_tokenize
from radixlm.srt.server.openai import chat as openai_chat
from radixlm.srt.server.openai import completions as openai_completions
from radixlm.srt.server.openai import models as openai_models
from radixlm.srt.server.openai import responses as openai_responses

logger = logging.getLogger(__name__)

METRICS_SCHEDULER_TIMEOUT_S = 2.0

Watcher = Callable[[TokenizerManager], Awaitable[None]]


def package_version() -> str:
    try:
        return version("radixlm")
    except PackageNotFoundError:
        return "0.0.0"


def accepted_model_names(cfg: ServerConfig, info: dict[str, Any], served: str) -> set[str]:
    """What a request's ``model`` may say: the served name, the path it was given as,
    ``default`` (what SGLang's examples send) or ``unknown`` (what sglang-router sends for a
    request without one). Errors name only the served name."""
    names = {served, "default", "unknown"}
    for path in (cfg.model_path, info.get("model_path")):
        if path:
            names.add(str(path))
    return names


def create_app(
    tm: TokenizerManager,
    metrics: ServerMetrics | None = None,
    watchers: tuple[Watcher, ...] = (),
) -> FastAPI:
    """The app for a tokenizer manager whose ``info`` (the scheduler's ready report) is set."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await tm.start()
        tasks = [asyncio.create_task(w(tm)) for w in watchers]
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await tm.close()

    app = FastAPI(
        title="radixlm", version=package_version(), lifespan=lifespan, docs_url=None, redoc_url=None
    )
    name = served_model_name(tm.cfg, tm.info)
    app.state.tm = tm
    app.state.metrics = metrics
    app.state.served_model_name = name
    app.state.accepted_model_names = accepted_model_names(tm.cfg, tm.info, name)
    app.state.created = int(time.time())
    app.state.profile_dir = torch_profiler_dir(tm.cfg)  # /start_profile writes only here
    app.state.weight_update_roots = weight_update_roots(tm.cfg, tm.info.get("model_path"))
    install_error_handlers(app)
    app.include_router(native_generate.router)
    app.include_router(native_sessions.router)
    app.include_router(native_admin.router)
    app.include_router(native_health.router)
    app.include_router(native_tokenize.router)
    app.include_router(native_info.router)
    app.include_router(openai_models.router)
    app.include_router(openai_chat.router)
    app.include_router(openai_completions.router)
    app.include_router(openai_responses.router)
    app.include_router(native_parse.router)
    app.include_router(native_score.router)
    app.include_router(anthropic_messages.router)
    # HEAD too: load balancers probe with it
    # (HEAD kept out of the OpenAPI schema: one operation id per route)
    for path in ("/health", "/ready", "/ping"):  # SGLang's readiness and SageMaker's routes
        app.add_api_route(path, health, methods=["GET"])
        app.add_api_route(path, health, methods=["HEAD"], include_in_schema=False)
    app.add_api_route("/metrics", metrics_route, methods=["GET"], response_class=PlainTextResponse)
    install_openapi(app)
    install_call_observer(app, tm.cfg)  # tracing, request dump: innermost, when on
    # added last = outermost: the key is checked before any body is read
    app.add_middleware(BodyLimitMiddleware, max_bytes=int(tm.cfg.max_request_body_mb * 2**20))
    if tm.cfg.api_key:
        app.add_middleware(
            ApiKeyMiddleware, api_key=tm.cfg.api_key, admin_api_key=tm.cfg.admin_api_key
        )
    host_names = allowed_host_names(tm.cfg)
    if host_names is not None:  # outermost: a rebound name gets nothing, not even a 401
        app.add_middleware(HostAllowListMiddleware, names=host_names)
    log_access_warnings(tm.cfg)
    return app


async def health(request: Request) -> Response:
    """``/health``, ``/ready`` and ``/ping``: 200 while the server can serve (a draining server answers
    every route 503: supervisor.DrainGate); 503 once a child died, or while the launcher's probe
    (``app.state.health_problem``: process states and heartbeats) names a problem. Answered
    without the scheduler, so a long step does not make it fail. While generation is paused (or
    weights load), ``/ready`` is a 503 naming the reason and ``/health`` and ``/ping`` stay 200
    (the process is alive: sglang-router and supervisors must not restart it) with
    ``"status": "paused"``."""
    tm: TokenizerManager = request.app.state.tm
    if not tm.is_alive:
        return error_response(f"server unavailable: {tm.dead_reason}", 503)
    probe = getattr(request.app.state, "health_problem", None)
    problem = probe() if probe is not None else None
    if problem is not None:
        return error_response(f"server unavailable: {problem}", 503)
    paused = tm.pause_reason
    if paused is None:
        return json_response({"status": "ok"})
    if request.url.path == "/ready":
        return error_response(f"not ready: {paused}", 503)
    return json_response({"status": "paused", "reason": paused})


async def metrics_route(request: Request) -> Response:
    metrics: ServerMetrics | None = request.app.state.metrics
    if metrics is None:
        return error_response("metrics are not enabled", 404)
    tm: TokenizerManager = request.app.state.tm
    if tm.is_alive:  # the load figures: answered without waiting for the step in flight
        try:
            load = await asyncio.wait_for(
                native_info.scheduler_load(tm), METRICS_SCHEDULER_TIMEOUT_S
            )
            metrics.update_scheduler(
                {
                    "max_total_tokens": load["max_total_num_tokens"],
                    "available": load["num_available_tokens"],
                    "evictable": load["num_evictable_tokens"],
                    "num_running": load["num_running_reqs"],
                    "num_waiting": load["num_waiting_reqs"],
                    "hicache": load.get("hicache"),
                }
            )
        except GenerateError as e:
            logger.warning("metrics: no scheduler figures (%s)", e.message)
        except asyncio.TimeoutError:
            logger.warning(
                "metrics: the scheduler did not answer within %s s", METRICS_SCHEDULER_TIMEOUT_S
            )
    return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)
