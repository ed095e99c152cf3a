"""Hostile clients (see conftest.py): disconnects and aborts in every phase, an abort storm, concurrent mixed requests against a serial run, the stream protocol."""

from __future__ import annotations

import random
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import httpx
import orjson
import pytest
from hostile_util import (
    CONTEXT,
    GREEDY,
    POOL,
    LiveServer,
    assert_4xx,
    assert_openai_error,
    gen,
    ids_prompt,
    openai_prompt,
    parse_response_events,
    raw_request,
    read_until,
    stream,
    stream_aborted_after_first_event,
    stream_text,
    wait_for,
)

pytestmark = pytest.mark.slow


# ---------------------------------------------------------------------- disconnect and abort
def _phase_body(phase: str, rid: str) -> dict:
    """A native request that stays in ``phase`` for a while."""
    sp: dict = {"max_new_tokens": 400 if phase != "prefill" else 1, "ignore_eos": True}
    body: dict = {"rid": rid, "stream": phase == "streaming", "sampling_params": sp}
    if phase == "prefill":
        body["input_ids"] = ids_prompt(CONTEXT - 2, 3000 + random.randrange(5000))
    else:
        body["text"] = f"Tell me a long story about {rid}."
    if phase == "grammar":  # a fresh (uncached) schema that takes a while to compile
        sp["json_schema"] = {
            "type": "object",
            "properties": {
                f"{rid}_{i}": {"type": "string", "pattern": "[a-z]{1,20}"} for i in range(400)
            },
        }
    if phase == "queued":  # waits behind the pool: the whole pool for prompt + output
        sp["max_new_tokens"] = CONTEXT - 20
    return body


def _hold_pool(server: LiveServer, tag: str) -> list[Future]:
    """Fills the pool with long requests so the next one waits (the 'before the first token'
    phase); they are aborted by the caller."""
    pool = ThreadPoolExecutor(8)
    futs = [
        pool.submit(
            server.post,
            "/generate",
            {
                "rid": f"{tag}-holder-{i}",
                "input_ids": ids_prompt(200, 4000 + 300 * i),
                "sampling_params": {"max_new_tokens": 300, "ignore_eos": True},
            },
            timeout=60,
        )
        for i in range(POOL // 500 + 1)
    ]
    pool.shutdown(wait=False)
    return futs


PHASES = ["queued", "prefill", "streaming", "grammar"]


@pytest.mark.parametrize("phase", PHASES)
def test_disconnect_in_every_phase(server: LiveServer, phase: str) -> None:
    rid = f"disc-{phase}-{uuid.uuid4().hex[:8]}"
    holders = _hold_pool(server, rid) if phase == "queued" else []
    time.sleep(0.3 if holders else 0)
    sock = raw_request(server, "/generate", orjson.dumps(_phase_body(phase, rid)))
    if phase == "streaming":
        assert b"data: " in read_until(sock, b"data: ", 20)
    else:
        time.sleep(0.15)
    sock.close()
    for i in range(len(holders)):
        server.post("/abort_request", {"rid": f"{rid}-holder-{i}"}, timeout=10)
    for f in holders:
        assert_ok_or_abort(f.result(timeout=60))


@pytest.mark.parametrize("phase", PHASES)
def test_abort_in_every_phase(server: LiveServer, phase: str) -> None:
    rid = f"abort-{phase}-{uuid.uuid4().hex[:8]}"
    holders = _hold_pool(server, rid) if phase == "queued" else []
    time.sleep(0.3 if holders else 0)
    body = _phase_body(phase, rid)
    if body["stream"]:  # abort once the first event is out: surely mid-way
        out = stream_aborted_after_first_event(server, "/generate", body, rid, timeout=30)
    else:
        with ThreadPoolExecutor(1) as pool:
            fut = pool.submit(server.post, "/generate", body)
            time.sleep(0.15)
            r = server.post("/abort_request", {"rid": rid})
            assert r.status_code == 200, r.text
            out = fut.result(timeout=30)
    for i in range(len(holders)):
        server.post("/abort_request", {"rid": f"{rid}-holder-{i}"}, timeout=10)
    for f in holders:
        assert_ok_or_abort(f.result(timeout=60))
    if phase == "streaming":
        resp, events = out
        assert resp.status_code == 200 and events[-2]["meta_info"]["finish_reason"]["type"] in (
            "abort",
        ), events[-2]
    else:
        assert_ok_or_abort(out)


def assert_ok_or_abort(r: httpx.Response) -> None:
    """An aborted native request: 200 with finish_reason abort (SGLang), or a 4xx object;
    a request that won the race finished normally."""
    if r.status_code == 200:
        assert r.json()["meta_info"]["finish_reason"]["type"] in ("abort", "length", "stop")
    else:
        assert_4xx(r)


def test_abort_rid_is_exact(server: LiveServer) -> None:
    """Aborting rid ``job-1`` must not abort ``job-10`` or ``job-1x``."""
    tag = uuid.uuid4().hex[:6]
    rids = [f"{tag}-job-1", f"{tag}-job-10", f"{tag}-job-1x"]
    body = {
        "text": "Count slowly:",
        "sampling_params": {"max_new_tokens": 60, "ignore_eos": True, **GREEDY},
    }
    with ThreadPoolExecutor(3) as pool:
        futs = [pool.submit(server.post, "/generate", {**body, "rid": r}) for r in rids]
        time.sleep(0.3)
        server.post("/abort_request", {"rid": rids[0]})
        outs = [f.result(timeout=60) for f in futs]
    reasons = [
        o.json()["meta_info"]["finish_reason"]["type"] if o.status_code == 200 else o.status_code
        for o in outs
    ]
    assert reasons[1:] == ["length", "length"], reasons


def test_duplicate_rid_while_running(server: LiveServer) -> None:
    rid = f"dup-{uuid.uuid4().hex[:8]}"
    body = {
        "rid": rid,
        "text": "Go on:",
        "sampling_params": {"max_new_tokens": 400, "ignore_eos": True, **GREEDY},
    }
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(server.post, "/generate", body)
        # the second request must arrive while the first is decoding (on a quiet machine 80
        # tokens of the tiny model took less than the 0.3 s this test used to wait)
        assert wait_for(lambda: server.info()["kv_pool"]["num_running"] == 1, 30, 0.005)
        second = server.post("/generate", body)
        assert_openai_error(second)
        r = first.result(timeout=120)
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 400, r.text


def test_flush_cache_while_running_is_refused_cleanly(server: LiveServer) -> None:
    body = {"text": "Keep going:", "sampling_params": {"max_new_tokens": 60, "ignore_eos": True}}
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(server.post, "/generate", body)
        time.sleep(0.3)
        r = server.post("/flush_cache", {})
        assert r.status_code == 200 or assert_openai_error(r)
        assert fut.result(timeout=60).status_code == 200
    assert server.post("/flush_cache", {}).status_code == 200


# ---------------------------------------------------------------------- abort storm
def _storm_one(server: LiveServer, k: int, plan: tuple[str, float], tag: str) -> Any:
    how, delay = plan
    rid = f"{tag}-{k}"
    body = {
        "rid": rid,
        "text": f"Storm request number {k % 9}",
        "stream": k % 2 == 0,
        "sampling_params": {
            "max_new_tokens": 16 if how == "keep" else 120,
            "ignore_eos": True,
            **GREEDY,
        },
    }
    if how == "disconnect":
        sock = raw_request(server, "/generate", orjson.dumps(body))
        time.sleep(delay)
        sock.close()
        return None
    if how == "abort":
        threading.Timer(delay, server.post, ("/abort_request", {"rid": rid})).start()
    if body["stream"]:
        r, events = stream(server, "/generate", body, timeout=60)
        assert r.status_code == 200, r.text
        return events[-2]
    r = server.post("/generate", body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_abort_storm(server: LiveServer) -> None:
    rng = random.Random(1234)
    tag = f"storm-{uuid.uuid4().hex[:6]}"
    plans = [
        (rng.choice(["keep", "abort", "abort", "disconnect"]), rng.uniform(0.0, 1.5))
        for _ in range(32)
    ]
    ref_body = {"sampling_params": {"max_new_tokens": 16, "ignore_eos": True, **GREEDY}}
    serial = {
        j: server.post("/generate", {**ref_body, "text": f"Storm request number {j}"}).json()[
            "output_ids"
        ]
        for j in range(9)
    }
    with ThreadPoolExecutor(len(plans)) as pool:
        futs = [pool.submit(_storm_one, server, k, p, tag) for k, p in enumerate(plans)]
        outs = [f.result(timeout=90) for f in futs]
    for k, ((how, _), out) in enumerate(zip(plans, outs, strict=True)):
        if how == "keep":
            assert out["output_ids"] == serial[k % 9], k
        elif how == "abort":
            assert out["meta_info"]["finish_reason"]["type"] in ("abort", "length"), out
    assert gen(server, max_new_tokens=2).status_code == 200


# ---------------------------------------------------------------------- concurrency
CONCURRENT_KINDS = [
    "native",
    "native-stream",
    "completions",
    "completions-stream",
    "chat",
    "chat-stream",
]


def _mixed_call(server: LiveServer, kind: str, prompt: str) -> str:
    base = kind.removesuffix("-stream")
    path = {
        "native": "/generate",
        "completions": "/v1/completions",
        "chat": "/v1/chat/completions",
    }[base]
    if base == "native":
        body: dict = {"text": prompt, "sampling_params": {"max_new_tokens": 6, **GREEDY}}
    else:
        body = {"model": "default", "max_tokens": 6, **GREEDY, **openai_prompt(path, prompt)}
    if kind.endswith("-stream"):
        body["stream"] = True
        r, events = stream(server, path, body, timeout=120)
        assert r.status_code == 200, r.text
        return stream_text(path, events)
    r = server.post(path, body, timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()
    if base == "native":
        return out["text"]
    choice = out["choices"][0]
    return choice["message"]["content"] if base == "chat" else choice["text"]


def test_concurrent_mixed_requests_match_serial(server: LiveServer) -> None:
    prompts = [f"Item {i}: the {['cat', 'sky', 'sea', 'code'][i % 4]} is" for i in range(8)]
    calls = [(CONCURRENT_KINDS[k % 6], prompts[(k // 6) % 8]) for k in range(144)]
    serial = {c: _mixed_call(server, *c) for c in sorted(set(calls))}
    with ThreadPoolExecutor(len(calls)) as pool:
        results = list(pool.map(lambda c: _mixed_call(server, *c), calls))
    wrong = [(c, r, serial[c]) for c, r in zip(calls, results, strict=True) if r != serial[c]]
    assert not wrong, f"{len(wrong)} of {len(calls)} differ from the serial run: {wrong[:5]}"
    for p in prompts:  # both routes run the same greedy decode of the same tokens
        assert serial[("completions", p)] == serial[("native", p)], p


# ---------------------------------------------------------------------- stream protocol
@pytest.mark.parametrize("route", ["/generate", "/v1/completions", "/v1/chat/completions"])
def test_stream_protocol(server: LiveServer, route: str) -> None:
    if route == "/generate":
        body: dict = {
            "text": ["One", "Two"],
            "stream": True,
            "sampling_params": {"max_new_tokens": 5, "n": 2, **GREEDY},
        }
    else:
        body = {
            "model": "default",
            "max_tokens": 5,
            "n": 2,
            "stream": True,
            **GREEDY,
            "stream_options": {"include_usage": True},
            **openai_prompt(route),
        }
    r, events = stream(server, route, body)
    assert r.status_code == 200, r.text
    data = events[:-1]
    assert all(isinstance(e, dict) and "error" not in e for e in data), data
    if route == "/generate":
        finals = [e for e in data if e["meta_info"]["finish_reason"] is not None]
        assert sorted(e["index"] for e in finals) == [0, 1, 2, 3]
    else:
        finished = [c["index"] for e in data for c in e["choices"] if c["finish_reason"]]
        assert sorted(finished) == [0, 1]
        assert data[-1]["choices"] == [] and data[-1]["usage"]["completion_tokens"] == 10


@pytest.mark.parametrize("route", ["/generate", "/v1/completions", "/v1/chat/completions"])
def test_stream_error_is_an_error_event(server: LiveServer, route: str) -> None:
    """A request that fails after its stream may have started (its grammar does not compile):
    a 4xx before the stream, or an error event followed by [DONE]; never a 5xx or a cut."""
    bad = {"regex": "(unclosed"}
    if route == "/generate":
        body: dict = {"text": "hi", "stream": True, "sampling_params": {"max_new_tokens": 4, **bad}}
    else:
        body = {"model": "default", "max_tokens": 4, "stream": True, **bad, **openai_prompt(route)}
    r, events = stream(server, route, body)
    if r.status_code != 200:
        assert_4xx(r)
        return
    errors = [e for e in events[:-1] if "error" in e]
    assert len(errors) == 1 and errors[0]["error"]["message"], events
    assert 400 <= int(errors[0]["error"]["code"]) < 500, errors


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_openai_stream_aborted_mid_way(server: LiveServer, route: str) -> None:
    """An OpenAI stream whose request is aborted by the server side ends with an error event
    (or a final chunk) and [DONE], never a cut connection."""
    rid = f"oai-abort-{uuid.uuid4().hex[:8]}"
    body = {
        "model": "default",
        "max_tokens": 300,
        "ignore_eos": True,
        "stream": True,
        "rid": rid,
        **openai_prompt(route),
    }
    r, events = stream_aborted_after_first_event(server, route, body, rid)
    assert r.status_code == 200, r.text
    last = events[-2]
    assert "error" in last or last["choices"][0]["finish_reason"] not in (None, "length"), (
        f"the abort did not end the stream: {last}"
    )


def test_responses_stream_aborted_mid_way(server: LiveServer) -> None:
    """A Responses-API stream whose request is aborted ends with an ``error`` event and
    ``response.failed``, never a cut connection; nothing is stored for it."""
    rid = f"resp-abort-{uuid.uuid4().hex[:8]}"
    body = {
        "model": "default",
        "input": "Tell me a long story.",
        "max_output_tokens": 300,
        "ignore_eos": True,
        "stream": True,
        "rid": rid,
    }
    r, events = stream_aborted_after_first_event(
        server, "/v1/responses", body, rid, parse=parse_response_events
    )
    assert r.status_code == 200, r.text
    assert [e["type"] for e in events[-2:]] in (
        ["error", "response.failed"],
        ["response.output_item.done", "response.completed"],  # it won the race
    ), events[-2:]
    response_id = events[0]["response"]["id"]
    stored = server.get(f"/v1/responses/{response_id}")
    assert stored.status_code == (404 if events[-1]["type"] == "response.failed" else 200)
