"""Server-sent events, and a streaming response that always releases its requests."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson
from fastapi.responses import StreamingResponse

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
