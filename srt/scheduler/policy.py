"""Orders the waiting queue before admission (fcfs now; cache-aware policies plug in here)."""

from __future__ import annotations

from collections.abc import Iterable

from radixlm.srt.scheduler.req import Req


class FCFSPolicy:
    name = "fcfs"

    def order(self, waiting: Iterable[Req], cache) -> list[Req]:
        return list(waiting)


def make_policy(name: str):
    policies = {"fcfs": FCFSPolicy}
    if name not in policies:
        raise ValueError(f"schedule policy {name!r} is not available; choose one of {sorted(policies)}")
    return policies[name]()
