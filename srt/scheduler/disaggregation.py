"""The scheduler's side of prefill-decode disaggregation: one role object per server.

``NullRole`` (a whole server), ``PrefillRole`` or ``DecodeRole``, from
``--disaggregation-mode``; the scheduler calls the same hooks on each, so a whole server has
no disaggregation branch. A request takes part when it carries a ``bootstrap_room`` (the router
adds one in PD mode); one without runs whole on either worker (``/health_generate``).

- Prefill: the request is prefilled with its first token only (``max_new_tokens`` 1, with its
  radix cache: a cached prefix is not recomputed). When it finishes normally its KV stays held
  (``on_retire``) until the decode worker's registration for its room has come and the
  transfer engine has written the pages; then the KV goes into the radix cache as any
  finished request's. A registration that does not match (layout, prompt) is refused; a
  request not claimed within ``--disaggregation-transfer-timeout-s`` is let go.
- Decode: the request waits for slots (its own prefix cache first: only the positions it
  lacks are transferred), registers them with the prefill worker, and joins the running batch
  when the first token arrives. A failure (refused, prefill worker unreachable, timeout) ends
  it with a 503; slots a late write could still reach are held until the prefill worker
  answers or the timeout passes.

The idle rule (``available + evictable + protected == max_total_tokens``) holds on both sides
once no transfer is pending: every path ends in ``KVManager.release``.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from radixlm.srt.disaggregation import (
    Cancel,
    KVLayout,
    Link,
    Outcome,
    Registration,
    TransferError,
    TransferStats,
    is_listening,
    kv_writes,
    make_transfer_engine,
    prompt_digest,
)
from radixlm.srt.disaggregation.handshake import reachable_host, registration_problem
from radixlm.srt.scheduler.kv_manager import KVManager
from radixlm.srt.scheduler.req import Req, ReqStatus

logger = logging.getLogger(__name__)

PROBE_INTERVAL_S = 1.0  # how often a decode worker checks that its prefill workers listen


class NullRole:
    """A whole server: every hook is a no-op."""

    mode = "null"

    def on_queued(self, req: Req) -> bool:
        return False

    def on_retire(self, req: Req) -> bool:
        return False

    def poll(self) -> tuple[list[tuple[Req, int]], list[Req]]:
        return [], []

    def abort(self, hit: Callable[[Req], bool]) -> list[Req]:
        return []

    def has_work(self) -> bool:
        return False

    def info(self) -> dict[str, Any] | None:
        return None

    def close(self) -> None:
        pass


class _Role(NullRole):
    def __init__(self, cfg: Any, runner: Any, kv: KVManager) -> None:
        self.kv = kv
        self.timeout_s = cfg.disaggregation_transfer_timeout_s
        host = reachable_host(cfg.host)
        self.engine = make_transfer_engine(
            cfg.disaggregation_transfer_backend,
            host,
            cfg.disaggregation_transport,
            cfg.disaggregation_ib_device,
        )
        k, v = runner.kv_pool.transfer_buffers()
        self.engine.register(k + v)
        model = f"{runner.model_config.architecture}:{runner.model_dir.name}"
        self.layout = KVLayout.of_pool(k, v, kv.page_size, model, runner.kv_pool.scales_info())
        self.stats = TransferStats()
        self.backend = cfg.disaggregation_transfer_backend

    def pending(self) -> int:
        return 0

    def info(self) -> dict[str, Any]:
        out = self.stats.info(self.mode, self.backend, self.pending())
        out["session_id"] = self.engine.session_id
        return out

    def close(self) -> None:
        self.link.close()


class PrefillRole(_Role):
    mode = "prefill"

    def __init__(self, cfg: Any, runner: Any, kv: KVManager) -> None:
        super().__init__(cfg, runner, kv)
        self.link = Link(cfg.host, cfg.disaggregation_bootstrap_port)
        self.held: dict[int, tuple[Req, float]] = {}  # room -> (finished request, since)
        self.registered: dict[int, tuple[Registration, float]] = {}
        self.closed: dict[int, float] = {}  # rooms that ended without KV, until expiry

    def on_queued(self, req: Req) -> bool:
        if req.bootstrap_room is not None:  # the decode worker samples the rest
            req.params = req.params.replace(max_new_tokens=1)
        return False

    def on_retire(self, req: Req) -> bool:
        room = req.bootstrap_room
        if room is None or req.disagg_done:
            return False
        req.disagg_done = True
        if req.is_normal_finish:
            self.held[room] = (req, time.monotonic())
            return True
        self._refuse_room(room, f"the prefill worker ended the request: {_reason(req)}")
        return False

    def poll(self) -> tuple[list[tuple[Req, int]], list[Req]]:
        now = time.monotonic()
        for msg in self.link.poll():
            if isinstance(msg, Registration):
                if msg.room in self.closed:
                    self._answer(msg, Outcome(msg.room, False, message="the prefill request ended"))
                else:
                    self.registered[msg.room] = (msg, now)
            elif isinstance(msg, Cancel):
                self.registered.pop(msg.room, None)
                if msg.room in self.held:
                    self._release(msg.room)
        for room in [r for r in self.held if r in self.registered]:
            self._transfer(room)
        for room, (_, since) in list(self.held.items()):
            if now - since > self.timeout_s:
                logger.warning("no decode worker claimed room %d in time; freeing its KV", room)
                self.stats.num_failures += 1
                self._release(room)
                self.closed[room] = now
        for room, (msg, since) in list(self.registered.items()):
            if now - since > self.timeout_s:
                self._answer(msg, Outcome(room, False, message="no such request arrived in time"))
                del self.registered[room]
        self.closed = {r: t for r, t in self.closed.items() if now - t < self.timeout_s}
        return [], []

    def has_work(self) -> bool:
        return bool(self.held)

    def pending(self) -> int:
        return len(self.held)

    def _transfer(self, room: int) -> None:
        req, _ = self.held[room]
        msg, _ = self.registered.pop(room)
        problem = registration_problem(msg, self.layout.fingerprint, req.prompt_ids)
        if problem is None:
            src = self.kv.req_to_token_pool.read(req.req_slot, msg.num_tokens, start=msg.start)
            writes = kv_writes(self.layout, msg.k_addrs, msg.v_addrs, src.tolist(), msg.slots)
            started = time.perf_counter()
            try:
                self.engine.write_batch(msg.session, *writes)
                self.stats.on_transfer(sum(writes[2]), time.perf_counter() - started)
            except TransferError as e:
                problem = str(e)
        if problem is None:
            self._answer(msg, Outcome(room, True, first_token=req.output_ids[0]))
        else:
            logger.warning("room %d: KV transfer refused or failed: %s", room, problem)
            self.stats.num_failures += 1
            self._answer(msg, Outcome(room, False, message=problem))
        self._release(room)

    def _answer(self, msg: Registration, outcome: Outcome) -> None:
        self.link.send(msg.notify, outcome)

    def _release(self, room: int) -> None:
        req, _ = self.held.pop(room)
        self.kv.release(req)  # into the prefix cache, as any finished request

    def _refuse_room(self, room: int, message: str) -> None:
        self.closed[room] = time.monotonic()
        entry = self.registered.pop(room, None)
        if entry is not None:
            self._answer(entry[0], Outcome(room, False, message=message))


class DecodeRole(_Role):
    mode = "decode"

    def __init__(self, cfg: Any, runner: Any, kv: KVManager) -> None:
        super().__init__(cfg, runner, kv)
        self.link = Link(cfg.host)
        self.queue: deque[Req] = deque()  # waiting for slots
        self.awaiting: dict[int, tuple[Req, float]] = {}  # registered, waiting for the KV
        self.draining: dict[int, tuple[Req, float]] = {}  # given up; a write may still land
        self.next_probe = 0.0

    def on_queued(self, req: Req) -> bool:
        if req.bootstrap_room is None:
            return False
        if req.bootstrap_room in self.awaiting or any(
            r.bootstrap_room == req.bootstrap_room for r in self.queue
        ):
            req.finish(_failed(f"bootstrap_room {req.bootstrap_room} is already in use", 400))
            return False
        req.arrival_time = time.monotonic()
        self.queue.append(req)
        return True

    def poll(self) -> tuple[list[tuple[Req, int]], list[Req]]:
        arrived: list[tuple[Req, int]] = []
        failed: list[Req] = []
        for msg in self.link.poll():
            if isinstance(msg, Outcome):
                self._on_outcome(msg, arrived, failed)
        self._allocate(failed)
        self._expire(failed)
        return arrived, failed

    def abort(self, hit: Callable[[Req], bool]) -> list[Req]:
        out = [r for r in self.queue if hit(r)]
        for req in out:
            self.queue.remove(req)
        for room, (req, _) in list(self.awaiting.items()):
            if hit(req):
                self._give_up(room)
                out.append(req)
        return out

    def has_work(self) -> bool:
        return bool(self.queue or self.awaiting or self.draining)

    def pending(self) -> int:
        return len(self.queue) + len(self.awaiting)

    def _on_outcome(self, msg: Outcome, arrived: list, failed: list) -> None:
        if msg.room in self.draining:
            req, _ = self.draining.pop(msg.room)
            self.kv.release(req, keep_in_cache=False)
            return
        entry = self.awaiting.pop(msg.room, None)
        if entry is None:
            return
        req = entry[0]
        if msg.ok:
            self.stats.num_transfers += 1
            req.status = ReqStatus.RUNNING
            arrived.append((req, msg.first_token))
        else:
            self._fail(req, f"the prefill worker refused the KV transfer: {msg.message}", failed)

    def _allocate(self, failed: list[Req]) -> None:
        while self.queue:
            req = self.queue[0]
            if not self._reserve(req):
                return
            self.queue.popleft()
            slots = self.kv.req_to_token_pool.read(req.req_slot, req.num_kv_tokens)
            start = req.num_cached_prefix
            req.cached_tokens = start
            req.admitted = True
            self.awaiting[req.bootstrap_room] = (req, time.monotonic())
            address = f"tcp://{req.bootstrap_host}:{req.bootstrap_port}"
            self.link.send(
                address,
                Registration(
                    room=req.bootstrap_room,
                    session=self.engine.session_id,
                    notify=self.link.endpoint,
                    fingerprint=self.layout.fingerprint,
                    k_addrs=list(self.layout.k_addrs),
                    v_addrs=list(self.layout.v_addrs),
                    slots=slots[start:].tolist(),
                    start=start,
                    num_tokens=len(req.prompt_ids),
                    prompt_digest=prompt_digest(req.prompt_ids),
                ),
            )

    def _reserve(self, req: Req) -> bool:
        """Slots for the prompt positions the prefix cache lacks (all or nothing)."""
        n = len(req.prompt_ids)
        if self.kv.free_req_slots() < 1 or self.kv.room() < n:
            return False
        prefix = self.kv.match_and_lock(req)
        if not self.kv.bind_req_slot(req, prefix):
            self.kv.release(req, keep_in_cache=False)
            return False
        if self.kv.alloc_tokens(req, n - req.num_cached_prefix) is None:
            self.kv.release(req, keep_in_cache=False)
            return False
        return True

    def _expire(self, failed: list[Req]) -> None:
        now = time.monotonic()
        for req in [r for r in self.queue if now - r.arrival_time > self.timeout_s]:
            self.queue.remove(req)
            self._fail(req, "no KV slots came free in time for the transfer", failed)
        dead = set()
        if now >= self.next_probe and self.awaiting:
            self.next_probe = now + PROBE_INTERVAL_S
            peers = {(r.bootstrap_host, r.bootstrap_port) for r, _ in self.awaiting.values()}
            dead = {p for p in peers if not is_listening(*p)}
        for room, (req, since) in list(self.awaiting.items()):
            if (req.bootstrap_host, req.bootstrap_port) in dead:
                del self.awaiting[room]  # nothing can write any more: the slots are free
                where = f"{req.bootstrap_host}:{req.bootstrap_port}"
                self._fail(req, f"the prefill worker at {where} is unreachable", failed)
            elif now - since > self.timeout_s:
                self._give_up(room)
                self._fail(req, "the KV transfer timed out", failed, release=False)
        for room, (req, since) in list(self.draining.items()):
            if now - since > self.timeout_s:
                del self.draining[room]
                self.kv.release(req, keep_in_cache=False)

    def _give_up(self, room: int) -> None:
        """Stops waiting for a room; its slots stay held until the prefill worker answers."""
        req, _ = self.awaiting.pop(room)
        self.draining[room] = (req, time.monotonic())
        self.link.send(f"tcp://{req.bootstrap_host}:{req.bootstrap_port}", Cancel(room))

    def _fail(self, req: Req, message: str, failed: list[Req], release: bool = True) -> None:
        logger.warning("request %s: %s", req.rid, message)
        self.stats.num_failures += 1
        if release:
            self.kv.release(req, keep_in_cache=False)
        req.finish(_failed(message, 503))
        failed.append(req)


def _failed(message: str, status: int) -> dict[str, Any]:
    return {"type": "abort", "status_code": status, "message": message}


def _reason(req: Req) -> str:
    reason = req.finish_reason or {}
    return str(reason.get("message") or reason.get("type"))


def make_role(cfg: Any, runner: Any, kv: KVManager) -> NullRole:
    mode = cfg.disaggregation_mode
    if mode == "prefill":
        return PrefillRole(cfg, runner, kv)
    if mode == "decode":
        return DecodeRole(cfg, runner, kv)
    return NullRole()
