"""The Engine's in-process inbox and step driving (the Engine is the request front of
request_front.py plus this).

There is no background thread: a caller waiting for an item (a request's update, a control
reply) runs the scheduler's steps itself, one caller at a time; the others wait for what it
produces, and take over when it is done. Running the model on the thread that waits, usually
the main thread, matters on a CPU: once a process's main thread has used torch's OpenMP pool,
parallel ops issued from a second thread ran 2-4x slower here (softmax, SDPA, large adds),
which made a decode step 25% slower.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from typing import Any

from radixlm.srt.managers.detokenizer import Detokenizer
from radixlm.srt.managers.engine_ranks import InProcessRanks
from radixlm.srt.managers.engine_streams import FINISHED
from radixlm.srt.managers.request_front import RequestFront, is_busy
from radixlm.srt.messages import BatchStrOut, BatchTokenOut, ControlMessage, ControlReply
from radixlm.srt.scheduler.failures import handle_message, run_step

__all__ = ["StepDriver"]

POLL_S = 0.002  # how often a caller that is not stepping looks at its queue


class StepDriver:
    """Delivers the messages of ``inbox`` (what ``front`` sends) to the in-process scheduler
    and runs its steps for the caller that waits; each request's updates go to its queue
    (``ReqState.waiter``): a snapshot per update, then ``FINISHED``."""

    def __init__(
        self, scheduler: Any, ranks: InProcessRanks, front: RequestFront, inbox: queue.Queue
    ) -> None:
        self.scheduler, self.ranks, self.front, self.inbox = scheduler, ranks, front, inbox
        self.detokenizer = Detokenizer(scheduler.runner.tokenizer)
        self._driving = threading.Lock()  # held by the caller that runs scheduler steps

    def next(self, q: queue.Queue, timeout: float | None = None) -> Any:
        """The next item of ``q``; runs scheduler steps meanwhile unless another caller does."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                return q.get_nowait()
            except queue.Empty:
                pass
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError("the engine did not answer in time")
            if not self.try_step():
                try:
                    return q.get(timeout=POLL_S)
                except queue.Empty:
                    pass

    async def anext(self, q: queue.Queue) -> Any:
        """:meth:`next` for coroutines: one scheduler step (or a short sleep while another
        caller steps) between looks at ``q``, yielding to the event loop each time."""
        while True:
            try:
                return q.get_nowait()
            except queue.Empty:
                pass
            await asyncio.sleep(0 if self.try_step() else POLL_S)

    def ask(self, msg: ControlMessage, timeout: float = 60) -> ControlReply:
        """The scheduler's reply to one control message (its ``req_id`` is set here)."""
        q: queue.Queue = queue.Queue()
        req_id = self.front.send_control(msg, q)
        try:
            return self.next(q, timeout=timeout)
        finally:
            self.front.forget(req_id)

    def ask_when_idle(self, msg: ControlMessage) -> ControlReply:
        """A weight update's reply, ``msg`` sent again while the scheduler answers ``busy``
        (requests in flight), running their steps meanwhile."""
        while True:
            reply = self.ask(msg)
            if not is_busy(reply):
                return reply
            if not self.try_step():  # another caller runs the steps of those requests
                time.sleep(POLL_S)

    def try_step(self) -> bool:
        """Runs one scheduler step unless another caller is running them (then False)."""
        if not self._driving.acquire(blocking=False):
            return False
        try:
            self.run_once()
        finally:
            self._driving.release()
        return True

    def deliver_now(self) -> None:
        """Hands the queued messages to the scheduler now, unless a caller is stepping."""
        if self._driving.acquire(blocking=False):
            try:
                self.drain_inbox()
            finally:
                self._driving.release()

    def run_once(self) -> None:
        """Handles queued messages, then runs one scheduler step (caller holds ``_driving``).
        Raises RuntimeError once the tensor-parallel group cannot run."""
        self.ranks.check()
        self.drain_inbox()
        if not self.scheduler.wants_step():
            return
        out = run_step(self.scheduler)  # never raises; a failed step reports what it held
        if out is not None:
            self.dispatch(self.detokenizer.handle(out))
        self.ranks.check()

    def drain_inbox(self) -> None:
        while True:
            try:
                msg = self.inbox.get_nowait()
            except queue.Empty:
                return
            reply = handle_message(self.scheduler, msg)  # never raises
            if isinstance(reply, ControlReply):
                waiter = self.front.reply_waiter(reply)
                if waiter is not None:
                    waiter.put(reply)
            elif isinstance(reply, BatchTokenOut):  # a request the scheduler failed to admit
                self.dispatch(self.detokenizer.handle(reply))

    def dispatch(self, out: BatchStrOut) -> None:
        for state, _ in self.front.fold(out):
            result = state.result
            state.waiter.put(FINISHED if result.is_finished else result.to_dict())
