"""Tensor parallelism in the in-process Engine: rank 0 in the test process, rank 1 a spawned
child (gloo on CPUs). TP=2 is checked against TP=1 on the same tiny random Llama (4 query and
2 KV heads, so each rank holds 2 and 1): greedy ids, a chunked prefill, radix reuse, a JSON
schema, logprobs; a killed follower makes later calls raise and leaves no process behind. The
layout helpers (which ranks a machine runs, the rendezvous) are checked without processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import psutil
import pytest
import torch

from radixlm.srt.config import ServerConfig
from radixlm.srt.managers.tp_ranks import ranks_on_this_node, with_rendezvous

GREEDY = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
PROMPTS = [
    "Hello there, how are you",
    "The capital of France is",
    "1 2 3 4 5 6 7 8",
    # longer than CHUNK tokens: its prefill runs in several chunks
    "A long prompt that the scheduler splits into chunks: " + "one two three four " * 6,
]
CHUNK = 16
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
ENGINE_OPTIONS = dict(
    device="cpu", log_level="warning", max_total_tokens=2048, chunked_prefill_size=CHUNK
)


def test_ranks_are_spread_evenly_over_machines() -> None:
    def cfg(**kw) -> ServerConfig:
        return ServerConfig(dist_init_addr="10.0.0.1:5000", **kw)

    assert list(ranks_on_this_node(ServerConfig())) == [0]
    assert list(ranks_on_this_node(cfg(tp_size=4))) == [0, 1, 2, 3]
    assert list(ranks_on_this_node(cfg(tp_size=4, nnodes=2, node_rank=0))) == [0, 1]
    assert list(ranks_on_this_node(cfg(tp_size=4, nnodes=2, node_rank=1))) == [2, 3]
    assert list(ranks_on_this_node(cfg(tp_size=8, nnodes=4, node_rank=3))) == [6, 7]


def test_rendezvous_is_a_free_local_port_unless_given() -> None:
    assert with_rendezvous(ServerConfig()).dist_init_addr is None  # one rank: no group
    given = ServerConfig(tp_size=2, dist_init_addr="10.0.0.1:5000")
    assert with_rendezvous(given).dist_init_addr == "10.0.0.1:5000"
    host, port = with_rendezvous(ServerConfig(tp_size=2)).dist_init_addr.split(":")
    assert host == "127.0.0.1" and 0 < int(port) < 65536


def test_engine_refuses_a_follower_machine(tiny_llama_dir) -> None:
    from radixlm.srt import Engine

    with pytest.raises(ValueError, match="node_rank must be 0"):
        Engine(
            str(tiny_llama_dir),
            tp_size=2,
            nnodes=2,
            node_rank=1,
            dist_init_addr="127.0.0.1:1",
            log_level="warning",
        )


@pytest.mark.slow
def test_tp_size_that_does_not_fit_the_heads(tiny_llama_dir) -> None:
    """3 ranks for 2 KV heads: rank 0's ValueError (naming tp_size) reaches the caller, the
    followers are reaped and the group is left."""
    from radixlm.srt import Engine

    threads = torch.get_num_threads()
    before = {p.pid for p in psutil.Process().children()}
    with pytest.raises(ValueError, match="tp_size 3"):
        Engine(str(tiny_llama_dir), tp_size=3, **ENGINE_OPTIONS)
    torch.set_num_threads(threads)
    left = [p for p in psutil.Process().children() if p.pid not in before]
    assert not [p for p in left if p.name().startswith("radixlm-")]
    assert not torch.distributed.is_initialized()


def run_all(engine) -> dict[str, object]:
    """Every request the comparison covers, on one engine."""
    out: dict[str, object] = {}
    out["greedy"] = [o["output_ids"] for o in engine.generate(PROMPTS, GREEDY)]
    schema = {**GREEDY, "json_schema": json.dumps(SCHEMA), "max_new_tokens": 48}
    schema.pop("ignore_eos")
    constrained = engine.generate("A person as JSON:", schema)
    out["json"] = (constrained["output_ids"], constrained["text"])
    logprob = engine.generate(
        PROMPTS[1], GREEDY, return_logprob=True, top_logprobs_num=3, logprob_start_len=0
    )
    out["logprob"] = logprob["meta_info"]
    # sampling runs on rank 0 over the gathered full-vocabulary logits, with the request's own
    # generator: a seeded request draws the same tokens at every TP size unless a row's logits
    # differ at a near tie of the draw (row-parallel sums round differently: ~1e-6 here)
    sampled = {"temperature": 0.9, "top_p": 0.95, "seed": 7, "max_new_tokens": 16}
    out["seeded"] = [
        o["output_ids"] for o in engine.generate(PROMPTS[:2], {**sampled, "ignore_eos": True})
    ]
    return out


@pytest.fixture(scope="module")
def reference(tiny_llama_dir) -> dict[str, object]:
    from radixlm.srt import Engine

    with Engine(str(tiny_llama_dir), **ENGINE_OPTIONS) as engine:
        return run_all(engine)


@pytest.fixture(scope="module")
def tp_engine(tiny_llama_dir) -> Iterator:
    from radixlm.srt import Engine

    threads = torch.get_num_threads()  # rank 0 shares this machine's cores with rank 1
    engine = Engine(str(tiny_llama_dir), tp_size=2, **ENGINE_OPTIONS)
    yield engine
    engine.shutdown()
    torch.set_num_threads(threads)


def follower_pids(engine) -> list[int]:
    return [p.pid for p in engine._ranks.followers.procs.values()]


def assert_logprobs_match(got: dict, want: dict) -> None:
    for key in ("input_token_logprobs", "output_token_logprobs"):
        assert len(got[key]) == len(want[key]), key
        for (lp, tid, *_), (ref_lp, ref_tid, *_) in zip(got[key], want[key], strict=True):
            assert tid == ref_tid
            assert (lp is None) == (ref_lp is None)
            if lp is not None:
                assert lp == pytest.approx(ref_lp, abs=1e-4)
    for got_top, want_top in zip(
        got["output_top_logprobs"], want["output_top_logprobs"], strict=True
    ):
        assert [t[1] for t in got_top] == [t[1] for t in want_top]


@pytest.mark.slow
def test_tp2_matches_tp1(tp_engine, reference) -> None:
    assert tp_engine.get_server_info()["max_total_tokens"] == 2048
    got = run_all(tp_engine)
    assert got["greedy"] == reference["greedy"]
    assert got["seeded"] == reference["seeded"]
    assert got["json"] == reference["json"]
    text = got["json"][1]
    assert text.startswith('{"name":"')  # the grammar held (a random model rarely finishes)
    if text.rstrip().endswith("}"):  # finished within the budget: valid under the schema
        value = json.loads(text)
        assert set(value) == {"name", "age"} and isinstance(value["age"], int)
    assert_logprobs_match(got["logprob"], reference["logprob"])
    assert tp_engine.scheduler.check_idle()


@pytest.mark.slow
def test_tp2_reuses_a_cached_prefix(tp_engine, reference) -> None:
    first = tp_engine.generate(PROMPTS[3], GREEDY)
    again = tp_engine.generate(PROMPTS[3], GREEDY)
    assert again["meta_info"]["cached_tokens"] > CHUNK  # beyond the first chunk
    assert first["output_ids"] == again["output_ids"] == reference["greedy"][3]
    assert tp_engine.scheduler.check_idle()


@pytest.mark.slow
def test_killed_follower_stops_the_engine(tp_engine) -> None:
    """Last in the module (it breaks the shared engine): later calls raise, shutdown reaps the
    followers and leaves the group, so a new tensor-parallel Engine may start."""
    pids = follower_pids(tp_engine)
    assert tp_engine.generate(PROMPTS[0], GREEDY)["meta_info"]["completion_tokens"] == 12
    os.kill(pids[0], signal.SIGKILL)
    time.sleep(0.5)
    with pytest.raises(RuntimeError, match="rank 1 exited"):
        tp_engine.generate(PROMPTS[0], GREEDY)
    with pytest.raises(RuntimeError, match="create a new Engine"):
        tp_engine.generate(PROMPTS[1], GREEDY)
    tp_engine.shutdown()
    assert not [p for p in pids if psutil.pid_exists(p)]
    assert not torch.distributed.is_initialized()


EXIT_WITHOUT_SHUTDOWN = """
import os, sys
from radixlm.srt import Engine
if __name__ == "__main__":
    engine = Engine(sys.argv[1], tp_size=2, device="cpu", max_total_tokens=2048)
    print(*[p.pid for p in engine._ranks.followers.procs.values()], flush=True)
    engine.generate("Hi", {"max_new_tokens": 2})
"""


@pytest.mark.slow
def test_script_exits_without_shutdown(tiny_llama_dir, tmp_path) -> None:
    """A script that never calls shutdown still exits (the followers stop at exit instead of
    blocking multiprocessing's wait for its children) and leaves no follower."""
    script = tmp_path / "script.py"
    script.write_text(EXIT_WITHOUT_SHUTDOWN)
    done = subprocess.run(
        [sys.executable, str(script), str(tiny_llama_dir)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    pids = [int(p) for p in done.stdout.split()]
    assert len(pids) == 1 and not psutil.pid_exists(pids[0])


@pytest.mark.gpu
def test_tp2_engine_on_two_gpus(default_model_dir) -> None:
    """NCCL between two GPUs, the default model in float32: greedy outputs equal TP=1's, the
    pool is idle afterwards, and shutdown reaps the follower."""
    from radixlm.srt import Engine

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    params = {"temperature": 0, "max_new_tokens": 32}
    options = dict(dtype="float32", max_total_tokens=16384, log_level="warning")
    with Engine(**options) as engine:
        want = [o["output_ids"] for o in engine.generate(PROMPTS, params)]
    torch.cuda.empty_cache()
    engine = Engine(tp_size=2, **options)
    try:
        pids = follower_pids(engine)
        assert [o["output_ids"] for o in engine.generate(PROMPTS, params)] == want
        again = engine.generate(PROMPTS[3], params)
        assert again["meta_info"]["cached_tokens"] > 0 and again["output_ids"] == want[3]
        assert engine.scheduler.check_idle()
    finally:
        engine.shutdown()
    assert not [p for p in pids if psutil.pid_exists(p)]


def test_more_ranks_than_this_machine_runs_are_refused_before_any_process(tiny_llama_dir) -> None:
    from radixlm.srt import Engine

    before = {p.pid for p in psutil.Process().children()}
    with pytest.raises(ValueError, match="tp_size 4096 .* needs 4096 ranks here"):
        Engine(str(tiny_llama_dir), tp_size=4096, **ENGINE_OPTIONS)
    assert {p.pid for p in psutil.Process().children()} == before
    assert not torch.distributed.is_initialized()
