"""The suite's shared-server pool: one server per configuration, the least recently used idle one
stopped beyond the bound, a held one never, a dead one started again (fake servers, no process)."""

from __future__ import annotations

import pytest
import server_pool
from server_pool import ServerPool, normalised_args


class FakeProc:
    def __init__(self) -> None:
        self.returncode: int | None = None

    def poll(self) -> int | None:
        return self.returncode


class FakeServer:
    def __init__(self, args: list[str], log_path=None) -> None:
        self.args = args
        self.proc = FakeProc()
        self.url = "http://fake"
        self.stopped = False

    def stop(self) -> int:
        self.stopped = True
        return 0


@pytest.fixture
def pool(monkeypatch, tmp_path_factory) -> ServerPool:
    monkeypatch.setattr(server_pool, "ServerProcess", FakeServer)
    monkeypatch.setattr(server_pool, "wait_drained", lambda url: None)
    return ServerPool(tmp_path_factory, max_alive=2)


def test_argument_order_and_spelling_do_not_matter():
    a = normalised_args(["--max-total-tokens", "8192", "--enable-x", "--model-path", "m"])
    b = normalised_args(["--model-path=m", "--enable-x", "--max-total-tokens", "8192"])
    assert a == b
    assert a != normalised_args(["--max-total-tokens", "4096", "--enable-x", "--model-path", "m"])


def test_one_server_per_configuration(pool):
    a, b = object(), object()
    first = pool.lease(a, ["--max-total-tokens", "8192"])
    assert pool.lease(b, ["--max-total-tokens", "8192"]) is first
    assert pool.lease(b, ["--max-total-tokens", "4096"]) is not first


def test_the_least_recently_used_idle_server_is_stopped_beyond_the_bound(pool):
    holder = object()
    s1 = pool.lease(holder, ["--a", "1"])
    s2 = pool.lease(holder, ["--a", "2"])
    pool.release(holder)
    pool.lease(holder, ["--a", "1"])  # s1 is now the most recently used
    pool.release(holder)
    s3 = pool.lease(holder, ["--a", "3"])
    assert s2.stopped and not s1.stopped and not s3.stopped
    assert pool.lease(holder, ["--a", "2"]) is not s2  # started again when asked for


def test_a_held_server_is_never_stopped_and_a_dead_one_restarts(pool):
    holder = object()
    servers = [pool.lease(holder, ["--a", str(i)]) for i in range(3)]
    assert not any(s.stopped for s in servers)  # all held: the bound waits
    servers[0].proc.returncode = -9
    again = pool.lease(holder, ["--a", "0"])
    assert again is not servers[0] and servers[0].stopped
    pool.close()
    assert all(s.stopped for s in [again, *servers[1:]])
