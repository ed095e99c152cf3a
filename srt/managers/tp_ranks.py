"""Tensor-parallel ranks as processes: which ranks a machine runs, the rendezvous address, and
the followers an in-process ``Engine`` spawns.

Ranks are spread evenly over ``cfg.nnodes`` machines: machine ``k`` runs ranks
``k * tp_size / nnodes`` up to the next machine's first (the same rule ``init_distributed``
uses for the local rank, i.e. the CUDA device index). Rank 0 (machine 0) schedules; every other
rank is a follower (``scheduler_process.run_follower_process``).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import socket
import time
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess

from radixlm.srt.config import ServerConfig
from radixlm.srt.managers.scheduler_process import run_follower_process

logger = logging.getLogger(__name__)

FOLLOWER_STOP_TIMEOUT_S = 10.0


def ranks_on_this_node(cfg: ServerConfig) -> range:
    """The tensor-parallel ranks machine ``cfg.node_rank`` runs."""
    per_node = cfg.tp_size // cfg.nnodes
    return range(cfg.node_rank * per_node, (cfg.node_rank + 1) * per_node)


def free_local_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def check_ranks_fit(cfg: ServerConfig) -> None:
    """Refuses, before any process starts, more ranks on this machine than it can run: one
    GPU per rank, or (on CPUs) no more ranks than cores; and the options TP does not support."""
    per_node = cfg.tp_size // cfg.nnodes
    if per_node == 1:
        return  # before any torch import: a one-rank server starts its children first
    from radixlm.srt.distributed import check_tp_config

    check_tp_config(cfg)
    import torch

    on_gpu = cfg.device.startswith("cuda") or (cfg.device == "auto" and torch.cuda.is_available())
    have = torch.cuda.device_count() if on_gpu else max(os.cpu_count() or 1, 2)
    if per_node > have:
        kind = "GPUs" if on_gpu else "CPU cores"
        raise ValueError(
            f"tp_size {cfg.tp_size} over {cfg.nnodes} machine(s) needs {per_node} ranks here, "
            f"but this machine has {have} {kind}"
        )


def with_rendezvous(cfg: ServerConfig) -> ServerConfig:
    """``cfg`` with ``dist_init_addr`` set when ``tp_size > 1``: a free port on 127.0.0.1 when
    none was given (``config.validate`` already demands one for several machines). Checks
    first that this machine can run its ranks (``check_ranks_fit``)."""
    check_ranks_fit(cfg)
    if cfg.tp_size == 1 or cfg.dist_init_addr:
        return cfg
    return cfg.replace(dist_init_addr=f"127.0.0.1:{free_local_port()}")


class FollowerProcesses:
    """The followers (ranks 1..tp_size-1) of an in-process rank 0, as ``spawn`` children that
    never outlive this process (parent-death signal, a parent watch, ``daemon``)."""

    def __init__(self, cfg: ServerConfig) -> None:
        ctx = mp.get_context("spawn")
        self.procs: dict[int, BaseProcess] = {}
        self.ready_conns: dict[int, Connection] = {}
        for rank in ranks_on_this_node(cfg):
            if rank == 0:
                continue
            reader, writer = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=run_follower_process,
                name=f"radixlm-tp{rank}",
                args=(cfg, rank, writer, os.getpid()),
                daemon=True,
            )
            proc.start()
            writer.close()
            self.procs[rank], self.ready_conns[rank] = proc, reader

    def wait_ready(self, timeout_s: float) -> None:
        """Blocks until every follower reported ready; raises RuntimeError naming the first one
        that failed, exited or did not report within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        pending = dict(self.ready_conns)
        while pending:
            left = deadline - time.monotonic()
            if left <= 0 or not (ready := wait(list(pending.values()), left)):
                raise RuntimeError(f"tensor-parallel ranks {sorted(pending)} did not start in time")
            for rank in [r for r, c in pending.items() if c in ready]:
                try:
                    report = pending.pop(rank).recv()
                except EOFError:
                    code = self.procs[rank].exitcode
                    raise RuntimeError(
                        f"tensor-parallel rank {rank} exited during start-up (exit code {code})"
                    ) from None
                if not report["ok"]:
                    raise RuntimeError(report["error"])

    def problem(self) -> str | None:
        """Why the group cannot run: the first follower that exited, or None."""
        for rank, proc in self.procs.items():
            if not proc.is_alive():
                return f"tensor-parallel rank {rank} exited (exit code {proc.exitcode})"
        return None

    def stop(self) -> None:
        """Waits for the followers to exit (rank 0 stopped them first), SIGKILL after
        FOLLOWER_STOP_TIMEOUT_S; reaps them. Idempotent."""
        deadline = time.monotonic() + FOLLOWER_STOP_TIMEOUT_S
        for rank, proc in self.procs.items():
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                logger.warning("tensor-parallel rank %d did not stop in time; killing it", rank)
                proc.kill()
                proc.join()
        for conn in self.ready_conns.values():
            conn.close()
        self.ready_conns.clear()

    def kill(self) -> None:
        for proc in self.procs.values():
            if proc.is_alive():
                proc.kill()
        self.stop()
