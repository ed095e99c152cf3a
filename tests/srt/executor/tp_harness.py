"""Runs tensor-parallel model runners in real processes (spawned, gloo on CPUs, NCCL on GPUs).

Rank 0 runs the real scheduler over its ``ModelRunner`` (greedy requests, prefix sharing, chunked
prefill) and records every step's logits; the other ranks ``follow()``. The same workload then
runs at TP=1 in rank 0's process, so the test compares TP=2 with TP=1 on identical schedules.
Results travel back through ``torch.save`` files, one per rank.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

PREFIX = [11, 523, 1004, 77, 3021, 9, 18000, 415, 222, 7001, 38, 1290, 4512, 6, 990, 3]
PROMPTS = [
    PREFIX + [100, 200, 300, 400, 500],
    PREFIX + [101, 201],
    [5000, 40, 2, 17, 8080, 1337, 12, 99, 4242, 31],
]
LATE_PROMPT = PREFIX + [100, 200, 300, 400, 501, 7, 8]  # arrives later: hits the cached prefix
NUM_TOKENS = 16


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_config(model_dir: Path, tp_size: int, port: int, **options: Any):
    from radixlm.srt.config import config_from_kwargs

    options = {
        "max_total_tokens": 2048,
        "chunked_prefill_size": 16,  # prompts above 16 tokens prefill in chunks
        "log_level": "warning",
        "device": "cpu",
        "dtype": "float32",
        **options,
    }
    if tp_size > 1:
        options.update(tp_size=tp_size, dist_init_addr=f"127.0.0.1:{port}")
    else:  # the single-rank reference: no expert parallelism either
        options.pop("ep_size", None)
    return config_from_kwargs(model_path=str(model_dir), **options)


class _RetractionCounter(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.count += "retracting" in record.getMessage()


def run_workload(scheduler, prompts=PROMPTS, late=LATE_PROMPT, num_tokens=NUM_TOKENS):
    """Greedy outputs by rid, the logits of every step ([rows, vocab] float32 on the CPU) and
    the number of requests retracted (KV pool full)."""
    from radixlm.srt.messages import TokenizedGenerateReq
    from radixlm.srt.scheduler.failures import run_step

    steps: list[torch.Tensor] = []
    runner = scheduler.runner
    forward = runner.forward

    def recording_forward(*args, **kwargs):
        logits = forward(*args, **kwargs)
        steps.append(logits.detach().float().cpu().clone())
        return logits

    runner.forward = recording_forward
    counter, log = _RetractionCounter(), logging.getLogger("radixlm.srt.scheduler.scheduler")
    log.setLevel(logging.INFO)
    log.addHandler(counter)
    params = {"temperature": 0, "max_new_tokens": num_tokens, "ignore_eos": True}

    def msg(i, prompt):
        return TokenizedGenerateReq(rid=f"r{i}", input_ids=prompt, sampling_params=params)

    for i, prompt in enumerate(prompts):
        scheduler.handle(msg(i, prompt))
    outputs: dict[str, list[int]] = {}
    for step in range(1000):
        if step == 6 and late is not None:
            scheduler.handle(msg(len(prompts), late))
        elif not scheduler.has_work() and step > 6:
            break
        out = run_step(scheduler)
        for rid, ids in zip(out.rids if out else [], out.new_token_ids if out else [], strict=True):
            outputs.setdefault(rid, []).extend(ids)
    runner.forward = forward
    log.removeHandler(counter)
    assert scheduler.check_idle()
    return outputs, steps, counter.count


def _rank_main(rank: int, jobs: list, tp_size: int, port: int, out_dir: str):
    """One rank over ``jobs`` (model folder, runner options) in turn, in one process group
    (joined once): rank 0 runs each job's workload at TP=``tp_size`` then at TP=1; the others
    follow. Results go to ``job<i>-rank<rank>.pt``; after a failed job the rank stops (its peer
    then fails in its collective)."""
    from dataclasses import replace

    from radixlm.srt.distributed import init_distributed
    from radixlm.srt.executor.model_runner import ModelRunner
    from radixlm.srt.scheduler import Scheduler

    group = None
    for index, (model_dir, opts) in enumerate(jobs):
        result: dict[str, Any] = {"rank": rank}
        try:
            cfg = make_config(Path(model_dir), tp_size, port, **opts)
            if group is None:
                group = init_distributed(cfg, rank)
            tp = replace(group, ep_size=int(getattr(cfg, "ep_size", 1)))
            runner = ModelRunner(cfg, tp_rank=rank, tp_group=tp)
            result["threads"] = torch.get_num_threads()
            result["kv_heads"] = runner.heads.num_kv_heads
            result["max_total_tokens"] = runner.max_total_tokens
            blocks = getattr(runner.model, "sparse_blocks", list)()  # MoE models: expert split
            result["expert_shard"] = blocks[0][1].experts.shard if blocks else None
            if rank == 0:
                result["tp"] = run_workload(Scheduler(cfg, runner))
                runner.stop_followers()
                reference = ModelRunner(make_config(Path(model_dir), 1, port, **opts))
                result["ref"] = run_workload(Scheduler(reference.cfg, reference))
            else:
                start = time.monotonic()
                runner.follow()
                result["followed_s"] = time.monotonic() - start
            result["ok"] = True
        except BaseException as e:  # reported to the test, which decides
            result["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
        torch.save(result, Path(out_dir) / f"job{index}-rank{rank}.pt")
        if not result.get("ok"):
            break


def run_ranks(
    model_dir: Path, out_dir: Path, tp_size: int = 2, timeout_s: float = 600, **opts: Any
) -> list[dict[str, Any]]:
    """Runs ``_rank_main`` on ``tp_size`` spawned processes; returns each rank's result dict
    (with its exit code under ``"exitcode"``)."""
    return run_jobs([(model_dir, opts)], out_dir, tp_size, timeout_s)[0]


def run_jobs(
    jobs: list[tuple[Path, dict[str, Any]]],
    out_dir: Path,
    tp_size: int = 2,
    timeout_s: float = 600,
) -> list[list[dict[str, Any]]]:
    """``run_ranks`` for several (model folder, runner options) jobs in one launch of
    ``tp_size`` processes (each job a model runner of its own on the same process group: the
    spawn, the imports and the rendezvous are paid once); returns the ranks' result dicts per
    job. A job that did not run (an earlier one failed) has no result but ``rank`` and
    ``exitcode``."""
    port = free_port()
    jobs = [(str(model_dir), dict(opts)) for model_dir, opts in jobs]
    ctx = mp.start_processes(
        _rank_main,
        args=(jobs, tp_size, port, str(out_dir)),
        nprocs=tp_size,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + timeout_s
    for p in ctx.processes:
        p.join(max(deadline - time.monotonic(), 1))
    for p in ctx.processes:
        if p.is_alive():
            p.kill()
            p.join()
    per_job = []
    for index in range(len(jobs)):
        results = []
        for rank, p in enumerate(ctx.processes):
            path = out_dir / f"job{index}-rank{rank}.pt"
            res = torch.load(path, weights_only=False) if path.exists() else {"rank": rank}
            res["exitcode"] = p.exitcode
            results.append(res)
        per_job.append(results)
    return per_job


def _death_main(rank: int, model_dir: str, port: int, out_dir: str, how: str):
    """``"exit"``: both ranks load the model; rank 0's process ends while rank 1 ``follow()``s.
    ``"stall"``: no model (the step receiver alone, over a request table): rank 0 sends a step
    header and nothing more, so rank 1 waits in a collective with ``dist_timeout_s`` 3 s."""
    import torch.distributed as dist

    from radixlm.srt.distributed import init_distributed
    from radixlm.srt.executor.memory_pool import ReqToTokenPool
    from radixlm.srt.executor.tp_sync import HEADER_LEN, KIND_STEP, StepReceiver

    cfg = make_config(Path(model_dir), 2, port, dist_timeout_s=3.0)
    if how == "exit":
        from radixlm.srt.executor.model_runner import ModelRunner

        runner = ModelRunner(cfg, tp_rank=rank)
        follow = runner.follow
    else:
        tp = init_distributed(cfg, rank)
        follow = StepReceiver(tp, ReqToTokenPool(4, 64, torch.device("cpu"))).receive
    if rank == 0:
        time.sleep(1.0)
        if how == "exit":
            os._exit(3)
        header = torch.zeros(HEADER_LEN, dtype=torch.int64)
        header[:5] = torch.tensor([KIND_STEP, 0, 4, 1, 1])  # 4 tokens of 1 request, 1 logit row
        dist.broadcast(header, src=0, group=tp.wait_group)
        time.sleep(60)  # never sends the rest: the follower must time out
        os._exit(0)
    start = time.monotonic()
    result: dict[str, Any] = {}
    try:
        follow()
        result["returned"] = True
    except RuntimeError as e:
        result["error"] = str(e)
    result["elapsed_s"] = time.monotonic() - start
    torch.save(result, Path(out_dir) / "follower.pt")
    os._exit(0)


def run_death(model_dir: Path, out_dir: Path, how: str) -> dict[str, Any]:
    port = free_port()
    ctx = mp.start_processes(
        _death_main,
        args=(str(model_dir), port, str(out_dir), how),
        nprocs=2,
        join=False,
        start_method="spawn",
    )
    follower = ctx.processes[1]
    follower.join(120)
    for p in ctx.processes:
        if p.is_alive():
            p.kill()
        p.join()
    path = out_dir / "follower.pt"
    return torch.load(path, weights_only=False) if path.exists() else {"missing": True}
