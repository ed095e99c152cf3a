"""Helpers for the hostile-client tests: servers that restart when a test killed them, the
shared leak check every test ends with, OpenAI-error-shape checks, SSE parsing and raw sockets.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import plain_http

from radixlm.srt.server.process.server_process import ServerProcess

CLEAN_TIMEOUT_S = 10.0
HTTP_TIMEOUT_S = 30.0


@dataclass
class LiveServer:
    """A ``radixlm serve`` child that is started again when a test left it dead, so one crash
    fails the test that caused it (its leak check) and not every later test."""

    args: list[str]
    log_dir: Path
    api_key: str | None = None
    proc: ServerProcess | None = None
    num_starts: int = 0
    crashes: list[str] = field(default_factory=list)

    def start(self) -> None:
        self.num_starts += 1
        log = self.log_dir / f"server-{self.num_starts}.log"
        args = [*self.args, *(["--api-key", self.api_key] if self.api_key else [])]
        self.proc = ServerProcess(args, log_path=log, startup_timeout_s=240)

    @property
    def url(self) -> str:
        assert self.proc is not None
        return self.proc.url

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def log_tail(self, num_chars: int = 3000) -> str:
        path = self.log_dir / f"server-{self.num_starts}.log"
        return path.read_text(errors="replace")[-num_chars:] if path.exists() else ""

    def is_healthy(self) -> bool:
        if self.proc is None or self.proc.proc.poll() is not None:
            return False
        try:
            return plain_http.get(self.url + "/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    def ensure_running(self) -> None:
        if self.proc is not None and self.is_healthy():
            return
        if self.proc is not None:
            self.crashes.append(self.log_tail())
            self.proc.stop(timeout_s=10)
        self.start()

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop(timeout_s=30)

    # ------------------------------------------------------------------ requests
    def post(
        self,
        path: str,
        body: Any = None,
        *,
        raw: bytes | None = None,
        timeout: float = HTTP_TIMEOUT_S,
        **kw: Any,
    ) -> httpx.Response:
        headers = {**self.headers, **kw.pop("headers", {})}
        if raw is not None:
            headers.setdefault("Content-Type", "application/json")
            return plain_http.post(
                self.url + path, content=raw, headers=headers, timeout=timeout, **kw
            )
        return plain_http.post(self.url + path, json=body, headers=headers, timeout=timeout, **kw)

    def get(self, path: str, timeout: float = HTTP_TIMEOUT_S) -> httpx.Response:
        return plain_http.get(self.url + path, headers=self.headers, timeout=timeout)

    def info(self) -> dict[str, Any]:
        r = self.get("/get_server_info", timeout=10)
        assert r.status_code == 200, r.text
        return r.json()


def start_all(servers: list[LiveServer]) -> None:
    """Starts the servers at once (each start is mostly imports and model loading)."""
    errors: list[BaseException] = []

    def one(s: LiveServer) -> None:
        try:
            s.start()
        except BaseException as e:  # reported below, in the caller's thread
            errors.append(e)

    threads = [threading.Thread(target=one, args=(s,)) for s in servers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        for s in servers:
            s.stop()
        raise errors[0]


def _is_idle(info: dict[str, Any]) -> bool:
    pool = info["kv_pool"]
    return (
        info["num_inflight_requests"] == 0
        and pool["num_running"] == 0
        and pool["num_waiting"] == 0
        and pool["grammar"].get("num_queued", 0) == 0
    )


def assert_clean(server: LiveServer) -> None:
    """The check every test ends with: /health is 200, once idle no request state is left in
    the tokenizer manager and the KV pool adds up (available + evictable + protected == total)
    with no node still locked."""
    r = plain_http.get(server.url + "/health", timeout=5)
    assert r.status_code == 200, f"/health answered {r.status_code}: {r.text}\n{server.log_tail()}"
    deadline = time.monotonic() + CLEAN_TIMEOUT_S
    info = server.info()
    while not _is_idle(info) and time.monotonic() < deadline:
        time.sleep(0.1)
        info = server.info()
    pool = info["kv_pool"]
    assert info["num_inflight_requests"] == 0, (
        f"request state left: {info['num_inflight_requests']}"
    )
    assert pool["num_running"] == 0 and pool["num_waiting"] == 0, f"scheduler not idle: {pool}"
    assert pool["grammar"].get("num_queued", 0) == 0, f"grammar jobs left: {pool['grammar']}"
    total = pool["available"] + pool["evictable"] + pool["protected"]
    assert total == pool["max_total_tokens"], f"KV leak when idle: {pool}"
    assert pool["protected"] == 0, f"radix nodes still locked when idle: {pool}"


# ---------------------------------------------------------------------- response shapes
def assert_openai_error(r: httpx.Response, statuses: tuple[int, ...] = (400,)) -> dict:
    """``r`` is one of ``statuses`` with an OpenAI error object; returns the error."""
    assert r.status_code in statuses, f"{r.status_code} (wanted {statuses}): {r.text[:500]}"
    body = r.json()
    assert isinstance(body, dict) and isinstance(body.get("error"), dict), r.text[:500]
    err = body["error"]
    assert isinstance(err.get("message"), str) and err["message"], err
    assert isinstance(err.get("type"), str) and err["type"], err
    assert "param" in err and "code" in err, err
    return err


def assert_4xx(r: httpx.Response) -> dict:
    return assert_openai_error(r, tuple(range(400, 500)))


def assert_ok_or_4xx(r: httpx.Response) -> None:
    """An answer a client can act on: a finished 200 or a 4xx error object; never a 5xx."""
    if r.status_code == 200:
        body = r.json()
        outs = body if isinstance(body, list) else [body]
        for out in outs:
            if "choices" in out:
                assert all(c["finish_reason"] in ("stop", "length") for c in out["choices"]), out
            else:
                assert out["meta_info"]["finish_reason"] is not None, out
        return
    assert_4xx(r)


# ---------------------------------------------------------------------- streams
def parse_sse(raw: bytes) -> list[Any]:
    """The events of a whole SSE body; asserts every event is ``data: <json>`` and that the
    last one (only) is ``data: [DONE]``."""
    text = raw.decode("utf-8")
    assert text.endswith("\n\n"), f"the stream does not end with a blank line: {text[-200:]!r}"
    blocks = [b for b in text.split("\n\n") if b]
    events: list[Any] = []
    for block in blocks:
        assert block.startswith("data: ") and "\n" not in block, f"bad SSE event {block[:200]!r}"
        data = block[len("data: ") :]
        events.append("[DONE]" if data == "[DONE]" else json.loads(data))
    assert events and events[-1] == "[DONE]", f"no final [DONE]: {blocks[-3:]}"
    assert "[DONE]" not in events[:-1], "[DONE] before the end"
    return events


def stream(
    server: LiveServer, path: str, body: dict, timeout: float = HTTP_TIMEOUT_S
) -> tuple[httpx.Response, list[Any]]:
    """POSTs a streaming request; the response and its parsed events (empty when not 200)."""
    with plain_http.stream(
        "POST", server.url + path, json=body, headers=server.headers, timeout=timeout
    ) as r:
        raw = r.read()
    if r.status_code != 200:
        return r, []
    assert r.headers["content-type"].startswith("text/event-stream"), r.headers
    return r, parse_sse(raw)


RESPONSE_TERMINAL_EVENTS = ("response.completed", "response.incomplete", "response.failed")


def parse_response_events(raw: bytes) -> list[Any]:
    """The events of a whole Responses-API SSE body: each ``event: <type>`` then ``data:
    <json>`` of that type, sequence numbers 0, 1, 2, ..., and a terminal event last (only)."""
    text = raw.decode("utf-8")
    assert text.endswith("\n\n"), f"the stream does not end with a blank line: {text[-200:]!r}"
    events: list[Any] = []
    for block in (b for b in text.split("\n\n") if b):
        head, _, data = block.partition("\n")
        assert head.startswith("event: ") and data.startswith("data: "), block[:200]
        event = json.loads(data[len("data: ") :])
        assert event["type"] == head[len("event: ") :], block[:200]
        events.append(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    terminal = [i for i, e in enumerate(events) if e["type"] in RESPONSE_TERMINAL_EVENTS]
    assert terminal == [len(events) - 1], [e["type"] for e in events[-3:]]
    return events


def stream_aborted_after_first_event(
    server: LiveServer,
    path: str,
    body: dict,
    rid: str,
    timeout: float = HTTP_TIMEOUT_S,
    parse: Callable[[bytes], list[Any]] = parse_sse,
) -> tuple[httpx.Response, list[Any]]:
    """Like :func:`stream`, but aborts ``rid`` (``/abort_request``) as soon as the first event
    arrived, so the request is surely mid-way (a fixed sleep raced fast decoding); ``parse``
    reads the body (SSE with a final ``[DONE]`` unless told otherwise)."""
    raw = b""
    with plain_http.stream(
        "POST", server.url + path, json=body, headers=server.headers, timeout=timeout
    ) as r:
        aborted = False
        for chunk in r.iter_bytes():
            raw += chunk
            if not aborted and b"data: " in raw:
                abort = server.post("/abort_request", {"rid": rid})
                assert abort.status_code == 200, abort.text
                aborted = True
    if r.status_code != 200:
        return r, []
    return r, parse(raw)


def stream_text(path: str, events: list[Any]) -> str:
    """The text a stream delivered (cumulative on /generate, deltas on the OpenAI routes)."""
    data = [e for e in events[:-1] if "error" not in e]
    assert len(data) == len(events) - 1, f"error event in stream: {events}"
    if path == "/generate":
        return data[-1]["text"]
    key = "delta" if path.endswith("chat/completions") else None
    parts = []
    for e in data:
        for c in e["choices"]:
            parts.append(c["delta"].get("content") or "" if key else c["text"])
    return "".join(parts)


# ---------------------------------------------------------------------- raw clients
def raw_request(server: LiveServer, path: str, body: bytes) -> socket.socket:
    """Sends a POST on a plain socket and returns it unread (to close it in any phase)."""
    host, port = "127.0.0.1", int(server.url.rsplit(":", 1)[1])
    sock = socket.create_connection((host, port), timeout=10)
    auth = "".join(f"{k}: {v}\r\n" for k, v in server.headers.items())
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"{auth}Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    sock.sendall(head.encode() + body)
    return sock


def read_until(sock: socket.socket, marker: bytes, limit_s: float = 20.0) -> bytes:
    """Reads from ``sock`` until ``marker`` arrived (or the peer closed, or time ran out)."""
    buf = b""
    deadline = time.monotonic() + limit_s
    sock.settimeout(1.0)
    while marker not in buf and time.monotonic() < deadline:
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            continue
        if not chunk:
            break
        buf += chunk
    return buf


def wait_for(predicate: Callable[[], bool], timeout_s: float, step_s: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(step_s)
    return predicate()


class Failures:
    """Collects failed checks of a table of cases, so one run names every failing case."""

    def __init__(self) -> None:
        self.items: list[str] = []

    def check(self, what: Any, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except (AssertionError, httpx.HTTPError, ValueError, KeyError) as e:
            self.items.append(f"{str(what)[:300]}: {type(e).__name__}: {str(e)[:400]}")
            return None

    def assert_none(self) -> None:
        assert not self.items, f"{len(self.items)} case(s) failed:\n" + "\n".join(self.items)


# ---------------------------------------------------------------------- the two servers' shape
CONTEXT = 512
POOL = 2048
SMALL_POOL = 256
API_KEY = "hostile-test-key"
ADMIN_KEY = "hostile-admin-key"
GREEDY = {"temperature": 0}


def gen(
    server: LiveServer, text: str = "Hello there", timeout: float = HTTP_TIMEOUT_S, **sp: Any
) -> httpx.Response:
    body = {"text": text, "sampling_params": {"max_new_tokens": 4, **GREEDY, **sp}}
    return server.post("/generate", body, timeout=timeout)


def ids_prompt(n: int, token_id: int = 1000) -> list[int]:
    return [token_id + (i % 7) for i in range(n)]


def openai_prompt(route: str, text: str = "Hello there") -> dict[str, Any]:
    if route.endswith("chat/completions"):
        return {"messages": [{"role": "user", "content": text}]}
    return {"prompt": text}
