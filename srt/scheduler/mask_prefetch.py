"""Grammar mask rows filled ahead of time, on a worker thread, while the forward pass runs.

After a constrained request has taken its sampled token (and any jump-forward), its matcher
does not change until the next step samples from it. ``MaskPrefetcher.submit`` hands the matcher
to a worker thread, which fills the request's next mask row into a private buffer; the next
step's ``take`` waits for that row (usually long done) and returns it. llguidance computes masks
with the GIL released and the forward pass spends its time in torch kernels, so the two overlap.

A row is only used if the request's output is what it was at submission (the matcher has
accepted exactly the output ids); otherwise ``take`` returns None and the caller fills the row
itself. Between ``submit`` and ``take`` the scheduler must not touch the matcher.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field

import torch

from radixlm.grammar import GrammarMatcher
from radixlm.grammar.bitmask import BitmaskBuffer
from radixlm.srt.scheduler.req import Req

logger = logging.getLogger(__name__)


def _output_key(req: Req) -> tuple[int, int | None]:
    return len(req.output_ids), req.output_ids[-1] if req.output_ids else None


@dataclass
class _MaskJob:
    matcher: GrammarMatcher | None  # dropped once the row is filled
    output_key: tuple[int, int | None]  # the request's output when the job was made
    packed: memoryview | None = None  # the filled row's bytes (the worker allocates them)
    done: threading.Event = field(default_factory=threading.Event)
    compute_s: float = 0.0
    failed: bool = False


class MaskPrefetcher:
    def __init__(self, bitmask_words: int) -> None:
        self.bitmask_words = bitmask_words
        self._jobs: dict[Req, _MaskJob] = {}
        self._queue: queue.SimpleQueue[_MaskJob | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def submit(self, req: Req) -> None:
        """Starts filling ``req``'s next mask row (its matcher must be settled for the step)."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._work, args=(self._queue,), name="grammar-mask", daemon=True
            )
            self._thread.start()
        job = _MaskJob(req.grammar, _output_key(req))
        self._jobs[req] = job
        self._queue.put(job)

    def take(self, req: Req) -> tuple[memoryview, float] | None:
        """The row prefetched for ``req``'s current output (packed bytes, for
        ``BitmaskBuffer.write``) and the seconds the worker spent filling it, or None."""
        job = self._jobs.pop(req, None)
        if job is None:
            return None
        job.done.wait()
        if job.failed or job.output_key != _output_key(req):
            return None
        return job.packed, job.compute_s

    def forget_finished(self) -> None:
        """Drops the jobs of finished requests (aborted ones never come to ``take``)."""
        for req in [r for r in self._jobs if r.is_finished]:
            del self._jobs[req]

    def shutdown(self) -> None:
        """Stops the worker after the rows queued so far; a later ``submit`` starts another."""
        if self._thread is not None:
            self._queue.put(None)
            self._queue = queue.SimpleQueue()
            self._thread = None
        self._jobs.clear()

    def _work(self, jobs: queue.SimpleQueue) -> None:
        while (job := jobs.get()) is not None:
            start = time.perf_counter()
            try:
                buffer = BitmaskBuffer(torch.empty((1, self.bitmask_words), dtype=torch.int32))
                job.matcher.fill_row(buffer, 0)
                job.packed = buffer.data
            except Exception:  # the scheduler fills the row itself and meets the error there
                logger.exception("prefetching a grammar mask row failed")
                job.failed = True
            job.compute_s = time.perf_counter() - start
            job.matcher = None
            job.done.set()
