"""Priority, fairness and preemption: SGLang's priority scheduling contract.

With ``--enable-priority-scheduling`` every request has a rank (``PriorityRule.rank``: smaller
runs first). By default a larger ``priority`` value runs first; with
``--schedule-low-priority-values-first`` a smaller one does. A request without a priority has
the lowest rank of all (as SGLang). The waiting queue is ordered by rank, the admission
policy's order (fcfs: arrival) kept within a rank; with ``--enable-fair-scheduling`` requests of
one rank are taken round robin by caller (the API key's namespace, else the ``user`` field's:
managers/caller_scope.py): the i-th waiting request of each caller is in round i, and within a
round the caller served longest ago (or never) goes first, so one caller's burst does not hold
back the others' requests.

Preemption: when the first waiting request cannot be admitted (the running batch is at
``--max-running-requests`` or the KV pool has no room for it), running requests whose rank
is worse by more than ``--priority-scheduling-preemption-threshold`` are retracted (the
scheduler's retraction: KV released, the request waits again and later recomputes its tokens,
producing the same greedy output), worst rank first and the newest first within a rank,
until it fits. When retracting every eligible request would not make room, none is retracted.

Without priority scheduling the rank of every request is 0: the order is the policy's alone
and nothing is preempted.
"""

from __future__ import annotations

import sys
from collections import defaultdict
from collections.abc import Callable, Sequence

from radixlm.srt.config import ServerConfig
from radixlm.srt.scheduler.req import Req

LOWEST_RANK = sys.maxsize  # a request without a priority (SGLang: the lowest priority)
MAX_CALLERS_REMEMBERED = 4096  # fair scheduling forgets the callers served longest ago past it


class PriorityRule:
    def __init__(
        self,
        enabled: bool = False,
        low_values_first: bool = False,
        preemption_threshold: int = 10,
        fair: bool = False,
        default_priority: int | None = None,
    ) -> None:
        self.enabled = enabled
        self.default_priority = default_priority
        self.low_values_first = low_values_first
        self.preemption_threshold = preemption_threshold
        self.fair = fair
        self.last_served: dict[str, int] = {}  # caller -> when it was last served (a count)
        self.num_served = 0

    @classmethod
    def from_config(cls, cfg: ServerConfig) -> PriorityRule:
        return cls(
            cfg.enable_priority_scheduling,
            cfg.schedule_low_priority_values_first,
            cfg.priority_scheduling_preemption_threshold,
            cfg.enable_fair_scheduling,
            cfg.default_priority_value,
        )

    @property
    def reorders(self) -> bool:
        return self.enabled or self.fair

    def rank(self, req: Req) -> int:
        """Smaller runs first; 0 for every request without priority scheduling."""
        if not self.enabled:
            return 0
        priority = self.default_priority if req.priority is None else req.priority
        if priority is None:
            return LOWEST_RANK
        return priority if self.low_values_first else -priority

    def order(self, ordered: Sequence[Req]) -> list[Req]:
        """``ordered`` (the admission policy's order) by rank, then by caller round and the
        caller's last service (fair scheduling), the policy's order kept among equals."""
        if not self.reorders:
            return list(ordered)
        rounds: dict[tuple[int, str], int] = defaultdict(int)
        keys: dict[int, tuple[int, int, int]] = {}
        for req in ordered:
            rank = self.rank(req)
            turn = last = 0
            if self.fair:
                turn = rounds[(rank, req.caller)]
                rounds[(rank, req.caller)] = turn + 1
                last = self.last_served.get(req.caller, -1)
            keys[id(req)] = (rank, turn, last)
        return sorted(ordered, key=lambda r: keys[id(r)])

    def note_served(self, req: Req) -> None:
        """``req`` got a prefill piece this step: its caller was served now."""
        if not self.fair:
            return
        self.last_served.pop(req.caller, None)
        self.last_served[req.caller] = self.num_served
        self.num_served += 1
        if len(self.last_served) > MAX_CALLERS_REMEMBERED:  # dicts keep insertion order
            del self.last_served[next(iter(self.last_served))]

    def first(self, waiting: Sequence[Req]) -> Req | None:
        """The waiting request that runs next by rank and arrival (None: none waits)."""
        return min(waiting, key=lambda r: (self.rank(r), r.arrival), default=None)

    def can_preempt(self, incoming: Req, running: Req) -> bool:
        return self.enabled and self.rank(running) - self.rank(incoming) > self.preemption_threshold

    def victims(self, incoming: Req, running: Sequence[Req]) -> list[Req]:
        """The running requests ``incoming`` may retract, in the order they go: worst rank
        first, the newest first within a rank."""
        if not self.enabled:
            return []
        worst_first = sorted(running, key=lambda r: (-self.rank(r), -r.arrival))
        out = []
        for req in worst_first:
            if not self.can_preempt(incoming, req):
                break
            out.append(req)
        return out

    def may_preempt(self, waiting: Sequence[Req], running: Sequence[Req]) -> bool:
        """Whether some waiting request outranks some running one by more than the threshold
        (cheap: one pass over each)."""
        if not (self.enabled and waiting and running):
            return False
        best = min(self.rank(r) for r in waiting)
        worst = max(self.rank(r) for r in running)
        return worst - best > self.preemption_threshold

    def plan_preemption(
        self,
        incoming: Req,
        running: Sequence[Req],
        fits: Callable[[list[Req]], bool],
    ) -> list[Req]:
        """The running requests to retract so that ``incoming`` fits: ``fits(retracted)`` says
        whether it fits once those are gone. Empty when it fits already, or when retracting
        every eligible request would not be enough (SGLang: nothing is preempted then)."""
        if fits([]):
            return []
        chosen: list[Req] = []
        for victim in self.victims(incoming, running):
            chosen.append(victim)
            if fits(chosen):
                return chosen
        return []


class RankedPolicy:
    """An admission policy whose order the rule then sorts by rank and caller round."""

    def __init__(self, policy, rule: PriorityRule) -> None:
        self.policy = policy
        self.rule = rule
        self.name = policy.name

    def order(self, waiting: Sequence[Req], cache, running: Sequence[Req] = ()) -> list[Req]:
        return self.rule.order(self.policy.order(waiting, cache, running))


def queue_victim(rule: PriorityRule, incoming: Req, waiting: Sequence[Req]) -> Req | None:
    """With the queue full: the waiting request ``incoming`` pushes out, if any (SGLang: the
    least preferred one, the newest among equals, when ``incoming`` strictly outranks it).
    Requests already admitted once (retracted, with output) are never pushed out."""
    if not rule.enabled:
        return None
    candidates = [r for r in waiting if not r.admitted]
    if not candidates:
        return None
    worst = max(candidates, key=lambda r: (rule.rank(r), r.arrival))
    return worst if rule.rank(incoming) < rule.rank(worst) else None
