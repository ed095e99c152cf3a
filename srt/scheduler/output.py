"""Turns what requests did in a step into a BatchTokenOut; records input logprobs.

Which requests get an entry in a step: every request that finished, and a streaming request
with unsent tokens when its first token is unsent or at least ``stream_interval`` tokens are
(the request's ``stream_interval``, else the server's ``--stream-interval``), unless its output
ends in text that may still grow into a stop-regex match (``StopChecker.holds_stream``): those
tokens wait, so that a matched stop is trimmed before any of it is streamed.
"""

from __future__ import annotations

import torch

from radixlm.srt.messages import BatchTokenOut
from radixlm.srt.sampling.logprobs import (
    token_ids_logprob_rows,
    token_logprobs,
    top_logprob_rows,
)
from radixlm.srt.scheduler.batch import ScheduledBatch
from radixlm.srt.scheduler.req import Req
from radixlm.srt.scheduler.stop import StopChecker


def record_input_logprobs(
    batch: ScheduledBatch, logits: torch.Tensor, per_req: list[list[int]]
) -> None:
    """Stores the logprob of each prompt token (from the position before it) for requests that
    asked for input logprobs; completes them once the whole prompt has been seen."""
    for i, req in enumerate(batch.reqs):
        if not req.wants_input_logprobs:
            continue
        rows = per_req[i][:-1] if batch.completes_fill(i) else per_req[i]
        if rows:
            start = max(req.logprob_start_len - 1, 0)
            first_pos = max(start, batch.starts[i])
            # a request sent back to the queue between two chunks (retracted) computes some
            # positions again: their rows replace the ones held, never add to them
            for held in (
                req.partial_input_logprobs,
                req.partial_input_top,
                req.partial_input_token_ids,
            ):
                del held[first_pos - start :]
            targets = req.prompt_ids[first_pos + 1 : first_pos + 1 + len(rows)]
            contiguous = rows[-1] - rows[0] == len(rows) - 1
            sub = logits[rows[0] : rows[-1] + 1] if contiguous else logits[rows]  # a view if it can
            ids = torch.tensor(targets, dtype=torch.int64, device=logits.device)
            vals = token_logprobs(sub, ids).tolist()
            req.partial_input_logprobs += [[v, t] for v, t in zip(vals, targets, strict=True)]
            if req.top_logprobs_num > 0:
                req.partial_input_top += top_logprob_rows(sub, req.top_logprobs_num)
            if req.token_ids_logprob:
                req.partial_input_token_ids += token_ids_logprob_rows(sub, req.token_ids_logprob)
        if batch.completes_fill(i):
            head = [[None, req.prompt_ids[0]]] if req.logprob_start_len == 0 else []
            req.input_token_logprobs = head + req.partial_input_logprobs
            req.input_top_logprobs = ([[]] if head else []) + req.partial_input_top
            req.input_token_ids_logprobs = ([[]] if head else []) + req.partial_input_token_ids


def record_prefill_only_logprobs(req: Req, last_row: torch.Tensor) -> None:
    """A request with ``max_new_tokens`` 0 samples nothing; as in SGLang, its top and
    token-ids logprobs still get one output row: the next token's distribution after the
    prompt (``last_row``: ``[V]``, the logits of the prompt's last position). ``/v1/score``
    reads it."""
    if not req.return_logprob:
        return
    logits = last_row.unsqueeze(0)
    if req.top_logprobs_num > 0:
        req.output_top_logprobs += top_logprob_rows(logits, req.top_logprobs_num)
    if req.token_ids_logprob:
        req.output_token_ids_logprobs += token_ids_logprob_rows(logits, req.token_ids_logprob)


def is_stream_due(req: Req, stream_interval: int = 1) -> bool:
    """Whether a running streaming request has tokens to send this step: its first one, or at
    least ``req.params.stream_interval`` (else ``stream_interval``) unsent ones."""
    unsent = len(req.output_ids) - req.num_sent_tokens
    if not req.stream or unsent <= 0:
        return False
    interval = req.params.stream_interval or stream_interval
    return req.num_sent_tokens == 0 or unsent >= interval


def build_batch_output(
    reqs: list[Req], stream_interval: int = 1, stop: StopChecker | None = None
) -> BatchTokenOut | None:
    """One entry per request that has something to report: its finish, or streamed tokens
    (:func:`is_stream_due`, ``stream_interval`` being the server's default) that ``stop``
    does not hold back."""
    chosen = [
        r
        for r in reqs
        if r.is_finished
        or (is_stream_due(r, stream_interval) and (stop is None or not stop.holds_stream(r)))
    ]
    if not chosen:
        return None
    with_ids = any(r.token_ids_logprob for r in chosen)  # else their lists stay empty
    out = BatchTokenOut(
        rids=[],
        new_token_ids=[],
        finish_reason=[],
        prompt_tokens=[],
        completion_tokens=[],
        cached_tokens=[],
        no_stop_trim=[],
        skip_special_tokens=[],
        output_token_logprobs=[],
        output_top_logprobs=[],
        input_token_logprobs=[],
        input_top_logprobs=[],
    )
    for r in chosen:
        sent = r.num_sent_tokens
        out.rids.append(r.rid)
        out.new_token_ids.append(r.output_ids[sent:])
        out.finish_reason.append(r.finish_reason)
        out.prompt_tokens.append(len(r.prompt_ids))
        out.completion_tokens.append(len(r.output_ids))
        out.cached_tokens.append(r.cached_tokens)
        out.no_stop_trim.append(r.params.no_stop_trim)
        out.skip_special_tokens.append(r.params.skip_special_tokens)
        out.output_token_logprobs.append(
            r.output_token_logprobs[sent:] if r.return_logprob else None
        )
        out.output_top_logprobs.append(r.output_top_logprobs[sent:] if r.top_logprobs_num else None)
        first_input = (
            r.return_logprob and not r.sent_input_logprobs and r.input_token_logprobs is not None
        )
        out.input_token_logprobs.append(r.input_token_logprobs if first_input else None)
        out.input_top_logprobs.append(
            r.input_top_logprobs if first_input and r.top_logprobs_num else None
        )
        if with_ids:
            out.output_token_ids_logprobs.append(
                r.output_token_ids_logprobs[sent:] if r.token_ids_logprob else None
            )
            out.input_token_ids_logprobs.append(
                r.input_token_ids_logprobs if first_input and r.token_ids_logprob else None
            )
        if first_input:
            r.sent_input_logprobs = True
        out.stop_strs.append(r.params.stop_strs)
        r.num_sent_tokens = len(r.output_ids)
    return out
