"""`radixlm serve --tp-size 2` on CPUs (gloo): the HTTP process, rank 0 (the scheduler process)
and rank 1 (a follower process) on a tiny random Llama. Outputs equal a TP=1 Engine's (greedy
with a chunked prefill, a JSON schema, logprobs), a repeated prompt reuses its cached prefix,
/server_info reports the ranks; supervision covers every rank: a stopped follower turns
/health 503 until it runs again, a rank killed with SIGKILL (follower or rank 0) fails the
requests in flight with 503 and ends the server with EXIT_WORKER_DIED leaving no process, and
SIGTERM stops every rank cleanly (exit 0); two "machines" (``--nnodes 2``) on this host serve
and stop together. A GPU variant (NCCL, two devices) is marked `gpu`."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import plain_http
import psutil
import pytest
from processes import suspend_and_wait

from radixlm.srt.server.process.launch import HEARTBEAT_STALE_S
from radixlm.srt.server.process.server_process import ServerProcess, free_port
from radixlm.srt.server.process.supervisor import EXIT_WORKER_DIED

pytestmark = pytest.mark.slow

CHUNK = 16
GREEDY = {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True}
PROMPTS = [
    "Hello there, how are you",
    "The capital of France is",
    "A prompt longer than one chunk of prefill: " + "alpha beta gamma delta " * 5,
]
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
JSON_PARAMS = {"temperature": 0, "max_new_tokens": 16, "json_schema": json.dumps(SCHEMA)}
LONG = {"max_new_tokens": 1500, "ignore_eos": True}


def server_args(model_dir: Path, *extra: str) -> list[str]:
    return [
        "--model-path",
        str(model_dir),
        "--device",
        "cpu",
        "--tp-size",
        "2",
        "--max-total-tokens",
        "2048",
        "--chunked-prefill-size",
        str(CHUNK),
        *extra,
    ]


@pytest.fixture(scope="module")
def reference(tiny_llama_dir) -> dict:
    """What a TP=1 Engine answers to the same requests."""
    import torch

    from radixlm.srt import Engine

    threads = torch.get_num_threads()
    options = dict(device="cpu", log_level="warning", max_total_tokens=2048)
    with Engine(str(tiny_llama_dir), **options) as engine:
        out = {
            "greedy": [o["output_ids"] for o in engine.generate(PROMPTS, GREEDY)],
            "json": engine.generate("JSON:", JSON_PARAMS)["output_ids"],
            "logprob": engine.generate(
                PROMPTS[1], GREEDY, return_logprob=True, logprob_start_len=0
            )["meta_info"],
        }
    torch.set_num_threads(threads)
    return out


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("tp-server") / "server.log"
    s = ServerProcess(server_args(tiny_llama_dir), log_path=log)
    s.log_path = log  # type: ignore[attr-defined]
    s.procs = processes(s)  # type: ignore[attr-defined]
    yield s
    s.stop(signal.SIGKILL)


def generate(server: ServerProcess, text: str, params: dict, **extra) -> dict:
    body = {"text": text, "sampling_params": params, **extra}
    r = plain_http.post(server.url + "/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def processes(server: ServerProcess) -> list[psutil.Process]:
    return psutil.Process(server.pid).children(recursive=True)


def rank_process(procs: list[psutil.Process], name: str) -> psutil.Process:
    return next(p for p in procs if p.name().startswith(name))


def test_server_info_reports_the_ranks(server: ServerProcess) -> None:
    info = plain_http.get(server.url + "/server_info", timeout=30).json()
    assert info["tp_size"] == 2 and info["dp_size"] == 1
    assert info["max_total_num_tokens"] == 2048
    names = sorted(p.name() for p in processes(server) if p.name().startswith("radixlm-"))
    assert names == ["radixlm-detoken", "radixlm-schedul", "radixlm-tp1"]


def test_outputs_equal_tp1(server: ServerProcess, reference: dict) -> None:
    for prompt, want in zip(PROMPTS, reference["greedy"], strict=True):
        assert generate(server, prompt, GREEDY)["output_ids"] == want
    assert generate(server, "JSON:", JSON_PARAMS)["output_ids"] == reference["json"]
    got = generate(server, PROMPTS[1], GREEDY, return_logprob=True, logprob_start_len=0)
    want_lp = reference["logprob"]["output_token_logprobs"]
    got_lp = got["meta_info"]["output_token_logprobs"]
    assert [t[1] for t in got_lp] == [t[1] for t in want_lp]
    assert [t[0] for t in got_lp] == pytest.approx([t[0] for t in want_lp], abs=1e-4)


def test_repeated_prompt_reuses_its_prefix(server: ServerProcess, reference: dict) -> None:
    generate(server, PROMPTS[2], GREEDY)
    again = generate(server, PROMPTS[2], GREEDY)
    assert again["meta_info"]["cached_tokens"] > CHUNK
    assert again["output_ids"] == reference["greedy"][2]


def test_openai_chat_through_the_ranks(server: ServerProcess) -> None:
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "temperature": 0}
    r = plain_http.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 5


def test_health_follows_a_stopped_follower(server: ServerProcess) -> None:
    """Idle longer than the heartbeat limit: the follower, blocked waiting for rank 0, still
    beats. Stopped (SIGSTOP), it turns /health 503; running again, 200."""
    time.sleep(HEARTBEAT_STALE_S + 1)
    assert plain_http.get(server.url + "/health", timeout=10).status_code == 200
    follower = rank_process(processes(server), "radixlm-tp1")
    suspend_and_wait(follower)
    try:
        r = plain_http.get(server.url + "/health", timeout=10)
        assert r.status_code == 503 and "tp-rank-1" in r.text
    finally:
        follower.resume()
    assert plain_http.get(server.url + "/health", timeout=10).status_code == 200
    assert generate(server, PROMPTS[0], GREEDY)["meta_info"]["completion_tokens"] == 10


def test_sigterm_stops_every_rank(server: ServerProcess) -> None:
    """Last of the shared server's tests: it stops it."""
    assert generate(server, PROMPTS[0], GREEDY)["meta_info"]["completion_tokens"] == 10
    assert server.stop(signal.SIGTERM, timeout_s=30) == 0
    assert_no_process_left(server, timeout_s=2)
    log = server.log_path.read_text(errors="replace")  # type: ignore[attr-defined]
    assert "tensor-parallel rank 1 stopped by rank 0" in log
    assert "did not stop in time" not in log


@pytest.fixture
def own_server(tiny_llama_dir, tmp_path: Path) -> Iterator[ServerProcess]:
    s = ServerProcess(server_args(tiny_llama_dir), log_path=tmp_path / "server.log")
    s.procs = processes(s)  # type: ignore[attr-defined]
    yield s
    s.stop(signal.SIGKILL)
    for p in s.procs:  # type: ignore[attr-defined]
        if p.is_running():
            p.kill()


def assert_no_process_left(server: ServerProcess, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        alive = [
            p
            for p in server.procs  # type: ignore[attr-defined]
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE
        ]
        if not alive:
            return
        time.sleep(0.1)
    raise AssertionError(f"processes left running: {alive}")


class LongCall(threading.Thread):
    def __init__(self, server: ServerProcess) -> None:
        super().__init__(daemon=True)
        self.url = server.url + "/generate"
        self.response: httpx.Response | None = None
        self.start()

    def run(self) -> None:
        body = {"text": "Tell me a story", "sampling_params": LONG}
        self.response = plain_http.post(self.url, json=body, timeout=120)


def wait_running(server: ServerProcess) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if plain_http.get(server.url + "/server_info", timeout=10).json()["kv_pool"]["num_running"]:
            return
        time.sleep(0.1)
    raise AssertionError("the request did not start running")


def test_killed_follower_takes_the_server_down(own_server: ServerProcess) -> None:
    call = LongCall(own_server)
    wait_running(own_server)
    rank_process(own_server.procs, "radixlm-tp1").kill()  # type: ignore[attr-defined]
    t0 = time.monotonic()
    call.join(10)
    assert call.response is not None and call.response.status_code == 503
    assert time.monotonic() - t0 < 5
    try:  # the server answers 503 until it is gone, never 200 again
        assert plain_http.get(own_server.url + "/health", timeout=5).status_code == 503
    except httpx.TransportError:
        pass
    assert own_server.proc.wait(15) == EXIT_WORKER_DIED
    assert time.monotonic() - t0 < 15
    assert_no_process_left(own_server)


def test_two_machines_on_one_host(tiny_llama_dir, tmp_path: Path, reference: dict) -> None:
    """``--nnodes 2``: "machine" 1 runs rank 1 only (no HTTP) and exits 0 once machine 0's
    rank 0 stops it (SIGTERM to machine 0)."""
    addr = f"127.0.0.1:{free_port()}"
    multi = ["--nnodes", "2", "--dist-init-addr", addr]
    node1_log = tmp_path / "node1.log"
    with open(node1_log, "wb") as log:
        node1 = subprocess.Popen(
            [sys.executable, "-m", "radixlm.srt.cli", "serve", *server_args(tiny_llama_dir)]
            + [*multi, "--node-rank", "1"],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        node0 = ServerProcess(
            server_args(tiny_llama_dir, *multi, "--node-rank", "0"), log_path=tmp_path / "n0.log"
        )
        node0.procs = processes(node0)  # type: ignore[attr-defined]
        names = {p.name() for p in node0.procs}  # type: ignore[attr-defined]
        assert "radixlm-tp1" not in names and "radixlm-schedul" in names
        assert generate(node0, PROMPTS[2], GREEDY)["output_ids"] == reference["greedy"][2]
        assert node0.stop(signal.SIGTERM, timeout_s=30) == 0
        assert node1.wait(30) == 0
        assert "rank 0 stopped this machine's ranks" in node1_log.read_text(errors="replace")
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.wait()


@pytest.mark.gpu
def test_tp2_on_two_gpus(default_model_dir, tmp_path: Path) -> None:
    """NCCL between two GPUs: greedy float32 outputs equal a TP=1 Engine's; a killed follower
    takes the server down with no process left."""
    import torch

    from radixlm.srt import Engine

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    params = {"temperature": 0, "max_new_tokens": 24}
    options = {"dtype": "float32", "max_total_tokens": 8192}
    with Engine(log_level="warning", **options) as engine:
        want = [o["output_ids"] for o in engine.generate(PROMPTS, params)]
    torch.cuda.empty_cache()
    args = ["--tp-size", "2", "--dtype", "float32", "--max-total-tokens", "8192"]
    with ServerProcess(args, log_path=tmp_path / "server.log") as server:
        server.procs = processes(server)  # type: ignore[attr-defined]
        assert [generate(server, p, params)["output_ids"] for p in PROMPTS] == want
        rank_process(server.procs, "radixlm-tp1").kill()  # type: ignore[attr-defined]
        assert server.proc.wait(30) == EXIT_WORKER_DIED
        assert_no_process_left(server)
