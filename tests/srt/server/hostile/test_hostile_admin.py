"""Hostile clients against the admin surface (see conftest.py): keys that mean what they say,
client paths kept inside their folders, a failing profile export that fails no other request,
a pause that says so and ends held requests, and requests a web page could send (cross-origin
posts, DNS rebinding). Every test ends with the package's health, zombie and leak checks; the
pause tests run on a server of their own (they pause it) with the same checks."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import plain_http
import pytest
from hostile_util import (
    API_KEY,
    GREEDY,
    LiveServer,
    assert_4xx,
    assert_clean,
    gen,
    wait_for,
)

from radixlm.srt.config import ADMIN_VERBS
from radixlm.srt.server.http.paths import CHECKPOINT_NOT_FOUND

pytestmark = pytest.mark.slow

# the worst /health round trip allowed under a hostile input: the target is 0.5 s, but on a
# shared 2-core machine /health takes 0.3-0.6 s while the scheduler decodes at all (the figures
# are printed, with a baseline under the same load, for the record)
HEALTH_BUDGET_S = 2.0
PAUSE_LIMIT_S = 3.0


def health_latencies(server: LiveServer, stop: threading.Event) -> list[float]:
    """/health round trips, measured until ``stop`` is set (run it in a thread)."""
    out: list[float] = []
    while not stop.is_set():
        t0 = time.monotonic()
        r = plain_http.get(server.url + "/health", timeout=10)
        out.append(time.monotonic() - t0)
        assert r.status_code == 200, r.text
        time.sleep(0.02)
    return out


# ---------------------------------------------------------------------- keys
def test_empty_keys_are_refused_at_start_up() -> None:
    for flag in ("--api-key", "--admin-api-key"):
        cmd = [sys.executable, "-m", "radixlm.srt.cli", "serve", flag, ""]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert done.returncode == 2, done.stderr[-2000:]
        assert flag in done.stderr and "empty" in done.stderr, done.stderr[-2000:]


@pytest.fixture(scope="module")
def keyed(tiny_llama_dir, tmp_path_factory) -> Iterator[LiveServer]:
    """A server with ``--api-key`` and no ``--admin-api-key`` (the folder's keyed server has
    both), for the rules that hold only without an admin key."""
    s = LiveServer(
        ["--model-path", str(tiny_llama_dir), "--max-total-tokens", "256"],
        tmp_path_factory.mktemp("api-key-only"),
        api_key=API_KEY,
    )
    s.start()
    yield s
    s.stop()


def test_the_api_key_holds_no_admin_verb(keyed: LiveServer) -> None:
    """--api-key without --admin-api-key: a key holder can neither pause, reload, read weights
    nor profile; the server keeps serving."""
    for path in ADMIN_VERBS:
        body = {"mode": "in_place"} if path == "/pause_generation" else {}
        err = assert_4xx(keyed.post(path, body, timeout=10))
        assert err["code"] == "admin_verbs_disabled", (path, err)
    get = plain_http.get(
        keyed.url + "/get_weights_by_name?name=lm_head.weight", headers=keyed.headers
    )
    assert assert_4xx(get)["code"] == "admin_verbs_disabled"
    assert gen(keyed).status_code == 200  # not paused
    assert keyed.post("/flush_cache", None, timeout=10).status_code == 200  # the API key's


def test_local_paths_are_hidden_from_key_holders(keyed: LiveServer, tiny_llama_dir) -> None:
    for path in ("/get_server_info", "/server_info", "/model_info", "/get_model_info"):
        r = keyed.get(path)
        assert r.status_code == 200, r.text
        assert str(tiny_llama_dir) not in r.text and "pytest" not in r.text, (path, r.text[:300])
        assert r.json()["model_path"] == r.json()["served_model_name"], path


def test_a_server_without_keys_shows_its_paths_locally(server: LiveServer, tiny_llama_dir) -> None:
    assert server.get("/model_info").json()["model_path"] == str(tiny_llama_dir)


# ---------------------------------------------------------------------- browsers
def test_cross_origin_admin_requests_are_refused(server: LiveServer) -> None:
    evil = {"Origin": "http://evil.example", "Sec-Fetch-Site": "cross-site"}
    text = {**evil, "Content-Type": "text/plain"}
    r = server.post("/pause_generation", raw=b'{"mode": "abort"}', headers=text)
    assert assert_4xx(r)["code"] == "unsupported_media_type"
    for path in ("/flush_cache", "/continue_generation", "/start_profile", "/stop_profile"):
        r = plain_http.post(server.url + path, headers=evil, timeout=10)  # no body: a simple POST
        assert r.status_code == 415, (path, r.text)
    img = plain_http.get(server.url + "/start_profile", headers={"Sec-Fetch-Site": "cross-site"})
    assert img.status_code == 415, img.text  # what an <img src=...> sends
    form = {"Content-Type": "application/x-www-form-urlencoded", "Origin": "http://evil.example"}
    assert server.post("/flush_cache", raw=b"a=1", headers=form).status_code == 415
    assert plain_http.get(server.url + "/ready").status_code == 200  # nothing was paused
    r = server.post("/stop_profile", {})
    assert "no profile is running" in assert_4xx(r)["message"]  # nothing was started
    assert plain_http.post(server.url + "/flush_cache", timeout=10).status_code == 200  # curl's


def test_dns_rebinding_is_refused(server: LiveServer) -> None:
    port = server.url.rsplit(":", 1)[1]
    for host in ("evil.example", f"evil.example:{port}", f"127.0.0.1.nip.io:{port}"):
        for method, path in (("GET", "/health"), ("POST", "/generate"), ("POST", "/flush_cache")):
            r = httpx.request(
                method, server.url + path, json={"text": "hi"}, headers={"Host": host}
            )
            assert r.status_code == 400, (host, path, r.text)
            assert r.json()["error"]["code"] == "host_not_allowed"
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", "localhost"):
        r = plain_http.get(server.url + "/v1/models", headers={"Host": host})
        assert r.status_code == 200, (host, r.text)


# ---------------------------------------------------------------------- files
def test_profile_output_stays_in_its_folder(server: LiveServer, tmp_path: Path) -> None:
    outside = tmp_path.parent / f"radixlm-outside-{uuid.uuid4().hex[:8]}"
    for output_dir in ("../../../" + outside.name, "/var/radixlm-hostile", "~/radixlm"):
        err = assert_4xx(server.post("/start_profile", {"output_dir": output_dir}))
        assert err["param"] == "output_dir", err
    assert not outside.exists() and not Path("/var/radixlm-hostile").exists()
    for name in ("profile_id", "profile_prefix"):
        err = assert_4xx(server.post("/start_profile", {name: "x" * 300}))
        assert err["message"].startswith(name), err
    r = server.post("/stop_profile", {})
    assert "no profile is running" in assert_4xx(r)["message"]


def rss_bytes(server: LiveServer) -> int:
    """Resident memory of the HTTP process (the launcher: the children are separate)."""
    assert server.proc is not None
    status = Path(f"/proc/{server.proc.proc.pid}/status").read_text()
    return int(next(ln for ln in status.splitlines() if ln.startswith("VmRSS")).split()[1]) * 1024


def test_weight_updates_tell_nothing_about_the_file_system(server: LiveServer, capsys) -> None:
    paths = [
        "~/.ssh",
        "~root",
        "/etc",
        "/etc/passwd",
        "/nonexistent/model",
        "relative/model",
        "/tmp/../etc",
        "/",
        "x" * 5000,
    ]
    messages = set()
    for path in paths:
        r = server.post("/update_weights_from_disk", {"model_path": path})
        err = assert_4xx(r)
        assert r.json()["success"] is False  # SGLang's answer shape too
        messages.add(err["message"])
        assert err["param"] == "model_path"
    assert messages == {CHECKPOINT_NOT_FOUND}
    before = rss_bytes(server)
    for i in range(300):  # refused admin requests hold nothing
        server.post("/update_weights_from_disk", {"model_path": paths[i % len(paths)]})
        server.post("/start_profile", {"output_dir": "../" * (i % 50)})
    growth = rss_bytes(server) - before
    with capsys.disabled():
        print(f"\nHTTP process RSS after 600 refused admin requests: {growth / 2**20:+.1f} MiB")
    assert growth < 16 * 2**20, growth
    assert gen(server).status_code == 200


def test_a_checkpoint_under_the_roots_loads(server: LiveServer, tiny_llama_dir) -> None:
    """The default root is the folder holding the served model's: the same checkpoint again."""
    before = gen(server, "Reload check", max_new_tokens=6).json()["text"]
    r = server.post("/update_weights_from_disk", {"model_path": str(tiny_llama_dir)}, timeout=120)
    assert r.status_code == 200 and r.json()["success"], r.text
    assert gen(server, "Reload check", max_new_tokens=6).json()["text"] == before


# ---------------------------------------------------------------------- faults
def _generate_while_probing(server: LiveServer) -> tuple[list[httpx.Response], list[float]]:
    """4 clients generate 24 tokens each while /health is probed: the answers, the latencies."""
    stop = threading.Event()
    try:
        with ThreadPoolExecutor(5) as pool:
            probe = pool.submit(health_latencies, server, stop)
            jobs = [
                pool.submit(gen, server, f"Story {i}", max_new_tokens=24, ignore_eos=True)
                for i in range(4)
            ]
            answers = [j.result() for j in jobs]
            stop.set()
            return answers, probe.result()
    finally:
        stop.set()


def test_a_failing_profile_export_fails_no_other_request(server: LiveServer, capsys) -> None:
    """The profile ends by itself after 3 steps while 4 clients generate; its folder was
    replaced by a file, so writing the trace fails: every request still finishes, /health
    stays fast, and /stop_profile reports the failure."""
    _, baseline = _generate_while_probing(server)
    name = f"radixlm-hostile-{uuid.uuid4().hex[:8]}"
    started = server.post("/start_profile", {"output_dir": name, "num_steps": 3, "profile_id": "p"})
    assert started.status_code == 200, started.text
    folder = Path(started.json()["path"]).parent
    folder.rmdir()
    folder.write_text("")
    try:
        answers, latencies = _generate_while_probing(server)
    finally:
        folder.unlink()
    for r in answers:
        assert r.status_code == 200, r.text
        assert r.json()["meta_info"]["finish_reason"]["type"] == "length"
    err = assert_4xx(server.post("/stop_profile", {}))
    assert "could not be written" in err["message"], err
    with capsys.disabled():
        print(
            f"\n/health while 4 clients generate: worst {max(baseline) * 1000:.0f} ms; with a "
            f"failing profile export: worst {max(latencies) * 1000:.0f} ms"
        )
    assert max(latencies) < HEALTH_BUDGET_S, latencies


# ---------------------------------------------------------------------- pause
@pytest.fixture(scope="module")
def pausable(tiny_llama_dir, tmp_path_factory) -> Iterator[LiveServer]:
    """A server of this module's own (its tests pause it), with a short pause limit."""
    args = ["--model-path", str(tiny_llama_dir), "--max-total-tokens", "2048"]
    s = LiveServer(
        [*args, "--paused-request-timeout-s", str(PAUSE_LIMIT_S)],
        tmp_path_factory.mktemp("pausable"),
    )
    s.start()
    yield s
    s.post("/continue_generation", {})
    s.stop()


def test_a_paused_server_says_so(pausable: LiveServer) -> None:
    assert pausable.post("/pause_generation", {"mode": "abort"}).status_code == 200
    try:
        ready = plain_http.get(pausable.url + "/ready", timeout=5)
        assert ready.status_code == 503 and "paused" in ready.json()["error"]["message"]
        health = plain_http.get(pausable.url + "/health", timeout=5)
        assert health.status_code == 200 and health.json()["status"] == "paused", health.text
        assert pausable.info()["paused"]
        t0 = time.monotonic()
        r = gen(pausable, timeout=30)
        waited = time.monotonic() - t0
        assert r.status_code == 503 and r.json()["error"]["code"] == "paused_timeout", r.text
        assert PAUSE_LIMIT_S - 0.5 < waited < PAUSE_LIMIT_S + 5, waited
    finally:
        assert pausable.post("/continue_generation", {}).status_code == 200
    assert plain_http.get(pausable.url + "/ready", timeout=5).json() == {"status": "ok"}
    assert gen(pausable).status_code == 200
    assert_clean(pausable)


@pytest.mark.parametrize("mode", ["in_place", "retract"])
def test_requests_held_by_a_pause_end_at_the_limit(pausable: LiveServer, mode: str, capsys) -> None:
    """A request the paused scheduler holds (with its KV, or sent back to wait) ends with a
    503 after the limit, while /health answers at once; its KV is released."""
    body = {"text": "Tell me a story.", "sampling_params": {"max_new_tokens": 2000, **GREEDY}}
    body["sampling_params"]["ignore_eos"] = True
    stop = threading.Event()
    with ThreadPoolExecutor(2) as pool:
        long = pool.submit(pausable.post, "/generate", body, timeout=60)
        assert wait_for(lambda: pausable.info()["kv_pool"]["num_running"] == 1, 20)
        assert pausable.post("/pause_generation", {"mode": mode}).status_code == 200
        probe = pool.submit(health_latencies, pausable, stop)
        t0 = time.monotonic()
        r = long.result()
        waited = time.monotonic() - t0
        stop.set()
        latencies = probe.result()
    try:
        assert r.status_code == 503, r.text
        assert "--paused-request-timeout-s" in r.json()["error"]["message"], r.text
        assert waited < PAUSE_LIMIT_S + 5, waited
        with capsys.disabled():
            print(
                f"\npaused {mode}: held request ended after {waited:.1f} s; /health worst "
                f"{max(latencies) * 1000:.0f} ms"
            )
        assert max(latencies) < HEALTH_BUDGET_S, latencies
    finally:
        assert pausable.post("/continue_generation", {}).status_code == 200
    assert gen(pausable).status_code == 200
    assert_clean(pausable)
