"""What happens when something fails: the scheduler never dies, and never drops a request.

Per-request failures are handled where they happen (the request ends with an abort carrying a
``status_code`` and a message, its KV and request row are released, the others run on):
a grammar matcher that raises (400, ``GrammarManager.fail_request``), a sampling row that
raises (500, ``SamplingStep``), a token id outside the embedding or a forward that fails for
one request (500, ``Scheduler._run``). What still escapes ``Scheduler.step`` cannot be
attributed to one request: ``run_step`` then ends every request the step may have touched
(``fail_held_requests``), reports them all in the returned output, and releases their KV.

``run_step`` and ``handle_message`` are the one place where the scheduler process's ZMQ loop and
the in-process ``Engine`` step the scheduler and hand it messages.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from radixlm.srt.messages import (
    AbortReq,
    BatchTokenOut,
    ControlMessage,
    ControlReply,
    TokenizedGenerateReq,
)
from radixlm.srt.scheduler.batch import ScheduledBatch
from radixlm.srt.scheduler.output import build_batch_output
from radixlm.srt.scheduler.req import PENDING_TOKEN, Req, ReqStatus

if TYPE_CHECKING:
    from radixlm.srt.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)


def check_fits(req: Req, context_length: int, max_total_tokens: int) -> None:
    """ValueError (a 400) for a prompt that can never run here. The rest of a request was
    checked by the front door (srt/managers/front_door.py); the KV pool's size is the
    scheduler's to know."""
    n = len(req.prompt_ids)
    limit = min(context_length, max_total_tokens)
    if n >= limit:
        raise ValueError(
            f"the prompt has {n} tokens, but this server holds at most {limit - 1} prompt "
            f"tokens (context length {context_length}, KV pool {max_total_tokens} tokens); "
            "shorten the prompt"
        )


def internal_error(error: BaseException) -> dict[str, Any]:
    """The finish reason of a request ended by a server-side failure (HTTP 500)."""
    return {"type": "abort", "status_code": 500, "message": f"internal error: {error}"}


def run_step(scheduler: Scheduler) -> BatchTokenOut | None:
    """One scheduler step that never raises: the step's output, or after a failure the output
    that ends the requests it held (each with a 500)."""
    try:
        return scheduler.step()
    except Exception as e:
        logger.exception("scheduler step failed; ending the requests it held")
        try:
            return fail_held_requests(scheduler, e)
        except Exception:  # the state is beyond repair: end everything, as a last resort
            logger.exception("releasing the requests of the failed step failed")
            scheduler.abort("", abort_all=True)
            return None


def fail_held_requests(scheduler: Scheduler, error: BaseException) -> BatchTokenOut | None:
    """Ends every request that holds KV, runs, or finished without being reported (a step
    that raised may have left any of them half updated) and returns their output. Requests
    still queued without KV (waiting, compiling a grammar) are untouched and run later."""
    scheduler.inflight = None  # its tokens are lost with the requests that sampled them
    held = [
        r
        for r in scheduler.live
        if r.is_finished
        or r.status is not ReqStatus.WAITING
        or r.req_slot >= 0
        or r.cache_node is not None
    ]
    reason = internal_error(error)
    for req in held:
        while req.output_ids and req.output_ids[-1] == PENDING_TOKEN:
            req.output_ids.pop()
        req.finish(reason)  # keeps the reason of one that finished already
        _forget(scheduler, req)
        scheduler.kv.release(req, keep_in_cache=False)  # its last KV may be half written
    reported = list(dict.fromkeys(held + scheduler.finished_outside_step))
    scheduler.finished_outside_step = []
    scheduler.live.difference_update(reported)
    return build_batch_output(reported)


def _forget(scheduler: Scheduler, req: Req) -> None:
    scheduler.spec.release(req)  # the drafter's state for it
    if req in scheduler.running:
        scheduler.running.remove(req)
    if req in scheduler.waiting:
        scheduler.waiting.remove(req)
    if scheduler.chunked is req:
        scheduler.chunked = None


def handle_message(scheduler: Scheduler, msg: Any) -> ControlReply | BatchTokenOut | None:
    """``Scheduler.handle`` that never raises: a message it fails on gets an error reply (a
    control message) or ends its request with a 500 (a new request)."""
    try:
        return scheduler.handle(msg)
    except Exception as e:  # one bad message must not take the scheduler down
        logger.exception("scheduler failed on %s", type(msg).__name__)
        return _failure_reply(msg, e)


def _failure_reply(msg: Any, e: Exception) -> ControlReply | BatchTokenOut | None:
    if isinstance(msg, ControlMessage):
        return ControlReply(msg.req_id, False, {"message": f"internal error: {e}"})
    if isinstance(msg, TokenizedGenerateReq):  # (Scheduler.add_request reports its own)
        return abort_output(msg.rid, len(msg.input_ids), f"internal error: {e}")
    if not isinstance(msg, AbortReq):
        logger.error("unexpected message %s", type(msg).__name__)
    return None


def abort_output(rid: str, prompt_tokens: int, message: str) -> BatchTokenOut:
    """A BatchTokenOut that finishes one request with an error before it produced anything."""
    return BatchTokenOut(
        rids=[rid],
        new_token_ids=[[]],
        finish_reason=[{"type": "abort", "message": message, "status_code": 500}],
        prompt_tokens=[prompt_tokens],
        completion_tokens=[0],
        cached_tokens=[0],
        no_stop_trim=[False],
        skip_special_tokens=[True],
        output_token_logprobs=[None],
        output_top_logprobs=[None],
        input_token_logprobs=[None],
        input_top_logprobs=[None],
    )


def reject_unembeddable(batch: ScheduledBatch, vocab_size: int) -> list[Req]:
    """Takes out of the batch (and finishes with a 500) every request whose new tokens include
    an id outside the model's embedding: the forward would fail for all of them. The caller
    releases them."""
    ids = batch.input_ids()
    if not ids or (min(ids) >= 0 and max(ids) < vocab_size):
        return []
    bad = [
        i
        for i in range(len(batch.reqs))
        if any(not 0 <= t < vocab_size for t in batch.new_tokens(i))
    ]
    rejected = batch.remove(bad)
    for req in rejected:
        logger.error("request %s holds a token id outside [0, %d)", req.rid, vocab_size)
        req.finish(
            {
                "type": "abort",
                "status_code": 500,
                "message": f"internal error: a token id outside [0, {vocab_size}) was "
                "about to be computed",
            }
        )
    return rejected
