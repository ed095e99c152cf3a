"""Supervision of `radixlm serve` with the real process trio on a tiny random Llama: a child
killed mid-request (503 + Retry-After at once, the server exits EXIT_WORKER_DIED, no child left),
a stopped scheduler (/health 503, /health_generate 503 within its timeout, both recover after
SIGCONT), SIGTERM (drain: in-flight requests finish, new ones get 503, exit 0)."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest
from processes import suspend_and_wait

from radixlm.srt.managers.heartbeat import (
    create_heartbeat_file,
    heartbeat_age_s,
    start_heartbeat,
)
from radixlm.srt.server.process.server_process import ServerProcess
from radixlm.srt.server.process.supervisor import EXIT_WORKER_DIED

LONG = {"max_new_tokens": 1500, "ignore_eos": True}
HEALTH_GENERATE_TIMEOUT_S = 6.0  # the servers' RADIXLM_HEALTH_CHECK_TIMEOUT (20 s by default)


@pytest.fixture
def server(
    tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[ServerProcess]:
    monkeypatch.setenv("RADIXLM_HEALTH_CHECK_TIMEOUT", str(HEALTH_GENERATE_TIMEOUT_S))
    s = ServerProcess(
        ["--model-path", str(tiny_llama_dir), "--max-total-tokens", "4096"],
        log_path=tmp_path / "server.log",
    )
    s.children = psutil.Process(s.pid).children(recursive=True)  # type: ignore[attr-defined]
    yield s
    s.stop(signal.SIGKILL)
    for child in s.children:  # type: ignore[attr-defined]
        if child.is_running():
            child.kill()


def child(server: ServerProcess, prefix: str) -> psutil.Process:
    return next(c for c in server.children if c.name().startswith(prefix))  # type: ignore[attr-defined]


def assert_no_child_left(server: ServerProcess) -> None:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        alive = [
            c
            for c in server.children  # type: ignore[attr-defined]
            if c.is_running() and c.status() != psutil.STATUS_ZOMBIE
        ]
        if not alive:
            return
        time.sleep(0.1)
    raise AssertionError(f"children left running: {alive}")


def log_text(tmp_path: Path) -> str:
    return (tmp_path / "server.log").read_text(errors="replace")


class Stream(threading.Thread):
    """A streaming /generate in a thread: ``started`` once the first event arrived."""

    def __init__(self, server: ServerProcess, sampling_params: dict) -> None:
        super().__init__(daemon=True)
        self.url = server.url + "/generate"
        self.body = {"text": "Once upon a time", "stream": True, "sampling_params": sampling_params}
        self.events: list[str] = []
        self.started = threading.Event()
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.url, json=self.body, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line[6:])
                        self.started.set()
        except BaseException as e:  # noqa: BLE001 (the test reads it)
            self.error = e


class Call(threading.Thread):
    """A non-streaming /generate in a thread; ``response`` and ``elapsed_s`` once it returned."""

    def __init__(self, server: ServerProcess, sampling_params: dict) -> None:
        super().__init__(daemon=True)
        self.url = server.url + "/generate"
        self.body = {"text": "Tell me a story", "sampling_params": sampling_params}
        self.response: httpx.Response | None = None
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            self.response = httpx.post(self.url, json=self.body, timeout=120)
        except BaseException as e:  # noqa: BLE001 (the test reads it)
            self.error = e


def wait_running(server: ServerProcess, num: int, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pool = httpx.get(server.url + "/server_info", timeout=10).json()["kv_pool"]
        if pool["num_running"] >= num:
            return
        time.sleep(0.1)
    raise AssertionError(f"{num} requests did not start running")


def exit_code_within(server: ServerProcess, timeout_s: float) -> int:
    try:
        return server.proc.wait(timeout_s)
    except Exception as e:
        raise AssertionError(f"the server did not exit within {timeout_s} s") from e


@pytest.mark.slow
@pytest.mark.parametrize("victim", ["radixlm-sched", "radixlm-detok"])
def test_killed_child_fails_requests_and_exits(
    server: ServerProcess, tmp_path: Path, victim: str
) -> None:
    stream, call = Stream(server, LONG), Call(server, LONG)
    assert stream.started.wait(60), stream.error
    wait_running(server, 2)
    t0 = time.monotonic()
    child(server, victim).kill()
    call.join(10)
    stream.join(10)
    assert call.response is not None, call.error
    assert time.monotonic() - t0 < 5
    assert call.response.status_code == 503
    assert int(call.response.headers["retry-after"]) > 0
    message = call.response.json()["error"]["message"]
    assert "SIGKILL" in message and victim.removeprefix("radixlm-") in message
    errors = [json.loads(e)["error"] for e in stream.events if e.startswith('{"error"')]
    assert [e["code"] for e in errors] == [503]  # the stream ended with one error event
    assert exit_code_within(server, 15) == EXIT_WORKER_DIED
    assert time.monotonic() - t0 < 15
    assert_no_child_left(server)
    assert "exit code -9" in log_text(tmp_path)


@pytest.mark.slow
def test_stopped_scheduler_turns_health_503_then_recovers(server: ServerProcess) -> None:
    sched = child(server, "radixlm-sched")
    heartbeats = [f.path for f in sched.open_files() if f.path.endswith(".heartbeat")]
    assert heartbeats and heartbeat_age_s(heartbeats[0]) < 3  # the trio's heartbeat beats
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    suspend_and_wait(sched)
    try:
        t0 = time.monotonic()
        r = httpx.get(server.url + "/health", timeout=10)
        assert r.status_code == 503 and time.monotonic() - t0 < 2
        assert "scheduler" in r.json()["error"]["message"] and r.headers["retry-after"]
        r = httpx.get(server.url + "/health_generate", timeout=HEALTH_GENERATE_TIMEOUT_S + 30)
        elapsed_s = time.monotonic() - t0
        assert r.status_code == 503, r.text
        assert HEALTH_GENERATE_TIMEOUT_S - 1 < elapsed_s < HEALTH_GENERATE_TIMEOUT_S + 10
    finally:
        sched.resume()
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    assert httpx.get(server.url + "/health_generate", timeout=60).status_code == 200
    info = httpx.get(server.url + "/server_info", timeout=10).json()
    assert info.get("num_inflight_requests", 0) == 0  # the timed-out probe left no state
    assert server.stop(signal.SIGTERM) == 0


@pytest.mark.slow
@pytest.mark.parametrize("to_children", [False, True], ids=["server", "whole-group"])
def test_sigterm_drains_in_flight_then_exits_zero(
    server: ServerProcess, tmp_path: Path, to_children: bool
) -> None:
    """SIGTERM to the server alone (Kubernetes, docker) or to every process of the server, as
    systemd's default KillMode=control-group does (the children then exit 0 while draining)."""
    # long enough that the drain is still running when /health is asked (40 tokens of the tiny
    # model finished within the 0.3 s wait on a quiet machine, and the server was gone)
    short = {"max_new_tokens": 600, "ignore_eos": True, "temperature": 0}
    stream, call = Stream(server, short), Call(server, short)
    assert stream.started.wait(60), stream.error
    wait_running(server, 2)
    server.proc.send_signal(signal.SIGTERM)
    for c in server.children if to_children else []:  # type: ignore[attr-defined]
        c.send_signal(signal.SIGTERM)
    time.sleep(0.1)
    r = httpx.get(server.url + "/health", timeout=10)
    assert r.status_code == 503 and r.headers["retry-after"]
    r = httpx.post(server.url + "/generate", json={"text": "late"}, timeout=10)
    assert r.status_code == 503
    assert exit_code_within(server, 90) == 0
    call.join(10)
    stream.join(10)
    assert call.response is not None and call.response.status_code == 200, call.error
    assert call.response.json()["meta_info"]["completion_tokens"] == 600
    assert stream.events[-1] == "[DONE]"
    assert json.loads(stream.events[-2])["meta_info"]["finish_reason"]["type"] == "length"
    assert_no_child_left(server)
    assert "draining 2 request(s)" in log_text(tmp_path)


@pytest.mark.slow
def test_second_sigterm_ends_the_drain_with_503(server: ServerProcess, tmp_path: Path) -> None:
    call = Call(server, LONG)
    wait_running(server, 1)
    server.proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    t0 = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    call.join(10)
    assert call.response is not None, call.error
    assert call.response.status_code == 503 and call.response.headers["retry-after"]
    assert time.monotonic() - t0 < 5
    assert exit_code_within(server, 30) == 0
    assert_no_child_left(server)
    # the scheduler was told to drop the request, so it exits on SIGTERM instead of generating
    # on until CHILD_STOP_TIMEOUT_S and being killed
    assert "did not stop in time" not in log_text(tmp_path)


def _beat_then_sleep(path: str) -> None:
    start_heartbeat(path)
    time.sleep(60)


@pytest.mark.slow
def test_heartbeat_age_grows_while_the_process_is_frozen(tmp_path: Path) -> None:
    path = str(tmp_path / "child.heartbeat")
    create_heartbeat_file(path)
    assert heartbeat_age_s(path) is None  # no beat yet
    proc = mp.get_context("spawn").Process(target=_beat_then_sleep, args=(path,), daemon=True)
    proc.start()
    try:
        deadline = time.monotonic() + 30
        while heartbeat_age_s(path) is None:
            assert time.monotonic() < deadline, "the child never beat"
            time.sleep(0.05)
        time.sleep(1.5)
        assert heartbeat_age_s(path) < 1.5  # beats every second while running
        os.kill(proc.pid, signal.SIGSTOP)
        time.sleep(2.5)
        assert heartbeat_age_s(path) > 2.0
        os.kill(proc.pid, signal.SIGCONT)
        time.sleep(0.5)
        assert heartbeat_age_s(path) < 1.5
    finally:
        proc.kill()
        proc.join()
