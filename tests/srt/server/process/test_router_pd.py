"""sglang-router's PD mode (``--pd-disaggregation --prefill URL BOOTSTRAP_PORT --decode URL``)
in front of one prefill and one decode radixlm worker on 127.0.0.1, the KV moved by Mooncake's
transfer engine over TCP: greedy outputs equal a whole server's for native ``/generate`` and
OpenAI chat, streamed or not; a shared prefix hits the prefill worker's radix cache; both
workers are left with no KV held (``available + evictable + protected == max_total_tokens``)
and report their transfers in ``/server_info`` and ``/metrics``. Then faults: a decode request
whose prefill worker is gone fails at once; a prefill whose decode worker never claims its KV
frees it after the timeout; kill -9 of the decode worker while a transfer is pending, then of
the prefill worker: the survivor fails the request fast, leaks nothing and serves the next one.

The tiny model has large random weights (``initializer_range`` 0.5), so that its greedy tokens
depend on the whole prompt's KV (smaller ones repeat the last prompt token whatever the KV).
Skipped, with the reason, when the router or Mooncake's engine does not start here."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import plain_http
import pytest

from radixlm.srt.server.process.server_process import ServerProcess, free_port

pytestmark = pytest.mark.slow

ROUTER_START_TIMEOUT_S = 90.0
TRANSFER_TIMEOUT_S = 10
GREEDY = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
PROMPTS = [
    "The capital of France is",
    "Once upon a time in a land far away, there lived",
    "def fibonacci(n):\n    ",
    "1, 2, 3, 5, 8, 13,",
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, default_model_dir, tiny_model_writer) -> Path:
    pytest.importorskip("mooncake.engine", reason="mooncake-transfer-engine is not importable")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_dir)
    return tiny_model_writer(tmp_path_factory.mktemp("pd-model"), tok, initializer_range=0.5)


class Workers:
    def __init__(self, model_dir: Path, tmp_path_factory) -> None:
        self.tmp = tmp_path_factory
        self.base = ["--model-path", str(model_dir), "--device", "cpu"]
        self.base += ["--max-total-tokens", "4096"]
        self.pd = ["--disaggregation-transfer-timeout-s", str(TRANSFER_TIMEOUT_S)]
        self.pd += ["--enable-metrics"]
        self.bootstrap_port = free_port()
        with ThreadPoolExecutor(3) as pool:
            p = pool.submit(self.start_prefill)
            d = pool.submit(self.start_decode)
            w = pool.submit(self.start, "whole", self.base)
            self.prefill, self.decode, self.whole = p.result(), d.result(), w.result()

    def start(self, name: str, args: list[str]) -> ServerProcess:
        log = self.tmp.mktemp(name) / "server.log"
        return ServerProcess(args, log_path=log)

    def start_prefill(self) -> ServerProcess:
        mode = ["--disaggregation-mode", "prefill"]
        port = ["--disaggregation-bootstrap-port", str(self.bootstrap_port)]
        return self.start("prefill", self.base + self.pd + mode + port)

    def start_decode(self) -> ServerProcess:
        return self.start("decode", self.base + self.pd + ["--disaggregation-mode", "decode"])

    def stop(self) -> None:
        for w in (self.prefill, self.decode, self.whole):
            w.stop()


@pytest.fixture(scope="module")
def workers(model_dir, tmp_path_factory) -> Iterator[Workers]:
    started = Workers(model_dir, tmp_path_factory)
    try:
        yield started
    finally:
        started.stop()


@pytest.fixture(scope="module")
def router(workers: Workers, tmp_path_factory) -> Iterator[str]:
    port = free_port()
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--pd-disaggregation", "--policy", "random"]
    cmd += ["--prefill", workers.prefill.url, str(workers.bootstrap_port)]
    cmd += ["--decode", workers.decode.url, "--prometheus-port", str(free_port())]
    cmd += ["--log-level", "warn"]
    log_path = tmp_path_factory.mktemp("router") / "router.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        reason = wait_router(proc, url)
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


def wait_router(proc: subprocess.Popen, url: str) -> str | None:
    deadline = time.monotonic() + ROUTER_START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return f"it exited with code {proc.returncode}"
        try:
            listed = plain_http.get(url + "/workers", timeout=2).json()["workers"]
            if len(listed) == 2 and all(w["is_healthy"] for w in listed):
                return None
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        time.sleep(0.5)
    return f"no healthy workers within {ROUTER_START_TIMEOUT_S:.0f} s"


def generate(url: str, body: dict, timeout: float = 120) -> httpx.Response:
    return plain_http.post(url + "/generate", json=body, timeout=timeout)


def pool_of(worker: ServerProcess) -> dict:
    return plain_http.get(worker.url + "/server_info", timeout=30).json()["kv_pool"]


def wait_idle(worker: ServerProcess, timeout_s: float = 30.0) -> dict:
    """The worker's pool once no transfer is pending; asserts the idle rule."""
    deadline = time.monotonic() + timeout_s
    while True:
        pool = pool_of(worker)
        busy = pool["num_running"] or pool["num_waiting"]
        if not busy and not pool["disaggregation"]["pending_transfers"]:
            break
        assert time.monotonic() < deadline, pool
        time.sleep(0.2)
    total = pool["available"] + pool["evictable"] + pool["protected"]
    assert total == pool["max_total_tokens"], pool
    return pool


def test_native_generate_through_the_router_equals_a_whole_server(router, workers):
    for text in PROMPTS:
        body = {"text": text, "sampling_params": GREEDY}
        routed, whole = generate(router, body), generate(workers.whole.url, body)
        assert routed.status_code == 200, routed.text
        assert routed.json()["output_ids"] == whole.json()["output_ids"], text
        assert routed.json()["meta_info"]["completion_tokens"] == GREEDY["max_new_tokens"]
    outs = {tuple(generate(router, {"text": t, "sampling_params": GREEDY}).json()["output_ids"])
            for t in PROMPTS}  # fmt: skip
    assert len(outs) == len(PROMPTS)  # the KV matters: each prompt has its own answer


def stream_events(url: str, path: str, body: dict) -> list[dict]:
    with plain_http.stream("POST", url + path, json={**body, "stream": True}, timeout=120) as s:
        assert s.status_code == 200
        lines = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_native_stream_through_the_router_equals_a_whole_server(router, workers):
    body = {"text": PROMPTS[1], "sampling_params": GREEDY}
    events = stream_events(router, "/generate", body)
    assert len(events) >= 2
    assert events[-1]["output_ids"] == generate(workers.whole.url, body).json()["output_ids"]


def chat_body(**extra) -> dict:
    messages = [{"role": "user", "content": "Tell me about the sea and its tides."}]
    return {"messages": messages, "max_tokens": 12, "temperature": 0, **extra}


def test_openai_chat_through_the_router_equals_a_whole_server(router, workers):
    routed = plain_http.post(router + "/v1/chat/completions", json=chat_body(), timeout=120)
    whole = plain_http.post(
        workers.whole.url + "/v1/chat/completions", json=chat_body(), timeout=120
    )
    assert routed.status_code == 200, routed.text
    content = whole.json()["choices"][0]["message"]["content"]
    assert routed.json()["choices"][0]["message"]["content"] == content
    streamed = stream_events(router, "/v1/chat/completions", chat_body())
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in streamed if e["choices"])
    assert text == content
    # n = 2: the router sends one room per choice
    two = plain_http.post(router + "/v1/chat/completions", json=chat_body(n=2), timeout=120)
    assert two.status_code == 200, two.text
    assert [c["message"]["content"] for c in two.json()["choices"]] == [content, content]


def test_a_shared_prefix_hits_the_prefill_workers_cache(router, workers):
    before = pool_of(workers.prefill)["prefix_cache"]["num_cached_tokens"]
    prefix = "You are a helpful assistant who knows geology. " * 8
    for q in ("Why are rocks hard?", "What is basalt?", "Where is granite found?"):
        body = {"text": prefix + q, "sampling_params": {**GREEDY, "max_new_tokens": 2}}
        assert generate(router, body).status_code == 200
    cached = pool_of(workers.prefill)["prefix_cache"]["num_cached_tokens"] - before
    assert cached >= 2 * 60, cached  # the second and third prompts reuse the prefix


def test_both_workers_hold_no_kv_and_report_their_transfers(router, workers):
    prefill, decode = wait_idle(workers.prefill), wait_idle(workers.decode)
    sent, got = prefill["disaggregation"], decode["disaggregation"]
    assert sent["mode"] == "prefill" and got["mode"] == "decode"
    assert sent["num_transfers"] >= len(PROMPTS) and sent["transfer_bytes_total"] > 0
    assert sent["transfer_bytes_per_s"] > 0 and got["num_transfers"] == sent["num_transfers"]
    assert sent["num_transfer_failures"] == got["num_transfer_failures"] == 0
    metrics = plain_http.get(workers.prefill.url + "/metrics", timeout=30).text
    assert "disaggregation_transfer_bytes_total" in metrics
    assert "disaggregation_pending_transfers" in metrics


def test_a_whole_server_refuses_bootstrap_fields(workers):
    r = generate(workers.whole.url, {"text": "hi", "bootstrap_room": 5})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "bootstrap_room"


def pd_body(room: int, port: int, max_new_tokens: int = 8) -> dict:
    params = {**GREEDY, "max_new_tokens": max_new_tokens}
    return {"text": PROMPTS[0], "sampling_params": params, "bootstrap_host": "127.0.0.1",
            "bootstrap_port": port, "bootstrap_room": room}  # fmt: skip


def test_decode_fails_fast_when_the_prefill_worker_is_gone(workers):
    started = time.monotonic()
    r = generate(workers.decode.url, pd_body(101, free_port()))
    assert r.status_code == 503 and "unreachable" in r.text, r.text
    assert time.monotonic() - started < 5
    wait_idle(workers.decode)


def test_prefill_frees_kv_no_decode_worker_claims(workers):
    failures = pool_of(workers.prefill)["disaggregation"]["num_transfer_failures"]
    r = generate(workers.prefill.url, pd_body(102, workers.bootstrap_port))
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 1
    assert pool_of(workers.prefill)["disaggregation"]["pending_transfers"] == 1
    pool = wait_idle(workers.prefill, TRANSFER_TIMEOUT_S + 20)
    assert pool["disaggregation"]["num_transfer_failures"] == failures + 1


def test_a_registration_that_does_not_match_is_refused(workers):
    # the two workers got different prompts under one room: the prefill worker refuses to send
    prefill_body = pd_body(105, workers.bootstrap_port)
    decode_body = {**prefill_body, "text": PROMPTS[3]}
    with ThreadPoolExecutor(2) as pool:
        decoded = pool.submit(generate, workers.decode.url, decode_body)
        prefilled = pool.submit(generate, workers.prefill.url, prefill_body)
        r = decoded.result()
    assert prefilled.result().status_code == 200
    assert r.status_code == 503 and "the prompts differ" in r.text, r.text
    wait_idle(workers.prefill)
    wait_idle(workers.decode)


def test_kill_of_either_worker_mid_transfer_leaves_the_survivor_clean(workers):
    # the decode worker registers room 103 and waits; killed, the prefill's write fails
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(generate, workers.decode.url, pd_body(103, workers.bootstrap_port))
        time.sleep(2)
        workers.decode.stop(signal.SIGKILL)
        with pytest.raises(httpx.HTTPError):
            waiting.result()
    failures = pool_of(workers.prefill)["disaggregation"]["num_transfer_failures"]
    started = time.monotonic()
    r = generate(workers.prefill.url, pd_body(103, workers.bootstrap_port))
    assert r.status_code == 200
    pool = wait_idle(workers.prefill, 10)
    assert time.monotonic() - started < 10
    assert pool["disaggregation"]["num_transfer_failures"] == failures + 1
    assert (
        generate(workers.prefill.url, {"text": "hi", "sampling_params": GREEDY}).status_code == 200
    )
    # a new decode worker registers room 104 and waits; the prefill worker is killed
    workers.decode = workers.start_decode()
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(generate, workers.decode.url, pd_body(104, workers.bootstrap_port))
        time.sleep(2)
        workers.prefill.stop(signal.SIGKILL)
        killed = time.monotonic()
        r = waiting.result()
    assert r.status_code == 503 and "unreachable" in r.text, r.text
    assert time.monotonic() - killed < 5
    wait_idle(workers.decode)
    body = {"text": PROMPTS[2], "sampling_params": GREEDY}
    assert (
        generate(workers.decode.url, body).json()["output_ids"]
        == (generate(workers.whole.url, body).json()["output_ids"])
    )
