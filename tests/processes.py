"""Helpers for tests that act on a server's child processes."""

from __future__ import annotations

import time

import psutil


def suspend_and_wait(proc: psutil.Process, timeout_s: float = 10.0) -> None:
    """SIGSTOP ``proc`` and wait until the kernel shows it stopped: the signal takes effect when
    the kernel next runs the process, which on a busy machine is after ``suspend()`` returns, and
    the server's ``/health`` judges the state the kernel shows."""
    proc.suspend()
    deadline = time.monotonic() + timeout_s
    while proc.status() != psutil.STATUS_STOPPED:
        assert time.monotonic() < deadline, f"process {proc.pid} is still {proc.status()}"
        time.sleep(0.01)
