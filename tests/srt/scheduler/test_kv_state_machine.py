"""The real KVManager, slot allocator and RadixCache, driven like the scheduler drives them.

Requests are admitted (match and lock a prefix, take a request row, allocate the rest, in
chunks), decode (with retraction when the pool is short), have their tail cut by jump-forward
(``KVManager.truncate``, through ``edit_output`` and directly), finish (into the tree or not), are aborted in every phase, and the cache
is evicted and flushed — in random orders, for page sizes 1 and 16.

A brute-force model tracks every KV *page*: free, cached (keyed by all tokens up to the end of
the page, as ``RadixCache.snapshot``), or owned by one request; and each request's view of its
row (one slot per token with KV). It predicts every match, insert, allocation success and
``ensure_available`` answer. Which pages an eviction takes is left to the tree's LRU order;
the model checks that the evicted pages were unlocked, prefix-closed, and came back free.
After every step: ``available + evictable + protected + owned == max_total_tokens`` (owned ==
0 when idle, where ``check_idle_invariant`` must hold), the free pages, the tree and every row
equal the model's, and each row maps position p to offset ``p % page_size`` of its page.
"""

from __future__ import annotations

import random
from collections import Counter

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from kv_model import KVModel, Tracked
from quick import examples

from radixlm.grammar import JumpForwardEdit
from radixlm.radix import RadixCache
from radixlm.srt.executor.memory_pool import ReqToTokenPool, TokenSlotAllocator
from radixlm.srt.sampling.params import SamplingParams
from radixlm.srt.scheduler.jump_forward import edit_output, max_rollback
from radixlm.srt.scheduler.kv_manager import KVManager
from radixlm.srt.scheduler.req import Req

NUM_ROWS = 3  # request rows: few, so binding a row fails too
TOKENS = st.lists(st.integers(0, 2), min_size=1, max_size=4)
INDEX = st.integers(0, 15)
# (who, rollback wanted, forced tokens, whether the output so far was streamed)
EDIT = st.tuples(INDEX, st.integers(1, 4), TOKENS, st.booleans())  # edits of any reach
CHUNK = st.integers(1, 40) | st.sampled_from([16, 32])  # page-aligned chunks too


class KVMachineBase(RuleBasedStateMachine):
    page_size = 1
    num_pages = 32  # small pools: eviction, failed allocations and retraction all happen
    base_len = 10
    max_context = 64
    max_chunk = 7

    def __init__(self) -> None:
        super().__init__()
        ps, cpu = self.page_size, torch.device("cpu")
        self.allocator = TokenSlotAllocator(ps * self.num_pages, ps, cpu)
        self.rows = ReqToTokenPool(NUM_ROWS, self.max_context, cpu)
        self.cache = RadixCache(page_size=ps, free_slots=self.allocator.free)
        self.kv = KVManager(self.allocator, self.rows, self.cache)
        self.model = KVModel(ps, self.num_pages)
        self.reqs: list[Tracked] = []
        rng = random.Random(ps)
        self.bases = [[rng.randrange(3) for _ in range(self.base_len)] for _ in range(2)]

    # ------------------------------------------------------------------ model helpers
    def _in(self, phase: str) -> list[Tracked]:
        return [t for t in self.reqs if t.phase == phase]

    def _locks(self) -> Counter:
        held = Counter()
        for t in self.reqs:
            if t.locked is not None:
                held.update(
                    t.locked[:e] for e in range(self.page_size, len(t.locked) + 1, self.page_size)
                )
        return held

    def _owned_pages(self, t: Tracked) -> set[int]:
        return self.model.pages(t.slots[len(t.locked or ()) :])

    def _evictable_pages(self) -> int:
        locks = self._locks()
        return sum(1 for key in self.model.cache if not locks[key])

    def _can_free(self, num_tokens: int) -> bool:
        return (len(self.model.free) + self._evictable_pages()) * self.page_size >= num_tokens

    def _reconcile_evictions(self) -> None:
        """Takes the pages the tree evicted out of the model's cache: unlocked, prefix-closed."""
        real = {tokens for _, tokens in self.cache.snapshot()}
        assert real <= set(self.model.cache), "eviction added pages to the tree"
        gone = set(self.model.cache) - real
        locks = self._locks()
        for key in gone:
            assert not locks[key], f"evicted a locked page {key}"
            longer = [k for k in real if len(k) > len(key) and k[: len(key)] == key]
            assert not longer, f"evicted {key} but kept its extension {longer[0]}"
        for key in gone:
            self.model.release_pages(list(self.model.cache.pop(key)))

    def _ensure(self, num_tokens: int) -> bool:
        expected = self._can_free(num_tokens)
        evicting = len(self.model.free) * self.page_size < num_tokens
        before = dict(self.model.cache)
        ok = self.kv.ensure_available(num_tokens)
        self._reconcile_evictions()
        assert ok == expected, (num_tokens, ok)
        if not evicting:
            assert self.model.cache == before, "evicted with enough slots free"
        return ok

    def _take(self, t: Tracked, returned: torch.Tensor) -> None:
        """Records slots just written to the request's row (the ones the allocation returned,
        where the forward writes K/V); new pages must have been free."""
        start = len(t.slots)
        new = self.rows.read(t.req.req_slot, start + len(returned), start).tolist()
        assert new == returned.tolist(), (new, returned)
        fresh = self.model.pages(new) - self._owned_pages(t)
        assert fresh <= self.model.free, f"allocated pages {sorted(fresh - self.model.free)}"
        self.model.free -= fresh
        t.slots += new

    def _model_release(self, t: Tracked, keep_in_cache: bool) -> None:
        n, num_cached = len(t.slots), len(t.locked or ())
        tokens = t.req.fill_ids[:n]
        if t.has_row and keep_in_cache:
            present = self.model.insert(tokens, t.slots)
            self.model.release_pages(t.slots[num_cached:present])  # duplicates of the tree's
            self.model.release_pages(t.slots[self.model.aligned(n) :])  # a partial last page
        elif t.has_row:
            self.model.release_pages(t.slots[num_cached:])
        t.slots, t.locked, t.has_row = [], None, False

    def _release(self, t: Tracked, keep_in_cache: bool = True) -> None:
        self.kv.release(t.req, keep_in_cache)
        self._model_release(t, keep_in_cache)

    def _cache_chunk(self, t: Tracked) -> None:
        self.kv.cache_chunk(t.req)
        n, num_cached = len(t.slots), len(t.locked or ())
        tokens = t.req.fill_ids[:n]
        present = self.model.insert(tokens, t.slots)
        self.model.release_pages(t.slots[num_cached:present])
        cached = self.model.aligned(n)
        t.slots[:cached] = self.model.cached_slots(tokens, cached)
        t.locked = tuple(tokens[:cached])

    # ------------------------------------------------------------------ admission, prefill
    @precondition(lambda self: len(self._in("waiting")) < 3)  # admit them rather than pile up
    @rule(base=st.integers(0, 1), share=st.integers(0, 40), tail=TOKENS)
    def new_request(self, base: int, share: int, tail: list[int]) -> None:
        prompt = self.bases[base][:share] + tail
        req = Req(rid=str(len(self.reqs)), prompt_ids=prompt, params=SamplingParams())
        self.reqs.append(Tracked(req, "waiting", []))

    @precondition(lambda self: self._in("waiting") or self._in("chunked"))
    @rule(
        picks=st.lists(INDEX, min_size=1, max_size=3, unique=True),
        chunk=CHUNK,
        defer=st.booleans(),
        token=st.integers(0, 1),
        finish=st.sets(INDEX, max_size=2),
    )
    def prefill_step(
        self, picks: list[int], chunk: int, defer: bool, token: int, finish: set[int]
    ) -> None:
        """One prefill batch, as Scheduler._schedule_prefill and the step after the forward:
        continue chunked requests, admit waiting ones until one does not fit, sample a token
        for every complete prompt, finish some of them (a grammar that ends at once), and put
        the others' new KV into the tree in batch order."""
        chunk = min(chunk, self.max_chunk)
        queue = self._in("chunked") + self._in("waiting")
        batch: list[Tracked] = []
        for t in dict.fromkeys(queue[i % len(queue)] for i in picks):
            if t.phase == "waiting" and not self._admit(t):
                break  # no request row left
            if t.phase == "waiting" and defer and batch:
                self._release(t)  # deferred: it may share an in-batch prefix next step
                continue
            if not self._extend(t, chunk):
                if t.phase == "waiting":
                    self._release(t)  # did not fit: back to waiting, holding nothing
                break
            batch.append(t)
        for i, t in enumerate(batch):
            if t.req.num_kv_tokens < t.req.fill_len:
                continue
            t.req.output_ids.append(token)
            t.phase = "running"
            if i in finish:
                self._finish(t, keep_in_cache=True)  # finished at its first token: no cache_chunk
        for t in batch:
            if t in self.reqs:
                self._cache_chunk(t)

    def _admit(self, t: Tracked) -> bool:
        """Match and lock the longest cached prefix, then take a request row."""
        req, fill = t.req, t.req.fill_ids
        expected = self.model.cached_len(fill[: req.max_prefix_match()])
        prefix = self.kv.match_and_lock(req)
        assert req.num_cached_prefix == expected
        assert prefix.tolist() == self.model.cached_slots(fill, expected)
        t.slots, t.locked = prefix.tolist(), tuple(fill[:expected])
        free_row = sum(x.has_row for x in self.reqs) < NUM_ROWS
        assert self.kv.bind_req_slot(req, prefix) == free_row
        t.has_row = free_row
        if not free_row:
            self._release(t)
        return free_row

    def _extend(self, t: Tracked, chunk: int) -> bool:
        """The request's next prefill piece (as Scheduler._add_extend)."""
        req = t.req
        ext = min(req.fill_len - req.num_kv_tokens, chunk)
        expected = self._can_free(ext)
        slots = self.kv.alloc_tokens(req, ext)
        self._reconcile_evictions()
        assert (slots is not None) == expected, (ext, slots)
        if slots is None:
            return False
        self._take(t, slots)
        t.phase = "chunked"
        return True

    # ------------------------------------------------------------------ decode, jump-forward
    @precondition(lambda self: self._in("running"))
    @rule(steps=st.lists(st.tuples(st.integers(0, 1), st.none() | EDIT), min_size=1, max_size=8))
    def decode_steps(self, steps: list[tuple[int, tuple | None]]) -> None:
        """Decode steps over every running request (all sample the same token); after a step
        a jump-forward edit may rewrite one request's output."""
        for token, edit in steps:
            batch = [t for t in self._in("running") if t.req.fill_len < self.max_context - 8]
            if batch:
                self._decode(batch, token)
            if edit is not None:
                self._jump_forward(*edit)

    def _decode(self, batch: list[Tracked], token: int) -> None:
        while True:  # as Scheduler._make_room_for_decode
            forced = sum(t.req.fill_len - t.req.num_kv_tokens - 1 for t in batch)
            if self._ensure(len(batch) * self.page_size + forced):
                break
            victim = batch.pop()
            if not batch:
                self._finish(victim, keep_in_cache=True)  # finish_reason length
                return
            self._release(victim)  # retracted: waits with its output, holding nothing
            victim.phase = "waiting"
        pending = [t.req.fill_len - t.req.num_kv_tokens for t in batch]
        out = self.kv.alloc_for_batch([t.req for t in batch], pending)
        self._reconcile_evictions()
        assert out is not None, "decode slots were reserved"
        for t, num, slots in zip(batch, pending, out, strict=True):
            assert len(slots) == num
            self._take(t, slots)
            t.req.output_ids.append(token)

    @precondition(lambda self: self._in("running"))
    @rule(edit=EDIT)
    def jump_forward(self, edit: tuple) -> None:
        self._jump_forward(*edit)

    def _jump_forward(self, i: int, rollback: int, forced: list[int], streamed: bool) -> None:
        """A jump-forward edit after a sampled token (jump_forward.edit_output): drop what
        ``max_rollback`` allows of ``rollback`` output tokens, cutting their KV
        (``KVManager.truncate``), then append forced tokens (at least one: an edit always leaves a
        token to compute)."""
        running = [t for t in self._in("running") if t.req.fill_len < self.max_context - 8]
        if not running:
            return
        t = running[i % len(running)]
        req = t.req
        if streamed:  # tokens already sent to the client are never rolled back
            req.num_sent_tokens = len(req.output_ids) - 1
        num_rollback = min(rollback, max_rollback(req, self.page_size))
        new_len = req.fill_len - num_rollback
        assert new_len >= len(req.prompt_ids) + req.num_sent_tokens
        assert new_len >= len(t.locked or ()), "an edit would drop KV the tree owns"
        edit_output(req, JumpForwardEdit(num_rollback, tuple(forced)), self.kv)
        if len(t.slots) > new_len:
            assert self.page_size == 1, "with pages > 1 only KV-less tokens are dropped"
            self.model.release_pages(t.slots[new_len:])
            del t.slots[new_len:]

    @precondition(lambda self: self.page_size == 1 and self._in("running"))
    @rule(i=INDEX, num_dropped=st.integers(1, 8))
    def truncate(self, i: int, num_dropped: int) -> None:
        """``KVManager.truncate`` on its own: cut up to ``num_dropped`` positions of written KV
        that the tree does not own (pages of one token: written KV may be dropped)."""
        t = self._in("running")[i % len(self._in("running"))]
        req = t.req
        fixed = len(req.prompt_ids) + req.num_sent_tokens  # never drop what was streamed
        new_len = max(req.num_kv_tokens - num_dropped, req.num_cached_prefix, fixed)
        if new_len >= req.num_kv_tokens:
            return
        available = self.allocator.available_size()
        self.kv.truncate(req, new_len)
        self.allocator.collect_freed()
        assert self.allocator.available_size() == available + len(t.slots) - new_len
        # the token at position new_len stays, to be computed again (as an edit's last token)
        del req.output_ids[new_len - len(req.prompt_ids) + 1 :]
        self.model.release_pages(t.slots[new_len:])
        del t.slots[new_len:]

    # ------------------------------------------------------------------ finish, abort
    def _finish(self, t: Tracked, keep_in_cache: bool) -> None:
        self._release(t, keep_in_cache)
        self.reqs.remove(t)

    @precondition(lambda self: self._in("running"))
    @rule(i=INDEX, keep_in_cache=st.booleans())
    def finish(self, i: int, keep_in_cache: bool) -> None:
        running = self._in("running")
        self._finish(running[i % len(running)], keep_in_cache)

    @precondition(lambda self: len(self.reqs) >= 3)  # fewer aborts, so requests live long
    @rule(i=INDEX)
    def abort(self, i: int) -> None:
        """Scheduler.abort -> _finish_between_steps: any phase (waiting, retracted, chunked, running,
        with forced tokens pending), KV kept in the tree."""
        self._finish(self.reqs[i % len(self.reqs)], keep_in_cache=True)

    # ------------------------------------------------------------------ cache control
    @precondition(lambda self: self.model.cache)
    @rule(num_tokens=st.integers(1, 200))
    def ensure_available(self, num_tokens: int) -> None:
        self._ensure(num_tokens)

    @precondition(lambda self: self.model.cache and not any(t.has_row for t in self.reqs))
    @rule()
    def flush(self) -> None:
        """/flush_cache: only when no request holds KV (waiting ones may stay)."""
        self.cache.reset()
        for key in list(self.model.cache):
            self.model.release_pages(list(self.model.cache.pop(key)))
        assert self.allocator.available_size() == self.kv.max_total_tokens

    # ------------------------------------------------------------------ invariants
    @invariant()
    def accounting(self) -> None:
        self.allocator.check_integrity()
        self.cache.check_integrity()
        usage = self.kv.usage()
        owned = sum(len(self._owned_pages(t)) for t in self.reqs) * self.page_size
        total = usage["available"] + usage["evictable"] + usage["protected"]
        assert total + owned == usage["max_total_tokens"], (usage, owned)
        if not any(t.has_row or t.locked for t in self.reqs):
            assert owned == 0 and usage["protected"] == 0
            assert self.kv.check_idle_invariant()

    @invariant()
    def pages_match_the_model(self) -> None:
        assert set(self.allocator._free_pages) == self.model.free  # no public view of the pages
        snapshot = self.cache.snapshot()
        assert {tokens: slots for (_, tokens), slots in snapshot.items()} == self.model.cache
        locks = self._locks()
        locked = sum(1 for key in self.model.cache if locks[key]) * self.page_size
        assert self.cache.protected_size() == locked
        owners = [self._owned_pages(t) for t in self.reqs]
        cached = self.model.pages([s for slots in self.model.cache.values() for s in slots])
        every = [*owners, cached, self.model.free]
        assert sum(map(len, every)) == len(set().union(*every)) == self.num_pages

    @invariant()
    def rows_match_the_model(self) -> None:
        ps = self.page_size
        assert self.rows.available_size() == NUM_ROWS - sum(t.has_row for t in self.reqs)
        for t in self.reqs:
            req = t.req
            if not t.has_row:  # the KV counters are only valid with a row (Req's contract)
                assert (req.req_slot, req.cache_node) == (-1, None)
                assert t.locked is None and t.slots == []
                continue
            assert req.num_kv_tokens == len(t.slots) <= req.fill_len
            assert req.num_cached_prefix == len(t.locked or ())
            assert self.rows.read(req.req_slot, len(t.slots)).tolist() == t.slots
            assert all((s - 1) % ps == p % ps for p, s in enumerate(t.slots)), t.slots
            if ps > 1 and t.slots:
                assert req.last_kv_slot == t.slots[-1]

    def teardown(self) -> None:
        while self.reqs:
            self._finish(self.reqs[-1], keep_in_cache=True)
        self.accounting()
        self.cache.reset()
        assert self.allocator.available_size() == self.kv.max_total_tokens


class KVMachinePage1(KVMachineBase):
    pass


class KVMachinePage16(KVMachineBase):
    page_size = 16
    num_pages = 6
    base_len = 40
    max_context = 128
    max_chunk = 40


_SETTINGS = settings(
    max_examples=examples(100),
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestKVStateMachinePage1 = KVMachinePage1.TestCase
TestKVStateMachinePage1.settings = _SETTINGS
TestKVStateMachinePage16 = KVMachinePage16.TestCase
TestKVStateMachinePage16.settings = _SETTINGS


def _checked(machine: KVMachineBase, step, *args) -> None:
    step(*args)
    machine.accounting()
    machine.pages_match_the_model()
    machine.rows_match_the_model()


@pytest.mark.parametrize("machine_class", [KVMachinePage1, KVMachinePage16])
def test_twins_decoding_together_hand_back_their_duplicates(machine_class) -> None:
    """Two identical prompts prefilled in one batch, then decoding the same tokens: the second
    one's chunk and its finished tail are already in the tree, so it frees its own copies
    (the paths the random runs reach least often with pages of 16)."""
    m = machine_class()
    prompt_len = 2 * m.page_size if m.page_size > 1 else 8
    for _ in range(2):
        _checked(m, m.new_request, 0, prompt_len - 1, [1])
    while m._in("waiting") or m._in("chunked"):
        _checked(m, m.prefill_step, [0, 1], 40, False, 0, set())
    a, b = m.reqs
    assert a.locked == b.locked and len(a.locked) == m.model.aligned(prompt_len)
    _checked(m, m.decode_steps, [(1, None)] * m.page_size)
    _checked(m, m._finish, a, True)
    assert m.model.cached_len(b.req.fill_ids[: len(b.slots)]) > len(b.locked)
    _checked(m, m._finish, b, True)
    m.teardown()


@pytest.mark.parametrize("machine_class", [KVMachinePage1, KVMachinePage16])
def test_no_free_row_unlocks_the_matched_prefix(machine_class) -> None:
    """All request rows taken: a request that matched (and locked) a cached prefix gives the
    lock back and waits; it is admitted once a row is free."""
    m = machine_class()
    shared = 2 * m.page_size if m.page_size > 1 else 8
    for i in range(NUM_ROWS + 1):
        _checked(m, m.new_request, 0, shared, [i % 3, 2])
        while m._in("chunked") or (i < NUM_ROWS and m._in("waiting")):
            _checked(m, m.prefill_step, [0], 40, False, 0, set())
    late = m._in("waiting")[0]
    protected = m.cache.protected_size()
    _checked(m, m.prefill_step, [0], 40, False, 0, set())
    assert late.phase == "waiting" and late.req.cache_node is None
    assert m.cache.protected_size() == protected
    _checked(m, m.finish, 0, True)
    while late.phase != "running":
        _checked(m, m.prefill_step, [0], 40, False, 0, set())
    assert late.locked and len(late.locked) >= m.model.aligned(shared)
    m.teardown()
