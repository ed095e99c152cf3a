"""Run ``radixlm serve`` as a subprocess and wait until it answers (tests, benchmarks, scripts).

with ServerProcess(["--max-total-tokens", "4096"]) as server:
    requests.post(server.url + "/generate", json={...})
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerProcess:
    """A server on 127.0.0.1 and a free port; ``stop`` sends SIGTERM and waits."""

    def __init__(
        self,
        args: list[str] | None = None,
        port: int | None = None,
        log_path: str | Path | None = None,
        startup_timeout_s: float = 300.0,
    ) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [
            sys.executable,
            "-m",
            "radixlm.srt.cli",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *(args or []),
        ]
        self._log = open(log_path, "wb") if log_path else subprocess.DEVNULL  # noqa: SIM115
        self.proc = subprocess.Popen(
            cmd,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        try:
            self._wait_healthy(startup_timeout_s)
        except BaseException:
            self.stop(signal.SIGKILL)
            raise

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        # one client for the whole wait: each new one loads a CA bundle (tens of ms of CPU)
        with httpx.Client(timeout=2.0) as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(
                        f"the server exited during start-up (code {self.proc.returncode})"
                    )
                try:
                    if client.get(self.url + "/health").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(0.1)  # a refused connection costs little; each start waits half a poll
        raise TimeoutError(f"the server did not become healthy within {timeout_s:.0f}s")

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 60.0) -> int:
        """Signals the server and waits for it; returns its exit code (SIGKILL after timeout)."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._log is not subprocess.DEVNULL:
            self._log.close()
            self._log = subprocess.DEVNULL
        return int(self.proc.returncode)

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
