"""The scheduler process: ZMQ in, ``Scheduler.step()`` in a loop, token ids out.

Also holds what every child process of the server shares: the ipc endpoints, the start-up
handshake (a ready report on a pipe) and the ties to the parent (a child never outlives it).

Loop: drain every pending message without blocking and hand it to the scheduler (control
replies go straight back to the tokenizer manager), run one step and push its ``BatchTokenOut``
to the detokenizer; with no work, block on the socket (with a timeout, to watch the parent).
SIGTERM makes the loop finish the requests it holds, then exit; SIGINT is left to the parent.

Tensor parallelism: the scheduler process is rank 0 (its ``ModelRunner`` joins the group and
broadcasts every step); ``run_follower_process`` is a rank > 0, which only runs the forwards
rank 0 describes. Under tensor parallelism a forward that raised on rank 0 leaves the ranks out
of step (a follower may wait in a collective rank 0 never reaches), so it ends the process with
``EXIT_TP_GROUP_FAILED`` instead of failing only the step's requests; followers exit non-zero
when the group fails and 0 when rank 0 stops them.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import zmq

from radixlm.srt.config import ServerConfig
from radixlm.srt.managers.heartbeat import start_heartbeat
from radixlm.srt.messages import BatchTokenOut, ControlReply, decode, encode

logger = logging.getLogger(__name__)

POLL_INTERVAL_MS = 500
PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15
EXIT_TP_GROUP_FAILED = 3  # a rank's collective failed: the whole group must go down
EXIT_WATCHDOG = 4  # one step ran past --watchdog-timeout: a hung device or a deadlock


class StepWatchdog:
    """SGLang's ``--watchdog-timeout``: a daemon thread that ends the process when one step runs
    longer than ``timeout_s`` (a hung kernel, a deadlocked collective), after writing every
    thread's stack to stderr. The server then fails what is in flight with 503 and exits
    non-zero, for its supervisor to restart it, instead of holding every request forever. The
    first ``FIRST_STEPS`` steps get ``FIRST_STEPS_FACTOR`` times as long: they compile kernels
    (Triton, FlashInfer's JIT) the later ones reuse. ``on_timeout`` (tests) replaces the exit.
    ``timeout_s`` <= 0: off."""

    FIRST_STEPS = 8
    FIRST_STEPS_FACTOR = 10.0

    def __init__(self, timeout_s: float, on_timeout: Any = None) -> None:
        self.timeout_s = timeout_s
        self.on_timeout = on_timeout or self._exit
        self.started: float | None = None  # when the step in progress began
        self.limit_s = timeout_s  # the step in progress's
        self.num_steps = 0
        self.fired = False
        if timeout_s > 0:
            threading.Thread(target=self._watch, name="step-watchdog", daemon=True).start()

    def begin(self) -> None:
        early = self.num_steps < self.FIRST_STEPS
        self.limit_s = self.timeout_s * (self.FIRST_STEPS_FACTOR if early else 1.0)
        self.started = time.monotonic()

    def end(self) -> None:
        self.started = None
        self.num_steps += 1

    def _watch(self) -> None:
        poll = min(1.0, self.timeout_s / 4)
        while not self.fired:
            time.sleep(poll)
            started = self.started
            if started is not None and time.monotonic() - started > self.limit_s:
                self.fired = True
                self.on_timeout()

    def _exit(self) -> None:
        import faulthandler

        logger.error(
            "a scheduler step has run for more than %g s (--watchdog-timeout %g s); exiting "
            "(every thread's stack follows on stderr)",
            self.limit_s,
            self.timeout_s,
        )
        faulthandler.dump_traceback(all_threads=True)
        logging.shutdown()
        os._exit(EXIT_WATCHDOG)  # no atexit: a hung step may hold what teardown needs


@dataclass(frozen=True)
class IpcEndpoints:
    """ZMQ addresses; each socket is bound by the process that reads it (PULL)."""

    scheduler: str  # tokenizer manager -> scheduler
    detokenizer: str  # scheduler -> detokenizer
    tokenizer: str  # detokenizer / scheduler -> tokenizer manager

    @classmethod
    def in_dir(cls, ipc_dir: str | Path) -> IpcEndpoints:
        d = Path(ipc_dir)
        return cls(
            f"ipc://{d / 'scheduler'}", f"ipc://{d / 'detokenizer'}", f"ipc://{d / 'tokenizer'}"
        )


class ChildLifecycle:
    """Ties a child process to its parent and turns SIGTERM into a drain request."""

    def __init__(self, parent_pid: int, name: str) -> None:
        self.parent_pid = parent_pid
        self.name = name
        self.term_requested = threading.Event()

    def install(self, log_level: str) -> None:
        configure_child_logging(self.name, log_level)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the group; the parent decides
        signal.signal(signal.SIGTERM, lambda *_: self.term_requested.set())
        set_process_name(f"radixlm-{self.name}")
        set_parent_death_signal()
        if not self.is_parent_alive():  # the parent died before the signal was armed
            os._exit(1)
        threading.Thread(target=self._watch_parent, name="parent-watch", daemon=True).start()

    def is_parent_alive(self) -> bool:
        return os.getppid() == self.parent_pid

    def _watch_parent(self) -> None:
        while not self.term_requested.wait(1.0):
            if not self.is_parent_alive():
                os._exit(1)


def _prctl(option: int, arg: int | bytes) -> None:
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    if libc.prctl(option, arg, 0, 0, 0) != 0:
        logger.warning("prctl(%d) failed: errno %d", option, ctypes.get_errno())


def set_parent_death_signal(sig: int = signal.SIGKILL) -> None:
    """Linux: the kernel sends ``sig`` to this process when its parent exits."""
    _prctl(PR_SET_PDEATHSIG, int(sig))


def set_process_name(name: str) -> None:
    """Linux: the name ``ps -o comm`` and ``top`` show (15 bytes at most)."""
    _prctl(PR_SET_NAME, name.encode()[:15])


def configure_child_logging(name: str, log_level: str) -> None:
    logging.basicConfig(
        level=log_level.upper(),
        format=f"%(asctime)s [{name}] %(levelname)s %(name)s: %(message)s",
        force=True,
    )


def report_ready(conn: Connection, info: dict[str, Any]) -> None:
    conn.send({"ok": True, "info": info})
    conn.close()


def report_failure(conn: Connection, what: str) -> None:
    conn.send({"ok": False, "error": f"{what}:\n{traceback.format_exc()}"})
    conn.close()


class SchedulerLoop:
    def __init__(self, scheduler: Any, endpoints: IpcEndpoints, life: ChildLifecycle) -> None:
        # the scheduler package (torch) loads in the child only, as Scheduler does
        from radixlm.srt.scheduler.failures import handle_message, run_step

        self._run_step, self._handle_message = run_step, handle_message
        self.scheduler = scheduler
        self.life = life
        cfg = getattr(getattr(scheduler, "runner", None), "cfg", None)
        self.watchdog = StepWatchdog(getattr(cfg, "watchdog_timeout", 0.0))
        self.tp_guard = TPGuard(getattr(scheduler, "runner", None))
        self.ctx = zmq.Context()
        self.recv_sock = self.ctx.socket(zmq.PULL)
        self.recv_sock.bind(endpoints.scheduler)
        self.detok_sock = self.ctx.socket(zmq.PUSH)
        self.detok_sock.setsockopt(zmq.SNDHWM, 0)
        self.detok_sock.connect(endpoints.detokenizer)
        self.reply_sock = self.ctx.socket(zmq.PUSH)
        self.reply_sock.setsockopt(zmq.SNDHWM, 0)
        self.reply_sock.connect(endpoints.tokenizer)

    def run(self) -> None:
        while not self._should_exit():
            if self.life.term_requested.is_set():
                self.scheduler.paused = None  # a drain runs paused requests to their end
            self.receive(block=not self.scheduler.wants_step())
            if self.scheduler.wants_step():
                self.run_step()
        logger.info("scheduler loop exits")
        self.scheduler.close()  # a disk KV tier flushes its writes
        self.tp_guard.stop_followers()
        self.ctx.destroy(linger=1000)

    def run_step(self) -> None:
        self.watchdog.begin()
        out = self._run_step(self.scheduler)  # never raises; a failed step reports what it held
        self.watchdog.end()
        if self.tp_guard.failure is not None:  # the server fails what is in flight with 503
            logger.error(
                "a tensor-parallel forward failed (%r); the ranks are out of step, exiting",
                self.tp_guard.failure,
            )
            logging.shutdown()
            os._exit(EXIT_TP_GROUP_FAILED)  # no atexit: leaving the group may block
        if out is not None:
            self.detok_sock.send(encode(out))

    def _should_exit(self) -> bool:
        if not self.life.is_parent_alive():
            return True
        return self.life.term_requested.is_set() and not self.scheduler.has_work()

    def receive(self, block: bool) -> None:
        timeout = POLL_INTERVAL_MS if block else 0
        while self.recv_sock.poll(timeout, zmq.POLLIN):
            self.dispatch(decode(self.recv_sock.recv()))
            timeout = 0

    def dispatch(self, msg: Any) -> None:
        reply = self._handle_message(self.scheduler, msg)  # never raises
        if isinstance(reply, ControlReply):
            self.reply_sock.send(encode(reply))
        elif isinstance(reply, BatchTokenOut):
            self.detok_sock.send(encode(reply))


class TPGuard:
    """Records a forward that raised on rank 0 of a tensor-parallel group (``failure``); wraps
    the runner's ``forward`` only when the runner has followers (``runner`` may be None)."""

    def __init__(self, runner: Any) -> None:
        self.failure: BaseException | None = None
        tp = getattr(runner, "tp", None)
        self.runner = runner if tp is not None and tp.is_distributed else None
        if self.runner is None:
            return
        forward = runner.forward

        def guarded_forward(*args: Any, **kwargs: Any) -> Any:
            try:
                return forward(*args, **kwargs)
            except BaseException as e:
                self.failure = e
                raise

        runner.forward = guarded_forward

    def stop_followers(self) -> None:
        """Rank 0 leaves: the followers return from ``follow`` and exit 0 (a broken group is
        only logged: its followers exit on their own)."""
        if self.runner is None or self.failure is not None:
            return
        try:
            self.runner.stop_followers()
        except Exception:
            logger.exception("could not stop the tensor-parallel followers")


def run_scheduler_process(
    cfg: ServerConfig,
    endpoints: IpcEndpoints,
    ready_conn: Connection,
    parent_pid: int,
    heartbeat_path: str | None = None,
) -> None:
    """Entry point of the scheduler child (started with the ``spawn`` method)."""
    life = ChildLifecycle(parent_pid, "scheduler")
    life.install(cfg.log_level)
    start_heartbeat(heartbeat_path)  # a thread: /health sees a frozen process, not a long step
    try:
        from radixlm.srt.scheduler import Scheduler

        scheduler = Scheduler(cfg)
        loop = SchedulerLoop(scheduler, endpoints, life)
    except BaseException:
        report_failure(ready_conn, "the scheduler failed to start")
        sys.exit(1)
    report_ready(ready_conn, scheduler.ready_info())
    loop.run()
    exit_cleanly()


def exit_cleanly() -> None:
    """Ends a child whose loop returned (its work done, its sockets closed) with code 0: the
    exit handlers run (an OpenTelemetry exporter sends its last spans) and the logs and standard
    streams are flushed, but the interpreter's teardown is skipped (seconds of torch and Triton
    finalisation that the parent's stop would wait for, past its timeout on a busy machine)."""
    import atexit

    atexit._run_exitfuncs()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(0)


def run_follower_process(
    cfg: ServerConfig,
    tp_rank: int,
    ready_conn: Connection,
    parent_pid: int,
    heartbeat_path: str | None = None,
) -> None:
    """Entry point of a tensor-parallel follower (rank ``tp_rank`` > 0, ``spawn`` method): joins
    the group, loads its shard and runs rank 0's steps until rank 0 stops it (exit 0) or the
    group fails (exit ``EXIT_TP_GROUP_FAILED``). SIGTERM is only noted: rank 0 decides when
    the followers stop, after its drain."""
    life = ChildLifecycle(parent_pid, f"tp{tp_rank}")
    life.install(cfg.log_level)
    start_heartbeat(heartbeat_path)
    try:
        from radixlm.srt.executor.model_runner import ModelRunner

        runner = ModelRunner(cfg, tp_rank=tp_rank)
    except BaseException:
        report_failure(ready_conn, f"tensor-parallel rank {tp_rank} failed to start")
        sys.exit(1)
    report_ready(ready_conn, {"tp_rank": tp_rank, "device": str(runner.device)})
    try:
        runner.follow()
    except BaseException:
        logger.exception("tensor-parallel rank %d: the group failed; exiting", tp_rank)
        logging.shutdown()
        os._exit(EXIT_TP_GROUP_FAILED)  # no atexit: leaving a broken group may block
    logger.info("tensor-parallel rank %d stopped by rank 0", tp_rank)
    logging.shutdown()
    # leave without tearing the group down: rank 0 may already be gone, and gloo's threads torn
    # down while the peer closes its side sometimes abort the process after a clean stop
    os._exit(0)
