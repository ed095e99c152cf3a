"""While one scheduler step runs longer than the query timeout (a long prompt on a CPU),
/server_info and /v1/loads answer with the scheduler's last figures (and their age) instead of
a 503, and an action such as /flush_cache is a 503 that expires unread. The real HTTP process
over fake_stack's worker, made to stall for one tick."""

from __future__ import annotations

import time

import httpx
import pytest
from fake_stack import FakeStack


@pytest.fixture
def stalled(tmp_path):
    s = FakeStack(tmp_path)
    s.tm.control_timeout_s = 0.3
    try:
        yield s
    finally:
        s.close()


@pytest.mark.slow
def test_reads_answer_from_the_last_figures_during_a_long_step(stalled: FakeStack) -> None:
    url = stalled.url
    fresh = httpx.get(url + "/server_info", timeout=10).json()
    assert "age_s" not in fresh["kv_pool"]
    assert httpx.get(url + "/v1/loads", timeout=10).status_code == 200
    stalled.worker.stall_s = 2.0
    time.sleep(0.05)  # the worker is inside its long tick now
    start = time.monotonic()
    r = httpx.get(url + "/server_info", timeout=10)
    assert r.status_code == 200, r.text
    assert r.json()["kv_pool"]["age_s"] >= 0.3
    assert r.json()["kv_pool"]["max_total_tokens"] == fresh["kv_pool"]["max_total_tokens"]
    loads = httpx.get(url + "/v1/loads", timeout=10)
    assert loads.status_code == 200, loads.text
    flush = httpx.post(url + "/flush_cache", timeout=10)
    assert flush.status_code == 503 and "retry" in flush.json()["error"]["message"]
    assert time.monotonic() - start < 1.9  # none of them waited for the step
    time.sleep(2.0)
    r = httpx.get(url + "/server_info", timeout=10)  # the step is over: fresh figures again
    assert r.status_code == 200 and "age_s" not in r.json()["kv_pool"]
    assert httpx.post(url + "/flush_cache", timeout=10).status_code == 200
