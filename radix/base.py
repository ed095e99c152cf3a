"""The prefix-cache interface the scheduler programs against.

A prefix cache maps token-id sequences to the KV slots that already hold their keys and values,
so a new request only computes the part of its prompt nobody has computed before.

Contract
--------
* Page alignment. Everything the cache stores, matches and returns is a multiple of
  ``page_size`` tokens; ``cacheable_len(n)`` says how many of ``n`` tokens it would keep.
* Namespaces. ``namespace`` (a cache salt, a LoRA adapter id, ...) partitions the cache:
  sequences inserted under one namespace are never matched under another. ``None`` is the
  default namespace.
* Ownership of KV slots. Slots held by the cache belong to it until it frees them through the
  ``free_slots`` callback (on ``evict`` or ``reset``), each slot exactly once. After
  ``num_present = insert(tokens, kv_slots).num_present`` with
  ``num_cacheable = cacheable_len(len(tokens))``:

    - ``kv_slots[:num_present]`` stay with the caller: those positions were already cached,
      with the cache's own slots (the caller frees the ones it allocated itself; slots it got
      from ``match_prefix`` are the cache's and must not be freed);
    - ``kv_slots[num_present:num_cacheable]`` now belong to the cache;
    - ``kv_slots[num_cacheable:]`` stay with the caller.

  ``insert`` also returns the cache's slots for ``tokens[:num_cacheable]`` and the node that
  ends them, as a match of the same tokens right after the insert would (no re-match needed
  to lock what was just inserted).

* Locking. ``inc_lock_ref(node)`` protects the path from ``node`` to its root from eviction
  until the matching ``dec_lock_ref(node)``. The ``last_node`` of a ``MatchResult`` must be
  locked before anything else touches the cache (an unlocked node may be evicted or split).
* Eviction. ``evict(n)`` frees least-recently-used unlocked leaves, whole nodes at a time,
  until at least ``n`` tokens are freed or nothing unlocked is left; it returns the number freed.

Invariants (checked by ``check_integrity``)
-------------------------------------------
* ``evictable_size() + protected_size() == total_size()``; a token is protected iff the node
  holding it is locked.
* A locked node's ancestors are locked at least as many times as it is.
* No slot is held twice.

Tiers. A cache may keep prefixes in slower tiers (host memory, disk) besides the device slots
(``HiRadixCache``). ``match_prefix`` only ever answers with device-resident slots and moves
nothing; ``match_and_load`` is the match a request is admitted with: a tiered cache also brings
the longest continuation it holds in slower tiers back into device slots (all or nothing) and
reports the tokens per tier. ``prefetch`` is a hint that a request will be admitted soon;
``observe_prefill`` tells the cache how fast the model recomputes tokens, so it can skip a load
that would be slower. A cache of one tier inherits the defaults: plain match, no-op hints.

Thread model: a cache is owned by one thread (the scheduler loop); it does no locking. A tiered
cache may run copies and disk I/O on its own streams and threads, never touching the tree there.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

FreeSlotsFn = Callable[[torch.Tensor], None]


@dataclass(frozen=True, eq=False)
class MatchResult:
    """The longest cached prefix of a query."""

    kv_slots: torch.Tensor  # [matched_len] int64 on the cache's device: slots of the prefix
    matched_len: int  # number of matched tokens, a multiple of page_size
    last_node: Any  # handle of the node that ends the match; pass it to inc/dec_lock_ref
    # of matched_len, the tokens brought back from host memory / from disk by match_and_load
    num_host_hit: int = 0
    num_disk_hit: int = 0


@dataclass(frozen=True, eq=False)
class InsertResult:
    """What an insert did: which leading tokens were already cached, and where all of the
    inserted (page-aligned) tokens now live."""

    num_present: int  # leading tokens that were cached already (the caller's copies are its own)
    kv_slots: torch.Tensor  # [cacheable_len(len(tokens))] int64: the cache's slots for them
    last_node: Any  # the node that ends them; pass it to inc/dec_lock_ref


class PrefixCache(ABC):
    """A map from token-id prefixes to KV slots; see the module docstring for the contract."""

    page_size: int

    @abstractmethod
    def match_prefix(self, token_ids: Sequence[int], namespace: str | None = None) -> MatchResult:
        """The longest cached page-aligned prefix of ``token_ids``; refreshes its LRU time."""

    def match_and_load(self, token_ids: Sequence[int], namespace: str | None = None) -> MatchResult:
        """The match a request is admitted with: ``match_prefix``, and in a tiered cache the
        continuation held in host memory or on disk loaded into device slots first (all or
        nothing; skipped when loading would be slower than recomputing)."""
        return self.match_prefix(token_ids, namespace)

    def prefetch(self, token_ids: Sequence[int], namespace: str | None = None) -> Any:
        """Hint: a request with these tokens waits for admission (a disk tier starts reading).
        Returns a handle (or None) to give to :meth:`release_prefetch` once that request is
        admitted or gone, so reads nobody will use are not kept."""
        return None

    def prefetch_ready(self, handle: Any, waited_s: float) -> bool:
        """Whether the request whose :meth:`prefetch` returned ``handle``, queued for
        ``waited_s`` seconds, may be admitted now (a disk tier's ``wait_complete`` policy holds
        it back while its reads run)."""
        return True

    def release_prefetch(self, handle: Any) -> None:
        """The request whose :meth:`prefetch` returned ``handle`` no longer waits."""
        return None

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        """A prefill step computed ``num_tokens`` tokens in ``seconds`` (the recompute cost)."""
        return None

    def continuation(
        self, token_ids: Sequence[int], max_tokens: int, namespace: str | None = None
    ) -> list[int]:
        """Up to ``max_tokens`` cached tokens that follow the whole of ``token_ids`` (a cached
        sequence extends it), along the most recently used path; ``[]`` when none does.
        Read-only: no LRU update, no split, no lock (speculative drafts read it)."""
        return []

    def tier_stats(self) -> dict[str, Any]:
        """Per-tier figures for server_info and metrics (empty for a cache of one tier)."""
        return {}

    def check_tiers_idle(self) -> bool:
        """The slower tiers' slot accounting when nothing runs (always true for one tier)."""
        return True

    def close(self) -> None:
        """Stops background threads and flushes pending writes (no-op for one tier)."""
        return None

    @abstractmethod
    def insert(
        self, token_ids: Sequence[int], kv_slots: torch.Tensor, namespace: str | None = None
    ) -> InsertResult:
        """Cache ``token_ids`` (page-aligned part) with ``kv_slots`` (one per token id).

        Returns how many leading tokens were already cached (see the ownership rules above)
        and the cache's slots and last node for the page-aligned part; refreshes its LRU time.
        """

    @abstractmethod
    def cacheable_len(self, num_tokens: int) -> int:
        """How many of ``num_tokens`` tokens ``insert`` keeps (0 for a cache that keeps none)."""

    @abstractmethod
    def inc_lock_ref(self, node: Any) -> None:
        """Protect the path from ``node`` to its root from eviction."""

    @abstractmethod
    def dec_lock_ref(self, node: Any) -> None:
        """Undo one ``inc_lock_ref(node)``."""

    @abstractmethod
    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` unlocked tokens if possible; return how many were freed."""

    @abstractmethod
    def evictable_size(self) -> int:
        """Tokens held in unlocked nodes."""

    @abstractmethod
    def protected_size(self) -> int:
        """Tokens held in locked nodes."""

    def total_size(self) -> int:
        """All tokens held."""
        return self.evictable_size() + self.protected_size()

    @abstractmethod
    def reset(self) -> None:
        """Free everything through the callback; only allowed while nothing is locked."""

    @abstractmethod
    def check_integrity(self) -> None:
        """Assert the invariants listed in the module docstring."""

    @abstractmethod
    def format_tree(self) -> str:
        """A human-readable rendering of the cache contents."""

    def pretty_print(self) -> None:
        """Print ``format_tree()`` (debugging aid)."""
        print(self.format_tree())
