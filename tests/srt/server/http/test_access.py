"""Keys, admin verbs, the browser guard, the Host allow-list, path policies and the pause limit:
the pure rules, then the HTTP process over the fake worker (fake_stack.py)."""

from __future__ import annotations

import argparse
import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fake_stack import FakeStack

from radixlm.srt.config import (
    ADMIN_ROUTES,
    ADMIN_VERBS,
    OPEN_PATHS,
    ServerConfig,
    add_cli_args,
    allowed_host_names,
    config_from_kwargs,
    torch_profiler_dir,
)
from radixlm.srt.managers.tokenizer_manager import GenerateError
from radixlm.srt.server.http.access import REDACTED, access_warnings, redact_paths
from radixlm.srt.server.http.middleware import host_name
from radixlm.srt.server.http.paths import (
    CHECKPOINT_NOT_FOUND,
    checkpoint_path,
    profile_output_dir,
    weight_update_roots,
)

ROOT = Path(__file__).resolve().parents[4]
ADMIN, USER = "admin-key", "user-key"


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


# ---------------------------------------------------------------------- start-up
@pytest.mark.parametrize("name", ["api_key", "admin_api_key"])
@pytest.mark.parametrize("value", ["", "   "])
def test_empty_keys_are_refused_naming_the_flag(name: str, value: str) -> None:
    flag = "--" + name.replace("_", "-")
    with pytest.raises(ValueError, match=re.escape(flag)):
        config_from_kwargs(**{name: value})


def test_other_start_up_values_are_checked() -> None:
    with pytest.raises(ValueError, match="allowed_hosts"):
        config_from_kwargs(allowed_hosts=" , ")
    with pytest.raises(ValueError, match="paused_request_timeout_s"):
        config_from_kwargs(paused_request_timeout_s=0)
    with pytest.raises(ValueError, match="weight_update_roots"):
        config_from_kwargs(weight_update_roots=",")


def test_warnings_name_who_holds_the_admin_verbs() -> None:
    assert access_warnings(ServerConfig()) == []  # loopback, no keys: local use
    assert access_warnings(ServerConfig(api_key="k", admin_api_key="a")) == []
    (off,) = access_warnings(ServerConfig(api_key="k"))
    assert "are off" in off and "/update_weights_from_disk" in off
    (on,) = access_warnings(ServerConfig(api_key="k", enable_admin_verbs_with_api_key=True))
    assert "every --api-key holder" in on
    open_warnings = access_warnings(ServerConfig(host="0.0.0.0"))
    assert any("every route is open" in w for w in open_warnings)


# ---------------------------------------------------------------------- the one list
def _help_of(flag: str) -> str:
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    return next(a.help for a in parser._actions if flag in a.option_strings)


def test_help_names_exactly_the_admin_routes() -> None:
    routes = {path for path, _ in ADMIN_ROUTES}
    named = set(re.findall(r"/[a-z_]+", _help_of("--admin-api-key")))
    assert named == routes
    verbs_in_api_key_help = set(re.findall(r"/[a-z_]+", _help_of("--api-key")))
    assert verbs_in_api_key_help == {*OPEN_PATHS, *ADMIN_VERBS, "/flush_cache", "/abort_request"}


def _docs_table() -> dict[str, tuple[str, str]]:
    """production.md's "Keys" table: route -> (without an admin key, with one)."""
    text = (ROOT / "docs/operations/production.md").read_text()
    section = text.split("## Keys", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`/"):
            rows[cells[0].strip("`").split("`")[0]] = (cells[1], cells[2])
    return rows


def test_the_docs_table_is_the_code_list() -> None:
    table = _docs_table()
    assert set(table) == {path for path, _ in ADMIN_ROUTES} | set(OPEN_PATHS)
    for path, is_verb in ADMIN_ROUTES:
        without_admin_key, with_admin_key = table[path]
        assert with_admin_key == "admin key", path
        assert ("off" in without_admin_key) == is_verb, (path, without_admin_key)
    for path in OPEN_PATHS:
        assert table[path] == ("none", "none"), path


# ---------------------------------------------------------------------- hosts
@pytest.mark.parametrize(
    "raw,name",
    [
        ("127.0.0.1:30000", "127.0.0.1"),
        ("[::1]:30000", "::1"),
        ("LocalHost.:80", "localhost"),
        ("evil.example", "evil.example"),
        ("", ""),
    ],
)
def test_host_name(raw: str, name: str) -> None:
    assert host_name(raw) == name


def test_allowed_hosts_default_by_bind() -> None:
    assert allowed_host_names(ServerConfig()) == {"localhost", "127.0.0.1", "::1"}
    assert "127.0.0.2" in allowed_host_names(ServerConfig(host="127.0.0.2"))
    assert allowed_host_names(ServerConfig(host="0.0.0.0")) is None
    assert allowed_host_names(ServerConfig(allowed_hosts="*")) is None
    assert allowed_host_names(ServerConfig(allowed_hosts="A.example, b")) == {"a.example", "b"}


# ---------------------------------------------------------------------- paths
def test_profile_output_dir_stays_inside_its_root(tmp_path: Path) -> None:
    root = str(tmp_path.resolve())
    assert profile_output_dir(root, None) == root
    assert profile_output_dir(root, "run1") == f"{root}/run1"
    assert profile_output_dir(root, f"{root}/a/b") == f"{root}/a/b"
    (tmp_path / "link").symlink_to("/etc")
    for bad in ("../x", "a/../../x", "/etc", "~/x", "link/x", root + "-other", "", 5):
        with pytest.raises(GenerateError) as e:
            profile_output_dir(root, bad)
        assert e.value.status_code == 400 and e.value.param == "output_dir", bad


def test_checkpoint_paths_get_one_message_for_every_failure(tmp_path: Path) -> None:
    models = tmp_path / "models"
    (models / "ckpt").mkdir(parents=True)
    (models / "served").mkdir()
    (models / "ckpt" / "x.gguf").write_text("")
    roots = weight_update_roots(ServerConfig(), str(models / "served"))
    assert roots == [str(models.resolve())]
    assert checkpoint_path(roots, str(models / "ckpt")) == str((models / "ckpt").resolve())
    (models / "out").symlink_to(tmp_path)
    messages = set()
    for bad in ("~/ckpt", "ckpt", "/etc", str(models / "missing"), str(models / "out"), None):
        with pytest.raises(GenerateError) as e:
            checkpoint_path(roots, bad)
        messages.add((e.value.status_code, e.value.message))
    assert messages == {(400, CHECKPOINT_NOT_FOUND)}
    given = ServerConfig(weight_update_roots=f"{tmp_path}/a, {tmp_path}/b")
    assert weight_update_roots(given, None) == [f"{tmp_path}/a", f"{tmp_path}/b"]


def test_torch_profiler_dir_flag_then_environment(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SGLANG_TORCH_PROFILER_DIR", str(tmp_path / "sglang"))
    assert torch_profiler_dir(ServerConfig()) == str(tmp_path / "sglang")
    monkeypatch.setenv("RADIXLM_TORCH_PROFILER_DIR", str(tmp_path / "radixlm"))
    assert torch_profiler_dir(ServerConfig()) == str(tmp_path / "radixlm")
    flag = ServerConfig(torch_profiler_dir=str(tmp_path / "flag"))
    assert torch_profiler_dir(flag) == str(tmp_path / "flag")


def test_redaction_keeps_the_fields() -> None:
    answer = {
        "model_path": "/home/me/models/x",
        "kv_cache_scales": "calibrate",
        "chat_template": "/home/me/t.jinja",
        "hicache_storage_dir": None,
        "kv_pool": {"torch_profiler_dir": "/srv/p"},
        "context_length": 512,
    }
    out = redact_paths(answer, "x")
    assert out == {
        "model_path": "x",
        "kv_cache_scales": "calibrate",
        "chat_template": REDACTED,
        "hicache_storage_dir": None,
        "kv_pool": {"torch_profiler_dir": REDACTED},
        "context_length": 512,
    }


# ---------------------------------------------------------------------- over HTTP
@pytest.fixture(scope="module")
def user_only(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeStack]:
    s = FakeStack(tmp_path_factory.mktemp("user"), api_key=USER)
    yield s
    s.close()


def test_admin_verbs_are_off_without_an_admin_key(user_only: FakeStack) -> None:
    for path in ADMIN_VERBS:
        r = httpx.post(user_only.url + path, json={}, headers=auth(USER), timeout=10)
        assert r.status_code == 403, (path, r.text)
        assert r.json()["error"]["code"] == "admin_verbs_disabled", path
        assert "--enable-admin-verbs-with-api-key" in r.json()["error"]["message"]
    r = httpx.post(user_only.url + "/flush_cache", headers=auth(USER), timeout=10)
    assert r.status_code == 200, r.text  # not a verb: the API key guards it


def test_the_flag_serves_the_verbs_to_the_api_key(tmp_path: Path) -> None:
    s = FakeStack(tmp_path, api_key=USER, enable_admin_verbs_with_api_key=True)
    try:
        r = httpx.post(
            s.url + "/get_weights_by_name", json={"name": "model.norm.weight"}, headers=auth(USER)
        )
        assert r.status_code == 200, r.text
        info = httpx.get(s.url + "/model_info", headers=auth(USER)).json()
        assert info["model_path"] == "/models/fake-model"  # admin powers: the paths too
    finally:
        s.close()


def test_paths_are_hidden_from_callers_who_are_not_admins(tmp_path: Path) -> None:
    s = FakeStack(tmp_path, api_key=USER, admin_api_key=ADMIN)
    try:
        for path in ("/model_info", "/get_server_info"):
            user = httpx.get(s.url + path, headers=auth(USER)).json()
            admin = httpx.get(s.url + path, headers=auth(ADMIN)).json()
            assert user["model_path"] == "fake-model" and "/models" not in str(user), path
            assert admin["model_path"] == "/models/fake-model", path
            assert set(user) == set(admin), path
    finally:
        s.close()


def test_admin_requests_a_browser_could_send_are_refused(user_only: FakeStack) -> None:
    url = user_only.url + "/flush_cache"
    for headers in (
        {"Content-Type": "text/plain"},
        {"Content-Type": "application/x-www-form-urlencoded"},
        {"Origin": "http://evil.example"},
        {"Sec-Fetch-Site": "cross-site"},
    ):
        r = httpx.post(url, headers={**auth(USER), **headers}, timeout=10)
        assert r.status_code == 415, (headers, r.text)
    r = httpx.get(
        user_only.url + "/start_profile", headers={**auth(USER), "Sec-Fetch-Site": "cross-site"}
    )
    assert r.status_code == 415, r.text
    json_post = {**auth(USER), "Content-Type": "application/json", "Origin": "http://x"}
    assert httpx.post(url, headers=json_post).status_code == 200  # JSON needs a preflight
    assert httpx.post(url, headers=auth(USER)).status_code == 200  # sglang-router's flush


def test_host_allow_list(user_only: FakeStack) -> None:
    port = user_only.port
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", "LOCALHOST"):
        r = httpx.get(user_only.url + "/health", headers={"Host": host})
        assert r.status_code == 200, host
    for host in ("evil.example", f"evil.example:{port}", "127.0.0.1.evil.example"):
        r = httpx.get(user_only.url + "/v1/models", headers={**auth(USER), "Host": host})
        assert r.status_code == 400 and r.json()["error"]["code"] == "host_not_allowed", host


def test_a_paused_server_says_so_and_ends_held_requests(tmp_path: Path) -> None:
    s = FakeStack(tmp_path, paused_request_timeout_s=0.5)
    try:
        assert httpx.post(s.url + "/pause_generation", json={"mode": "abort"}).status_code == 200
        ready, health = httpx.get(s.url + "/ready"), httpx.get(s.url + "/health")
        assert ready.status_code == 503 and "paused" in ready.json()["error"]["message"]
        assert health.status_code == 200 and health.json()["status"] == "paused"
        assert httpx.get(s.url + "/get_server_info").json()["paused"]
        t0 = time.monotonic()
        r = httpx.post(s.url + "/generate", json={"text": "hi"}, timeout=10)
        assert r.status_code == 503 and r.json()["error"]["code"] == "paused_timeout", r.text
        assert 0.4 < time.monotonic() - t0 < 5
        assert "--paused-request-timeout-s" in r.json()["error"]["message"]
        assert httpx.post(s.url + "/continue_generation", json={}).status_code == 200
        assert httpx.get(s.url + "/ready").json() == {"status": "ok"}
        assert httpx.post(s.url + "/generate", json={"text": "hi"}).status_code == 200
        s.tm.assert_no_requests()
    finally:
        s.close()


def test_every_admin_route_is_served(user_only: FakeStack) -> None:
    """The list names routes that exist (each admin route's handler checks it is listed:
    access.require_admin): a 403 for the verbs, no 404 for any."""
    for path, is_verb in ADMIN_ROUTES:
        assert httpx.post(user_only.url + path, json={}).status_code == 401, path
        r = httpx.post(user_only.url + path, json={"rid": "x"}, headers=auth(USER), timeout=10)
        assert r.status_code == (403 if is_verb else 200), (path, r.text)


def test_get_weights_by_name_bounds_truncate_size(tmp_path: Path) -> None:
    s = FakeStack(tmp_path)
    try:
        url = s.url + "/get_weights_by_name"
        for size in (10**30, 0, -1):
            r = httpx.post(url, json={"name": "model.norm.weight", "truncate_size": size})
            assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_size", r.text
        r = httpx.get(url, params={"name": "model.norm.weight", "truncate_size": str(10**30)})
        assert r.status_code == 400, r.text
        s.tm.assert_no_requests()
        # no control entry left behind (the start-up's own read-only queries may still be out)
        deadline = time.monotonic() + 5
        while s.tm.front.pending and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not s.tm.front.pending
    finally:
        s.close()
