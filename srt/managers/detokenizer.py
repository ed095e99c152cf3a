"""Incremental detokenization: token ids in, UTF-8-safe text deltas out.

Each request keeps two offsets into its output ids (as SGLang does): ``surrogate_offset`` marks
where the decode window starts (a few ids of context so the tokenizer sees word boundaries) and
``read_offset`` marks the ids whose text is already confirmed. A step decodes the window with and
without the new ids; the difference is accepted only when it no longer ends in U+FFFD, so a
multi-byte character split across tokens is emitted whole, one step later.

While a request with stop strings is still running, text that might be the start of a stop string
is held back; when the scheduler reports a matched stop string it is trimmed from the final text
(unless ``no_stop_trim``), so a stop string never reaches the client, not even in part. A matched
stop token id is dropped before decoding for the same reason. A stop-regex match is trimmed where
the scheduler found it: its finish reason says how many characters of the output start at the
match (``MATCH_FROM_END_KEY``, removed here before the reason goes on to the client); the
scheduler holds back streamed tokens that may grow into a match (srt/scheduler/output.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from radixlm.srt.managers.stop_prefix import StopPrefixes
from radixlm.srt.messages import BatchStrOut, BatchTokenOut
from radixlm.srt.sampling.stop_regex import MATCH_FROM_END_KEY, MATCH_TEXT_KEY

INCOMPLETE_CHAR = "\ufffd"


class DecodesIds(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


@dataclass
class _DecodeState:
    output_ids: list[int] = field(default_factory=list)
    surrogate_offset: int = 0
    read_offset: int = 0
    text: str = ""  # confirmed text (complete characters only)
    num_sent_chars: int = 0  # prefix of ``text`` already sent to the client
    stop_prefixes: StopPrefixes | None = None  # what may start a stop string, kept up to date


def held_back_len(text: str, stop_strs: list[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a stop string (from
    scratch; the detokenizer keeps it up to date with ``StopPrefixes``)."""
    longest = 0
    for stop in stop_strs:
        for k in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:k]):
                longest = k
                break
    return longest


def trim_stop_str(text: str, start: int, matched: str, keep: bool = False) -> str:
    """Cuts ``text`` at the first occurrence of ``matched`` at or after ``start`` (after it when
    ``keep``: ``no_stop_trim`` keeps the stop, not what its last token spelled beyond it)."""
    pos = text.find(matched, start)
    return text if pos < 0 else text[: pos + len(matched) * keep]


def trim_regex_match(text: str, matched: str, from_end: int, keep: bool = False) -> str:
    """Cuts ``text`` where a stop-regex match begins (where it ends when ``keep``):
    ``from_end`` characters before the text's end when ``matched`` is there, else at the
    occurrence of ``matched`` nearest to that point (the scheduler decoded the text a little
    differently); unchanged when there is none."""
    cut = len(text) - from_end
    if not (cut >= 0 and text.startswith(matched, cut)):
        best = -1
        pos = text.find(matched)
        while pos >= 0:
            if best < 0 or abs(pos - cut) < abs(best - cut):
                best = pos
            pos = text.find(matched, pos + 1)
        if best < 0:
            return text
        cut = best
    return text[: cut + len(matched) * keep]


def public_finish_reason(finish: dict | None) -> tuple[dict | None, tuple[int, str] | None]:
    """The finish reason without the scheduler's private stop-regex match keys, and the match
    (characters from the end where it starts, its text)."""
    if finish is None or MATCH_FROM_END_KEY not in finish:
        return finish, None
    public = {k: v for k, v in finish.items() if k not in (MATCH_FROM_END_KEY, MATCH_TEXT_KEY)}
    return public, (int(finish[MATCH_FROM_END_KEY]), str(finish.get(MATCH_TEXT_KEY, "")))


class Detokenizer:
    """Turns ``BatchTokenOut`` into ``BatchStrOut``, keeping per-rid state until a request ends."""

    def __init__(self, tokenizer: DecodesIds) -> None:
        self.tokenizer = tokenizer
        self._states: dict[str, _DecodeState] = {}

    @property
    def num_active(self) -> int:
        return len(self._states)

    def handle(self, out: BatchTokenOut) -> BatchStrOut:
        deltas = [self._step(out, i) for i in range(len(out.rids))]
        return BatchStrOut(token_out=out, text_delta=deltas)

    def drop(self, rid: str) -> None:
        self._states.pop(rid, None)

    def _step(self, out: BatchTokenOut, i: int) -> str:
        rid = out.rids[i]
        state = self._states.setdefault(rid, _DecodeState())
        finish, regex_match = public_finish_reason(out.finish_reason[i])
        out.finish_reason[i] = finish
        matched = finish.get("matched") if finish else None
        state.output_ids.extend(out.new_token_ids[i])
        keep = out.no_stop_trim[i]
        trims = finish is not None and not keep
        if trims and isinstance(matched, int) and len(state.output_ids) > state.read_offset:
            if state.output_ids[-1] == matched:
                state.output_ids.pop()
        self._advance(state, out.skip_special_tokens[i], force=finish is not None)
        if finish is None:
            if state.stop_prefixes is None:
                stops = out.stop_strs[i] if i < len(out.stop_strs) else []
                state.stop_prefixes = StopPrefixes(stops)
            limit = len(state.text) - state.stop_prefixes.feed(state.text)
            return self._emit(state, limit)
        del self._states[rid]
        final = state.text
        if regex_match is not None and regex_match[1]:
            from_end, text = regex_match
            final = trim_regex_match(final, text, from_end, keep)
        elif isinstance(matched, str) and matched:
            final = trim_stop_str(final, state.num_sent_chars, matched, keep)
        return final[state.num_sent_chars :]

    def _advance(self, state: _DecodeState, skip_special: bool, force: bool) -> None:
        """Moves newly complete text into ``state.text`` (all of it when ``force``)."""
        if len(state.output_ids) <= state.read_offset:
            return
        ids = state.output_ids
        prefix = self._decode(ids[state.surrogate_offset : state.read_offset], skip_special)
        window = self._decode(ids[state.surrogate_offset :], skip_special)
        if window.endswith(INCOMPLETE_CHAR) and not force:
            return
        state.text += window[len(prefix) :]
        state.surrogate_offset = state.read_offset
        state.read_offset = len(ids)

    def _emit(self, state: _DecodeState, limit: int) -> str:
        if limit <= state.num_sent_chars:
            return ""
        delta = state.text[state.num_sent_chars : limit]
        state.num_sent_chars = limit
        return delta

    def _decode(self, ids: list[int], skip_special: bool) -> str:
        if not ids:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special)
