"""Orders the waiting queue before admission.

- ``fcfs``: arrival order.
- ``lpm``: longest cached prefix first, so requests that reuse the cache run while it holds
  their prefix (falls back to fcfs for very long queues, where matching them all costs more
  than it saves).
- ``dfs-weight``: walk the radix tree depth first, heaviest subtree (most waiting requests)
  first, so requests sharing a prefix are admitted together.
- ``spf``: shortest prompt first, so short requests are not queued behind long prefills
  (radixlm's own; SGLang has ``lof``, longest output first). Bounded: a request that has waited
  more than ``SPF_MAX_WAIT_S`` goes before every younger one (the oldest first), so a long
  prompt is overtaken for that long at most.
"""

from __future__ import annotations

import time
from collections import defaultdict
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

    def order(self, waiting: Sequence[Req], cache) -> list[Req]:
        return list(waiting)


def _match(req: Req, cache):
    return cache.match_prefix(req.fill_ids[: req.max_prefix_match()], req.cache_salt)


class LPMPolicy:
    name = "lpm"

    def order(self, waiting: Sequence[Req], cache) -> list[Req]:
        if len(waiting) > LPM_MAX_QUEUE:
            return list(waiting)
        matched = {id(r): _match(r, cache).matched_len for r in waiting}
        return sorted(waiting, key=lambda r: -matched[id(r)])  # stable: fcfs among equals


class DFSWeightPolicy:
    name = "dfs-weight"

    def order(self, waiting: Sequence[Req], cache) -> list[Req]:
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


class ShortestPromptFirstPolicy:
    name = "spf"

    def order(self, waiting: Sequence[Req], cache) -> list[Req]:
        now = time.monotonic()
        overdue = [r for r in waiting if now - r.arrival_time > SPF_MAX_WAIT_S]
        young = [r for r in waiting if now - r.arrival_time <= SPF_MAX_WAIT_S]
        return overdue + sorted(young, key=lambda r: len(r.prompt_ids))  # stable: fcfs ties


POLICIES = {p.name: p for p in (FCFSPolicy, LPMPolicy, DFSWeightPolicy, ShortestPromptFirstPolicy)}


def make_policy(name: str):
    if name not in POLICIES:
        raise ValueError(
            f"schedule policy {name!r} is not available; choose one of {sorted(POLICIES)}"
        )
    return POLICIES[name]()
