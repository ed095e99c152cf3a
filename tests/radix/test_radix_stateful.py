"""Randomized insert / match / lock / unlock / evict / reset against a brute-force model.

The reference model stores every cached *page* separately, keyed by (namespace, all tokens up to
the end of the page), with the slots first inserted for it, its lock count and the logical time
of the last operation that covered it. What it predicts, exactly:

* match: matched_len = the longest page-aligned prefix of the query present in the model (the
  model checks that its keys are prefix-closed); kv_slots = the concatenated slots of those
  pages; every page of the match gets the current time.
* insert: returns the number of leading page-aligned tokens already present; new pages keep
  the caller's slots, present pages keep theirs; every covered page gets the current time.
* lock/unlock: +1/-1 on every page of the locked match; evictable/protected sizes are the
  token counts of pages with lock == 0 / lock > 0.
* evict(n): the slots handed to free_slots form whole unlocked pages, all of whose extensions
  are evicted too; the amount returned equals the slots freed; it frees at least
  min(n, evictable) and stops as soon as n is reached (all node frees but the last sum to < n);
  no evicted page is newer than a surviving unlocked page (LRU).
* the tree's full contents (RadixCache.snapshot) equal the model's after every step.

Slot accounting: insert always receives fresh slot numbers; the model checks that each one is,
at every step, in exactly one place: held by the tree, given back to the caller (duplicates and
the unaligned tail) or freed through the callback, which never sees a slot twice.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import hypothesis.strategies as st
import torch
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from quick import examples

from radixlm.radix import MatchResult, RadixCache

PageKey = tuple[str | None, tuple[int, ...]]
NAMESPACES = st.sampled_from([None, "lora-a"])


@dataclass
class RefPage:
    slots: tuple[int, ...]
    time: int
    lock: int = 0


class ReferenceCache:
    """Brute-force model of the prefix cache at page granularity."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.pages: dict[PageKey, RefPage] = {}
        self.clock = 0

    def page_ends(self, num_tokens: int) -> range:
        return range(self.page_size, num_tokens + 1, self.page_size)

    def match(self, tokens: list[int], namespace: str | None) -> tuple[int, list[int]]:
        self.clock += 1
        present = [
            e for e in self.page_ends(len(tokens)) if (namespace, tuple(tokens[:e])) in self.pages
        ]
        matched_len = max(present, default=0)
        slots: list[int] = []
        for end in self.page_ends(matched_len):
            page = self.pages[(namespace, tuple(tokens[:end]))]
            page.time = self.clock
            slots.extend(page.slots)
        return matched_len, slots

    def insert(self, tokens: list[int], slots: list[int], namespace: str | None) -> int:
        self.clock += 1
        num_present = 0
        for end in self.page_ends(len(tokens)):
            key = (namespace, tuple(tokens[:end]))
            if key in self.pages:
                assert num_present == end - self.page_size, "model lost prefix closure"
                num_present = end
                self.pages[key].time = self.clock
            else:
                self.pages[key] = RefPage(tuple(slots[end - self.page_size : end]), self.clock)
        return num_present

    def add_lock(
        self, tokens: list[int], matched_len: int, namespace: str | None, delta: int
    ) -> None:
        for end in self.page_ends(matched_len):
            page = self.pages[(namespace, tuple(tokens[:end]))]
            page.lock += delta
            assert page.lock >= 0

    def sizes(self) -> tuple[int, int]:
        evictable = sum(self.page_size for p in self.pages.values() if p.lock == 0)
        protected = sum(self.page_size for p in self.pages.values() if p.lock > 0)
        return evictable, protected

    def check_prefix_closed(self) -> None:
        for namespace, tokens in self.pages:
            if len(tokens) > self.page_size:
                assert (namespace, tokens[: len(tokens) - self.page_size]) in self.pages

    def apply_eviction(self, requested: int, freed_calls: list[list[int]], returned: int) -> None:
        freed = [s for call in freed_calls for s in call]
        assert returned == len(freed)
        evictable_before, _ = self.sizes()
        assert returned >= min(requested, evictable_before), "evict stopped early"
        if freed_calls:
            assert returned - len(freed_calls[-1]) < requested, "evict went on after reaching n"
        owner = {s: key for key, page in self.pages.items() for s in page.slots}
        evicted = {owner[s] for s in freed}  # KeyError: a freed slot the model says is not cached
        assert sorted(freed) == sorted(s for k in evicted for s in self.pages[k].slots)
        assert all(self.pages[k].lock == 0 for k in evicted), "a locked page was evicted"
        survivors = [p.time for k, p in self.pages.items() if k not in evicted and p.lock == 0]
        if evicted and survivors:
            assert max(self.pages[k].time for k in evicted) <= min(survivors), "not LRU"
        for key in evicted:
            del self.pages[key]
        self.check_prefix_closed()


def token_lists(page_size: int) -> st.SearchStrategy[list[int]]:
    alphabet = st.integers(0, 2) if page_size == 1 else st.integers(0, 1)
    return st.lists(alphabet, max_size=4 * page_size + 3)


class RadixMachineBase(RuleBasedStateMachine):
    page_size = 1

    def __init__(self) -> None:
        super().__init__()
        self.freed_calls: list[list[int]] = []
        self.cache = RadixCache(
            self.page_size, lambda slots: self.freed_calls.append(slots.tolist())
        )
        self.ref = ReferenceCache(self.page_size)
        self.locks: list[tuple[MatchResult, list[int], str | None]] = []
        self.history: list[list[int]] = []  # every sequence inserted so far
        self.next_slot = 0
        self.allocated: set[int] = set()
        self.caller_kept: Counter[int] = Counter()  # duplicates + unaligned tails
        self.cache_freed: Counter[int] = Counter()  # everything seen by free_slots

    def draw_tokens(self, data: st.DataObject) -> list[int]:
        """A random sequence, or (more often) an earlier one cut short and/or extended."""
        fresh = token_lists(self.page_size)
        if not self.history or data.draw(st.integers(0, 2)) == 0:
            return data.draw(fresh)
        base = data.draw(st.sampled_from(self.history))
        cut = data.draw(st.integers(0, len(base)))
        return base[:cut] + data.draw(fresh)[: data.draw(st.integers(0, self.page_size * 2))]

    def fresh_slots(self, n: int) -> list[int]:
        slots = list(range(self.next_slot, self.next_slot + n))
        self.next_slot += n
        self.allocated.update(slots)
        return slots

    def collect_freed(self) -> list[list[int]]:
        calls, self.freed_calls = self.freed_calls, []
        for call in calls:
            self.cache_freed.update(call)
        return calls

    def do_match(self, tokens: list[int], namespace: str | None) -> MatchResult:
        result = self.cache.match_prefix(tokens, namespace)
        matched_len, slots = self.ref.match(tokens, namespace)
        assert result.matched_len == matched_len
        assert result.kv_slots.dtype == torch.int64
        assert result.kv_slots.tolist() == slots
        return result

    def do_insert(self, tokens: list[int], slots: list[int], namespace: str | None) -> int:
        inserted = self.cache.insert(tokens, torch.tensor(slots, dtype=torch.int64), namespace)
        num_present = inserted.num_present
        aligned = len(tokens) // self.page_size * self.page_size
        assert num_present == self.ref.insert(tokens[:aligned], slots, namespace)
        assert self.collect_freed() == [], "insert must not free anything"
        # what the scheduler locks instead of re-matching: the cache's slots for every
        # inserted token, ending at the node that holds the last of them
        assert inserted.kv_slots.tolist() == self.ref.match(tokens, namespace)[1]
        node, depth = inserted.last_node, 0
        while not node.is_root:
            depth, node = depth + len(node.key), node.parent
        assert depth == aligned
        self.history.append(tokens)
        return num_present

    @rule(tokens=st.data(), namespace=NAMESPACES)
    def insert_fresh(self, tokens: st.DataObject, namespace: str | None) -> None:
        seq = self.draw_tokens(tokens)
        slots = self.fresh_slots(len(seq))
        num_present = self.do_insert(seq, slots, namespace)
        aligned = self.cache.cacheable_len(len(seq))
        self.caller_kept.update(slots[:num_present] + slots[aligned:])

    @rule(tokens=st.data(), namespace=NAMESPACES)
    def match_then_insert(self, tokens: st.DataObject, namespace: str | None) -> None:
        """The scheduler's flow: reuse the matched slots, compute the rest, insert it all."""
        seq = self.draw_tokens(tokens)
        match = self.do_match(seq, namespace)
        new_slots = self.fresh_slots(len(seq) - match.matched_len)
        num_present = self.do_insert(seq, match.kv_slots.tolist() + new_slots, namespace)
        assert num_present >= match.matched_len
        aligned = self.cache.cacheable_len(len(seq))
        own = range(match.matched_len, len(seq))
        self.caller_kept.update(
            new_slots[i - match.matched_len] for i in own if not num_present <= i < aligned
        )

    @rule(tokens=st.data(), namespace=NAMESPACES)
    def match(self, tokens: st.DataObject, namespace: str | None) -> None:
        self.do_match(self.draw_tokens(tokens), namespace)

    @rule(tokens=st.data(), namespace=NAMESPACES)
    def lock(self, tokens: st.DataObject, namespace: str | None) -> None:
        seq = self.draw_tokens(tokens)
        result = self.do_match(seq, namespace)
        self.cache.inc_lock_ref(result.last_node)
        self.ref.add_lock(seq, result.matched_len, namespace, +1)
        self.locks.append((result, seq, namespace))

    @precondition(lambda self: self.locks)
    @rule(index=st.integers(min_value=0))
    def unlock(self, index: int) -> None:
        result, seq, namespace = self.locks.pop(index % len(self.locks))
        self.cache.dec_lock_ref(result.last_node)
        self.ref.add_lock(seq, result.matched_len, namespace, -1)

    @rule(data=st.data())
    def evict(self, data: st.DataObject) -> None:
        num_tokens = data.draw(st.integers(0, 3 * self.page_size))
        returned = self.cache.evict(num_tokens)
        self.ref.apply_eviction(num_tokens, self.collect_freed(), returned)

    @precondition(lambda self: not self.locks)
    @rule()
    def reset(self) -> None:
        held = sorted(s for page in self.ref.pages.values() for s in page.slots)
        self.cache.reset()
        assert sorted(s for call in self.collect_freed() for s in call) == held
        self.ref.pages.clear()

    @invariant()
    def tree_matches_model(self) -> None:
        self.cache.check_integrity()
        expected = {key: page.slots for key, page in self.ref.pages.items()}
        assert self.cache.snapshot() == expected
        evictable, protected = self.ref.sizes()
        assert (self.cache.evictable_size(), self.cache.protected_size()) == (evictable, protected)
        assert self.cache.total_size() == evictable + protected

    @invariant()
    def every_slot_in_exactly_one_place(self) -> None:
        assert all(n == 1 for n in self.cache_freed.values()), "double free"
        held = Counter(s for page in self.ref.pages.values() for s in page.slots)
        everywhere = held + self.caller_kept + self.cache_freed
        assert set(everywhere) == self.allocated, "a slot leaked"
        assert all(n == 1 for n in everywhere.values()), "a slot is in two places"

    def teardown(self) -> None:
        while self.locks:
            self.unlock(0)
        self.reset()
        self.every_slot_in_exactly_one_place()
        assert set(self.cache_freed) | set(self.caller_kept) == self.allocated


_SETTINGS = settings(
    max_examples=examples(50),
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


class RadixMachinePage1(RadixMachineBase):
    page_size = 1


class RadixMachinePage4(RadixMachineBase):
    page_size = 4


TestRadixStatefulPage1 = RadixMachinePage1.TestCase
TestRadixStatefulPage1.settings = _SETTINGS
TestRadixStatefulPage4 = RadixMachinePage4.TestCase
TestRadixStatefulPage4.settings = _SETTINGS
