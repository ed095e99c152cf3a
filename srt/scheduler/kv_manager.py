"""Moves requests' KV between the slot allocator, the request table and the prefix cache.

One owner for the accounting rule: every usable slot is either free in the allocator, held by
the prefix cache (evictable or protected), or owned by exactly one running request's
uncached tail. So when nothing runs, ``available + evictable + protected == max_total_tokens``.
"""

from __future__ import annotations

import logging
import time

import torch

from radixlm.radix import InsertResult
from radixlm.srt.executor.memory_pool import ReqToTokenPool, TokenSlotAllocator
from radixlm.srt.executor.transfer import tensor_to_device, to_device
from radixlm.srt.scheduler.req import Req

logger = logging.getLogger(__name__)


class KVManager:
    def __init__(self, allocator: TokenSlotAllocator, req_to_token_pool: ReqToTokenPool, cache):
        self.allocator = allocator
        self.req_to_token_pool = req_to_token_pool
        self.cache = cache
        self.page_size = allocator.page_size
        # held session prefixes (retention.py), let go when the pool is short; None: none
        self.retention = None

    @property
    def max_total_tokens(self) -> int:
        return self.allocator.max_total_tokens

    def ensure_available(self, num_tokens: int) -> bool:
        """Evicts unlocked cached prefixes until ``num_tokens`` slots are free, if possible."""
        if self.allocator.available_size() >= num_tokens:
            return True
        self.allocator.collect_freed()  # slots freed in earlier steps, before evicting
        short = num_tokens - self.allocator.available_size()
        if short > 0:
            self.cache.evict(short)
            self.allocator.collect_freed()
        while self.allocator.available_size() < num_tokens and self._release_a_hold():
            self.cache.evict(num_tokens - self.allocator.available_size())
            self.allocator.collect_freed()
        return self.allocator.available_size() >= num_tokens

    def _release_a_hold(self) -> bool:
        """Running requests come before held session prefixes: the oldest hold goes."""
        return self.retention is not None and self.retention.release_for_room()

    def room(self) -> int:
        """Slots a request could get now: free ones plus unlocked cached prefixes (slots freed
        while a step is in flight count once that step is done: this never waits for it)."""
        self.allocator.collect_freed(wait=False)
        return self.allocator.available_size() + self.cache.evictable_size()

    def free_req_slots(self) -> int:
        return self.req_to_token_pool.available_size()

    def match_and_lock(self, req: Req) -> torch.Tensor:
        """Attaches and locks the longest cached prefix of the request's tokens; returns its
        KV slots."""
        fill = req.fill_ids
        limit = req.max_prefix_match()
        if self._could_fit(req):
            match = self.cache.match_and_load(fill[:limit], req.cache_salt)
        else:  # loading from a slower tier would evict work it cannot use this step
            match = self.cache.match_prefix(fill[:limit], req.cache_salt)
        num = len(match.kv_slots)
        req.cache_node = match.last_node
        self.cache.inc_lock_ref(req.cache_node)
        req.num_cached_prefix = num
        req.num_kv_tokens = num
        return match.kv_slots

    def prefetch_ready(self, req: Req) -> bool:
        """Whether the request's disk reads let it be admitted now (``wait_complete``)."""
        if req.prefetch is None:
            return True
        return self.cache.prefetch_ready(req.prefetch, time.monotonic() - req.arrival_time)

    def drop_prefetch(self, req: Req) -> None:
        """The request's disk reads are not waited for any more: it was admitted (the match
        used what it could) or it finished (``Scheduler._retire``)."""
        if req.prefetch is not None:
            self.cache.release_prefetch(req.prefetch)
            req.prefetch = None

    def _could_fit(self, req: Req) -> bool:
        """Whether the whole request could get device slots now (free plus evictable slots;
        its own cached prefix counts among the evictable ones): the same condition under which
        its prefill gets slots once its device prefix is locked."""
        room = self.allocator.available_size() + self.cache.evictable_size()
        return room >= req.fill_len

    def alloc_for_cache(self, num_tokens: int) -> torch.Tensor | None:
        """Fresh device slots (whole pages) for KV a tiered prefix cache loads back; evicts
        unlocked cached prefixes to make room. The cache owns them from here on."""
        if not self.ensure_available(num_tokens):
            return None
        return self.allocator.alloc(num_tokens)

    def bind_req_slot(self, req: Req, prefix_slots: torch.Tensor) -> bool:
        slot = self.req_to_token_pool.alloc()
        if slot is None:
            return False
        req.req_slot = slot
        if len(prefix_slots):
            self.req_to_token_pool.write(slot, 0, prefix_slots)
            if self.page_size > 1:  # admission is synchronous anyway; decode steps are not
                req.last_kv_slot = int(prefix_slots[-1])
        return True

    def alloc_tokens(self, req: Req, num_tokens: int) -> torch.Tensor | None:
        """Slots for the request's next ``num_tokens`` tokens, written into its table row."""
        if not self.ensure_available(num_tokens + self.page_size):
            if not self.ensure_available(num_tokens):
                return None
        used = req.num_kv_tokens
        # only pages > 1 token continue the last slot's page; its slot is kept on the host
        last = req.last_kv_slot if used and self.page_size > 1 else 0
        host_slots = self.allocator.alloc_for_host(num_tokens, last, used)
        if host_slots is None:
            return None
        if len(host_slots):
            req.last_kv_slot = int(host_slots[-1])
        slots = tensor_to_device(host_slots, self.allocator.device)
        self.req_to_token_pool.write(req.req_slot, used, slots)
        req.num_kv_tokens += num_tokens
        return slots

    def alloc_for_batch(self, reqs: list[Req], nums: list[int]) -> list[torch.Tensor] | None:
        """Slots for ``nums[i]`` new tokens of each request (all or nothing). The common decode
        case (one token each, page size 1) is one allocation and one table write."""
        if self.page_size > 1 or any(n != 1 for n in nums):
            out = [self.alloc_tokens(r, n) for r, n in zip(reqs, nums, strict=True)]
            return None if any(o is None for o in out) else out
        if not self.ensure_available(len(reqs)):
            return None
        slots = self.allocator.alloc(len(reqs))
        table = self.req_to_token_pool.req_to_token
        rows = to_device([r.req_slot for r in reqs], table.device)
        cols = to_device([r.num_kv_tokens for r in reqs], table.device)
        table[rows, cols] = slots
        for r in reqs:
            r.num_kv_tokens += 1
        return list(slots.split(1))

    def cache_chunk(self, req: Req) -> None:
        """After a prefill chunk of a still-running request: puts its KV so far into the prefix
        cache (others can share it at once) and points the request at the cache's slots."""
        n = req.num_kv_tokens
        kv = self.req_to_token_pool.read(req.req_slot, n).clone()
        inserted = self._insert(req, req.fill_ids[:n], kv)
        self.req_to_token_pool.write(req.req_slot, 0, inserted.kv_slots)
        if self.page_size > 1 and len(inserted.kv_slots) == n:  # the last position moved too
            req.last_kv_slot = int(inserted.kv_slots[-1])
        self.cache.inc_lock_ref(inserted.last_node)
        self.cache.dec_lock_ref(req.cache_node)
        req.cache_node = inserted.last_node
        req.num_cached_prefix = len(inserted.kv_slots)

    def _insert(self, req: Req, tokens: list[int], kv: torch.Tensor) -> InsertResult:
        """Inserts the request's KV into the prefix cache and frees the request's copies of
        positions the cache already held (its own locked prefix is the cache's already)."""
        inserted = self.cache.insert(tokens, kv, req.cache_salt)
        if inserted.num_present > req.num_cached_prefix:
            self.allocator.free(kv[req.num_cached_prefix : inserted.num_present])
        return inserted

    def truncate(self, req: Req, new_len: int) -> None:
        """Frees the KV slots of the request's positions ``[new_len, num_kv_tokens)``: tokens a
        jump-forward edit dropped, rejected draft tokens. They are never in the prefix cache.
        With pages larger than one token the page holding position ``new_len - 1`` stays the
        request's (the next allocation continues it), only the pages after it are freed, and
        ``last_kv_slot`` moves back to position ``new_len - 1``."""
        assert req.num_cached_prefix <= new_len < req.num_kv_tokens, (new_len, req.num_kv_tokens)
        free_from = new_len
        if self.page_size > 1 and new_len > 0:
            page_end = -(-new_len // self.page_size) * self.page_size
            free_from = min(page_end, req.num_kv_tokens)
            last = self.req_to_token_pool.read(req.req_slot, new_len, start=new_len - 1)
            req.last_kv_slot = int(last[0])
        if free_from < req.num_kv_tokens:
            slots = self.req_to_token_pool.read(req.req_slot, req.num_kv_tokens, start=free_from)
            self.allocator.free(slots.clone())
        req.num_kv_tokens = new_len

    def release(self, req: Req, keep_in_cache: bool = True) -> None:
        """Gives the request's KV back: into the prefix cache where it can be kept, else to the
        allocator; frees its table row and unlocks its cached prefix. A request holding
        nothing (released already, or never admitted) is left as it is."""
        if req.req_slot < 0:
            if req.cache_node is not None:
                self.cache.dec_lock_ref(req.cache_node)
                req.cache_node = None
            return
        n = req.num_kv_tokens
        kv = self.req_to_token_pool.read(req.req_slot, n).clone()
        kept = 0
        if keep_in_cache:
            self._insert(req, req.fill_ids[:n], kv)
            kept = self.cache.cacheable_len(n)
        else:
            kept = req.num_cached_prefix
        self.allocator.free(kv[kept:n])
        self.cache.dec_lock_ref(req.cache_node)
        req.cache_node = None
        self.req_to_token_pool.free(req.req_slot)
        req.req_slot = -1
        req.num_kv_tokens = 0
        req.num_cached_prefix = 0

    def usage(self) -> dict[str, int]:
        self.allocator.collect_freed()
        return {
            "max_total_tokens": self.max_total_tokens,
            "available": self.allocator.available_size(),
            "evictable": self.cache.evictable_size(),
            "protected": self.cache.protected_size(),
        }

    def check_idle_invariant(self) -> bool:
        u = self.usage()
        total = u["available"] + u["evictable"] + u["protected"]
        free_rows = self.req_to_token_pool.available_size()
        ok = total == u["max_total_tokens"] and free_rows == self.req_to_token_pool.num_req_slots
        ok = self.cache.check_tiers_idle() and ok
        if not ok:
            logger.error(
                "KV leak detected when idle: %s (sum %d), free request rows %d/%d",
                u,
                total,
                free_rows,
                self.req_to_token_pool.num_req_slots,
            )
        return ok
