"""Overlap scheduling's device side: launching a decode step whose sampled ids stay on the
device (the next step's inputs), and reading them back one step later (see ``Scheduler``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from radixlm.srt.executor.model_runner import ModelRunner
from radixlm.srt.executor.transfer import HostReadback, to_device
from radixlm.srt.scheduler.batch import ScheduledBatch
from radixlm.srt.scheduler.req import Req
from radixlm.srt.scheduler.sampling_step import SamplingStep


@dataclass
class InflightDecode:
    """A decode step launched on the device whose sampled ids are not read back yet."""

    reqs: list[Req]  # in the order of next_ids
    next_ids: torch.Tensor  # [B] int64 on the device
    host_ids: torch.Tensor  # [B] int64 on the host, valid once `done` has fired
    done: Any  # torch.cuda.Event recorded after the copy to host_ids (None on a CPU)

    def read_back(self) -> list[int]:
        if self.done is not None:
            self.done.synchronize()
        return self.host_ids.tolist()


def launch_decode(
    runner: ModelRunner, sampling: SamplingStep, batch: ScheduledBatch, prev: InflightDecode | None
) -> InflightDecode:
    """Runs ``batch``'s forward and sampling without waiting; with ``prev`` in flight, the
    inputs are its sampled ids, still on the device."""
    ids_on_device = None
    if prev is not None:
        same = len(prev.reqs) == len(batch.reqs) and all(
            a is b for a, b in zip(prev.reqs, batch.reqs, strict=True)
        )
        if same:
            ids_on_device = prev.next_ids
        else:
            row = {id(r): i for i, r in enumerate(prev.reqs)}
            index = to_device([row[id(r)] for r in batch.reqs], prev.next_ids.device)
            ids_on_device = prev.next_ids[index]
    logits = runner.forward(batch, list(range(len(batch.reqs))), input_ids_on_device=ids_on_device)
    next_ids = sampling.sample_on_device(logits, batch.reqs)
    if next_ids.device.type != "cuda":
        return InflightDecode(batch.reqs, next_ids, next_ids, None)
    readback = HostReadback(next_ids)
    return InflightDecode(batch.reqs, next_ids, readback.host, readback.event)
