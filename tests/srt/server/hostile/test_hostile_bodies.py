"""Hostile clients (see conftest.py): malformed and non-object bodies, wrong field types, payload limits, unknown OpenAI fields and model names, the API key on every route."""

from __future__ import annotations

import asyncio
import re
import socket
import tempfile
import threading
import time

import httpx
import orjson
import plain_http
import pytest
from hostile_util import (
    API_KEY,
    GREEDY,
    Failures,
    LiveServer,
    assert_openai_error,
    openai_prompt,
    read_until,
)

pytestmark = pytest.mark.slow


# ---------------------------------------------------------------------- malformed bodies
NESTED = b"[" * 100_000 + b"]" * 100_000
MALFORMED = {
    "not-json": b"{oops",
    "empty": b"",
    "array": b"[]",
    "array-of-objects": b'[{"text": "hi"}]',
    "number": b"42",
    "null": b"null",
    "string": b'"text"',
    "true": b"true",
    "nested-array": NESTED,
    "nested-object": b'{"a":' * 50_000 + b"1" + b"}" * 50_000,
    "invalid-utf8": b'{"text": "\xff\xfe\xfd", "prompt": "\xc3\x28", "model": "default"}',
    "lone-surrogate": b'{"text": "\\ud800", "prompt": "\\ud800", "model": "default", '
    b'"messages": [{"role": "user", "content": "\\udfff"}]}',
    "nan": b'{"text": "hi", "sampling_params": {"temperature": NaN}}',
    "trailing-garbage": b'{"text": "hi"} {"text": "again"}',
    "form": b"text=hi&model=default",
}
POST_ROUTES = [
    "/generate",
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/responses",
    "/abort_request",
    "/tokenize",
    "/detokenize",
]


@pytest.mark.parametrize("route", POST_ROUTES)
def test_malformed_body_is_400(server: LiveServer, route: str) -> None:
    """Sent as application/json: each is a 400 (a 413 or 415 would mean the check misfired)."""
    failures = Failures()
    for name in sorted(MALFORMED):
        failures.check(
            name,
            lambda b=MALFORMED[name]: assert_openai_error(
                server.post(route, raw=b, timeout=20), (400, 422)
            ),
        )
    for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data"):
        failures.check(
            ctype,
            lambda c=ctype: assert_openai_error(
                server.post(route, raw=b"text=hi", headers={"Content-Type": c}, timeout=20),
                (400, 415),
            ),
        )
    failures.assert_none()


def test_wrong_field_types_are_400(server: LiveServer) -> None:
    cases = [
        ("/generate", {"text": 5}),
        ("/generate", {"text": {"a": 1}}),
        ("/generate", {"text": "hi", "sampling_params": "greedy"}),
        ("/generate", {"text": "hi", "sampling_params": [1]}),
        ("/generate", {"text": "hi", "stream": "yes"}),
        ("/generate", {"text": ["a", "b"], "sampling_params": [{}, {}, {}]}),
        ("/generate", {"text": "hi", "rid": 5}),
        ("/generate", {"text": "hi", "input_ids": [1]}),
        ("/generate", {}),
        ("/generate", {"text": []}),
        ("/generate", {"text": ""}),
        ("/generate", {"input_ids": []}),
        ("/generate", {"input_ids": [[]]}),
        ("/generate", {"input_ids": [[[1]]]}),
        ("/v1/completions", {"model": "default"}),
        ("/v1/completions", {"model": "default", "prompt": []}),
        ("/v1/completions", {"model": "default", "prompt": [[]]}),
        ("/v1/completions", {"model": "default", "prompt": {"x": 1}}),
        ("/v1/chat/completions", {"model": "default", "messages": []}),
        ("/v1/chat/completions", {"model": "default", "messages": "hi"}),
        ("/v1/chat/completions", {"model": "default", "messages": [{"content": "no role"}]}),
        (
            "/v1/chat/completions",
            {"model": "default", "messages": [{"role": "wizard", "content": "x"}]},
        ),
        (
            "/v1/chat/completions",
            {
                "model": "default",
                "messages": [
                    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
                ],
            },
        ),
        ("/v1/responses", {"model": "default"}),
        ("/v1/responses", {"model": "default", "input": {"role": "user"}}),
        ("/v1/responses", {"model": "default", "input": [5]}),
        ("/v1/responses", {"model": "default", "input": [{"role": "user", "content": 5}]}),
        ("/v1/responses", {"model": "default", "input": [{"type": "function_call"}]}),
        ("/v1/responses", {"model": "default", "input": "hi", "tools": [{"type": 5}]}),
        ("/v1/responses", {"model": "default", "input": "hi", "tools": [{"type": "function"}]}),
        ("/v1/responses", {"model": "default", "input": "hi", "text": {"format": "json"}}),
        ("/v1/responses", {"model": "default", "input": "hi", "include": "all"}),
        ("/v1/responses", {"model": "default", "input": "hi", "metadata": {"a": 1}}),
        ("/v1/responses", {"model": "default", "input": "hi", "previous_response_id": 5}),
        ("/abort_request", {"rid": ["a"]}),
        ("/tokenize", {"prompt": 5}),
        ("/detokenize", {"tokens": "abc"}),
    ]
    failures = Failures()
    for path, body in cases:
        failures.check(
            (path, body), lambda p=path, b=body: assert_openai_error(server.post(p, b, timeout=20))
        )
    failures.assert_none()


# ---------------------------------------------------------------------- payload limits
def _poll_health(server: LiveServer, stop: threading.Event, latencies: list[float]) -> None:
    while not stop.is_set():
        t0 = time.monotonic()
        try:
            ok = plain_http.get(server.url + "/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            ok = False
        latencies.append(time.monotonic() - t0 if ok else float("inf"))
        time.sleep(0.05)


# JSON decoding and model validation hold the GIL for a body this size (about 0.5 s for 8 MB on
# a loaded 2-core machine); the bound catches work that scales with the prompt (tokenizing a
# 50 MB prompt on the event loop stalled every route for 38 s).
HEALTH_STALL_S = 3.0
BIG_BODIES = {
    "text-8mb": lambda: orjson.dumps({"text": "hello world " * 700_000}),
    "ids-8mb": lambda: orjson.dumps({"input_ids": [1000] * 1_600_000}),
    "chat-8mb": lambda: orjson.dumps(
        {
            "model": "default",
            "messages": [{"role": "user", "content": "hi "} for _ in range(200_000)],
        }
    ),
    "stop-8mb": lambda: orjson.dumps(
        {"text": "hi", "sampling_params": {"stop": ["abcdefgh"] * 700_000}}
    ),
}


@pytest.mark.parametrize("name", sorted(BIG_BODIES))
def test_multi_mb_body_is_refused_and_health_stays_up(server: LiveServer, name: str) -> None:
    raw = BIG_BODIES[name]()
    assert len(raw) > 2_000_000
    path = "/v1/chat/completions" if name.startswith("chat") else "/generate"
    stop, latencies = threading.Event(), []
    poller = threading.Thread(target=_poll_health, args=(server, stop, latencies))
    poller.start()
    try:
        r = server.post(path, raw=raw, timeout=60)
    finally:
        stop.set()
        poller.join()
    assert_openai_error(r, (400, 413))
    # tokenization runs off the event loop: /health answers meanwhile
    assert max(latencies, default=0) < HEALTH_STALL_S, (
        f"/health stalled while the body was processed: {[round(x, 2) for x in latencies]}"
    )


# ---------------------------------------------------------------------- OpenAI fields, models
UNKNOWN_FIELDS = {
    "user": "someone",
    "store": False,
    "metadata": {"a": "b"},
    "service_tier": "auto",
    "parallel_tool_calls": True,
    "some_future_field": [1],
    "prediction": {"type": "content", "content": "x"},
    "modalities": ["text"],
}


def test_unknown_openai_fields_are_ignored(server: LiveServer) -> None:
    chat = {
        "model": "default",
        "max_tokens": 3,
        **GREEDY,
        **UNKNOWN_FIELDS,
        "messages": [{"role": "user", "content": "hi", "unknown_part": 1}],
    }
    base = server.post(
        "/v1/chat/completions",
        {
            "model": "default",
            "max_tokens": 3,
            **GREEDY,
            "messages": [{"role": "user", "content": "hi"}],
        },
    )
    r = server.post("/v1/chat/completions", chat)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"] == base.json()["choices"][0]["message"]
    comp = {
        "model": "default",
        "prompt": "hi",
        "max_tokens": 3,
        **GREEDY,
        **UNKNOWN_FIELDS,
        "best_of": 1,
        "suffix": None,
    }
    r = server.post("/v1/completions", comp)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_model_name_missing_vs_unknown(server: LiveServer, route: str) -> None:
    body = {"max_tokens": 2, **openai_prompt(route)}
    for missing in (body, {**body, "model": None}):
        r = server.post(route, missing)
        if r.status_code != 200:  # OpenAI refuses a missing model; vLLM and SGLang serve it
            assert assert_openai_error(r)["param"] == "model", r.text
    err = assert_openai_error(server.post(route, {**body, "model": "gpt-unknown"}), (404,))
    assert err["code"] == "model_not_found" and err["param"] == "model", err
    assert_openai_error(server.post(route, {**body, "model": 123}), (400,))
    assert server.post(route, {**body, "model": "default"}).status_code == 200
    served = server.get("/v1/models").json()["data"][0]["id"]
    assert server.post(route, {**body, "model": served}).status_code == 200
    assert_openai_error(server.get("/v1/models/gpt-unknown"), (404,))


# ---------------------------------------------------------------------- API key
def _walk_routes(routes: list, prefix: str = "") -> list[tuple[str, str]]:
    from starlette.routing import Route

    out = []
    for route in routes:
        inner = getattr(route, "original_router", None) or getattr(route, "app", None)
        if isinstance(route, Route):
            path = re.sub(r"\{[^}]+\}", "x", prefix + route.path)
            out += [(m, path) for m in sorted(route.methods or ()) if m != "HEAD"]
        elif getattr(inner, "routes", None) is not None:  # an included router or a mount
            ctx = getattr(route, "include_context", None)
            out += _walk_routes(inner.routes, prefix + (getattr(ctx, "prefix", "") or ""))
    return out


def app_routes(keyed: LiveServer) -> list[tuple[str, str]]:
    """(method, path) of every route of the server's FastAPI app, built in-process."""
    from radixlm.srt.config import ServerConfig
    from radixlm.srt.managers.scheduler_process import IpcEndpoints
    from radixlm.srt.managers.tokenizer_manager import TokenizerManager
    from radixlm.srt.server.app import create_app

    with tempfile.TemporaryDirectory() as ipc:
        tm = TokenizerManager(ServerConfig(api_key=API_KEY), None, IpcEndpoints.in_dir(ipc))
        tm.info = keyed.info()
        routes = _walk_routes(create_app(tm).routes)
        asyncio.run(tm.close())
    return sorted(set(routes))


def test_api_key_on_every_route(keyed: LiveServer) -> None:
    from radixlm.srt.server.app import OPEN_PATHS

    routes = app_routes(keyed)
    assert ("POST", "/generate") in routes and ("POST", "/v1/chat/completions") in routes
    wrong = [
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": API_KEY},
        {"Authorization": f"Basic {API_KEY}"},
        {"Authorization": f"Bearer {API_KEY}x"},
        {"Authorization": f"Bearer {API_KEY[:-1]}"},
        {"X-API-Key": f"{API_KEY}x"},  # Anthropic's clients send the key here: checked too
        {"X-API-Key": ""},
        {"Authorization": "Bearer wrong", "X-API-Key": API_KEY},  # the bearer key counts
    ]
    failures = Failures()
    for method, path in routes:
        if path in OPEN_PATHS:
            continue
        for headers in wrong:
            failures.check((method, path, headers), _assert_401, keyed, method, path, headers)
    for path in [
        "/generate/",
        "//generate",
        "/GENERATE",
        "/generate?x=/health",
        "/health/../generate",
        "/v1/models/../../flush_cache",
        "/%67enerate",
    ]:
        failures.check(("path trick", path), _assert_not_served, keyed, path)
    failures.assert_none()
    for path in OPEN_PATHS:
        assert plain_http.get(keyed.url + path, timeout=10).status_code in (200, 404), path
    good = {"Authorization": f"Bearer {API_KEY}"}
    assert plain_http.get(keyed.url + "/v1/models", headers=good, timeout=10).status_code == 200
    r = plain_http.post(
        keyed.url + "/generate",
        headers=good,
        timeout=30,
        json={"text": "hi", "sampling_params": {"max_new_tokens": 1}},
    )
    assert r.status_code == 200, r.text


def _assert_401(server: LiveServer, method: str, path: str, headers: dict) -> None:
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 1}}
    r = httpx.request(
        method,
        server.url + path,
        headers=headers,
        timeout=10,
        json=body if method == "POST" else None,
    )
    assert_openai_error(r, (401,))


def _assert_not_served(server: LiveServer, path: str) -> None:
    with socket.create_connection(("127.0.0.1", int(server.url.rsplit(":", 1)[1])), 10) as s:
        body = b'{"text": "hi", "sampling_params": {"max_new_tokens": 1}}'
        s.sendall(
            f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
            + body
        )
        head = read_until(s, b"\r\n\r\n", 10).split(b"\r\n", 1)[0]
    status = int(head.split()[1]) if head.startswith(b"HTTP/") else 0
    assert status in (400, 401, 404, 405), f"{path!r} answered {head!r} without the key"
