"""A child process's heartbeat: a thread writes ``time.monotonic_ns()`` into an 8-byte file every
``HEARTBEAT_INTERVAL_S``; the HTTP process reads its age for /health.

The beat comes from a thread, not from the scheduler loop, so a long prefill on the main thread
(torch releases the GIL) does not stop it; what stops it is the whole process being frozen
(SIGSTOP, a debugger, uninterruptible I/O) or the GIL held forever. CLOCK_MONOTONIC is
system-wide on Linux, so the parent can compare the value with its own clock.
"""

from __future__ import annotations

import logging
import os
import struct
import threading
import time

logger = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = 1.0
_FORMAT = "<q"


def create_heartbeat_file(path: str) -> None:
    """The parent creates the file (value 0: no beat yet) before starting the child."""
    with open(path, "wb") as f:
        f.write(struct.pack(_FORMAT, 0))


def start_heartbeat(path: str | None) -> None:
    """In the child: beat into ``path`` from a daemon thread until the process ends."""
    if path is None:
        return
    fd = os.open(path, os.O_WRONLY)
    threading.Thread(target=_beat_forever, args=(fd,), name="heartbeat", daemon=True).start()


def _beat_forever(fd: int) -> None:
    while True:
        try:
            os.pwrite(fd, struct.pack(_FORMAT, time.monotonic_ns()), 0)
        except OSError as e:  # the parent removed the ipc folder: it is shutting down
            logger.debug("heartbeat stopped: %s", e)
            return
        time.sleep(HEARTBEAT_INTERVAL_S)


def heartbeat_age_s(path: str) -> float | None:
    """Seconds since the last beat in ``path``; None while the child has not beaten yet (or the
    file cannot be read)."""
    try:
        with open(path, "rb") as f:
            (beat_ns,) = struct.unpack(_FORMAT, f.read(8))
    except (OSError, struct.error):
        return None
    if beat_ns <= 0:
        return None
    return max(0.0, (time.monotonic_ns() - beat_ns) / 1e9)
