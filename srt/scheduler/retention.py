"""Session-aware retention: a session's prefix held in the prefix cache between its turns.

Agents pause between turns while their tools run; during the pause no request holds the
conversation, so LRU eviction may take exactly the prefix the next turn needs. When a turn of a
session finishes normally, the scheduler *holds* the cached prefix it leaves behind (its
conversation so far): the node is locked in the prefix cache as a running request would lock it,
so no eviction takes it, until the session's next turn finishes (the hold moves to the longer
prefix), the session is closed or expires (the HTTP process says so), or ``ttl_s`` passes.

Bounds: one hold covers at most ``max_tokens_per_session`` tokens (of a longer prefix, its
leading part); all holds together at most
``max_tokens`` (the oldest holds are let go first to make room for a new one; a prefix shared by two holds counts for each). Held tokens are
protected tokens, so the idle rule ``available + evictable + protected == max_total_tokens``
is unchanged. Holds never starve running requests: when the device pool is short even after
evicting everything else, ``KVManager`` lets go of the oldest holds (``release_for_room``).

The cache's own nodes are held (a node that is split later keeps its identity as the lower,
deeper half, exactly as for a request's ``cache_node``).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

COUNTERS = ("held", "released_closed", "released_expired", "released_for_room", "replaced")


@dataclass
class Hold:
    node: Any  # the locked cache node (the deepest of the held prefix)
    num_tokens: int  # the held prefix's length
    expires_at: float


class PrefixRetention:
    """The holds of one scheduler, keyed by session (its caller-scoped id). ``cache`` is the
    prefix cache (``inc_lock_ref`` / ``dec_lock_ref``); a ``ttl_s`` of 0 turns holding off."""

    def __init__(
        self,
        cache: Any,
        ttl_s: float,
        max_tokens: int,
        max_tokens_per_session: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if ttl_s < 0 or max_tokens < 0 or max_tokens_per_session < 0:
            raise ValueError("retention ttl and bounds must be >= 0")
        self.cache = cache
        self.ttl_s = ttl_s
        self.max_tokens = max_tokens
        self.max_tokens_per_session = max_tokens_per_session
        self.clock = clock
        self._holds: OrderedDict[str, Hold] = OrderedDict()  # oldest hold first
        self.held_tokens = 0
        self.counters = dict.fromkeys(COUNTERS, 0)

    @property
    def is_enabled(self) -> bool:
        return self.ttl_s > 0 and self.max_tokens > 0 and self.max_tokens_per_session > 0

    def hold(self, key: str, token_ids: Sequence[int], namespace: str | None = None) -> int:
        """Holds the cached prefix of ``token_ids`` (in ``namespace``), up to the per-session
        bound, for session ``key`` (its earlier hold is let go); returns the tokens held (0:
        nothing, e.g. off or nothing cached)."""
        self.release(key, "replaced")
        if not self.is_enabled:
            return 0
        # the match splits a longer node at the bound: exactly the leading part is held
        match = self.cache.match_prefix(token_ids[: self.max_tokens_per_session], namespace)
        node, num_tokens = match.last_node, match.matched_len
        if num_tokens == 0:
            return 0
        while self._holds and self.held_tokens + num_tokens > self.max_tokens:
            self.release(next(iter(self._holds)), "released_for_room")
        if self.held_tokens + num_tokens > self.max_tokens:
            return 0
        self.cache.inc_lock_ref(node)
        self._holds[key] = Hold(node, num_tokens, self.clock() + self.ttl_s)
        self.held_tokens += num_tokens
        self.counters["held"] += 1
        return num_tokens

    def release(self, key: str, reason: str = "released_closed") -> bool:
        """Lets go of session ``key``'s hold, if any."""
        hold = self._holds.pop(key, None)
        if hold is None:
            return False
        self.cache.dec_lock_ref(hold.node)
        self.held_tokens -= hold.num_tokens
        if reason != "replaced":
            self.counters[reason] += 1
        return True

    def expire(self) -> int:
        """Lets go of the holds past their TTL; returns how many."""
        if not self._holds:
            return 0
        now = self.clock()
        expired = [k for k, h in self._holds.items() if h.expires_at <= now]
        for key in expired:
            self.release(key, "released_expired")
        return len(expired)

    def release_for_room(self) -> bool:
        """Lets go of the oldest hold (the device pool is short); False if none is left."""
        if not self._holds:
            return False
        return self.release(next(iter(self._holds)), "released_for_room")

    def release_all(self) -> None:
        for key in list(self._holds):
            self.release(key, "released_for_room")

    def info(self) -> dict[str, Any]:
        return {
            "enabled": self.is_enabled,
            "ttl_s": self.ttl_s,
            "max_tokens": self.max_tokens,
            "max_tokens_per_session": self.max_tokens_per_session,
            "held_sessions": len(self._holds),
            "held_tokens": self.held_tokens,
            **self.counters,
        }


def make_retention(cfg: Any, kv: Any) -> PrefixRetention:
    """The retention of ``cfg``'s ``session_retention_*`` flags over ``kv``'s prefix cache,
    attached to ``kv`` (which lets go of holds when the device pool is short)."""
    max_tokens = cfg.session_retention_max_tokens or kv.max_total_tokens // 4
    per_session = cfg.session_retention_max_tokens_per_session or max_tokens
    retention = PrefixRetention(kv.cache, cfg.session_retention_ttl, max_tokens, per_session)
    kv.retention = retention
    return retention
