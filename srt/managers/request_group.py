"""The requests of one HTTP call (a prompt, a batch, ``n`` samples) and their lifecycle.

A :class:`RequestGroup` is the one owner of its requests' states: ``TokenizerManager.open``
registers every state with the request front (request_front.py) and sends the requests; leaving
the group's ``with`` block (normal end, validation error, abort, client disconnect, scheduler
error, cancelled stream, generator closed) releases them: every state is removed and each
request that has not finished is aborted by its exact internal rid.
Closing is synchronous, so it also runs where awaiting is impossible (a cancelled scope, a
generator closed by the garbage collector).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from radixlm.srt.managers.request_front import ReqState, RequestFront

DISCONNECT_POLL_S = 0.5


class GenerateError(Exception):
    """A request that cannot be served; ``status_code`` is the HTTP status to answer with."""

    def __init__(
        self,
        message: str,
        status_code: int = 400,
        param: str | None = None,
        code: str | int | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.param = param
        self.code = code


class ClientDisconnected(Exception):
    """The HTTP client went away; the request has been aborted."""


class DisconnectProbe(Protocol):
    async def is_disconnected(self) -> bool: ...


@dataclass
class RequestGroup:
    front: RequestFront
    output: Callable[[ReqState], dict[str, Any]]  # the response for the request so far
    states: list[ReqState]
    client_keys: list[str]  # the client rids registered for abort_request
    probe: DisconnectProbe | None = None
    event: asyncio.Event = field(default_factory=asyncio.Event)
    is_closed: bool = False

    def __enter__(self) -> RequestGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if not self.is_closed:
            self.is_closed = True
            self.front.release(self.states, self.client_keys)

    async def updates(self) -> AsyncIterator[tuple[int, dict[str, Any]]]:
        """``(index, output)`` per update: each request's final output, and every update of
        streaming requests. Raises the first error (GenerateError, ClientDisconnected)."""
        while not all(s.is_done for s in self.states):
            await self._wait()
            for i, state in enumerate(self.states):
                out = self._take(state)
                if out is not None:
                    yield i, out

    async def collect(self) -> list[dict[str, Any]]:
        """Every request's final output, in order."""
        finals: list[dict[str, Any]] = [{} for _ in self.states]
        async for i, out in self.updates():
            if self.states[i].is_done:
                finals[i] = out
        return finals

    def _take(self, state: ReqState) -> dict[str, Any] | None:
        if state.is_done:
            return None
        if state.error is not None:
            raise state.error
        if not state.has_update:
            return None
        state.has_update = False
        if state.finish_reason is not None:
            state.is_done = True
            raise_for_error_abort(state.finish_reason)
            return self.output(state)
        return self.output(state) if state.req.inp.stream else None

    async def _wait(self) -> None:
        while not self.event.is_set():
            try:
                await asyncio.wait_for(self.event.wait(), timeout=DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                if self.probe is not None and await self.probe.is_disconnected():
                    raise ClientDisconnected(self.states[0].req.client_rid) from None
        self.event.clear()


def raise_for_error_abort(finish_reason: dict[str, Any]) -> None:
    """An abort that carries an HTTP status (a rejected request) becomes a GenerateError; other
    aborts (asked for by a client) are reported as ``finish_reason.type == "abort"``."""
    if finish_reason.get("type") == "abort" and "status_code" in finish_reason:
        raise GenerateError(
            str(finish_reason.get("message", "aborted")),
            int(finish_reason["status_code"]),
            finish_reason.get("param"),
        )
