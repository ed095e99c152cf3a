"""Server-sent events, a streaming response that always releases its requests, and a group's
updates that start only once the first one is in (so an early refusal is an HTTP error)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson
from fastapi.responses import StreamingResponse

from radixlm.srt.managers.tokenizer_manager import RequestGroup

SSE_DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


class ClosingStreamingResponse(StreamingResponse):
    """An SSE response that calls ``on_close`` once it is over, however it ends: the body was
    fully sent, the client went away, the task was cancelled, or sending failed before the body
    generator ever started (then the generator's own cleanup never runs)."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream", headers=SSE_HEADERS)
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


Updates = AsyncIterator[tuple[int, dict[str, Any]]]


async def started_updates(group: RequestGroup) -> Updates:
    """``group.updates()`` once its first update is in: a request refused before its first
    token (a grammar that does not compile, an abort with a status) raises here, so the client
    gets an HTTP error (the same 400 as without ``stream``) instead of a 200 stream holding an
    error event. The first update comes with the first token, so no chunk is delayed."""
    updates = group.updates()
    try:
        first = await anext(updates)
    except StopAsyncIteration:
        first = None
    except BaseException:
        group.close()
        raise

    async def chained() -> Updates:
        if first is not None:
            yield first
            async for update in updates:
                yield update

    return chained()
