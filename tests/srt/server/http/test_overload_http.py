"""A server at capacity (one running request, two queued): a full queue answers 503 with
``Retry-After`` in each dialect's error shape, a high-priority request pushes out the worst
queued one and retracts the running low-priority one, overtaking the queue; nothing leaks."""

from __future__ import annotations

import threading
import time

import httpx
import plain_http
import pytest

from radixlm.srt.scheduler.queue_gate import PUSHED_OUT, QUEUE_FULL

pytestmark = pytest.mark.slow  # starts a server on the default model

ARGS = (
    "--max-total-tokens",
    8192,
    "--enable-priority-scheduling",
    "--max-running-requests",
    1,
    "--max-queued-requests",
    2,
)


def gen(n: int, priority: int | None = None) -> dict:
    body = {
        "text": "Count slowly:",
        "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True},
    }
    return body if priority is None else {**body, "priority": priority}


class Call(threading.Thread):
    """A request sent on its own thread; its response and the time it came back."""

    def __init__(self, url: str, path: str, body: dict) -> None:
        super().__init__(daemon=True)
        self.url, self.path, self.body = url, path, body
        self.response: httpx.Response | None = None
        self.done_at = 0.0
        self.start()

    def run(self) -> None:
        self.response = plain_http.post(self.url + self.path, json=self.body, timeout=300)
        self.done_at = time.monotonic()


def kv(url: str) -> dict:
    return plain_http.get(url + "/server_info", timeout=30).json()["kv_pool"]


def wait_for(url: str, running: int, waiting: int) -> None:
    deadline = time.monotonic() + 60
    while (k := kv(url))["num_running"] != running or k["num_waiting"] != waiting:
        assert time.monotonic() < deadline, k
        time.sleep(0.05)


# the running request's length: it must still be decoding when the high-priority request comes
# (about 1.5 s after it started, some 20 tokens on the 2-core machine) and its whole decode is
# most of the test's time (200 tokens: 16 s of the 30)
LONG_TOKENS = 100


def test_full_queue_503s_and_a_high_priority_request_overtakes(start_server) -> None:
    url = start_server(*ARGS).url  # its own: no other module serves this configuration
    long = Call(url, "/generate", gen(LONG_TOKENS, priority=0))
    wait_for(url, running=1, waiting=0)
    queued = []
    for n in (1, 2):  # one after the other: the second is the newest
        queued.append(Call(url, "/generate", gen(4, priority=0)))
        wait_for(url, running=1, waiting=n)

    # full: each dialect answers 503 + Retry-After in its own error shape
    r = plain_http.post(url + "/generate", json=gen(4, priority=0), timeout=60)
    assert r.status_code == 503 and r.headers["retry-after"]
    assert r.json()["error"]["message"] == QUEUE_FULL
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    r = plain_http.post(url + "/v1/chat/completions", json={**chat, "stream": True}, timeout=60)
    assert r.status_code == 503 and r.headers["retry-after"]
    err = r.json()["error"]
    assert err["message"] == QUEUE_FULL and err["type"] == "service_unavailable_error"
    r = plain_http.post(url + "/v1/messages", json={**chat, "model": "default"}, timeout=60)
    assert r.status_code == 503 and r.headers["retry-after"]
    body = r.json()
    assert body["type"] == "error" and body["error"]["message"] == QUEUE_FULL

    # priority 20: pushes out the newest queued request (priority 0) and, 20 > the
    # threshold of 10 above the running one, retracts it and runs first
    high = Call(url, "/v1/completions", {"prompt": "Hi", "max_tokens": 4, "priority": 20})
    for call in [high, *queued, long]:
        call.join(300)
    assert high.response.status_code == 200, high.response.text
    assert queued[1].response.status_code == 503
    assert queued[1].response.json()["error"]["message"] == PUSHED_OUT
    assert queued[0].response.status_code == 200
    assert long.response.status_code == 200
    assert long.response.json()["meta_info"]["completion_tokens"] == LONG_TOKENS
    assert high.done_at < queued[0].done_at and high.done_at < long.done_at

    deadline = time.monotonic() + 30
    while (k := kv(url))["num_running"] or k["num_waiting"]:
        assert time.monotonic() < deadline, k
        time.sleep(0.1)
    assert k["available"] + k["evictable"] + k["protected"] == k["max_total_tokens"]
    assert k["protected"] == 0
    info = plain_http.get(url + "/server_info", timeout=30).json()
    assert info["num_request_states"] == 0
