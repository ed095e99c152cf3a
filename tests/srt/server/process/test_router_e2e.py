"""Two radixlm workers (tiny random Llama) behind sglang-router's cache-aware policy
(``python -m sglang_router.launch_router --worker-urls ... --policy cache_aware``) on
127.0.0.1: native /generate, OpenAI chat (plain and streamed, ending with ``data: [DONE]``)
and the Responses API pass through, with the router's routing-key header; a shared-prefix
workload keeps each prefix on one worker, so the prefix-cache hit rate through the router is
close to one worker's while both workers serve; /flush_cache through the router empties both
workers' caches.

Skipped, with the reason, when the router's binary does not start here. The router's
``--dp-aware`` mode is not used: sglang-router 0.3.2 sends its calls to host ``0`` (it parses
``host:port@rank`` wrongly)."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import plain_http
import pytest

from radixlm.srt.server.process.server_process import ServerProcess, free_port

pytestmark = pytest.mark.slow

ROUTER_START_TIMEOUT_S = 60.0
NUM_GROUPS, PER_GROUP = 4, 4
TOPICS = ["astronomy", "cooking", "sailing", "geology"]
ONE_TOKEN = {"max_new_tokens": 1, "temperature": 0}
SEED = {"max_new_tokens": 48, "temperature": 0, "ignore_eos": True}
ROUTING_KEY = {"x-smg-routing-key": "user-42"}


@pytest.fixture(scope="module")
def workers(tiny_llama_dir, tmp_path_factory) -> Iterator[list[ServerProcess]]:
    """Both workers, started at once (each start waits mostly on its own children)."""
    args = ["--model-path", str(tiny_llama_dir), "--device", "cpu", "--max-total-tokens", "4096"]
    logs = [tmp_path_factory.mktemp(f"worker{i}") / "server.log" for i in range(2)]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        starts = [pool.submit(ServerProcess, args, log_path=log) for log in logs]
    started = [s.result() for s in starts if s.exception() is None]
    try:
        for s in starts:
            if s.exception() is not None:
                raise s.exception()
        yield started
    finally:
        for w in started:
            w.stop()


@pytest.fixture(scope="module")
def router(workers, tmp_path_factory) -> Iterator[str]:
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "sglang_router.launch_router",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--policy",
        "cache_aware",
        "--prometheus-port",
        str(free_port()),
        "--log-level",
        "warn",
        "--worker-urls",
        *[w.url for w in workers],
    ]
    log_path = tmp_path_factory.mktemp("router") / "router.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        reason = wait_router(proc, url, len(workers))
        if reason is not None:
            tail = log_path.read_text(errors="replace")[-2000:]
            pytest.skip(f"sglang-router did not start here: {reason}\n{tail}")
        yield url
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def wait_router(proc: subprocess.Popen, url: str, num_workers: int) -> str | None:
    """None once the router lists every worker as healthy, else why not."""
    deadline = time.monotonic() + ROUTER_START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return f"it exited with code {proc.returncode}"
        try:
            listed = plain_http.get(url + "/workers", timeout=2).json()["workers"]
            if sum(w["is_healthy"] for w in listed) == num_workers:
                return None
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        time.sleep(0.5)
    return f"no healthy workers within {ROUTER_START_TIMEOUT_S:.0f} s"


def prefix_totals(worker: ServerProcess) -> dict[str, int]:
    """A worker's cumulative admissions (requests, prompt and cached tokens) and its
    evictable (cached, unreferenced) KV tokens now."""
    pool = plain_http.get(worker.url + "/server_info", timeout=30).json()["kv_pool"]
    return {**pool["prefix_cache"], "evictable": pool["evictable"]}


def group_prompts() -> list[list[str]]:
    """PER_GROUP questions on each of NUM_GROUPS long, distinct system prompts."""
    prefixes = [
        f"You are an expert on {t}. " + " ".join(f"{t} fact {i} is remembered." for i in range(24))
        for t in TOPICS[:NUM_GROUPS]
    ]
    return [[f"{p} Question {q}: why?" for q in range(PER_GROUP)] for p in prefixes]


def post(url: str, text: str, params: dict) -> dict:
    body = {"text": text, "sampling_params": params}
    r = plain_http.post(url + "/generate", json=body, timeout=120)  # no routing key: it would pin
    assert r.status_code == 200, r.text
    return r.json()["meta_info"]


def run_workload(url: str) -> float:
    """Each group's first question at once (long answers, so that they overlap: a router
    without a prefix match balances by load), then the other questions one at a time,
    interleaved across groups; returns the prompt tokens' cached share."""
    groups = group_prompts()
    with concurrent.futures.ThreadPoolExecutor(NUM_GROUPS) as pool:
        metas = list(pool.map(lambda g: post(url, g[0], SEED), groups))
    for q in range(1, PER_GROUP):
        metas += [post(url, g[q], ONE_TOKEN) for g in groups]
    return sum(m["cached_tokens"] for m in metas) / sum(m["prompt_tokens"] for m in metas)


def flush(url: str) -> None:
    assert plain_http.post(url + "/flush_cache", timeout=30).status_code == 200


def test_native_and_openai_requests_pass_through(router: str) -> None:
    body = {"text": "Hello there", "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    r = plain_http.post(router + "/generate", json=body, headers=ROUTING_KEY, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["meta_info"]["completion_tokens"] == 4
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0}
    r = plain_http.post(router + "/v1/chat/completions", json=chat, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4
    for path, payload in (("/generate", body), ("/v1/chat/completions", chat)):
        with plain_http.stream(
            "POST", router + path, json={**payload, "stream": True}, timeout=60
        ) as s:
            assert s.status_code == 200
            events = [line for line in s.iter_lines() if line.startswith("data: ")]
        assert len(events) >= 2 and events[-1] == "data: [DONE]", (path, events[-3:])


def test_responses_api_passes_through(router: str) -> None:
    """sglang-router re-sends /v1/responses with its own defaults (priority 0, top_k -1,
    stream null, ...); the workers accept them, plain and streamed."""
    body = {"model": "default", "input": "Hi", "max_output_tokens": 4, "temperature": 0}
    r = plain_http.post(router + "/v1/responses", json=body, timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["status"] in ("completed", "incomplete") and out["usage"]["output_tokens"] <= 4
    with plain_http.stream("POST", router + "/v1/responses", json={**body, "stream": True}) as s:
        assert s.status_code == 200
        kinds = [line for line in s.iter_lines() if line.startswith("event: ")]
    assert kinds[0] == "event: response.created"
    assert kinds[-1] in ("event: response.completed", "event: response.incomplete")


def test_cache_aware_routing_keeps_prefixes_on_one_worker(
    router: str, workers: list[ServerProcess]
) -> None:
    flush(workers[0].url)
    single = run_workload(workers[0].url)  # one worker holds every prefix
    flush(router)
    before = [prefix_totals(w) for w in workers]
    routed = run_workload(router)
    after = [prefix_totals(w) for w in workers]
    served = [
        a["num_admitted_reqs"] - b["num_admitted_reqs"] for a, b in zip(after, before, strict=True)
    ]
    cached = [
        a["num_cached_tokens"] - b["num_cached_tokens"] for a, b in zip(after, before, strict=True)
    ]
    assert sum(served) == NUM_GROUPS * PER_GROUP
    assert min(served) >= PER_GROUP  # both workers serve (whole groups)
    assert single > 0.5  # the workload is mostly shared prefixes
    assert routed >= single - 0.05, (routed, single, served, cached)
    assert all(c > 0 for c in cached)  # each worker reuses the prefixes it holds


def test_flush_through_the_router_reaches_every_worker(
    router: str, workers: list[ServerProcess]
) -> None:
    run_workload(router)
    assert sum(prefix_totals(w)["evictable"] for w in workers) > 0
    r = plain_http.post(router + "/flush_cache", timeout=30)
    assert r.status_code == 200, r.text
    assert [prefix_totals(w)["evictable"] for w in workers] == [0, 0]


def test_router_log_has_no_errors_from_workers(router: str, tmp_path_factory) -> None:
    """The router reads every worker's info without complaint (registration, load)."""
    logs = list(Path(tmp_path_factory.getbasetemp()).glob("router*/router.log"))
    assert logs
    text = logs[0].read_text(errors="replace")
    assert "Failed to" not in text, text[-2000:]
