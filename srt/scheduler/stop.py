"""Finish checks after each new token: stop token ids, EOS, stop strings, stop regexes, lengths.

Stop regexes (``stop_regex``) are searched in the decoded text of the last output tokens: as
many as the longest match of the patterns spans (srt/sampling/stop_regex.py caps unbounded
ones), plus a few tokens of context before them, so that ``^``, ``\\b`` and lookbehinds see the
real preceding text (``^`` matches only while the window reaches the start of the output). A
match finishes the request with ``{"type": "stop", "matched": <the pattern>}`` (as SGLang);
the finish reason also carries :data:`MATCH_FROM_END_KEY`, how many characters of the decoded
output start at the match, and :data:`MATCH_TEXT_KEY`, the matched text, which the detokenizer
reads (and removes) to trim the output at the match exactly.

``min_new_tokens`` only keeps EOS and ``stop_token_ids`` from being sampled (and from ending the
request) before that many tokens; stop strings and stop regexes end it at any length, as in
SGLang, so the text, the token ids and the streamed text always agree. Stop strings are matched
in the output decoded with its special tokens, so a stop such as ``"<|im_end|>"`` (the chatml
template's, which SGLang's frontend sends) matches the special token.

Time is bounded: one search may take :data:`STOP_REGEX_TIMEOUT_S`, and all of a request's
searches together :data:`STOP_REGEX_BASE_BUDGET_S` plus :data:`STOP_REGEX_BUDGET_PER_TOKEN_S` per
output token. A request past either ends with a 400 abort naming ``stop_regex`` (its pattern
backtracks too much); other requests are not affected.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any
from weakref import WeakKeyDictionary

import regex

from radixlm.srt.sampling.stop_regex import (
    MATCH_FROM_END_KEY,
    MATCH_TEXT_KEY,
    compile_stop_regex,
    window_chars,
)
from radixlm.srt.scheduler.req import PENDING_TOKEN, Req

STOP_STR_WINDOW_EXTRA_TOKENS = 4
STOP_REGEX_CONTEXT_TOKENS = 4
STOP_REGEX_TIMEOUT_S = 0.02
STOP_REGEX_BASE_BUDGET_S = 0.5
STOP_REGEX_BUDGET_PER_TOKEN_S = 0.002


@dataclass
class _RegexCost:
    """A live request's stop-regex time: seconds spent, and the pattern that ran out of time."""

    seconds: float = 0.0
    slow_index: int | None = None


class StopChecker:
    def __init__(self, tokenizer, eos_token_ids: set[int], context_length: int):
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.context_length = context_length
        # each live request's stop-regex time (an entry goes with its request)
        self._regex_costs: WeakKeyDictionary[Req, _RegexCost] = WeakKeyDictionary()

    def suppressed_ids(self, req: Req) -> list[int]:
        """Token ids that may not be sampled yet (EOS and stop ids before min_new_tokens;
        none under ignore_eos, which turns both off)."""
        if len(req.output_ids) >= req.params.min_new_tokens or req.params.ignore_eos:
            return []
        return sorted(set(req.params.stop_token_ids or []) | self.eos_token_ids)

    def check(self, req: Req) -> None:
        """Sets ``req.finish_reason`` if the token just appended ends the request."""
        p = req.params
        num_out = len(req.output_ids)
        last = req.output_ids[-1]
        # SGLang's rule: ignore_eos turns off stop_token_ids too (vLLM keeps them)
        if (
            num_out >= p.min_new_tokens
            and not p.ignore_eos
            and (last in self.eos_token_ids or last in (p.stop_token_ids or ()))
        ):
            req.finish({"type": "stop", "matched": last})
            return
        matched = self._matched_stop_str(req)
        if matched is not None:
            req.finish({"type": "stop", "matched": matched})
            return
        reason = self._matched_stop_regex(req)
        if reason is not None:
            req.finish(reason)
            return
        if num_out >= p.max_new_tokens:
            req.finish({"type": "length", "length": p.max_new_tokens})
        elif req.seq_len >= self.context_length:
            req.finish({"type": "length", "length": num_out})

    def holds_stream(self, req: Req) -> bool:
        """Whether the output ends in text that may still grow into a stop-regex match, so a
        streaming request must not send it yet (a stop never reaches the client, even in
        part). A search past its time limit holds too, and the next :meth:`check` ends the
        request."""
        patterns = req.params.stop_regexes
        if not patterns or req.params.no_stop_trim:  # untrimmed: nothing to hold back
            return False
        text, pos = self._regex_tail(req, patterns)
        for i, pattern in enumerate(patterns):
            try:
                m = self._search(req, pattern, text, pos, partial=True)
            except TimeoutError:
                self._regex_costs[req].slow_index = i  # the next check() aborts the request
                return True
            if m is not None and m.end() > m.start():  # not the empty partial match at the end
                return True
        return False

    def _matched_stop_str(self, req: Req) -> str | None:
        stops = req.params.stop_strs
        if not stops:
            return None
        window = max(len(s) for s in stops) + STOP_STR_WINDOW_EXTRA_TOKENS
        tail = self.tokenizer.decode(req.output_ids[-window:], skip_special_tokens=False)
        for s in stops:
            if s in tail:
                return s
        return None

    def _matched_stop_regex(self, req: Req) -> dict[str, Any] | None:
        patterns = req.params.stop_regexes
        if not patterns:
            return None
        cost = self._regex_costs.get(req)
        if cost is not None and cost.slow_index is not None:
            return _too_slow(cost.slow_index, patterns[cost.slow_index])
        text, pos = self._regex_tail(req, patterns)
        for i, pattern in enumerate(patterns):
            try:
                m = self._search(req, pattern, text, pos, partial=False)
            except TimeoutError:
                return _too_slow(i, pattern)
            if m is not None:
                from_end = len(text) - m.start()
                return {
                    "type": "stop",
                    "matched": pattern,
                    MATCH_FROM_END_KEY: from_end,
                    MATCH_TEXT_KEY: m.group(0),
                }
        return None

    def _regex_tail(self, req: Req, patterns: list[str]) -> tuple[str, int]:
        """The decoded end of the output and the position the search starts at (after the
        context tokens decoded before the window)."""
        ids = req.output_ids
        end = len(ids)
        while end > 0 and ids[end - 1] == PENDING_TOKEN:
            end -= 1
        window = window_chars(tuple(patterns)) + STOP_STR_WINDOW_EXTRA_TOKENS
        start = max(end - window, 0)
        context_start = max(start - STOP_REGEX_CONTEXT_TOKENS, 0)
        text = self.tokenizer.decode(ids[context_start:end], skip_special_tokens=True)
        if context_start == start:
            return text, 0
        context = self.tokenizer.decode(ids[context_start:start], skip_special_tokens=True)
        return text, len(os.path.commonprefix([context, text]))

    def _search(
        self, req: Req, pattern: str, text: str, pos: int, partial: bool
    ) -> regex.Match | None:
        """One search, within the request's time budget (TimeoutError past it)."""
        cost = self._regex_costs.setdefault(req, _RegexCost())
        budget = STOP_REGEX_BASE_BUDGET_S + STOP_REGEX_BUDGET_PER_TOKEN_S * len(req.output_ids)
        timeout = min(STOP_REGEX_TIMEOUT_S, budget - cost.seconds)
        if timeout <= 0:
            raise TimeoutError
        started = time.perf_counter()
        try:
            return compile_stop_regex(pattern).search(text, pos, partial=partial, timeout=timeout)
        finally:
            cost.seconds += time.perf_counter() - started


def _too_slow(index: int, pattern: str) -> dict[str, Any]:
    shown = pattern if len(pattern) <= 80 else pattern[:77] + "..."
    return {
        "type": "abort",
        "message": (
            f"stop_regex[{index}] {shown!r} took too long to search the output (more than "
            f"{STOP_REGEX_TIMEOUT_S * 1000:g} ms for one search, or more than the request's "
            "time budget): it backtracks too much; simplify it"
        ),
        "status_code": 400,
    }
