"""Prefill admission: which waiting requests join the next step and how many of their tokens
each computes, and how a prefill step carries the running requests' decode tokens.

Budget. A prefill step computes at most ``max_prefill_tokens`` new tokens; with chunked prefill
(``chunked_prefill_size > 0``) at most one chunk, and only the last request of a batch may be
cut short: it becomes the scheduler's ``chunked`` request and continues first in the next step.
Without chunking a prompt over the budget runs alone.

Mixed steps (``PrefillAdmission.mixes``: chunking on, ``--disable-mixed-chunk`` off, no
speculative decoding). A step that prefills also computes the next token of every running
request: one EXTEND batch, prefill pieces first, then the running requests (``mixed_batch``).
So a running request gets a token in every step, however long the prompts being prefilled are;
without mixing, every chunk of a long prompt runs before decoding resumes. The scheduler builds
the decode part first (room for the running requests' next tokens is made before a new request
takes a slot, retracting as a decode step would); the decode tokens count against the chunk
budget, down to half of it, so a large running batch never stops admission altogether.

Decode kept going while prompts prefill (``step_budget``). A mixed step lasts as long as its
prefill piece, and every running request waits that long for its next token. Two optional
caps bound the piece of a step that decodes: ``--mixed-chunk-size`` (tokens) and
``--mixed-step-target-ms`` (the step lasts about that long: the piece is the prompt tokens per
second of step time measured over recent prefill steps, ``PrefillRate``, times the target; the
decode rows' time is in that rate, so a step converges to the target; at least
``min_mixed_chunk`` tokens, so prompts always progress). A step with nothing to decode keeps the
full chunk: nothing waits on it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from radixlm.srt.config import ServerConfig
from radixlm.srt.executor.forward_batch import ForwardMode
from radixlm.srt.scheduler.batch import ScheduledBatch
from radixlm.srt.scheduler.policy import shares_uncached_prefix
from radixlm.srt.scheduler.req import Req, ReqStatus

if TYPE_CHECKING:
    from collections.abc import Sequence

    from radixlm.srt.scheduler.kv_manager import KVManager
    from radixlm.srt.scheduler.reports import LoadStats


CLIP_NEW_TOKENS = 4096  # a request's future output counted at most (max_new_tokens may be huge)
RESERVE_RATIO_INIT = 0.7  # times --schedule-conservativeness
RESERVE_RATIO_FLOOR = 0.14  # of the initial ratio
RESERVE_DECAY_STEPS = 600
MIN_MIXED_CHUNK = 64  # a mixed step's piece under --mixed-step-target-ms: never fewer tokens,
MIN_MIXED_CHUNK_SHARE = 16  # nor fewer than 1/16 of the chunk (decode rows slower than the target)
RATE_SMOOTHING = 0.2  # weight of the newest step in a measured prefill rate
MIN_RATE_TOKENS = 16  # steps with fewer new tokens say little about the prefill rate


def min_mixed_chunk(chunk_size: int) -> int:
    return max(MIN_MIXED_CHUNK, chunk_size // MIN_MIXED_CHUNK_SHARE)


class PrefillRate:
    """New prompt tokens per second of step time over recent prefill steps, mixed ones included
    (an exponential average; None until a step of at least ``MIN_RATE_TOKENS`` tokens). One
    meter serves the TTFT target (queue_gate.py) and the mixed-step target."""

    def __init__(self) -> None:
        self.tokens_per_s: float | None = None

    def observe(self, num_tokens: int, seconds: float) -> None:
        if num_tokens < MIN_RATE_TOKENS or seconds <= 0:
            return
        rate = num_tokens / seconds
        old = self.tokens_per_s
        self.tokens_per_s = rate if old is None else old + RATE_SMOOTHING * (rate - old)


def step_budget(
    chunk_size: int,
    max_prefill_tokens: int,
    num_decode_tokens: int = 0,
    mixed_chunk_size: int | None = None,
    mixed_step_target_s: float | None = None,
    prefill_tokens_per_s: float | None = None,
) -> int:
    """New prompt tokens a prefill step may compute (module docstring). ``chunk_size`` <= 0:
    chunking off, the budget is ``max_prefill_tokens``. A step with ``num_decode_tokens``
    decode tokens gives them room in the chunk (down to half of it) and takes the caps of mixed
    steps; the time target applies once a prefill rate is known, down to
    ``min_mixed_chunk(chunk_size)``."""
    if chunk_size <= 0:
        return max_prefill_tokens
    budget = min(max_prefill_tokens, max(chunk_size - num_decode_tokens, (chunk_size + 1) // 2))
    if num_decode_tokens <= 0:
        return budget
    if mixed_chunk_size is not None:
        budget = min(budget, mixed_chunk_size)
    if mixed_step_target_s is not None and prefill_tokens_per_s:
        fits = int(prefill_tokens_per_s * mixed_step_target_s)
        budget = min(budget, max(min_mixed_chunk(chunk_size), fits))
    return budget


def future_tokens(req: Req) -> int:
    """Output tokens the request may still produce, clipped to ``CLIP_NEW_TOKENS``."""
    return max(0, min(req.params.max_new_tokens - len(req.output_ids), CLIP_NEW_TOKENS))


class AdmissionPolicy(Protocol):
    def order(self, waiting: Sequence[Req], cache) -> list[Req]: ...


class PrefillAdmission:
    """Builds prefill batches from the waiting queue under the step's token budget.

    ``cfg`` is the resolved config (``chunked_prefill_size`` is never None). The admission
    owns no request state: the scheduler passes its waiting queue (admitted requests leave it),
    its chunked request and its admission policy."""

    def __init__(
        self,
        cfg: ServerConfig,
        kv: KVManager,
        stats: LoadStats,
        prefill_rate: PrefillRate | None = None,
    ) -> None:
        assert cfg.chunked_prefill_size is not None, "needs the resolved config"
        self.kv = kv
        self.stats = stats
        self.chunk_size = cfg.chunked_prefill_size  # > 0: chunking on; -1: off
        self.max_prefill_tokens = cfg.max_prefill_tokens
        self.max_running_requests = cfg.max_running_requests
        # a prefill step also carries the running requests' decode tokens (see above)
        self.mixes = (
            self.chunk_size > 0
            and not cfg.disable_mixed_chunk
            and cfg.speculative_algorithm == "none"
        )
        self.mixed_chunk_size = cfg.mixed_chunk_size
        target = cfg.mixed_step_target_ms
        self.mixed_step_target_s = None if target is None else target / 1000
        self.prefill_rate = prefill_rate or PrefillRate()  # fed by the scheduler
        self.ratio_init = min(1.0, RESERVE_RATIO_INIT * cfg.schedule_conservativeness)
        self.ratio_floor = self.ratio_init * RESERVE_RATIO_FLOOR
        self.reserve_ratio = self.ratio_init

    def on_decode_step(self) -> None:
        """A step decoded the running requests: the reserve shrinks a little."""
        step = (self.ratio_init - self.ratio_floor) / RESERVE_DECAY_STEPS
        self.reserve_ratio = max(self.ratio_floor, self.reserve_ratio - step)

    def on_retract(self) -> None:
        """Decode ran out of slots: admit more carefully from now on."""
        if self.ratio_init > 0:
            self.reserve_ratio = min(1.0, max(self.ratio_init, 1.5 * self.reserve_ratio))

    def reserve(self, running: Sequence[Req]) -> float:
        """Slots kept free for the future output of ``running``."""
        return self.reserve_ratio * sum(future_tokens(r) for r in running)

    def need(self, req: Req) -> float:
        """Slots a request still wants: the rest of its prompt (beyond the slots it holds) and
        its share of reserve for the output."""
        return req.fill_len - req.num_kv_tokens + self.reserve_ratio * future_tokens(req)

    def blocked(self, waiting: Sequence[Req], running: Sequence[Req]) -> bool:
        """Whether no waiting request could be admitted now, judged without matching prefixes:
        true only when certain (every prompt fully cached would still not fit)."""
        if len(running) >= self.max_running_requests or not self.kv.free_req_slots():
            return True
        least = min(1 + self.reserve_ratio * future_tokens(r) for r in waiting)
        return self.kv.room() - self.reserve(running) < least

    @property
    def is_chunking(self) -> bool:
        return self.chunk_size > 0

    def budget(self, num_decode_tokens: int = 0) -> int:
        """New prefill tokens the step may compute next to ``num_decode_tokens`` decode tokens."""
        return step_budget(
            self.chunk_size,
            self.max_prefill_tokens,
            num_decode_tokens,
            self.mixed_chunk_size,
            self.mixed_step_target_s,
            self.prefill_rate.tokens_per_s,
        )

    def schedule(
        self,
        waiting: deque[Req],
        chunked: Req | None,
        running: Sequence[Req],
        policy: AdmissionPolicy,
        budget: int | None = None,
        rank: Callable[[Req], int] | None = None,
    ) -> ScheduledBatch | None:
        """A prefill batch: ``chunked``'s next piece first, then waiting requests in policy
        order while the budget, the pool (less the reserve for ``running`` and for the batch's
        own requests) and ``max_running_requests`` (counting ``running``) allow; ``budget``:
        new tokens of the step (default: ``self.budget()``, nothing decoding). Admitted
        requests leave ``waiting``. None when nothing fits; in particular, when ``chunked`` is
        given, a batch always starts with its piece (the scheduler then clears its
        ``chunked``).

        ``rank`` (priority scheduling's, smaller first; the policy's order is by rank): the
        batch holds prompts of its first request's rank only, so a high-priority prompt's step
        is not filled up with lower-priority prompts, which would make it as long as a full
        chunk (a request's time to first token is the whole step that prefills it)."""
        batch = ScheduledBatch(ForwardMode.EXTEND)
        budget = self.budget() if budget is None else budget
        promised = self.reserve(running)
        cut = None  # the batch's rank
        if chunked is not None:
            used = self._add_piece(batch, chunked, budget)
            if used == 0:
                return None
            budget -= used
            promised += self.need(chunked)
            cut = None if rank is None else rank(chunked)
        for req in policy.order(waiting, self.kv.cache, running):
            if budget <= 0 or not batch.all_complete():
                break
            if len(running) + len(batch.reqs) >= self.max_running_requests:
                break
            req_rank = None if rank is None else rank(req)
            if cut is not None and req_rank > cut:
                break
            used = self._admit(batch, req, budget, promised, alone=not running and not batch.reqs)
            if used < 0:
                break
            if used == 0:
                continue
            waiting.remove(req)
            budget -= used
            promised += self.need(req)
            cut = req_rank if cut is None else cut
        return batch if batch.reqs else None

    def _admit(
        self, batch: ScheduledBatch, req: Req, budget: int, promised: float, alone: bool
    ) -> int:
        """Matches and locks the request's cached prefix and adds its first piece: the piece's
        token count, 0 to skip the request this step, -1 to stop admitting. Unless ``alone``
        (nothing else would run), the request must fit beside the ``promised`` slots."""
        if not self.kv.prefetch_ready(req):
            return 0  # its disk reads still run (wait_complete): later requests go first
        self.kv.bind_req_slot(req, self.kv.match_and_lock(req))
        if req.req_slot < 0:
            self.kv.release(req)
            return -1
        if shares_uncached_prefix(req, batch):
            self.kv.release(req)  # defer: next step it finds that prefix in the cache
            return 0
        if not alone and self.need(req) > self.kv.room() - promised:
            self.kv.release(req)  # would take slots the running requests will need
            return -1
        first_time = not req.admitted  # not a retracted request (or chunked prompt) coming back
        if first_time:
            req.cached_tokens = req.num_cached_prefix
        used = self._add_piece(batch, req, budget)
        if used == 0:
            self.kv.release(req)
            return -1
        self.kv.drop_prefetch(req)
        if first_time:
            req.admitted = True
            self.stats.on_admit(req.cached_tokens, len(req.prompt_ids))
        return used

    def _add_piece(self, batch: ScheduledBatch, req: Req, budget: int) -> int:
        """Adds the request's next prefill piece to the batch; returns its token count (0 when
        it does not fit now). Without chunking a prompt over budget runs alone."""
        start = req.num_kv_tokens
        remaining = req.fill_len - start
        ext = min(remaining, budget) if self.is_chunking else remaining
        if not self.is_chunking and ext > budget and batch.reqs:
            return 0
        slots = self.kv.alloc_tokens(req, ext)
        if slots is None:
            return 0
        req.status = ReqStatus.RUNNING
        batch.add(req, start, ext, slots)
        return ext


def mixed_batch(prefill: ScheduledBatch, decode: ScheduledBatch) -> ScheduledBatch:
    """One EXTEND batch of the prefill pieces, then the running requests' decode pieces (their
    slots are already allocated); every decode piece completes its request's fill and samples."""
    out = ScheduledBatch(ForwardMode.EXTEND)
    for part in (prefill, decode):
        for req, start, ext, slots, draft in zip(
            part.reqs, part.starts, part.extend_lens, part.slots, part.drafts, strict=True
        ):
            out.add(req, start, ext, slots, draft)
    return out
