"""The scheduler's control plane: one handler per control message of ``srt/messages.py``,
called between two steps by ``Scheduler.handle`` through :data:`HANDLERS`.

A message past its ``expires_at`` is refused unread: its caller has answered its client already
(a timeout), and acting now would do what the client was told did not happen. A message of a
type without a handler is refused by name. Every other message first settles the step in flight
(``Scheduler.settle``) unless its class says it need not (``waits_for_step``: the load query).

Pausing (SGLang's ``/pause_generation`` modes ``in_place`` and ``retract``): no batch runs until
``continue``; requests stay where they are (``in_place``: their KV too) or go back to the
waiting queue with their KV released (``retract``: re-admitted on continue, their prompt and
output so far prefilled again). Aborts are still reported while paused.

Weight updates (SGLang's ``update_weights_from_disk`` and, in-process, ``_from_tensor``) run
between steps, while idle (a ``busy`` answer tells the caller to let the running requests finish
first) or paused: after a ``retract`` pause no request holds KV; after an ``in_place`` one the
running requests keep the KV of the old weights, so the prefix cache cannot be emptied and
``flush_cache`` must be false.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from radixlm.srt.executor import weight_update
from radixlm.srt.messages import (
    ContinueReq,
    ControlMessage,
    ControlReply,
    FlushCacheReq,
    GetWeightsByNameReq,
    LoadReq,
    PauseReq,
    ServerInfoReq,
    SetWeightVersionReq,
    StartProfileReq,
    StopProfileReq,
    UpdateWeightsFromDiskReq,
    UpdateWeightsFromTensorReq,
)
from radixlm.srt.scheduler.cache_factory import disk_storage
from radixlm.srt.scheduler.reports import load_info
from radixlm.srt.scheduler.req import ReqStatus

if TYPE_CHECKING:
    from radixlm.srt.scheduler.scheduler import Scheduler

Answer = tuple[bool, dict[str, Any]]  # a ControlReply's ok and data
PAUSE_MODES = ("in_place", "retract")


def handle_control(s: Scheduler, msg: ControlMessage) -> ControlReply:
    handler = HANDLERS.get(type(msg))
    if handler is None:
        message = f"unknown control message {type(msg).__name__}: nothing was done"
        return ControlReply(msg.req_id, False, {"message": message})
    if msg.expires_at is not None and time.time() > msg.expires_at:
        return ControlReply(msg.req_id, False, {"message": "expired before it was read"})
    if msg.waits_for_step:
        s.settle()  # the answer reports the settled state
    return ControlReply(msg.req_id, *handler(s, msg))


# ---------------------------------------------------------------- queries
def load(s: Scheduler, msg: LoadReq) -> Answer:
    return True, load_info(s)


def server_info(s: Scheduler, msg: ServerInfoReq) -> Answer:
    return True, s.server_info()


def get_weights_by_name(s: Scheduler, msg: GetWeightsByNameReq) -> Answer:
    try:
        values = weight_update.weights_by_name(s.runner, msg.name, msg.truncate_size)
    except ValueError as e:
        return False, {"message": str(e)}
    return True, {"parameter": values}


# ---------------------------------------------------------------- cache
def flush_cache(s: Scheduler, msg: FlushCacheReq) -> Answer:
    if s.holds_requests():
        return False, {"message": "requests are running"}
    s.retention.release_all()  # held session prefixes go with the rest of the cache
    s.cache.reset()
    compiled = s.grammars.compile_cache  # finished grammars (none is in use: idle)
    if compiled is not None:
        compiled.clear()
    return True, s.server_info()


# ---------------------------------------------------------------- pause
def pause(s: Scheduler, msg: PauseReq) -> Answer:
    """Stops running batches (the step in flight was settled by ``handle_control``)."""
    if msg.mode not in PAUSE_MODES:
        return False, {"message": f"pause mode {msg.mode!r}: send in_place or retract"}
    if msg.mode == "retract":
        victims = ([s.chunked] if s.chunked is not None else []) + s.running[::-1]
        s.chunked, s.running = None, []
        for req in victims:  # the first running request ends up first in the queue
            s.spec.release(req)
            s.kv.release(req)
            req.status = ReqStatus.WAITING
            s.waiting.appendleft(req)
    if s.paused != "retract":  # retracted requests stay retracted until continue
        s.paused = msg.mode
    return True, {"paused": s.paused, "num_requests": len(s.waiting) + len(s.running)}


def continue_(s: Scheduler, msg: ContinueReq) -> Answer:
    s.paused = None
    return True, {"paused": None}


# ---------------------------------------------------------------- weights
def set_weight_version(s: Scheduler, msg: SetWeightVersionReq) -> Answer:
    s.weight_version = str(msg.weight_version)
    return True, {"weight_version": s.weight_version}


def update_weights_from_disk(s: Scheduler, msg: UpdateWeightsFromDiskReq) -> Answer:
    def load() -> str:
        return weight_update.update_weights_from_disk(s.runner, msg.model_path, msg.load_format)

    return _update_weights(s, load, msg.flush_cache, msg.weight_version)


def update_weights_from_tensor(s: Scheduler, msg: UpdateWeightsFromTensorReq) -> Answer:
    def load() -> str:
        if _has_disk_tier(s):  # its pages are keyed by the checkpoint files the weights came from
            raise ValueError(
                "a disk KV tier names its pages after the checkpoint's files: update the "
                "weights from disk (update_weights_from_disk) with it on"
            )
        return weight_update.update_weights_from_tensor(
            s.runner, msg.named_tensors, msg.load_format
        )

    return _update_weights(s, load, msg.flush_cache, None)


def _has_disk_tier(s: Scheduler) -> bool:
    return getattr(s.cache, "storage", None) is not None


def _update_weights(
    s: Scheduler, load: Callable[[], str], flush_cache: bool, weight_version: str | None
) -> Answer:
    """Runs ``load`` (ValueError: refused, the previous weights stay) when no running request
    forbids it, then empties the prefix cache (unless ``flush_cache`` is false) and relabels."""
    disk_tier = _has_disk_tier(s)
    if s.paused == "in_place" and s.holds_requests():
        if flush_cache or disk_tier:
            return False, {
                "message": "requests are paused in place and hold KV of the current "
                "weights, so the prefix cache cannot be emptied: send flush_cache: false "
                "to keep it (their KV and the cache's stay from the old weights), or pause "
                "with mode retract"
                + (" (a disk KV tier always needs retract)" if disk_tier else "")
            }
    elif s.holds_requests() and s.paused is None:
        return False, {"message": "requests are running", "busy": True}
    try:
        message = load()
    except ValueError as e:
        return False, {"message": str(e)}
    if flush_cache or disk_tier:
        s.retention.release_all()
        s.cache.reset()  # its KV was computed with the old weights
    if disk_tier:  # pages of the new weights go to (and come from) a folder of their own
        s.cache.replace_storage(disk_storage(s.runner.cfg, s.runner))
    if weight_version is not None:
        s.weight_version = str(weight_version)
    return True, {"message": message, "weight_version": s.weight_version}


# ---------------------------------------------------------------- profiling
def start_profile(s: Scheduler, msg: StartProfileReq) -> Answer:
    try:
        return True, s.profiler.start(msg)
    except (ValueError, OSError) as e:
        return False, {"message": str(e)}


def stop_profile(s: Scheduler, msg: StopProfileReq) -> Answer:
    try:
        return True, s.profiler.stop()
    except (ValueError, OSError) as e:
        return False, {"message": str(e)}


HANDLERS: dict[type[ControlMessage], Callable[[Scheduler, Any], Answer]] = {
    LoadReq: load,
    ServerInfoReq: server_info,
    FlushCacheReq: flush_cache,
    SetWeightVersionReq: set_weight_version,
    UpdateWeightsFromDiskReq: update_weights_from_disk,
    UpdateWeightsFromTensorReq: update_weights_from_tensor,
    GetWeightsByNameReq: get_weights_by_name,
    PauseReq: pause,
    ContinueReq: continue_,
    StartProfileReq: start_profile,
    StopProfileReq: stop_profile,
}
