"""The test session's shared servers: one ``radixlm serve`` per configuration (its normalised CLI
arguments and the environment it starts in), handed to every module that asks for that
configuration, with a bound on how many run at once (``conftest.shared_server``)."""

from __future__ import annotations

import os
import time
from collections import OrderedDict
from typing import Any

import httpx

from radixlm.srt.server.process.server_process import ServerProcess

# Variables that change between tests without changing what a server started under them does.
_VOLATILE_ENV = frozenset({"PYTEST_CURRENT_TEST"})
HANDOVER_TIMEOUT_S = 60.0


def normalised_args(args: list[str]) -> tuple[tuple[str, ...], ...]:
    """The CLI arguments as a sorted tuple of options: ``--flag value`` and ``--flag=value`` are
    one option, a flag without a value is another, so the order the module wrote them in does not
    matter."""
    options: list[tuple[str, ...]] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if arg.startswith("--") and "=" in arg:
            options.append(tuple(arg.split("=", 1)))
        elif arg.startswith("--") and i + 1 < len(args) and not args[i + 1].startswith("--"):
            options.append((arg, args[i + 1]))
            i += 1
        else:
            options.append((arg,))
        i += 1
    return tuple(sorted(options))


def config_key(args: list[str]) -> tuple:
    env = tuple(sorted((k, v) for k, v in os.environ.items() if k not in _VOLATILE_ENV))
    return normalised_args(args), env


def wait_drained(url: str, timeout_s: float = HANDOVER_TIMEOUT_S) -> None:
    """Waits until the server holds no request (an earlier module may have left a cancelled
    stream finishing), then flushes its prefix cache so the next module starts as on a fresh
    server. Servers behind an API key answer 401 here and are handed over as they are."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=30) as client:  # one CA bundle load, not one a poll
        while time.monotonic() < deadline:
            r = client.get(url + "/server_info")
            if r.status_code != 200:
                return
            info = r.json()
            if info["num_request_states"] == 0 and info["kv_pool"]["num_running"] == 0:
                break
            time.sleep(0.1)
        else:
            raise AssertionError(f"the shared server at {url} did not drain: {info}")
        client.post(url + "/flush_cache")


class ServerPool:
    """Shared servers by configuration, least recently used first; beyond ``max_alive`` the least
    recently used one that no module holds is stopped (it starts again if asked for later)."""

    def __init__(self, tmp_path_factory: Any, max_alive: int) -> None:
        self.tmp_path_factory = tmp_path_factory
        self.max_alive = max_alive
        self.servers: OrderedDict[tuple, ServerProcess] = OrderedDict()
        self.holders: dict[tuple, set[int]] = {}

    def lease(self, holder: object, args: list[str]) -> ServerProcess:
        key = config_key(args)
        server = self.servers.get(key)
        if server is not None and server.proc.poll() is not None:
            server.stop()  # a module stopped or killed it: start a fresh one
            del self.servers[key]
            server = None
        first_hold = id(holder) not in self.holders.get(key, set())
        if server is None:
            self._make_room()
            log = self.tmp_path_factory.mktemp("shared-server") / "server.log"
            server = ServerProcess(args, log_path=log)
            self.servers[key] = server
        elif first_hold:
            wait_drained(server.url)
        self.servers.move_to_end(key)
        self.holders.setdefault(key, set()).add(id(holder))
        return server

    def release(self, holder: object) -> None:
        for held in self.holders.values():
            held.discard(id(holder))

    def _make_room(self) -> None:
        idle = [k for k in self.servers if not self.holders.get(k)]
        while len(self.servers) >= self.max_alive and idle:
            self.servers.pop(idle.pop(0)).stop()

    def close(self) -> None:
        while self.servers:
            _, server = self.servers.popitem()
            server.stop()
