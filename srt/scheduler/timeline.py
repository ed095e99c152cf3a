"""A per-step timeline of the scheduler, for finding where a saturated server loses time.

Off by default, and then free (three calls to a no-op per step). With
``RADIXLM_STEP_TIMELINE=<file>`` in the scheduler's environment, every step that ran a batch
appends one JSON line:

- ``t``: seconds since the timeline started, when the step began (``time.monotonic``);
- ``step_s``: the host time of ``Scheduler.step`` (with overlap scheduling on a GPU the device
  may still run the launched decode after it returns);
- ``idle_s``: host time since the previous step returned (the loop read messages, or had
  nothing to do: a device without a batch queued);
- ``decode_rows``: running requests that computed their next token in this step;
- ``decode_context``: the tokens those rows attend to (their KV in the cache plus the new ones),
  what a decode step reads besides the weights;
- ``prefill_tokens`` / ``prefill_reqs``: new prompt tokens computed and the requests they
  belong to (a chunk counts its tokens);
- ``waiting`` / ``running``: queue lengths after the step was scheduled;
- ``retractions`` / ``preemptions``: how many happened while scheduling this step.

``srt/bench/step_timeline.py`` summarises a file (share of mixed, prefill-only and decode-only
steps, idle share, mean decode batch); ``bench_serving --step-timeline`` sets the variable on
the server it starts and prints the summary of each rate.
"""

from __future__ import annotations

import os
import time
from typing import IO, TYPE_CHECKING

import orjson

if TYPE_CHECKING:
    from radixlm.srt.scheduler.batch import ScheduledBatch
    from radixlm.srt.scheduler.scheduler import Scheduler

ENV_VAR = "RADIXLM_STEP_TIMELINE"


class StepTimeline:
    """Records nothing; ``from_env`` gives a :class:`FileTimeline` when the variable is set."""

    @staticmethod
    def from_env() -> StepTimeline:
        path = os.environ.get(ENV_VAR)
        return FileTimeline(open(path, "ab")) if path else StepTimeline()  # noqa: SIM115

    def begin(self, sched: Scheduler) -> None:
        pass

    def batch(self, sched: Scheduler, batch: ScheduledBatch | None) -> None:
        pass

    def end(self, sched: Scheduler) -> None:
        pass


class FileTimeline(StepTimeline):
    def __init__(self, out: IO[bytes]) -> None:
        self.out = out
        self.origin = time.monotonic()
        self.last_end: float | None = None
        self.record: dict | None = None
        self.counts = (0, 0)

    def begin(self, sched: Scheduler) -> None:
        now = time.monotonic()
        idle = 0.0 if self.last_end is None else now - self.last_end
        self.record = {"t": round(now - self.origin, 6), "idle_s": round(idle, 6)}
        self.counts = (sched.num_retractions, sched.num_preemptions)

    def batch(self, sched: Scheduler, batch: ScheduledBatch | None) -> None:
        if self.record is None:
            return
        if batch is None:
            self.record = None  # a step without a batch (reports only) is not recorded
            return
        running = {id(r) for r in sched.running}
        decode_rows = decode_context = prefill_tokens = prefill_reqs = 0
        for req, start, ext in zip(batch.reqs, batch.starts, batch.extend_lens, strict=True):
            if id(req) in running:  # a running request's next token (and any forced ones)
                decode_rows += 1
                decode_context += start + ext
            else:
                prefill_tokens += ext
                prefill_reqs += 1
        self.record.update(
            decode_rows=decode_rows,
            decode_context=decode_context,
            prefill_tokens=prefill_tokens,
            prefill_reqs=prefill_reqs,
            waiting=len(sched.waiting),
            running=len(sched.running),
        )

    def end(self, sched: Scheduler) -> None:
        now = time.monotonic()
        if self.record is not None:
            self.record["step_s"] = round(now - self.origin - self.record["t"], 6)
            self.record["retractions"] = sched.num_retractions - self.counts[0]
            self.record["preemptions"] = sched.num_preemptions - self.counts[1]
            self.out.write(orjson.dumps(self.record) + b"\n")
            self.out.flush()
        self.record = None
        self.last_end = now
