"""The streaming skeleton of the parsers whose calls are JSON call objects (hermes, llama3,
generic): a state machine over the output text that hands each call object to a
``CallReader``.

A subclass sets ``STEPS`` (state -> step, assigned after the class body) and ``READER`` (the
state whose step is ``_read_call``), and says what follows a call (``_call_finished``) and how
its held markup turns into content (``_resume_content``). A step reads ``text`` from ``pos``
and returns the index to go on from; it may change state without reading (returning ``pos``).
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from radixlm.srt.parsers.call_stream import CallReader, Emitter
from radixlm.srt.parsers.json_stream import DONE, FAILED, WHITESPACE, skip_whitespace
from radixlm.srt.parsers.markers import MarkerSplitter
from radixlm.srt.parsers.tool_base import ToolCallDelta, ToolCallParser, ToolSpec

Step = Callable[[Any, str, int], int]  # (parser, text, pos) -> the index to go on from


class MarkupSteps:
    """Steps the marker-driven parsers share (they keep ``_em``, an Emitter, ``_state`` and,
    for markup held before a call stands, ``_budget`` characters)."""

    _em: Emitter
    _state: int
    _budget: int

    def _content_until(
        self, splitter: MarkerSplitter, text: str, pos: int, state: int
    ) -> tuple[int, str]:
        """Content up to ``splitter``'s marker, which is held (moving to ``state``); returns
        the index to go on from and the content text shown."""
        before, marker, after = splitter.scan(text, pos)
        self._em.content(before)
        if after is None:
            return len(text), before
        self._em.hold(marker)
        self._state = state
        return after, before

    def _hold(self, text: str) -> bool:
        """Holds markup; False (nothing held) when it would pass the budget: then it is not a
        call."""
        if len(text) > self._budget:
            return False
        self._budget -= len(text)
        self._em.hold(text)
        return True


class CallStreamParser(MarkupSteps, ToolCallParser):
    """``feed`` runs the step of the current state until the delta is read."""

    STEPS: ClassVar[Mapping[int, Step]]
    READER: ClassVar[int]

    def __init__(self, tools: list[ToolSpec], start: int) -> None:
        super().__init__(tools)
        self._em = Emitter()
        self._state = start
        self._reader = CallReader(self._em)

    def feed(self, delta: str) -> tuple[str, list[ToolCallDelta]]:
        pos = 0
        while pos < len(delta):
            pos = self.STEPS[self._state](self, delta, pos)
        return self._em.take()

    def _await_call(self, text: str, pos: int) -> int:
        """A step after a marker or a call: whitespace is held, ``{`` starts a call, anything
        else is content."""
        if text[pos] in WHITESPACE:
            return self._hold_whitespace(text, pos)
        return self._start_call(pos) if text[pos] == "{" else self._resume_content(pos)

    def _start_call(self, pos: int) -> int:
        """A call object starts at ``pos``: a fresh reader reads it (in state ``READER``)."""
        self._reader = CallReader(self._em)
        self._state = self.READER
        return pos

    def _read_call(self, text: str, pos: int) -> int:
        """The ``READER`` step: a call read to its end is claimed; a failed one is content."""
        stop = self._reader.feed(text, pos, len(text))
        if self._reader.status == DONE:
            self._em.claim()
            self._call_finished()
        elif self._reader.status == FAILED:
            return self._resume_content(stop)
        return stop

    def _finish_call(self) -> None:
        """End of output inside a call object: a committed call keeps its markup, else the
        markup is content."""
        if self._reader.finish():
            self._em.claim()
        else:
            self._em.release()

    def _hold_whitespace(self, text: str, pos: int) -> int:
        """Holds the whitespace run at ``pos`` as markup; returns where it ends."""
        stop = skip_whitespace(text, pos, len(text))
        self._em.hold(text[pos:stop])
        return stop

    @abstractmethod
    def _call_finished(self) -> None:
        """A call object was read (its markup claimed): moves to the state that follows."""

    @abstractmethod
    def _resume_content(self, pos: int) -> int:
        """The markup held so far is content; the text from ``pos`` is read as content."""
