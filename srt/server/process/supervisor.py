"""Supervision of a running server: what happens when a child dies, on SIGTERM, and for /health.

Policy (docs/operations/production.md):

- A child (scheduler or detokenizer) that dies while serving is fatal: every waiting request
  fails at once with 503 (streams end with an error event), the surviving child is killed,
  uvicorn stops and the process exits with ``EXIT_WORKER_DIED`` so that a supervisor (systemd,
  Kubernetes, docker --restart) starts a fresh server. Nothing is restarted in-process: a
  scheduler that was OOM-killed left no state worth keeping.
- SIGTERM / SIGINT start a drain: new requests get 503 (``/health`` too, so load balancers stop
  routing here), requests in flight run to completion for up to ``DRAIN_TIMEOUT_S``, then the
  rest fail with 503, uvicorn stops, the children are stopped and the process exits 0. A second
  signal ends the drain at once.
- ``/health`` is 503 while a child is stopped (SIGSTOP), a zombie, or has sent no heartbeat for
  ``HEARTBEAT_STALE_S``; it turns 200 again when the child runs again.

Every 503 the server sends carries ``Retry-After``.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import orjson
import uvicorn

from radixlm.srt.managers.scheduler_process import EXIT_WATCHDOG
from radixlm.srt.managers.tokenizer_manager import TokenizerManager
from radixlm.srt.server.http.errors import error_body

if TYPE_CHECKING:
    from radixlm.srt.server.process.launch import ServerProcesses

logger = logging.getLogger(__name__)

EXIT_WORKER_DIED = 75  # EX_TEMPFAIL (sysexits.h): a child process died; start the server again
RETRY_AFTER_S = 5
DRAIN_TIMEOUT_S = 60.0
DEATH_GRACE_S = 3.0  # after a child died: time to send the 503s before uvicorn is forced down
CLEAN_EXIT_GRACE_S = 2.0  # a child that exited 0 during a drain: the last outputs in transit
WATCH_INTERVAL_S = 0.1


def describe_exit(name: str, exitcode: int | None) -> str:
    """``the scheduler process was killed by SIGKILL (exit code -9)``, with a hint for SIGKILL."""
    if exitcode is not None and exitcode < 0:
        try:
            sig_name = signal.Signals(-exitcode).name
        except ValueError:
            sig_name = f"signal {-exitcode}"
        hint = (
            "; the kernel's OOM killer sends SIGKILL when memory runs out"
            if -exitcode == signal.SIGKILL
            else ""
        )
        return f"the {name} process was killed by {sig_name} (exit code {exitcode}{hint})"
    if exitcode == EXIT_WATCHDOG:
        return (
            f"the {name} process exited (exit code {exitcode}): a step ran past "
            "--watchdog-timeout (its stacks are in the log)"
        )
    return f"the {name} process exited (exit code {exitcode})"


class DrainGate:
    """ASGI wrapper around the app: counts HTTP requests in flight, answers new ones 503 once
    ``close`` was called, and adds ``Retry-After`` to every 503 response."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.num_inflight = 0
        self.closed_reason: str | None = None

    def close(self, reason: str) -> None:
        if self.closed_reason is None:
            self.closed_reason = reason

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.closed_reason is not None:
            await self._reject(send, self.closed_reason)
            return
        self.num_inflight += 1
        try:
            await self.app(scope, receive, _with_retry_after(send))
        finally:
            self.num_inflight -= 1

    @staticmethod
    async def _reject(send: Callable, reason: str) -> None:
        body = orjson.dumps(error_body(f"server unavailable: {reason}", 503))
        await send(
            {
                "type": "http.response.start",
                "status": 503,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"retry-after", str(RETRY_AFTER_S).encode()),
                    (b"connection", b"close"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


def _with_retry_after(send: Callable) -> Callable:
    async def send_with_retry_after(message: dict) -> None:
        if message["type"] == "http.response.start" and message["status"] == 503:
            headers = list(message.get("headers") or [])
            if not any(k.lower() == b"retry-after" for k, _ in headers):
                headers.append((b"retry-after", str(RETRY_AFTER_S).encode()))
            message = {**message, "headers": headers}
        await send(message)

    return send_with_retry_after


class SupervisedServer(uvicorn.Server):
    """uvicorn whose SIGTERM/SIGINT start the supervisor's drain instead of closing at once."""

    def __init__(self, config: uvicorn.Config, supervisor: Supervisor) -> None:
        super().__init__(config)
        self.supervisor = supervisor

    def handle_exit(self, sig: int, frame: Any) -> None:
        self.supervisor.request_drain(signal.Signals(sig).name)


class Supervisor:
    """Watches the children while uvicorn serves; decides when uvicorn stops and with which exit
    code the server ends (``exit_code``)."""

    def __init__(
        self, procs: ServerProcesses, gate: DrainGate, drain_timeout_s: float = DRAIN_TIMEOUT_S
    ) -> None:
        self.procs = procs
        self.gate = gate
        self.drain_timeout_s = drain_timeout_s
        self.server: uvicorn.Server | None = None
        self.exit_code = 0
        self.drain_deadline: float | None = None
        self._drain_signal: str | None = None
        self._drain_logged = False

    def request_drain(self, why: str) -> None:
        """Called from a signal handler: only sets attributes; ``watch`` acts on them."""
        now = time.monotonic()
        if self.drain_deadline is None:
            self._drain_signal = why
            self.drain_deadline = now + self.drain_timeout_s
            self.gate.close("the server is shutting down")
        else:  # a second signal: stop waiting for the requests in flight
            self.drain_deadline = now

    async def watch(self, tm: TokenizerManager) -> None:
        """The app's watcher task: child exits and the drain, every WATCH_INTERVAL_S."""
        exited: set[str] = set()
        while True:
            for name, code in self.procs.exited_children():
                if name not in exited:
                    exited.add(name)
                    if not self._on_child_exit(tm, name, code):
                        return
            if self.drain_deadline is not None and self._drain_done(tm):
                return
            await asyncio.sleep(WATCH_INTERVAL_S)

    def _on_child_exit(self, tm: TokenizerManager, name: str, code: int | None) -> bool:
        """Whether to keep watching: a child that exits 0 during a drain (systemd sends SIGTERM
        to the whole group) is expected; any other exit is fatal."""
        reason = describe_exit(name, code)
        if self.drain_deadline is not None and code == 0:
            logger.info("%s during the drain", reason)
            self.drain_deadline = min(self.drain_deadline, time.monotonic() + CLEAN_EXIT_GRACE_S)
            return True
        logger.error(
            "%s; failing the requests in flight with 503 and exiting with code %d so "
            "that a supervisor restarts the server",
            reason,
            EXIT_WORKER_DIED,
        )
        self.exit_code = EXIT_WORKER_DIED
        self.gate.close(reason)
        tm.mark_dead(reason)
        self.procs.kill_all()
        self._stop_uvicorn()
        return False

    def _drain_done(self, tm: TokenizerManager) -> bool:
        if not self._drain_logged:
            self._drain_logged = True
            logger.info(
                "%s: draining %d request(s) in flight for up to %.0f s; new requests get 503",
                self._drain_signal,
                self.gate.num_inflight,
                self.drain_timeout_s,
            )
        if self.gate.num_inflight == 0:
            logger.info("drained; stopping")
        elif time.monotonic() >= (self.drain_deadline or 0.0):
            logger.warning(
                "drain ended with %d request(s) in flight; failing them with 503",
                self.gate.num_inflight,
            )
            tm.mark_dead("the server is shutting down")
            tm.abort_all()  # the scheduler stops generating for them and can exit at once
        else:
            return False
        self._stop_uvicorn()
        return True

    def _stop_uvicorn(self) -> None:
        assert self.server is not None, "attach the uvicorn server before serving"
        self.server.should_exit = True
