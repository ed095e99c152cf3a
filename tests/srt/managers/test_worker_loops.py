"""The scheduler and detokenizer process loops, run in threads over real ZMQ ipc sockets with a
fake scheduler: a failing request or control call never stops the loop; SIGTERM (the flag it
sets) drains the work in hand before the loop exits."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import zmq
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from radixlm.srt.managers.detokenizer import Detokenizer
from radixlm.srt.managers.detokenizer_process import DetokenizerLoop
from radixlm.srt.managers.scheduler_process import ChildLifecycle, IpcEndpoints, SchedulerLoop
from radixlm.srt.messages import (
    AbortReq,
    BatchStrOut,
    BatchTokenOut,
    ControlMessage,
    ControlReply,
    FlushCacheReq,
    ServerInfoReq,
    TokenizedGenerateReq,
    decode,
    encode,
)

TIMEOUT_MS = 5000


class FakeScheduler:
    def __init__(self) -> None:
        self.pending: list[TokenizedGenerateReq] = []
        self.steps = 0

    def handle(self, msg: Any) -> ControlReply | None:
        if isinstance(msg, TokenizedGenerateReq):
            if msg.rid == "boom":
                raise RuntimeError("cannot take this one")
            self.pending.append(msg)
        elif isinstance(msg, ControlMessage):
            if isinstance(msg, FlushCacheReq):  # this fake fails on it
                raise KeyError("explode")
            return ControlReply(msg.req_id, True, {"pending": len(self.pending)})
        elif isinstance(msg, AbortReq):
            self.pending = [r for r in self.pending if not r.rid.startswith(msg.rid)]
        return None

    def has_work(self) -> bool:
        return bool(self.pending)

    paused = None  # never paused: it steps whenever it has work
    wants_step = has_work

    def close(self) -> None:
        self.closed = True

    def step(self) -> BatchTokenOut | None:
        self.steps += 1
        req = self.pending.pop(0)
        return BatchTokenOut(
            rids=[req.rid],
            new_token_ids=[[7]],
            finish_reason=[{"type": "length", "length": 1}],
            prompt_tokens=[len(req.input_ids)],
            completion_tokens=[1],
            cached_tokens=[0],
            no_stop_trim=[False],
            skip_special_tokens=[True],
            output_token_logprobs=[None],
            output_top_logprobs=[None],
            input_token_logprobs=[None],
            input_top_logprobs=[None],
        )


class Harness:
    """Plays the tokenizer manager (sends to the scheduler, reads replies) and the detokenizer
    (reads the scheduler's token outputs)."""

    def __init__(self, endpoints: IpcEndpoints) -> None:
        self.ctx = zmq.Context()
        self.to_scheduler = self.ctx.socket(zmq.PUSH)
        self.to_scheduler.connect(endpoints.scheduler)
        self.replies = self.ctx.socket(zmq.PULL)
        self.replies.bind(endpoints.tokenizer)
        self.token_outs = self.ctx.socket(zmq.PULL)
        self.token_outs.bind(endpoints.detokenizer)

    def send(self, msg: Any) -> None:
        self.to_scheduler.send(encode(msg))

    @staticmethod
    def recv(sock: zmq.Socket) -> Any:
        assert sock.poll(TIMEOUT_MS), "nothing arrived"
        return decode(sock.recv())


@pytest.fixture
def running(tmp_path) -> Iterator[tuple[Harness, FakeScheduler, ChildLifecycle, threading.Thread]]:
    endpoints = IpcEndpoints.in_dir(tmp_path)
    harness = Harness(endpoints)
    scheduler = FakeScheduler()
    life = ChildLifecycle(os.getppid(), "scheduler")  # the loop watches this process's parent
    loop = SchedulerLoop(scheduler, endpoints, life)
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()
    yield harness, scheduler, life, thread
    life.term_requested.set()
    thread.join(5)
    harness.ctx.destroy(linger=0)


def req(rid: str) -> TokenizedGenerateReq:
    return TokenizedGenerateReq(rid=rid, input_ids=[1, 2, 3], sampling_params={})


def test_a_failing_request_is_aborted_and_the_loop_goes_on(running) -> None:
    harness, _, _, thread = running
    harness.send(req("boom"))
    out = harness.recv(harness.token_outs)
    assert out.rids == ["boom"]
    assert out.finish_reason[0]["type"] == "abort" and out.finish_reason[0]["status_code"] == 500
    assert "cannot take this one" in out.finish_reason[0]["message"]
    harness.send(req("fine"))
    out = harness.recv(harness.token_outs)
    assert out.rids == ["fine"] and out.finish_reason[0]["type"] == "length"
    assert thread.is_alive()


def test_control_replies_and_failures(running) -> None:
    harness, _, _, thread = running
    harness.send(ServerInfoReq(req_id="a"))
    reply = harness.recv(harness.replies)
    assert (reply.req_id, reply.ok, reply.data) == ("a", True, {"pending": 0})
    harness.send(FlushCacheReq(req_id="b"))
    reply = harness.recv(harness.replies)
    assert (reply.req_id, reply.ok) == ("b", False) and "internal error" in reply.data["message"]
    assert thread.is_alive()


def test_term_flag_drains_work_then_exits(running) -> None:
    harness, scheduler, life, thread = running
    scheduler.pending.extend([req("x1"), req("x2"), req("x3")])
    life.term_requested.set()
    thread.join(5)
    assert not thread.is_alive()
    got = {harness.recv(harness.token_outs).rids[0] for _ in range(3)}
    assert got == {"x1", "x2", "x3"}


def test_detokenizer_loop(tmp_path) -> None:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        ["hello world"] * 5,
        trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()),
    )
    endpoints = IpcEndpoints.in_dir(tmp_path)
    ctx = zmq.Context()
    results = ctx.socket(zmq.PULL)
    results.bind(endpoints.tokenizer)
    life = ChildLifecycle(os.getppid(), "detokenizer")
    loop = DetokenizerLoop(Detokenizer(tok), endpoints, life, scheduler_pid=None)
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()
    to_detok = ctx.socket(zmq.PUSH)
    to_detok.connect(endpoints.detokenizer)
    ids = tok.encode("hello world").ids
    to_detok.send(encode(_one_pending(ids).step()))
    out = Harness.recv(results)
    assert isinstance(out, BatchStrOut) and out.token_out.rids == ["d"]
    assert out.text_delta == [tok.decode([7])]
    life.term_requested.set()  # no scheduler left: exits after one quiet poll
    thread.join(5)
    assert not thread.is_alive()
    ctx.destroy(linger=0)


def _one_pending(ids: list[int]) -> FakeScheduler:
    s = FakeScheduler()
    s.pending.append(TokenizedGenerateReq(rid="d", input_ids=ids, sampling_params={}))
    return s
