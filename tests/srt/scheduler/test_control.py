"""The control plane (srt/scheduler/control.py): each verb's handler on a real scheduler over the
tiny random Llama, a message type without a handler refused by name, an expired action not
carried out, and every wire message through encode and decode unchanged."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import ClassVar

import pytest
from spec_harness import make_scheduler

from radixlm.srt.messages import (
    CONTROL_TYPES,
    MESSAGE_TYPES,
    READ_ONLY_QUERIES,
    AbortReq,
    BatchStrOut,
    BatchTokenOut,
    ContinueReq,
    ControlMessage,
    ControlReply,
    FlushCacheReq,
    GetWeightsByNameReq,
    LoadReq,
    PauseReq,
    ReleaseSessionReq,
    ServerInfoReq,
    SetWeightVersionReq,
    StartProfileReq,
    StopProfileReq,
    TokenizedGenerateReq,
    UpdateWeightsFromDiskReq,
    UpdateWeightsFromTensorReq,
    decode,
    encode,
)
from radixlm.srt.scheduler import Scheduler
from radixlm.srt.scheduler.control import HANDLERS
from radixlm.srt.scheduler.failures import run_step

POOL = 2048
NORM = "model.norm.weight"  # a vector of hidden_size (64) values in the tiny model


@pytest.fixture(scope="module")
def sched(tiny_llama_dir):
    s = make_scheduler(tiny_llama_dir, algorithm="none", max_total_tokens=POOL)
    yield s
    s.grammars.shutdown()
    s.close()


@pytest.fixture(autouse=True)
def idle_after(sched):
    yield
    sched.paused = None
    sched.abort("", abort_all=True)
    while sched.wants_step():
        run_step(sched)
    assert sched.check_idle()
    sched.cache.reset()


def ask(s: Scheduler, msg: ControlMessage) -> ControlReply:
    reply = s.handle(msg)
    assert isinstance(reply, ControlReply) and reply.req_id == msg.req_id
    return reply


def generate(s: Scheduler, rid: str = "r", n: int = 12) -> None:
    """Runs one greedy request to its end: its prompt stays in the prefix cache."""
    params = {"temperature": 0, "max_new_tokens": 3, "ignore_eos": True}
    s.handle(TokenizedGenerateReq(rid, list(range(300, 300 + n)), params))
    while s.wants_step():
        run_step(s)


def queue_one(s: Scheduler, rid: str = "w") -> None:
    """A request that waits (no step runs it): the scheduler has work."""
    params = {"temperature": 0, "max_new_tokens": 3}
    s.handle(TokenizedGenerateReq(rid, [400, 401, 402], params))
    assert s.has_work()


def test_every_verb_has_one_handler() -> None:
    assert set(HANDLERS) == set(CONTROL_TYPES)
    assert len({cls.verb for cls in CONTROL_TYPES}) == len(CONTROL_TYPES)
    assert [cls for cls in CONTROL_TYPES if not cls.waits_for_step] == [LoadReq]
    assert READ_ONLY_QUERIES == (LoadReq, ServerInfoReq)


def test_load_and_server_info(sched) -> None:
    queue_one(sched)
    load = ask(sched, LoadReq(req_id="l"))
    assert load.ok and load.data["num_waiting_reqs"] == 1
    assert load.data["max_total_num_tokens"] == POOL
    info = ask(sched, ServerInfoReq(req_id="i"))
    assert info.ok and info.data["num_waiting"] == 1 and info.data["paused"] is None


def test_flush_cache_empties_the_cache_only_when_idle(sched) -> None:
    generate(sched)
    assert sched.kv.usage()["evictable"] > 0
    queue_one(sched)
    reply = ask(sched, FlushCacheReq(req_id="f"))
    assert not reply.ok and reply.data["message"] == "requests are running"
    assert sched.kv.usage()["evictable"] > 0
    sched.abort("w")
    run_step(sched)  # reports the abort
    reply = ask(sched, FlushCacheReq(req_id="f"))
    assert reply.ok and reply.data["evictable"] == 0 and sched.kv.usage()["evictable"] == 0


def test_finished_requests_waiting_for_their_report_do_not_block_a_flush(sched) -> None:
    """A control message settles the step in flight first: the requests it finished (or an
    abort between steps) wait for the next step's report but hold nothing, so a flush then is
    not refused (it was: a client that saw the pool idle got "requests are running")."""
    generate(sched)
    queue_one(sched)
    sched.abort("w")  # finished, not yet reported
    assert sched.finished_outside_step and sched.has_work() and not sched.holds_requests()
    reply = ask(sched, FlushCacheReq(req_id="f"))
    assert reply.ok and sched.kv.usage()["evictable"] == 0
    out = run_step(sched)  # the abort is still reported
    assert out is not None and out.rids == ["w"]
    assert not sched.has_work()


def test_set_weight_version(sched) -> None:
    reply = ask(sched, SetWeightVersionReq("v7", req_id="v"))
    assert reply.ok and reply.data == {"weight_version": "v7"}
    assert ask(sched, ServerInfoReq()).data["weight_version"] == "v7"


def test_update_weights_from_disk(sched, tiny_llama_dir, tmp_path) -> None:
    generate(sched)
    keep = UpdateWeightsFromDiskReq(str(tiny_llama_dir), flush_cache=False, weight_version="k")
    reply = ask(sched, keep)
    assert reply.ok and str(tiny_llama_dir) in reply.data["message"]
    assert reply.data["weight_version"] == "k" and sched.kv.usage()["evictable"] > 0
    reply = ask(sched, UpdateWeightsFromDiskReq(str(tiny_llama_dir)))
    assert reply.ok and reply.data["weight_version"] == "k"  # None keeps the label
    assert sched.kv.usage()["evictable"] == 0  # emptied: its KV came from the old weights
    missing = ask(sched, UpdateWeightsFromDiskReq(str(tmp_path / "nowhere")))
    assert not missing.ok and "cannot read" in missing.data["message"]
    queue_one(sched)
    busy = ask(sched, UpdateWeightsFromDiskReq(str(tiny_llama_dir), weight_version="b"))
    assert not busy.ok and busy.data == {"message": "requests are running", "busy": True}
    assert sched.weight_version == "k"


def test_update_weights_from_tensor_and_read_them_back(sched) -> None:
    before = ask(sched, GetWeightsByNameReq(NORM, truncate_size=4, req_id="g"))
    assert before.ok and len(before.data["parameter"]) == 4
    values = sched.runner.model.checkpoint_tensor(NORM).float().cpu()
    reply = ask(sched, UpdateWeightsFromTensorReq([(NORM, values * 2)]))
    assert reply.ok, reply.data
    after = ask(sched, GetWeightsByNameReq(NORM, truncate_size=4))
    assert after.data["parameter"] == pytest.approx([2 * v for v in before.data["parameter"]])
    assert ask(sched, UpdateWeightsFromTensorReq([(NORM, values)])).ok  # back
    unknown = ask(sched, UpdateWeightsFromTensorReq([("model.nothing", values)]))
    assert not unknown.ok and "model.nothing" in unknown.data["message"]
    missing = ask(sched, GetWeightsByNameReq("model.nothing"))
    assert not missing.ok and "model.nothing" in missing.data["message"]
    bad_size = ask(sched, GetWeightsByNameReq(NORM, truncate_size=0))
    assert not bad_size.ok and "truncate_size" in bad_size.data["message"]


@pytest.mark.parametrize("mode", ["in_place", "retract"])
def test_pause_and_continue(sched, mode) -> None:
    queue_one(sched)
    run_step(sched)  # admitted: it runs and holds KV
    assert sched.running
    reply = ask(sched, PauseReq(mode, req_id="p"))
    assert reply.ok and reply.data == {"paused": mode, "num_requests": 1}
    assert not sched.wants_step()
    assert (len(sched.running), len(sched.waiting)) == ((1, 0) if mode == "in_place" else (0, 1))
    refused = ask(sched, PauseReq("freeze"))
    assert not refused.ok and "in_place or retract" in refused.data["message"]
    assert sched.paused == mode
    reply = ask(sched, ContinueReq(req_id="c"))
    assert reply.ok and reply.data == {"paused": None} and sched.wants_step()


def test_profile_start_and_stop(sched, tmp_path) -> None:
    start = StartProfileReq(output_dir=str(tmp_path), profile_id="t", num_steps=50)
    reply = ask(sched, start)
    assert reply.ok and reply.data["path"] == str(tmp_path / "t-TP-0.trace.json.gz")
    again = ask(sched, StartProfileReq(output_dir=str(tmp_path)))
    assert not again.ok and "already running" in again.data["message"]
    generate(sched)
    reply = ask(sched, StopProfileReq(req_id="s"))
    assert reply.ok and (tmp_path / "t-TP-0.trace.json.gz").is_file()
    reply = ask(sched, StopProfileReq())
    assert not reply.ok and "no profile is running" in reply.data["message"]
    bad = ask(sched, StartProfileReq(num_steps=0))
    assert not bad.ok and bad.data["message"].startswith("num_steps")


def test_a_profile_that_cannot_be_written_fails_no_request(sched, tmp_path) -> None:
    """The trace is written in the step that ends the profile (num_steps); when that fails (its
    folder became a file) the step's requests still finish normally, and the next /stop_profile
    reports the failure."""
    folder = tmp_path / "traces"
    reply = ask(sched, StartProfileReq(output_dir=str(folder), profile_id="t", num_steps=2))
    assert reply.ok
    folder.rmdir()
    folder.write_text("")  # the export now meets a file where its folder was
    params = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
    sched.handle(TokenizedGenerateReq("p", list(range(300, 310)), params))
    outs = []
    while sched.wants_step():
        outs.append(run_step(sched))
    reasons = [r for out in outs if out is not None for r in out.finish_reason if r]
    assert reasons == [{"type": "length", "length": 6}], reasons
    assert not sched.profiler.is_active
    reply = ask(sched, StopProfileReq())
    assert not reply.ok and "could not be written" in reply.data["message"]
    reply = ask(sched, StopProfileReq())  # reported once
    assert not reply.ok and "no profile is running" in reply.data["message"]


def test_profile_names_are_bounded(sched, tmp_path) -> None:
    for name in ("profile_id", "profile_prefix"):
        reply = ask(sched, StartProfileReq(output_dir=str(tmp_path), **{name: "x" * 300}))
        assert not reply.ok and reply.data["message"].startswith(name), reply.data
    assert not sched.profiler.is_active


@dataclass
class RebootReq(ControlMessage):
    verb: ClassVar[str] = "reboot"


def test_a_message_type_without_a_handler_is_refused(sched) -> None:
    reply = ask(sched, RebootReq(req_id="x"))
    assert not reply.ok and "unknown control message RebootReq" in reply.data["message"]


@pytest.mark.parametrize(
    "msg",
    [
        SetWeightVersionReq("late"),
        PauseReq("retract"),
        FlushCacheReq(),
        UpdateWeightsFromDiskReq("/nowhere", weight_version="late"),
        StartProfileReq(),
    ],
    ids=lambda m: m.verb,
)
def test_an_expired_action_is_not_carried_out(sched, msg) -> None:
    generate(sched)
    cached = sched.kv.usage()["evictable"]
    msg.expires_at = time.time() - 1
    reply = ask(sched, msg)
    assert not reply.ok and reply.data["message"] == "expired before it was read"
    assert sched.weight_version != "late" and sched.paused is None
    assert sched.kv.usage()["evictable"] == cached and not sched.profiler.is_active


def _token_out() -> BatchTokenOut:
    return BatchTokenOut(
        rids=["a"],
        new_token_ids=[[5, 6]],
        finish_reason=[{"type": "stop", "matched": 2}],
        prompt_tokens=[3],
        completion_tokens=[2],
        cached_tokens=[1],
        no_stop_trim=[False],
        skip_special_tokens=[True],
        output_token_logprobs=[[[-0.5, 5], [-0.25, 6]]],
        output_top_logprobs=[None],
        input_token_logprobs=[None],
        input_top_logprobs=[None],
        stop_strs=[["\n"]],
    )


WIRE_EXAMPLES = [
    TokenizedGenerateReq("r", [1, 2], {"max_new_tokens": 3}, return_logprob=True, stream=True),
    TokenizedGenerateReq("s", [1], {}, cache_salt="tenant", retain_key="k::session"),
    AbortReq("r"),
    ReleaseSessionReq("k::session"),
    AbortReq(abort_all=True),
    LoadReq(req_id="1", expires_at=12.5),
    ServerInfoReq(req_id="2"),
    FlushCacheReq(req_id="3", expires_at=1.0),
    SetWeightVersionReq("v2", req_id="4"),
    UpdateWeightsFromDiskReq("/m", "auto", False, "v3", req_id="5", expires_at=9.0),
    GetWeightsByNameReq(NORM, 7, req_id="6"),
    PauseReq("retract", req_id="7"),
    ContinueReq(req_id="8"),
    StartProfileReq(
        req_id="9",
        output_dir="/tmp/p",
        num_steps=4,
        start_step=1,
        activities=["CPU", "MEM"],
        with_stack=True,
        profile_id="x",
        profile_prefix="y",
    ),
    StopProfileReq(req_id="10"),
    ControlReply("1", True, {"weight_version": "v2", "nested": {"a": [1, 2]}}),
    _token_out(),
    BatchStrOut(_token_out(), ["hi"]),
]


def test_every_wire_message_round_trips() -> None:
    assert {type(m) for m in WIRE_EXAMPLES} == set(MESSAGE_TYPES.values())
    for msg in WIRE_EXAMPLES:
        back = decode(encode(msg))
        assert type(back) is type(msg) and back == msg


def test_the_tensor_update_never_goes_on_the_wire() -> None:
    assert "UpdateWeightsFromTensorReq" not in MESSAGE_TYPES
    with pytest.raises(TypeError, match="not a wire message"):
        encode(UpdateWeightsFromTensorReq([]))
    with pytest.raises(TypeError, match="not a wire message"):
        encode(RebootReq())
