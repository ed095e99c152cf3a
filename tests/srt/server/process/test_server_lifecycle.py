"""Process lifecycle of `radixlm serve` (a child dying, start-up failures) and the CLI."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import plain_http
import psutil
import pytest

from radixlm.srt.server.process.server_process import ServerProcess, free_port
from radixlm.srt.server.process.supervisor import EXIT_WORKER_DIED

pytestmark = pytest.mark.slow


def cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "radixlm.srt.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_bad_options_fail_with_one_line() -> None:
    r = cli("serve", "--page-size", "0")
    assert r.returncode == 2 and "page_size must be >= 1" in r.stderr
    assert "Traceback" not in r.stderr
    r = cli("serve", "--schedule-policy", "nope")
    assert r.returncode == 2 and "invalid choice" in r.stderr


def test_missing_model_fails_at_start_up(tmp_path) -> None:
    r = cli("serve", "--model-path", str(tmp_path / "nowhere"), "--port", str(free_port()))
    assert r.returncode != 0 and "does not exist" in r.stderr


def test_idle_child_death_exits_for_a_restart_without_orphans(tmp_path) -> None:
    """A child dying while idle ends the server too (the policy: exit for a supervisor to
    restart it; tests/srt/server/process/test_supervision.py covers deaths mid-request)."""
    server = ServerProcess(["--max-total-tokens", "2048"], log_path=tmp_path / "server.log")
    try:
        children = psutil.Process(server.pid).children(recursive=True)
        by_name = {c.name(): c for c in children}
        detok = next(c for name, c in by_name.items() if name.startswith("radixlm-detok"))
        assert any(name.startswith("radixlm-sched") for name in by_name)
        assert plain_http.get(server.url + "/health").status_code == 200
        detok.kill()
        code = server.proc.wait(15)
    finally:
        server.stop(signal.SIGKILL)
    assert code == EXIT_WORKER_DIED
    assert "the detokenizer process was killed by SIGKILL" in (tmp_path / "server.log").read_text()
    time.sleep(0.5)
    assert not [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]


def test_cli_generate_prints_the_answer() -> None:
    r = cli(
        "generate",
        "--prompt",
        "The capital of France is",
        "--max-new-tokens",
        "3",
        "--max-total-tokens",
        "1024",
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "Paris" in r.stdout
