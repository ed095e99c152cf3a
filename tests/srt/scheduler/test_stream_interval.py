"""stream_interval: a streaming request gets an update every stream_interval output tokens (its
own value, else the server's), always its first token and its finish; the detokenizer still
produces the exact text from the larger chunks."""

from __future__ import annotations

import math

import pytest

from radixlm.srt.managers.detokenizer import Detokenizer
from radixlm.srt.sampling.params import SamplingParams
from radixlm.srt.scheduler.output import build_batch_output, is_stream_due
from radixlm.srt.scheduler.req import Req
from radixlm.srt.scheduler.stop import StopChecker

TEXT = "Streaming 🎉 text with 世界 and ünïcödé, split into chunks of several tokens each."


@pytest.fixture(scope="module")
def tok(default_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir)


def run(tok, sp: dict, server_interval: int, *, stream: bool = True, per_step: int = 1):
    """Decodes TEXT's tokens ``per_step`` at a time; returns the entries' token counts and
    the streamed deltas."""
    ids = tok.encode(TEXT, add_special_tokens=False)
    params = SamplingParams.from_dict({"max_new_tokens": len(ids), **sp})
    params.validate()
    req = Req("r", [1], params, stream=stream)
    stop, detok = StopChecker(tok, {2}, 10**6), Detokenizer(tok)
    sizes, deltas = [], []
    for start in range(0, len(ids), per_step):
        for token in ids[start : start + per_step]:
            req.output_ids.append(token)
            stop.check(req)
        out = build_batch_output([req], server_interval, stop)
        if out is not None:
            sizes.append(len(out.new_token_ids[0]))
            deltas.append(detok.handle(out).text_delta[0])
    assert req.is_finished and detok.num_active == 0
    return sizes, deltas, len(ids)


@pytest.mark.parametrize("interval", [1, 2, 3, 7, 1000])
def test_request_interval_sets_the_number_of_chunks(tok, interval) -> None:
    sizes, deltas, n = run(tok, {"stream_interval": interval}, server_interval=1)
    assert len(sizes) == 1 + math.ceil((n - 1) / interval)
    assert sizes[0] == 1 and sum(sizes) == n
    assert all(s == interval for s in sizes[1:-1])
    assert "".join(deltas) == TEXT


def test_server_interval_is_the_default(tok) -> None:
    sizes, deltas, n = run(tok, {}, server_interval=4)
    assert len(sizes) == 1 + math.ceil((n - 1) / 4) and "".join(deltas) == TEXT
    sizes, _, _ = run(tok, {"stream_interval": 1}, server_interval=4)  # the request's wins
    assert sizes == [1] * n


def test_not_streaming_reports_once(tok) -> None:
    sizes, deltas, n = run(tok, {"stream_interval": 2}, server_interval=1, stream=False)
    assert sizes == [n] and deltas == [TEXT]


def test_several_tokens_per_step(tok) -> None:
    """Steps that add several tokens (jump-forward) count tokens, not steps."""
    sizes, deltas, n = run(tok, {"stream_interval": 5}, server_interval=1, per_step=3)
    assert sizes[:3] == [3, 6, 6] and sum(sizes) == n and "".join(deltas) == TEXT


def test_is_stream_due() -> None:
    req = Req("r", [1], SamplingParams(stream_interval=3), stream=True)
    assert not is_stream_due(req)  # nothing to send
    req.output_ids = [5]
    assert is_stream_due(req)  # the first token
    req.num_sent_tokens = 1
    req.output_ids = [5, 6, 7]
    assert not is_stream_due(req) and not is_stream_due(req, 1)
    req.output_ids.append(8)
    assert is_stream_due(req)
    assert not is_stream_due(Req("q", [1], SamplingParams(), output_ids=[1]))  # not streaming
