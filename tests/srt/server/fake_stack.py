"""The HTTP process for real (app, TokenizerManager, ZMQ, uvicorn) over a fake worker thread that
stands in for the scheduler and detokenizer processes: every active request gets the next token
of CONTINUATION (repeated) each tick, and outputs go through the real Detokenizer."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import uvicorn
import zmq
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from radixlm.srt.config import ServerConfig
from radixlm.srt.managers.detokenizer import Detokenizer
from radixlm.srt.managers.scheduler_process import IpcEndpoints
from radixlm.srt.managers.tokenizer_manager import TokenizerManager
from radixlm.srt.messages import (
    AbortReq,
    BatchTokenOut,
    ControlMessage,
    ControlReply,
    FlushCacheReq,
    GetWeightsByNameReq,
    LoadReq,
    TokenizedGenerateReq,
    decode,
    encode,
)
from radixlm.srt.sampling.params import SamplingParams
from radixlm.srt.server.app import create_app
from radixlm.srt.server.http.metrics import ServerMetrics
from radixlm.srt.server.process.server_process import free_port

CONTINUATION = "Hello world! 你好 🎉 done. "
CONTEXT_LENGTH = 256
MAX_TOTAL_TOKENS = 1024
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def make_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE small enough that CJK and emoji split into several tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(["Hello world! done. the quick brown fox", "stop here"] * 20, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<eos>", chat_template=CHAT_TEMPLATE
    )


@dataclass
class FakeReq:
    msg: TokenizedGenerateReq
    params: SamplingParams
    cached_tokens: int
    output_ids: list[int] = field(default_factory=list)
    num_sent: int = 0
    finish: dict[str, Any] | None = None


class FakeWorker(threading.Thread):
    def __init__(self, tokenizer: Any, endpoints: IpcEndpoints, tick_s: float = 0.005) -> None:
        super().__init__(daemon=True)
        self.tokenizer = tokenizer
        self.endpoints = endpoints
        self.tick_s = tick_s
        self.cont_ids = tokenizer.encode(CONTINUATION, add_special_tokens=False)
        self.detok = Detokenizer(tokenizer)
        self.active: dict[str, FakeReq] = {}
        self.received: dict[str, TokenizedGenerateReq] = {}
        self.aborts: list[AbortReq] = []
        self.seen_prompts: set[tuple[int, ...]] = set()
        self.stopped = threading.Event()
        self.ready = threading.Event()
        self.stall_s = 0.0  # the next tick takes this long (a long scheduler step)

    def expected_ids(self, n: int) -> list[int]:
        return [self.cont_ids[i % len(self.cont_ids)] for i in range(n)]

    def run(self) -> None:
        ctx = zmq.Context()
        recv = ctx.socket(zmq.PULL)
        recv.bind(self.endpoints.scheduler)
        self.send = ctx.socket(zmq.PUSH)
        self.send.connect(self.endpoints.tokenizer)
        self.ready.set()
        while not self.stopped.is_set():
            while recv.poll(int(self.tick_s * 1000)):
                self.handle(decode(recv.recv()))
            self.tick()
        ctx.destroy(linger=0)

    def handle(self, msg: Any) -> None:
        if isinstance(msg, TokenizedGenerateReq):
            self.received[msg.rid] = msg
            key = tuple(msg.input_ids)
            cached = len(key) - 1 if key in self.seen_prompts else 0
            self.seen_prompts.add(key)
            params = SamplingParams.from_dict(msg.sampling_params)
            self.active[msg.rid] = FakeReq(msg, params, cached)
        elif isinstance(msg, AbortReq):
            self.aborts.append(msg)
            for rid, req in self.active.items():
                if msg.abort_all or rid.startswith(msg.rid):
                    req.finish = req.finish or {"type": "abort", "message": "aborted by request"}
        elif isinstance(msg, ControlMessage):
            self.send.send(encode(self.control(msg)))

    def control(self, msg: ControlMessage) -> ControlReply:
        info = {
            "max_total_tokens": MAX_TOTAL_TOKENS,
            "available": MAX_TOTAL_TOKENS,
            "evictable": 0,
            "protected": 0,
            "num_running": len(self.active),
            "num_waiting": 0,
        }
        if isinstance(msg, LoadReq):
            return ControlReply(msg.req_id, True, self.load_info())
        if isinstance(msg, GetWeightsByNameReq):  # a model of one 1x2 weight
            if msg.name != "model.norm.weight":
                return ControlReply(msg.req_id, False, {"message": "no weight named that"})
            return ControlReply(msg.req_id, True, {"parameter": [[0.5, -0.5]]})
        if isinstance(msg, FlushCacheReq) and self.active:
            return ControlReply(msg.req_id, False, {"message": "requests are running"})
        return ControlReply(msg.req_id, True, info)

    def load_info(self) -> dict:
        """The scheduler's ``"load"`` control reply, from the fake's own requests."""
        used = sum(len(r.msg.input_ids) + len(r.output_ids) for r in list(self.active.values()))
        return {
            "timestamp": time.time(),
            "num_running_reqs": len(self.active),
            "num_waiting_reqs": 0,
            "num_grammar_queue_reqs": 0,
            "num_retracted_reqs": 0,
            "num_used_tokens": used,
            "num_available_tokens": MAX_TOTAL_TOKENS - used,
            "num_evictable_tokens": 0,
            "num_pending_tokens": 0,
            "max_total_num_tokens": MAX_TOTAL_TOKENS,
            "max_running_requests": 256,
            "token_usage": used / MAX_TOTAL_TOKENS,
            "gen_throughput": 0.0,
            "cache_hit_rate": 0.0,
            "utilization": used / MAX_TOTAL_TOKENS,
        }

    def _advance(self, req: FakeReq) -> None:
        p = req.params
        if req.finish is not None:
            return
        if len(req.output_ids) >= p.max_new_tokens:
            req.finish = {"type": "length", "length": p.max_new_tokens}
            return
        tok = self.expected_ids(len(req.output_ids) + 1)[-1]
        req.output_ids.append(tok)
        text = self.tokenizer.decode(req.output_ids)
        if tok in (p.stop_token_ids or []):
            req.finish = {"type": "stop", "matched": tok}
        elif any(s in text for s in p.stop_strs):
            req.finish = {"type": "stop", "matched": next(s for s in p.stop_strs if s in text)}
        elif len(req.output_ids) >= p.max_new_tokens:
            req.finish = {"type": "length", "length": p.max_new_tokens}

    def tick(self) -> None:
        if self.stall_s:
            stall, self.stall_s = self.stall_s, 0.0
            time.sleep(stall)
        for req in self.active.values():
            self._advance(req)
        chosen = [
            r
            for r in self.active.values()
            if r.finish or (r.msg.stream and len(r.output_ids) > r.num_sent)
        ]
        if not chosen:
            return
        out = BatchTokenOut([], [], [], [], [], [], [], [], [], [], [], [], [])
        for r in chosen:
            self._append(out, r)
            if r.finish:
                del self.active[r.msg.rid]
        self.send.send(encode(self.detok.handle(out)))

    def _append(self, out: BatchTokenOut, r: FakeReq) -> None:
        new = r.output_ids[r.num_sent :]
        positions = range(r.num_sent, len(r.output_ids))
        want_lp, first = r.msg.return_logprob, r.num_sent == 0
        out.rids.append(r.msg.rid)
        out.new_token_ids.append(new)
        out.finish_reason.append(r.finish)
        out.prompt_tokens.append(len(r.msg.input_ids))
        out.completion_tokens.append(len(r.output_ids))
        out.cached_tokens.append(r.cached_tokens)
        out.no_stop_trim.append(r.params.no_stop_trim)
        out.skip_special_tokens.append(r.params.skip_special_tokens)
        out.output_token_logprobs.append(
            [[-0.1 * (i + 1), t] for i, t in zip(positions, new, strict=True)] if want_lp else None
        )
        out.output_top_logprobs.append(
            [[[-0.1 * (i + 1), t], [-5.0, 0]] for i, t in zip(positions, new, strict=True)]
            if want_lp and r.msg.top_logprobs_num
            else None
        )
        ids, start = r.msg.input_ids, r.msg.logprob_start_len
        in_lp = want_lp and first and start >= 0
        out.input_token_logprobs.append(
            [[None if i == 0 else -1.0, ids[i]] for i in range(start, len(ids))] if in_lp else None
        )
        out.input_top_logprobs.append(
            [[] if i == 0 else [[-1.0, ids[i]]] for i in range(start, len(ids))]
            if in_lp and r.msg.top_logprobs_num
            else None
        )
        tids = r.msg.token_ids_logprob if want_lp else None
        out.output_token_ids_logprobs.append(
            None if tids is None else fake_output_id_rows(r, tids, positions, new)
        )
        out.input_token_ids_logprobs.append(
            [[] if i == 0 else id_row(tids, ids[i], -1.0) for i in range(start, len(ids))]
            if in_lp and tids is not None
            else None
        )
        out.stop_strs.append(r.params.stop_strs)
        r.num_sent = len(r.output_ids)


def id_row(tids: list[int], chosen: int | None, chosen_lp: float) -> list[list[float]]:
    """The fake's token_ids_logprob row: the chosen token has ``chosen_lp``, any other id t has
    ``-5 - 0.01 t``."""
    return [[chosen_lp if t == chosen else fake_id_logprob(t), t] for t in tids]


def fake_id_logprob(t: int) -> float:
    return -5.0 - 0.01 * t


def fake_output_id_rows(r: FakeReq, tids: list[int], positions: range, new: list[int]) -> list:
    """One row per new token (its logprob is the one output_token_logprobs gives it); a
    prefill-only request gets one row, the next token's, as the real scheduler gives it."""
    if r.params.max_new_tokens == 0 and r.num_sent == 0:
        return [id_row(tids, None, 0.0)]
    return [id_row(tids, t, -0.1 * (i + 1)) for i, t in zip(positions, new, strict=True)]


class FakeStack:
    """uvicorn (in a thread) + app + TokenizerManager + FakeWorker on a private ipc folder."""

    def __init__(
        self, ipc_dir: Path, api_key: str | None = None, tick_s: float = 0.005, **cfg_options: Any
    ) -> None:
        self.tokenizer = make_tokenizer()
        self.endpoints = IpcEndpoints.in_dir(ipc_dir)
        self.worker = FakeWorker(self.tokenizer, self.endpoints, tick_s)
        self.worker.start()
        self.worker.ready.wait(5)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cfg = ServerConfig(
            model_path="/models/fake-model", api_key=api_key, port=self.port, **cfg_options
        )
        self.metrics = ServerMetrics("fake-model")
        self.tm = TokenizerManager(cfg, self.tokenizer, self.endpoints, observer=self.metrics)
        self.tm.info = {
            "model_path": "/models/fake-model",
            "context_length": CONTEXT_LENGTH,
            "vocab_size": len(self.tokenizer),
            "max_total_tokens": MAX_TOTAL_TOKENS,
        }
        self.app = create_app(self.tm, self.metrics)
        config = uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.worker.stopped.set()
        self.worker.join(5)
