"""The Engine's waiting helpers: a streamed request's chunks (sync and async iterators) and the
results of a call whose requests are all waited for, the first error raised after."""

from __future__ import annotations

import queue
from collections.abc import Awaitable, Callable
from typing import Any

from radixlm.srt.managers.request_front import ReqState, RequestFront

__all__ = ["FINISHED", "AsyncRequestStream", "RequestStream", "outcome", "results_or_first_error"]

FINISHED = object()  # put in a request's queue after its final update


async def outcome(result: Awaitable[dict]) -> dict | ValueError:
    try:
        return await result
    except ValueError as e:
        return e


def results_or_first_error(outcomes: list[dict | ValueError]) -> list[dict]:
    for outcome in outcomes:
        if isinstance(outcome, ValueError):
            raise outcome
    return outcomes  # type: ignore[return-value]


class RequestStream:
    """A streamed request's chunks (dicts with the text so far, then the result). Reading it to
    the end, ``close()``, an error while reading, or dropping it unread or part-read all free
    the request: one not finished is aborted. ``pull(queue)`` is the next item of the request's
    queue (the Engine runs scheduler steps meanwhile), ``output(state)`` the final result."""

    def __init__(
        self,
        front: RequestFront,
        state: ReqState,
        keys: list[str],
        pull: Callable[[queue.Queue], Any],
        output: Callable[[ReqState], dict],
    ) -> None:
        self._front, self._state, self._keys = front, state, keys
        self._pull, self._output = pull, output
        self._done = self._released = False

    def __iter__(self) -> RequestStream:
        return self

    def __next__(self) -> dict:
        if self._done:
            raise StopIteration
        try:
            return self._take(self._pull(self._state.waiter))
        except BaseException:
            self.close()
            raise

    def _take(self, item: Any) -> dict:
        if item is FINISHED:
            self._done = True
            try:
                return self._output(self._state)
            finally:
                self.close()
        return item

    def close(self) -> None:
        self._done = True
        if not self._released:
            self._released = True
            self._front.release([self._state], self._keys)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # an engine already shut down: nothing left to free
            pass


class AsyncRequestStream(RequestStream):
    """:class:`RequestStream` for ``async for`` (``pull`` is a coroutine function; a cancelled
    read aborts the request too)."""

    def __aiter__(self) -> AsyncRequestStream:
        return self

    async def __anext__(self) -> dict:
        if self._done:
            raise StopAsyncIteration
        try:
            return self._take(await self._pull(self._state.waiter))
        except BaseException:
            self.close()
            raise

    async def aclose(self) -> None:
        self.close()
