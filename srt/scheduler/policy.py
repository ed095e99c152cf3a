"""Orders the waiting queue before admission. The names are SGLang's ``--schedule-policy``
values; every one of them is served except ``priority`` (SGLang refuses it at start too: priority
is ``--enable-priority-scheduling``, which ranks the queue on top of any of these).

- ``fcfs``: arrival order.
- ``lpm``: longest cached prefix first, so requests that reuse the cache run while it holds
  their prefix (falls back to fcfs for very long queues, where matching them all costs more
  than it saves).
- ``dfs-weight``: walk the radix tree depth first, heaviest subtree (most waiting requests)
  first, so requests sharing a prefix are admitted together.
- ``lof``: longest output first (``max_new_tokens``, largest first; arrival order among equals).
- ``random``: a shuffle from a generator seeded with ``--random-seed``.
- ``hrrn``: highest response ratio next: the largest ``waited / work`` first, ``work`` the
  prompt tokens not in the cache, ``waited`` the time since arrival (SGLang ages a request by the
  prefill tokens processed since it arrived; at a steady prefill rate the two orders agree).
  Like ``lpm``, arrival order for very long queues.
- ``shortest-prefill-first`` (``spf``, radixlm's earlier name, still accepted): the fewest
  prompt tokens not in the cache first (the prompt length for very long queues), so short
  requests are not queued behind long prefills. Bounded, unlike SGLang's: a request that has
  waited more than ``SPF_MAX_WAIT_S`` goes before every younger one (the oldest first), so a
  long prompt is overtaken for that long at most.
- ``routing-key``: requests whose ``routing_key`` the most running requests share first (a
  router sends a conversation's turns with one key: they then run together), then the rest in
  arrival order.
"""

from __future__ import annotations

import random
import time
from collections import Counter, defaultdict
from collections.abc import Sequence

from radixlm.srt.scheduler.batch import ScheduledBatch
from radixlm.srt.scheduler.req import Req

LPM_MAX_QUEUE = 128
SPF_MAX_WAIT_S = 5.0  # spf: waited longer than this, a request is no longer overtaken
IN_BATCH_PREFIX_MIN_SHARED = 32  # defer a request sharing this many uncached tokens in-batch


def shares_uncached_prefix(req: Req, batch: ScheduledBatch) -> bool:
    """Whether an admitted request of this batch computes a long stretch of ``req``'s
    uncached prefix (in-batch prefix sharing: compute it once; ``req`` waits one step and
    then finds that prefix in the cache)."""
    k = req.num_cached_prefix + IN_BATCH_PREFIX_MIN_SHARED
    if req.fill_len - 1 < k:
        return False
    head = req.fill_slice(0, k)
    return any(
        o.cache_salt == req.cache_salt and o.fill_len >= k and o.fill_slice(0, k) == head
        for o in batch.reqs
    )


class FCFSPolicy:
    name = "fcfs"

    def order(self, waiting: Sequence[Req], cache, running: Sequence[Req] = ()) -> list[Req]:
        return list(waiting)


def _match(req: Req, cache):
    return cache.match_prefix(req.fill_ids[: req.max_prefix_match()], req.cache_salt)


class LPMPolicy:
    name = "lpm"

    def order(self, waiting: Sequence[Req], cache, running: Sequence[Req] = ()) -> list[Req]:
        if len(waiting) > LPM_MAX_QUEUE:
            return list(waiting)
        matched = {id(r): _match(r, cache).matched_len for r in waiting}
        return sorted(waiting, key=lambda r: -matched[id(r)])  # stable: fcfs among equals


class DFSWeightPolicy:
    name = "dfs-weight"

    def order(self, waiting: Sequence[Req], cache, running: Sequence[Req] = ()) -> list[Req]:
        if len(waiting) > LPM_MAX_QUEUE:
            return list(waiting)
        at_node: dict[object, list[Req]] = defaultdict(list)
        for r in waiting:
            at_node[_match(r, cache).last_node].append(r)
        weight: dict[object, int] = defaultdict(int)
        children: dict[object, list[object]] = defaultdict(list)
        roots = []
        for node, reqs in at_node.items():
            weight[node] += len(reqs)
            child, parent = node, getattr(node, "parent", None)
            while parent is not None:
                if child not in children[parent]:
                    children[parent].append(child)
                weight[parent] += len(reqs)
                child, parent = parent, getattr(parent, "parent", None)
            if child not in roots:
                roots.append(child)
        out: list[Req] = []
        stack = sorted(roots, key=lambda n: weight[n])
        while stack:
            node = stack.pop()
            out += at_node.get(node, [])
            stack += sorted(children[node], key=lambda n: weight[n])
        return out


def _uncached(waiting: Sequence[Req], cache) -> dict[int, int]:
    """Each request's prompt tokens not in the cache (its prompt length, for very long queues
    or without a cache)."""
    if cache is None or len(waiting) > LPM_MAX_QUEUE:
        return {id(r): len(r.prompt_ids) for r in waiting}
    return {id(r): max(len(r.prompt_ids) - _match(r, cache).matched_len, 0) for r in waiting}


class ShortestPrefillFirstPolicy:
    name = "shortest-prefill-first"

    def order(self, waiting: Sequence[Req], cache, running: Sequence[Req] = ()) -> list[Req]:
        now = time.monotonic()
        overdue = [r for r in waiting if now - r.arrival_time > SPF_MAX_WAIT_S]
        young = [r for r in waiting if now - r.arrival_time <= SPF_MAX_WAIT_S]
        work = _uncached(young, cache)
        return overdue + sorted(young, key=lambda r: work[id(r)])  # stable: fcfs ties


class LongestOutputFirstPolicy:
    name = "lof"

    def order(self, waiting: Sequence[Req], cache, running: Sequence[Req] = ()) -> list[Req]:
        return sorted(waiting, key=lambda r: -r.params.max_new_tokens)  # stable: fcfs ties


class RandomPolicy:
    name = "random"

    def __init__(self, seed: int | None = None) -> None:
        self.rng = random.Random(seed)

    def order(self, waiting: Sequence[Req], cache, running: Sequence[Req] = ()) -> list[Req]:
        out = list(waiting)
        self.rng.shuffle(out)
        return out


class HighestResponseRatioPolicy:
    name = "hrrn"

    def order(self, waiting: Sequence[Req], cache, running: Sequence[Req] = ()) -> list[Req]:
        if len(waiting) > LPM_MAX_QUEUE:
            return list(waiting)
        now = time.monotonic()
        work = _uncached(waiting, cache)

        def ratio(r: Req) -> float:
            if work[id(r)] == 0:
                return float("inf")  # nothing to prefill: first
            return (now - r.arrival_time) / work[id(r)]

        return sorted(waiting, key=lambda r: -ratio(r))  # stable: fcfs ties


class RoutingKeyPolicy:
    name = "routing-key"

    def order(self, waiting: Sequence[Req], cache, running: Sequence[Req] = ()) -> list[Req]:
        counts = Counter(r.routing_key for r in running if r.routing_key)
        if not counts:
            return list(waiting)
        return sorted(waiting, key=lambda r: -counts.get(r.routing_key, 0) if r.routing_key else 0)


POLICIES = {
    p.name: p
    for p in (
        FCFSPolicy,
        LPMPolicy,
        DFSWeightPolicy,
        LongestOutputFirstPolicy,
        RandomPolicy,
        HighestResponseRatioPolicy,
        ShortestPrefillFirstPolicy,
        RoutingKeyPolicy,
    )
}
ALIASES = {"spf": "shortest-prefill-first"}


def make_policy(name: str, seed: int | None = None):
    name = ALIASES.get(name, name)
    if name == "priority":
        raise ValueError(
            "schedule policy 'priority' is not a queue order; use --enable-priority-scheduling "
            "(with any --schedule-policy)"
        )
    if name not in POLICIES:
        raise ValueError(
            f"schedule policy {name!r} is not available; choose one of "
            f"{sorted([*POLICIES, *ALIASES])}"
        )
    return POLICIES[name](seed) if name == "random" else POLICIES[name]()
