"""Starting and stopping the server: the scheduler and detokenizer children, then uvicorn.

Start-up: the ipc folder (private, mode 0700), both children (``spawn``), the tokenizer in this
process meanwhile, then a wait until every child reported ready; only then does uvicorn accept
connections. A watcher turns a child's death into 503s. On SIGTERM uvicorn stops accepting,
lets in-flight requests finish, and the children are stopped; the process exits with status 0.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import multiprocessing as mp
import os
import shutil
import signal
import tempfile
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

import orjson

from radixlm.srt.config import ServerConfig
from radixlm.srt.managers.detokenizer_process import run_detokenizer_process
from radixlm.srt.managers.scheduler_process import IpcEndpoints, run_scheduler_process
from radixlm.srt.managers.tokenizer_manager import TokenizerManager

logger = logging.getLogger(__name__)

DRAIN_TIMEOUT_S = 60
CHILD_STOP_TIMEOUT_S = 10.0
WATCH_INTERVAL_S = 0.25


class ServerProcesses:
    """The scheduler and detokenizer children and the ipc folder they talk through."""

    def __init__(self, cfg: ServerConfig) -> None:
        self.cfg = cfg
        self.ipc_dir = tempfile.mkdtemp(prefix="radixlm-ipc-")
        os.chmod(self.ipc_dir, 0o700)
        self.endpoints = IpcEndpoints.in_dir(self.ipc_dir)
        self.procs: dict[str, BaseProcess] = {}
        self.ready_conns: dict[str, Connection] = {}
        self.stopping = False

    def start(self) -> None:
        ctx = mp.get_context("spawn")
        self._start_child(ctx, "scheduler", run_scheduler_process, ())
        self._start_child(ctx, "detokenizer", run_detokenizer_process,
                          (self.procs["scheduler"].pid,))

    def _start_child(self, ctx: Any, name: str, target: Any, extra: tuple) -> None:
        reader, writer = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=target, name=f"radixlm-{name}",
                           args=(self.cfg, self.endpoints, writer, os.getpid(), *extra))
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
            raise RuntimeError(f"the {name} process exited during start-up "
                               f"(exit code {self.procs[name].exitcode})") from None
        if not report["ok"]:
            raise RuntimeError(report["error"])
        return report["info"]

    def dead_child(self) -> str | None:
        for name, proc in self.procs.items():
            if not proc.is_alive():
                return f"the {name} process exited (exit code {proc.exitcode})"
        return None

    async def watch(self, tm: TokenizerManager) -> None:
        """Marks the tokenizer manager dead as soon as a child exits unexpectedly."""
        while not self.stopping:
            reason = self.dead_child()
            if reason is not None:
                tm.mark_dead(reason)
                return
            await asyncio.sleep(WATCH_INTERVAL_S)

    def stop(self) -> None:
        """SIGTERM to each child (the scheduler first: it finishes what it holds), then SIGKILL
        for any that does not exit in time; removes the ipc folder."""
        self.stopping = True
        for name in ("scheduler", "detokenizer"):
            proc = self.procs.get(name)
            if proc is None:
                continue
            if proc.is_alive():
                proc.terminate()
                proc.join(CHILD_STOP_TIMEOUT_S)
            if proc.is_alive():
                logger.warning("the %s process did not stop in time; killing it", name)
                proc.kill()
                proc.join()
        shutil.rmtree(self.ipc_dir, ignore_errors=True)


def configure_logging(log_level: str) -> None:
    logging.basicConfig(level=log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def resolved_config_line(cfg: ServerConfig, info: dict[str, Any]) -> str:
    shown = dataclasses.asdict(cfg)
    if shown.get("api_key"):
        shown["api_key"] = "<set>"
    keys = ("model_path", "architecture", "device", "dtype", "max_total_tokens",
            "context_length", "vocab_size", "attention_backend")
    shown.update({f"resolved_{k}": info[k] for k in keys if k in info})
    return orjson.dumps(shown).decode()


def _exit_on_signal(signum: int, _frame: Any) -> None:
    raise SystemExit(0)


def load_tokenizer_for(cfg: ServerConfig) -> Any:
    from radixlm.srt.managers.detokenizer_process import load_server_tokenizer

    return load_server_tokenizer(cfg)


def launch_server(cfg: ServerConfig) -> None:
    """Runs the server until SIGTERM/SIGINT; children never outlive this call."""
    import uvicorn
    from tqdm import tqdm

    from radixlm.srt.models.default_model import resolve_model_path
    from radixlm.srt.server.app import create_app, served_model_name
    from radixlm.srt.server.metrics import ServerMetrics

    configure_logging(cfg.log_level)
    signal.signal(signal.SIGTERM, _exit_on_signal)
    # resolve (and convert a GGUF) once, here, rather than in every child
    child_cfg = cfg.replace(model_path=str(resolve_model_path(cfg.model_path)))
    procs = ServerProcesses(child_cfg)
    try:
        with tqdm(total=3, desc="starting", unit="part", disable=None) as bar:
            procs.start()
            tokenizer = load_tokenizer_for(child_cfg)
            bar.update(1)
            infos = procs.wait_ready(on_ready=lambda _: bar.update(1))
        info = infos["scheduler"]
        metrics = ServerMetrics(served_model_name(cfg, info))
        tm = TokenizerManager(cfg, tokenizer, procs.endpoints, observer=metrics)
        tm.info = info
        app = create_app(tm, metrics, watchers=(procs.watch,))
        logger.info("serving %s on http://%s:%d; config %s", app.state.served_model_name,
                    cfg.host, cfg.port, resolved_config_line(cfg, info))
        uvicorn.run(app, host=cfg.host, port=cfg.port, log_level=cfg.log_level.lower(),
                    access_log=cfg.log_level.lower() == "debug",
                    timeout_graceful_shutdown=DRAIN_TIMEOUT_S)
    finally:
        procs.stop()
