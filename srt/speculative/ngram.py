"""N-gram drafts: copy what followed an earlier occurrence of the request's current suffix.

Two sources, tried in order for each request:

1. The prefix cache: when a cached sequence extends the request's whole sequence (another
   request with the same tokens went further), its continuation is the draft
   (``PrefixCache.continuation``, read-only).
2. The request's own tokens (prompt + output): the longest suffix of ``min_match`` to
   ``max_match`` tokens that occurred earlier, at its most recent occurrence; the draft is what
   followed it (continuing periodically when the occurrence overlaps the suffix, as in a loop).

The per-request index (:class:`SuffixIndex`) maps each ``min_match``-gram to the position after
its most recent occurrence, with a chain to earlier ones; it is updated with the tokens added
since the last step and holds at most ``window`` positions, so a step costs
O(new tokens x min_match + candidates x max_match), independent of the sequence length.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from radixlm.srt.config import ServerConfig
from radixlm.srt.speculative.adaptive import AdaptiveLength, DraftCounters, DraftLength
from radixlm.srt.speculative.base import Draft, Drafter

DEFAULT_WINDOW = 8192  # positions per request the index remembers
MAX_CANDIDATES = 8  # earlier occurrences of the min_match-gram compared per step
MAX_CACHE_WAIT = 64  # most steps between two prefix-cache lookups of a request that missed


def seq_len(req: Any) -> int:
    return len(req.prompt_ids) + len(req.output_ids)


def seq_slice(req: Any, start: int, end: int) -> list[int]:
    """``(prompt_ids + output_ids)[start:end]`` without building the whole list."""
    n = len(req.prompt_ids)
    if start >= n:
        return req.output_ids[start - n : end - n]
    if end <= n:
        return req.prompt_ids[start:end]
    return req.prompt_ids[start:] + req.output_ids[: end - n]


class SuffixIndex:
    """Occurrences of ``min_match``-grams in one token sequence that only grows (or is reset).

    ``last[h]`` is the end (exclusive) of the most recent occurrence of the gram hashed ``h``;
    ``prev[e % window]`` the end of the occurrence before the one ending at ``e``. Hash
    collisions are harmless: candidates are compared token by token.
    """

    def __init__(self, min_match: int, max_match: int, window: int = DEFAULT_WINDOW) -> None:
        self.min_match = min_match
        self.max_match = max_match
        self.window = window
        self.last: dict[int, int] = {}
        self.prev = array("q", [-1]) * window
        self.next_end = min_match  # grams ending before this position are indexed

    def num_entries(self) -> int:
        return len(self.last)

    def _reset(self, start_end: int) -> None:
        self.last.clear()
        self.prev = array("q", [-1]) * self.window
        self.next_end = start_end

    def update(self, req: Any, length: int) -> None:
        """Index the grams ending at ``next_end .. length - 1`` (the last one is the suffix
        being looked up, which must not match itself)."""
        m = self.min_match
        if length < self.next_end:  # the sequence was cut (an edit): start again
            self._reset(m)
        if len(self.last) > 2 * self.window:  # drop entries older than the window
            self._reset(self.next_end)
        first = max(self.next_end, length - self.window, m)
        if first >= length:
            return
        tokens = seq_slice(req, first - m, length - 1)
        for end in range(first, length):
            key = hash(tuple(tokens[end - first : end - first + m]))
            self.prev[end % self.window] = self.last.get(key, -1)
            self.last[key] = end
        self.next_end = length

    def lookup(self, req: Any, length: int) -> tuple[int, int]:
        """``(end, match_len)`` of the earlier occurrence of the longest suffix (most recent on
        ties), or ``(-1, 0)``."""
        m, big = self.min_match, self.max_match
        if length <= m:
            return -1, 0
        suffix = seq_slice(req, max(length - big, 0), length)
        key = hash(tuple(suffix[-m:]))
        best_end, best_len = -1, 0
        end = self.last.get(key, -1)
        oldest = length - self.window
        for _ in range(MAX_CANDIDATES):
            if end < max(oldest, m) or end >= length:
                break
            before = seq_slice(req, max(end - big, 0), end)
            match = _common_suffix_len(before, suffix)
            if match > best_len:
                best_end, best_len = end, match
                if match >= big:
                    break
            end = self.prev[end % self.window]
        if best_len < m:
            return -1, 0
        return best_end, best_len


def _common_suffix_len(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(reversed(a), reversed(b)):  # noqa: B905 (lengths may differ)
        if x != y:
            break
        n += 1
    return n


def copy_from(req: Any, end: int, length: int, num_tokens: int) -> list[int]:
    """``num_tokens`` tokens from position ``end`` on, repeating ``seq[end:length]`` past the
    end of the sequence (an occurrence that overlaps the suffix continues as a loop)."""
    out = seq_slice(req, end, min(end + num_tokens, length))
    period = length - end
    while len(out) < num_tokens:
        out.append(out[len(out) - period])
    return out


@dataclass
class _ReqState:
    index: SuffixIndex
    length: DraftLength
    cache_wait: int = 0  # steps to skip before asking the prefix cache again
    cache_backoff: int = 1  # the next wait after a miss (doubles per miss)


class SeqView:
    """A request's ``prompt_ids + output_ids`` (first ``length`` tokens) read by slices,
    without building the whole list (the prefix-cache walk reads what it compares)."""

    def __init__(self, req: Any, length: int) -> None:
        self.req = req
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: slice) -> list[int]:
        start, stop, _ = index.indices(self.length)
        return seq_slice(self.req, start, stop)


class NgramDrafter(Drafter):
    """Drafts from the prefix cache's continuations and the request's own earlier tokens."""

    name = "ngram"

    def __init__(
        self,
        cache: Any,
        max_draft_tokens: int,
        min_match: int = 2,
        max_match: int = 8,
        adaptive: bool = True,
        window: int = DEFAULT_WINDOW,
    ) -> None:
        if not 1 <= min_match <= max_match:
            raise ValueError(
                "need 1 <= speculative_ngram_min_match <= speculative_ngram_max_match, got "
                f"{min_match} and {max_match}"
            )
        self.cache = cache
        self.min_match = min_match
        self.max_match = max_match
        self.window = max(window, max_match + 1)
        self.lengths = AdaptiveLength(max_draft_tokens, enabled=adaptive)
        self.counters = DraftCounters()
        self.num_from_cache = 0  # drafts taken from prefix-cache continuations
        self.num_from_tokens = 0  # drafts taken from the request's own tokens
        self._states: dict[Any, _ReqState] = {}

    @classmethod
    def from_config(cls, cfg: ServerConfig, cache: Any) -> NgramDrafter:
        return cls(
            cache,
            cfg.speculative_num_draft_tokens,
            cfg.speculative_ngram_min_match,
            cfg.speculative_ngram_max_match,
            adaptive=not cfg.speculative_disable_adaptive,
        )

    def num_tracked(self) -> int:
        """Requests with state held (0 once every request was released)."""
        return len(self._states)

    def _state(self, req: Any) -> _ReqState:
        state = self._states.get(req.rid)
        if state is None:
            index = SuffixIndex(self.min_match, self.max_match, self.window)
            state = self._states[req.rid] = _ReqState(index, self.lengths.new_state())
        return state

    def propose(self, reqs: Sequence[Any], max_tokens: Sequence[int]) -> list[Draft]:
        return [self._propose_one(r, n) for r, n in zip(reqs, max_tokens, strict=True)]

    def _propose_one(self, req: Any, max_tokens: int) -> Draft:
        state = self._state(req)
        budget = min(max_tokens, self.lengths.limit(state.length)) if max_tokens > 0 else 0
        length = seq_len(req)
        state.index.update(req, length)
        if budget <= 0:
            return Draft([])
        tokens = self._from_cache(state, req, length, budget)
        if tokens:
            self.num_from_cache += 1
        else:
            end, _ = state.index.lookup(req, length)
            if end < 0:
                return Draft([])
            tokens = copy_from(req, end, length, budget)
            self.num_from_tokens += 1
        return Draft(tokens)

    def _from_cache(self, state: _ReqState, req: Any, length: int, budget: int) -> list[int]:
        """The prefix cache's continuation. The walk costs O(sequence) (C-speed slices), so
        after a miss the request waits 1, 2, 4, ... (at most ``MAX_CACHE_WAIT``) steps before
        asking again: a sequence that left the tree rarely finds it again."""
        if state.cache_wait > 0:
            state.cache_wait -= 1
            return []
        tokens = self.cache.continuation(SeqView(req, length), budget)
        if tokens:
            state.cache_backoff = 1
        else:
            state.cache_wait = state.cache_backoff
            state.cache_backoff = min(2 * state.cache_backoff, MAX_CACHE_WAIT)
        return tokens

    def observe(self, req: Any, num_proposed: int, num_accepted: int) -> None:
        state = self._states.get(req.rid)
        if state is None:
            return
        self.counters.add(num_proposed, num_accepted)
        self.lengths.update(state.length, num_proposed, num_accepted)

    def release(self, req: Any) -> None:
        self._states.pop(req.rid, None)

    def stats(self) -> dict[str, float]:
        return {
            **self.counters.as_dict(),
            "num_drafts_from_cache": float(self.num_from_cache),
            "num_drafts_from_tokens": float(self.num_from_tokens),
        }
