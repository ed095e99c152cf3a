"""Starting and stopping the server: the scheduler and detokenizer children, then uvicorn.

Start-up: the ipc folder (private, mode 0700), both children (``spawn``), the tokenizer in this
process meanwhile, then a wait until every child reported ready; only then does uvicorn accept
connections. While serving, ``supervisor.Supervisor`` watches the children: a child's death
fails every waiting request with 503 and ends the server with ``EXIT_WORKER_DIED``; SIGTERM
drains (new requests 503, in-flight ones finish within ``DRAIN_TIMEOUT_S``) and exits 0. Either
way the children are stopped and reaped before the process exits.

Tensor parallelism (``--tp-size N``): one process per rank on this machine. Rank 0 is the
scheduler process; ranks > 0 are followers (``tp-rank-<r>``) that the supervisor watches like
any other child, so a dead rank fails the server the same way. With ``--nnodes M`` machine
``k`` runs ranks ``k*N/M ..``; a machine with ``--node-rank`` > 0 runs its followers only, no
HTTP server, and exits when they do. Without ``--dist-init-addr`` the ranks meet on a free
local port.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import multiprocessing as mp
import os
import shutil
import signal
import tempfile
import time
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, Any

import orjson
import psutil

from radixlm.srt.config import ServerConfig
from radixlm.srt.managers.detokenizer_process import load_server_tokenizer, run_detokenizer_process
from radixlm.srt.managers.heartbeat import create_heartbeat_file, heartbeat_age_s
from radixlm.srt.managers.scheduler_process import (
    EXIT_TP_GROUP_FAILED,
    IpcEndpoints,
    run_follower_process,
    run_scheduler_process,
)
from radixlm.srt.managers.tp_ranks import ranks_on_this_node, with_rendezvous
from radixlm.srt.models.tokenizer import export_decoder

if TYPE_CHECKING:
    from radixlm.srt.server.process.supervisor import Supervisor

logger = logging.getLogger(__name__)

CHILD_STOP_TIMEOUT_S = 10.0
HEARTBEAT_STALE_S = 5.0  # the beat comes every second from a thread; 5 missed beats = frozen
# process states in which a child cannot serve; /health is 503 while a child is in one
UNHEALTHY_STATES = {
    psutil.STATUS_STOPPED: "stopped (SIGSTOP)",
    psutil.STATUS_TRACING_STOP: "stopped by a tracer",
    psutil.STATUS_ZOMBIE: "a zombie",
    psutil.STATUS_DEAD: "dead",
}


def follower_name(tp_rank: int) -> str:
    return f"tp-rank-{tp_rank}"


class ServerProcesses:
    """The children of this machine (scheduler = rank 0 and detokenizer on machine 0, the
    tensor-parallel followers) and the ipc folder they talk through."""

    def __init__(self, cfg: ServerConfig) -> None:
        self.cfg = cfg
        self.ipc_dir = tempfile.mkdtemp(prefix="radixlm-ipc-")
        os.chmod(self.ipc_dir, 0o700)
        self.endpoints = IpcEndpoints.in_dir(self.ipc_dir)
        self.procs: dict[str, BaseProcess] = {}
        self.ready_conns: dict[str, Connection] = {}
        self.follower_ranks = [r for r in ranks_on_this_node(cfg) if r > 0]
        self.has_scheduler = cfg.node_rank == 0
        names = ["scheduler", "detokenizer"] if self.has_scheduler else []
        names += [follower_name(r) for r in self.follower_ranks]
        self.heartbeats = {name: os.path.join(self.ipc_dir, f"{name}.heartbeat") for name in names}

    def start(self) -> None:
        """Starts the scheduler and the tensor-parallel followers of this machine; the
        detokenizer follows with ``start_detokenizer`` once the tokenizer is loaded."""
        ctx = mp.get_context("spawn")
        if self.has_scheduler:
            self._start_child(ctx, "scheduler", run_scheduler_process, (self.endpoints,))
        for rank in self.follower_ranks:  # while rank 0 loads: every rank must join the group
            self._start_child(ctx, follower_name(rank), run_follower_process, (rank,))

    def start_detokenizer(self, decoder_json: str | None) -> None:
        """``decoder_json``: the tokenizer's exported decoder (``models.tokenizer``), so the
        detokenizer starts without transformers; None: it loads the tokenizer itself."""
        self._start_child(
            mp.get_context("spawn"),
            "detokenizer",
            run_detokenizer_process,
            (self.endpoints,),
            (self.procs["scheduler"].pid, decoder_json),
        )

    def _start_child(
        self, ctx: Any, name: str, target: Any, lead: tuple, extra: tuple = ()
    ) -> None:
        """``target(cfg, *lead, ready_conn, parent_pid, *extra, heartbeat_path)``."""
        create_heartbeat_file(self.heartbeats[name])
        reader, writer = ctx.Pipe(duplex=False)
        proc = ctx.Process(
            target=target,
            name=f"radixlm-{name}",
            args=(self.cfg, *lead, writer, os.getpid(), *extra, self.heartbeats[name]),
        )
        proc.start()
        writer.close()
        self.procs[name], self.ready_conns[name] = proc, reader

    def wait_ready(self, on_ready: Any = None) -> dict[str, dict[str, Any]]:
        """Blocks until every child reported ready; raises RuntimeError naming a child that
        failed or died first. Returns each child's ready info."""
        infos: dict[str, dict[str, Any]] = {}
        while len(infos) < len(self.procs):
            waiting = {n: c for n, c in self.ready_conns.items() if n not in infos}
            sentinels = {self.procs[n].sentinel: n for n in waiting}
            for obj in wait([*waiting.values(), *sentinels]):
                name = sentinels.get(obj) or next(n for n, c in waiting.items() if c is obj)
                if name in infos:
                    continue
                infos[name] = self._read_ready(name)
                if on_ready is not None:
                    on_ready(name)
        return infos

    def _read_ready(self, name: str) -> dict[str, Any]:
        conn = self.ready_conns[name]
        try:
            report = conn.recv()
        except EOFError:
            self.procs[name].join(1.0)
            raise RuntimeError(
                f"the {name} process exited during start-up (exit code {self.procs[name].exitcode})"
            ) from None
        if not report["ok"]:
            raise RuntimeError(report["error"])
        return report["info"]

    def exited_children(self) -> list[tuple[str, int | None]]:
        """(name, exit code) of every child that has exited; a negative code is a signal.
        Ranks that exited because their group failed come last: the cause comes first."""
        exited = [(n, p.exitcode) for n, p in self.procs.items() if not p.is_alive()]
        return sorted(exited, key=lambda e: e[1] == EXIT_TP_GROUP_FAILED)

    def problem(self) -> str | None:
        """Why the server cannot serve now, judged from the outside (for /health): a child that
        is dead, stopped or a zombie, or whose heartbeat thread has gone silent."""
        for name, proc in self.procs.items():
            if not proc.is_alive():
                return f"the {name} process exited (exit code {proc.exitcode})"
            try:
                status = psutil.Process(proc.pid).status()
            except psutil.NoSuchProcess:
                return f"the {name} process is gone"
            if status in UNHEALTHY_STATES:
                return f"the {name} process is {UNHEALTHY_STATES[status]}"
            age_s = heartbeat_age_s(self.heartbeats[name])
            if age_s is not None and age_s > HEARTBEAT_STALE_S:
                return f"the {name} process sent no heartbeat for {age_s:.0f} s (frozen?)"
        return None

    def kill_all(self) -> None:
        """SIGKILL to every child still running (``stop`` reaps them)."""
        for proc in self.procs.values():
            if proc.is_alive():
                proc.kill()

    def stop(self) -> None:
        """SIGTERM to every child at once (the scheduler finishes what it holds, then stops the
        followers, which wait for that; the detokenizer forwards it and exits after the
        scheduler), then SIGKILL for any that has not exited within CHILD_STOP_TIMEOUT_S; reaps
        them and removes the ipc folder."""
        for proc in self.procs.values():
            if proc.is_alive():
                proc.terminate()
                _continue(proc)  # a stopped child acts on SIGTERM only once it runs again
        deadline = time.monotonic() + CHILD_STOP_TIMEOUT_S
        for name in ("scheduler", "detokenizer", *map(follower_name, self.follower_ranks)):
            proc = self.procs.get(name)
            if proc is None:
                continue
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                logger.warning("the %s process did not stop in time; killing it", name)
                proc.kill()
            proc.join()
        shutil.rmtree(self.ipc_dir, ignore_errors=True)


def _continue(proc: BaseProcess) -> None:
    try:
        os.kill(proc.pid, signal.SIGCONT)
    except (ProcessLookupError, TypeError):
        pass


def configure_logging(log_level: str) -> None:
    logging.basicConfig(
        level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )


def resolved_config_line(cfg: ServerConfig, info: dict[str, Any]) -> str:
    shown = dataclasses.asdict(cfg)
    for secret in ("api_key", "admin_api_key"):
        if shown.get(secret):
            shown[secret] = "<set>"
    keys = (
        "model_path",
        "architecture",
        "device",
        "dtype",
        "max_total_tokens",
        "context_length",
        "vocab_size",
        "attention_backend",
    )
    shown.update({f"resolved_{k}": info[k] for k in keys if k in info})
    return orjson.dumps(shown).decode()


def _exit_on_signal(signum: int, _frame: Any) -> None:
    raise SystemExit(0)


def launch_server(cfg: ServerConfig) -> None:
    """Runs the server until SIGTERM/SIGINT (then returns) or until a child dies (then raises
    ``SystemExit(EXIT_WORKER_DIED)``); children never outlive this call."""
    # the HTTP side's modules (torch among them) load after the children are started, so the
    # scheduler's own imports and model load overlap them
    from tqdm import tqdm

    from radixlm.srt.models.default_model import resolve_model_path

    configure_logging(cfg.log_level)
    signal.signal(signal.SIGTERM, _exit_on_signal)  # during start-up; uvicorn's handler after
    # resolve (and convert a GGUF) once, here, rather than in every child
    child_cfg = with_rendezvous(
        cfg.replace(
            model_path=str(
                resolve_model_path(cfg.model_path, need_weights=cfg.load_format != "dummy")
            )
        )
    )
    procs = ServerProcesses(child_cfg)
    if cfg.node_rank > 0:
        run_follower_node(procs)
        return
    supervisor: Supervisor | None = None
    try:
        parts = 1 + len(procs.heartbeats)  # the tokenizer and each child
        with tqdm(total=parts, desc="starting", unit="part", disable=None) as bar:
            procs.start()
            from radixlm.srt.managers.model_info import served_model_name
            from radixlm.srt.managers.tokenizer_manager import TokenizerManager
            from radixlm.srt.server.app import create_app
            from radixlm.srt.server.http.metrics import ServerMetrics
            from radixlm.srt.server.process.supervisor import DrainGate, Supervisor

            tokenizer = load_server_tokenizer(child_cfg)
            procs.start_detokenizer(export_decoder(tokenizer))
            bar.update(1)
            infos = procs.wait_ready(on_ready=lambda _: bar.update(1))
        info = infos["scheduler"]
        metrics = ServerMetrics(served_model_name(cfg, info))
        tm = TokenizerManager(cfg, tokenizer, procs.endpoints, observer=metrics)
        tm.info = info
        supervisor = Supervisor(procs, DrainGate(None))
        app = create_app(tm, metrics, watchers=(supervisor.watch,))
        app.state.health_problem = procs.problem
        supervisor.gate.app = app
        logger.info(
            "serving %s on http://%s:%d; config %s",
            app.state.served_model_name,
            cfg.host,
            cfg.port,
            resolved_config_line(cfg, info),
        )
        serve(cfg, supervisor)
    finally:
        procs.stop()
    if supervisor is not None and supervisor.exit_code:
        logger.error("exiting with code %d (a child process died)", supervisor.exit_code)
        raise SystemExit(supervisor.exit_code)


def serve(cfg: ServerConfig, supervisor: Supervisor) -> None:
    import uvicorn

    from radixlm.srt.server.process.supervisor import DEATH_GRACE_S, SupervisedServer

    level = cfg.log_level.lower()
    config = uvicorn.Config(
        supervisor.gate,
        host=cfg.host,
        port=cfg.port,
        log_level=level,
        access_log=level == "debug",
        lifespan="on",
        timeout_graceful_shutdown=int(DEATH_GRACE_S),
    )
    server = SupervisedServer(config, supervisor)
    supervisor.server = server
    # What start-up made (torch, the tokenizer, the app: ~350k objects) is moved out of the
    # collector's reach: else every full collection, which a large request body's allocations
    # trigger, walks all of it on the event loop (~0.4 s during which no client is answered).
    gc.collect()
    gc.freeze()
    server.run()


def run_follower_node(procs: ServerProcesses) -> None:
    """A machine with ``node_rank > 0``: its followers, no HTTP. Returns when they all exited 0
    (rank 0 stopped them) or on SIGTERM / SIGINT; raises ``SystemExit(EXIT_WORKER_DIED)`` when
    one failed (the others are killed)."""
    from radixlm.srt.server.process.supervisor import EXIT_WORKER_DIED, describe_exit

    signal.signal(signal.SIGINT, _exit_on_signal)
    try:
        procs.start()
        procs.wait_ready()
        logger.info("tensor-parallel ranks %s ready", procs.follower_ranks)
        while len(exited := procs.exited_children()) < len(procs.procs):
            failed = [(name, code) for name, code in exited if code != 0]
            if failed:
                logger.error("%s; stopping this machine's ranks", describe_exit(*failed[0]))
                procs.kill_all()
                raise SystemExit(EXIT_WORKER_DIED)
            wait([p.sentinel for p in procs.procs.values()], timeout=1.0)
        logger.info("rank 0 stopped this machine's ranks")
    finally:
        procs.stop()
