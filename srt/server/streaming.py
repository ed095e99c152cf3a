"""Running several request generators at once: merged streams, all-or-nothing collection, SSE."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import orjson

SSE_DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def _cancel_all(futures: Any) -> None:
    # Cancelling runs each generator's cleanup (which aborts its request) without awaiting here:
    # this may run inside a cancelled scope, where every await would raise again.
    for fut in futures:
        fut.cancel()


async def merge(gens: list[AsyncIterator[Any]]) -> AsyncIterator[tuple[int, Any]]:
    """Yields ``(index, item)`` from all generators as items arrive; the first exception ends
    the merge and cancels the other generators."""
    pending: dict[asyncio.Future[Any], int] = {
        asyncio.ensure_future(g.__anext__()): i for i, g in enumerate(gens)
    }
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for fut in done:
                i = pending.pop(fut)
                try:
                    item = fut.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(gens[i].__anext__())] = i
                yield i, item
    finally:
        _cancel_all(pending)


async def _last(gen: AsyncIterator[Any]) -> Any:
    last = None
    async for item in gen:
        last = item
    return last


async def collect_all(gens: list[AsyncIterator[Any]]) -> list[Any]:
    """The final item of every generator, run concurrently; on the first error the others are
    cancelled and the error is raised."""
    tasks = [asyncio.ensure_future(_last(g)) for g in gens]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        _cancel_all(t for t in tasks if not t.done())
