"""The Engine's tensor-parallel ranks: rank 0 in this process, the followers as children
(``tp_ranks.FollowerProcesses``). Kept apart from ``tp_ranks`` so that the HTTP process, which
only launches ranks, does not load the scheduler and the model runner."""

from __future__ import annotations

import atexit
import logging

import torch

from radixlm.srt.config import ServerConfig
from radixlm.srt.executor.model_runner import ModelRunner
from radixlm.srt.managers.scheduler_process import TPGuard
from radixlm.srt.managers.tp_ranks import FollowerProcesses
from radixlm.srt.scheduler import Scheduler

logger = logging.getLogger(__name__)


class InProcessRanks:
    """Rank 0 inside this process (the ``Engine``) and its followers as children; a no-op
    shell at ``tp_size == 1``. Once a follower died or a forward failed on rank 0 the ranks are
    out of step: the followers are killed and :meth:`check` raises RuntimeError from then on."""

    def __init__(self, cfg: ServerConfig) -> None:
        self.cfg = cfg
        self.followers: FollowerProcesses | None = None
        self.guard = TPGuard(None)
        self.runner: ModelRunner | None = None
        self.dead_reason: str | None = None

    def start_scheduler(self) -> Scheduler:
        """Spawns the followers, then builds the scheduler (rank 0 joins the group in its
        ModelRunner); a follower's start-up error wins over rank 0's join timeout."""
        cfg = self.cfg
        if cfg.tp_size == 1:
            return Scheduler(cfg)
        if cfg.node_rank != 0:
            raise ValueError(
                f"node_rank must be 0 in-process (got {cfg.node_rank}); the other machines "
                "run their ranks with `radixlm serve --node-rank K`"
            )
        if torch.distributed.is_initialized():
            raise ValueError(
                "tp_size > 1: this process already belongs to a tensor-parallel group (another "
                "Engine?); shut that one down first"
            )
        self.followers = FollowerProcesses(cfg)
        try:
            scheduler = Scheduler(cfg)
            self.followers.wait_ready(cfg.dist_timeout_s)
        except BaseException as e:
            try:
                if not isinstance(e, ValueError):  # a bad option stays rank 0's ValueError
                    self.followers.wait_ready(0.5)  # raises the follower's own error, if any
            finally:
                self.followers.kill()
                if torch.distributed.is_initialized():
                    torch.distributed.destroy_process_group()
            raise
        self.guard = TPGuard(scheduler.runner)
        self.runner = scheduler.runner
        # before multiprocessing's own exit hook, which would wait forever for followers
        # blocked waiting for rank 0 (atexit runs the last registered first)
        atexit.register(self.shutdown)
        return scheduler

    def check(self) -> None:
        """Raises RuntimeError when the group cannot run (a follower exited, a forward on rank
        0 failed, or it was shut down)."""
        if self.dead_reason is None and self.guard.failure is not None:
            self._fail(f"a tensor-parallel forward failed ({self.guard.failure!r})")
        if self.dead_reason is None and self.followers is not None:
            problem = self.followers.problem()
            if problem is not None:
                self._fail(problem)
        if self.dead_reason is not None:
            raise RuntimeError(f"{self.dead_reason}; create a new Engine")

    @property
    def is_running(self) -> bool:
        return self.dead_reason is None

    def _fail(self, reason: str) -> None:
        logger.error("%s; the tensor-parallel ranks stop", reason)
        self.dead_reason = reason
        if self.followers is not None:
            self.followers.kill()

    def shutdown(self) -> None:
        """Stops the followers (rank 0 tells them, then they are reaped) and leaves the group.
        Idempotent; runs at interpreter exit if the Engine was not shut down."""
        if self.followers is None:
            return
        atexit.unregister(self.shutdown)
        if self.dead_reason is None and self.guard.failure is None:
            self.guard.stop_followers()
            self.followers.stop()
        else:  # out of step (a rank died, a forward was interrupted): nothing to wait for
            self.followers.kill()
        self.followers = None
        if self.runner is not None:
            self.runner.tp.destroy()
        self.dead_reason = self.dead_reason or "the engine was shut down"
