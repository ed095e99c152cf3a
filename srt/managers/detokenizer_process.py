"""The detokenizer process: ``BatchTokenOut`` in from the scheduler, ``BatchStrOut`` out to the
tokenizer manager. On SIGTERM it keeps serving until the scheduler process has exited (it
drains its own requests first) and nothing arrived for one poll interval, then exits."""

from __future__ import annotations

import logging
import sys
from multiprocessing.connection import Connection

import psutil
import zmq

from radixlm.srt.config import ServerConfig
from radixlm.srt.managers.detokenizer import Detokenizer
from radixlm.srt.managers.heartbeat import start_heartbeat
from radixlm.srt.managers.scheduler_process import (
    POLL_INTERVAL_MS,
    ChildLifecycle,
    IpcEndpoints,
    exit_cleanly,
    report_failure,
    report_ready,
)
from radixlm.srt.messages import BatchTokenOut, decode, encode
from radixlm.srt.models.tokenizer import IdDecoder, load_tokenizer
from radixlm.srt.observability.tracing import (
    DetokenizerTraces,
    NullTracer,
    TraceSettings,
    make_tracer,
)

logger = logging.getLogger(__name__)


def load_server_tokenizer(cfg: ServerConfig):
    from radixlm.srt.models.default_model import resolve_model_path

    folder = cfg.tokenizer_path or resolve_model_path(
        cfg.model_path, need_weights=cfg.load_format != "dummy"
    )
    return load_tokenizer(folder, cfg.chat_template)


class DetokenizerLoop:
    def __init__(
        self,
        detokenizer: Detokenizer,
        endpoints: IpcEndpoints,
        life: ChildLifecycle,
        scheduler_pid: int | None,
        traces: DetokenizerTraces | None = None,
    ) -> None:
        self.detokenizer = detokenizer
        self.traces = traces or DetokenizerTraces(NullTracer())
        self.life = life
        self.scheduler_pid = scheduler_pid
        self.ctx = zmq.Context()
        self.recv_sock = self.ctx.socket(zmq.PULL)
        self.recv_sock.bind(endpoints.detokenizer)
        self.send_sock = self.ctx.socket(zmq.PUSH)
        self.send_sock.setsockopt(zmq.SNDHWM, 0)
        self.send_sock.connect(endpoints.tokenizer)

    def run(self) -> None:
        while self.life.is_parent_alive():
            if not self.recv_sock.poll(POLL_INTERVAL_MS, zmq.POLLIN):
                if self.life.term_requested.is_set() and not self._scheduler_alive():
                    break
                continue
            msg = decode(self.recv_sock.recv())
            assert isinstance(msg, BatchTokenOut), type(msg).__name__
            self.traces.on_batch(msg)
            self.send_sock.send(encode(self.detokenizer.handle(msg)))
        logger.info("detokenizer loop exits")
        self.ctx.destroy(linger=1000)

    def _scheduler_alive(self) -> bool:
        if self.scheduler_pid is None:
            return False
        try:
            return psutil.Process(self.scheduler_pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False


def run_detokenizer_process(
    cfg: ServerConfig,
    endpoints: IpcEndpoints,
    ready_conn: Connection,
    parent_pid: int,
    scheduler_pid: int | None = None,
    decoder_json: str | None = None,
    heartbeat_path: str | None = None,
) -> None:
    """Entry point of the detokenizer child (started with the ``spawn`` method).
    ``decoder_json``: the served tokenizer's exported decoder (``models.tokenizer``); without
    it the child loads the tokenizer with transformers."""
    life = ChildLifecycle(parent_pid, "detokenizer")
    life.install(cfg.log_level)
    start_heartbeat(heartbeat_path)
    try:
        tokenizer = IdDecoder(decoder_json) if decoder_json else load_server_tokenizer(cfg)
        detokenizer = Detokenizer(tokenizer)
        traces = DetokenizerTraces(make_tracer(TraceSettings.from_config(cfg), "detokenizer"))
        loop = DetokenizerLoop(detokenizer, endpoints, life, scheduler_pid, traces)
    except BaseException:
        report_failure(ready_conn, "the detokenizer failed to start")
        sys.exit(1)
    report_ready(ready_conn, {})
    loop.run()
    exit_cleanly()
