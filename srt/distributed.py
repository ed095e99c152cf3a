"""Tensor-parallel process groups: who this rank is, and the few collectives the model uses.

One process per rank. ``init_distributed(cfg, tp_rank)`` joins the rendezvous at
``cfg.dist_init_addr`` and returns a :class:`TPGroup` holding three groups over the same ranks:

* ``device_group``: the model's collectives (all-reduce after row-parallel layers, all-gather
  of logits). NCCL when the ranks run on CUDA devices, gloo on CPUs. Timeout ``dist_timeout_s``.
* ``cpu_group``: gloo, for control tensors (the step description rank 0 broadcasts, the KV
  pool size every rank agrees on). Timeout ``dist_timeout_s``.
* ``wait_group``: gloo, used only by followers to wait for rank 0's next step header. A server
  may sit idle for hours, so this group's timeout is very long; a follower still learns at once
  that rank 0 died, because gloo fails a pending receive when its peer's connection closes.

At ``size == 1`` (``TPGroup.single()``) there are no groups and every collective returns its
input unchanged: a single-rank runtime runs exactly the code it ran before tensor parallelism.

Collectives must be issued in the same order on every rank of a group; the model's forward and
the step protocol (``executor/tp_sync.py``) guarantee that.
"""

from __future__ import annotations

import datetime
import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

WAIT_TIMEOUT_S = 7 * 24 * 3600.0  # the idle wait for rank 0's next step: a week


@dataclass
class TPGroup:
    """This process's place among ``size`` tensor-parallel ranks (see the module docstring)."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0  # the rank's index on its machine (its CUDA device index)
    device_group: Any = None  # torch ProcessGroup for model collectives; None at size 1
    cpu_group: Any = None  # gloo ProcessGroup for control tensors; None at size 1
    wait_group: Any = None  # gloo ProcessGroup with a long timeout: followers' idle wait
    ep_size: int = 1  # MoE layers: experts split over this many groups of ranks (models/moe.py)

    @classmethod
    def single(cls) -> TPGroup:
        """The group of a runtime without tensor parallelism: every collective is a no-op."""
        return cls()

    @property
    def is_distributed(self) -> bool:
        return self.size > 1

    @property
    def is_leader(self) -> bool:
        """Rank 0: the rank that schedules, samples and broadcasts every step."""
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sums ``x`` over the ranks, in place; returns it (``x`` itself at size 1)."""
        if self.size > 1:
            dist.all_reduce(x, group=self.device_group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenates every rank's ``x`` (same shape on all ranks) along ``dim``, rank order."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.device_group)
        return torch.cat(parts, dim=dim)

    def broadcast(self, x: torch.Tensor, src: int = 0, control: bool = False) -> torch.Tensor:
        """Overwrites ``x`` with rank ``src``'s ``x`` (same shape and dtype on all ranks);
        ``control``: over the gloo control group (``x`` must then be a CPU tensor)."""
        if self.size > 1:
            dist.broadcast(x, src=src, group=self.cpu_group if control else self.device_group)
        return x

    def min_int(self, value: int) -> int:
        """The smallest of every rank's ``value`` (e.g. KV slots every rank can hold)."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t.item())

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier(group=self.cpu_group)

    def destroy(self) -> None:
        """Leaves the process group (idempotent; a no-op at size 1). Not a synchronisation
        point: it waits for no peer, so a rank may call it whenever it has issued its last
        collective (rank 0 after ``stop_followers``, a follower after ``follow`` returned)."""
        if self.size > 1 and dist.is_initialized():
            dist.destroy_process_group()


def tp_device(cfg: Any, local_rank: int) -> torch.device:
    """The device rank ``local_rank`` of a machine runs on: ``cuda`` -> ``cuda:<local_rank>``,
    ``cuda:N`` -> ``cuda:<N + local_rank>``, ``cpu`` -> ``cpu`` (``auto``: cuda if available)."""
    name = cfg.device
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + local_rank)


def init_distributed(cfg: Any, tp_rank: int) -> TPGroup:
    """Joins the ``cfg.tp_size`` ranks as rank ``tp_rank`` (``TPGroup.single()`` when
    ``tp_size == 1``). ``cfg.dist_init_addr`` (``host:port``) must be set when ``tp_size > 1``;
    rank 0 listens there. Ranks are spread evenly over ``cfg.nnodes`` machines, so the local rank
    (CUDA device index) is ``tp_rank % (tp_size // nnodes)``. Raises ``RuntimeError`` (from
    torch) when the other ranks do not join within ``cfg.dist_timeout_s``."""
    size = int(cfg.tp_size)
    if size == 1:
        return TPGroup.single()
    check_tp_config(cfg)
    if not 0 <= tp_rank < size:
        raise ValueError(f"tp_rank must be in [0, {size}), got {tp_rank}")
    if not cfg.dist_init_addr:
        raise ValueError("tp_size > 1 needs dist_init_addr (host:port of rank 0's rendezvous)")
    local_rank = tp_rank % (size // max(int(cfg.nnodes), 1))
    device = tp_device(cfg, local_rank)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=float(cfg.dist_timeout_s))
    dist.init_process_group(
        backend=backend,
        init_method=f"tcp://{cfg.dist_init_addr}",
        world_size=size,
        rank=tp_rank,
        timeout=timeout,
    )
    ranks = list(range(size))
    cpu_group = dist.new_group(ranks, timeout=timeout, backend="gloo")
    wait = datetime.timedelta(seconds=WAIT_TIMEOUT_S)
    wait_group = dist.new_group(ranks, timeout=wait, backend="gloo")
    device_group = dist.group.WORLD if backend == "nccl" else cpu_group
    logger.info("tensor parallel rank %d/%d on %s (%s)", tp_rank, size, device, backend)
    ep_size = int(getattr(cfg, "ep_size", 1))
    return TPGroup(tp_rank, size, local_rank, device_group, cpu_group, wait_group, ep_size)


def cpu_threads_per_rank(total_cores: int, tp_size: int) -> int:
    """Intra-op threads for one of ``tp_size`` ranks sharing ``total_cores`` CPU cores."""
    return max(1, total_cores // max(tp_size, 1))


def check_tp_config(cfg: Any) -> None:
    """Refuses, before any rank starts, the options tensor parallelism does not support yet
    (``ValueError`` naming the option)."""
    if int(cfg.tp_size) == 1:
        return
    if getattr(cfg, "enable_hierarchical_cache", False):
        raise ValueError(
            "enable_hierarchical_cache is not supported with tp_size > 1 yet: each rank would "
            "need its own host KV tier kept in step; drop --enable-hierarchical-cache or use "
            "--tp-size 1"
        )
    if getattr(cfg, "quantization", "none") == "int4":
        raise ValueError(
            f"quantization int4 does not support tensor parallelism (tp_size {cfg.tp_size}); "
            "drop --quantization or use --tp-size 1"
        )
