"""The transfer path's pure parts (byte ranges of a page-granular copy, layout fingerprints,
the pair's messages and the prefill worker's refusal of a registration that does not match),
and one real write between two Mooncake engines on 127.0.0.1 (TCP transport)."""

from __future__ import annotations

import pytest
import torch

from radixlm.srt.disaggregation import (
    KVLayout,
    Outcome,
    Registration,
    TransferError,
    kv_writes,
    make_transfer_engine,
    prompt_digest,
    slot_runs,
)
from radixlm.srt.disaggregation.handshake import decode, encode, registration_problem


def pool(num_slots: int = 16, layers: int = 2, fill: float = 0.0) -> tuple[list, list]:
    def buf(i: int) -> torch.Tensor:
        return torch.full((num_slots, 2, 4), fill + i, dtype=torch.float32)

    return [buf(i) for i in range(layers)], [buf(10 + i) for i in range(layers)]


def test_slot_runs_merge_what_is_contiguous_on_both_sides():
    assert slot_runs([4, 5, 6, 9, 10], [0, 1, 2, 3, 4]) == [(4, 0, 3), (9, 3, 2)]
    assert slot_runs([1, 2, 3], [7, 9, 10]) == [(1, 7, 1), (2, 9, 2)]
    assert slot_runs([], []) == []


def test_kv_writes_cover_each_layer_k_and_v_per_run():
    k, v = pool()
    local = KVLayout.of_pool(k, v, 1, "m")
    remote_k, remote_v = [1000, 2000], [3000, 4000]
    srcs, dsts, lens = kv_writes(local, remote_k, remote_v, [4, 5, 9], [0, 1, 7])
    b = local.slot_bytes
    assert b == 2 * 4 * 4
    assert len(srcs) == 2 * 2 * 2  # (K, V) x layers x runs
    assert srcs[0] == k[0].data_ptr() + 4 * b and dsts[0] == 1000 and lens[0] == 2 * b
    assert srcs[1] == k[0].data_ptr() + 9 * b and dsts[1] == 1000 + 7 * b and lens[1] == b
    assert dsts[4] == 3000 and srcs[4] == v[0].data_ptr() + 4 * b


def test_fingerprint_differs_with_page_size_dtype_and_model():
    k, v = pool()
    base = KVLayout.of_pool(k, v, 1, "m").fingerprint
    assert KVLayout.of_pool(k, v, 1, "m").fingerprint == base
    assert KVLayout.of_pool(k, v, 16, "m").fingerprint != base
    assert KVLayout.of_pool(k, v, 1, "other").fingerprint != base
    k16 = [b.to(torch.bfloat16) for b in k]
    assert KVLayout.of_pool(k16, k16, 1, "m").fingerprint != base


def registration(**changes) -> Registration:
    ids = [5, 6, 7, 8]
    fields = dict(
        room=2**64 - 1,
        session="127.0.0.1:1",
        notify="tcp://127.0.0.1:2",
        fingerprint="fp",
        k_addrs=[1],
        v_addrs=[2],
        slots=[10, 11, 12],
        start=1,
        num_tokens=4,
        prompt_digest=prompt_digest(ids),
    )
    return Registration(**{**fields, **changes})


def test_messages_round_trip_with_64_bit_rooms():
    msg = registration()
    assert decode(encode(msg)) == msg
    out = Outcome(room=2**64 - 1, ok=True, first_token=42)
    assert decode(encode(out)) == out


def test_registration_problem_refuses_mismatches():
    ids = [5, 6, 7, 8]
    assert registration_problem(registration(), "fp", ids) is None
    assert "layouts differ" in registration_problem(registration(fingerprint="x"), "fp", ids)
    assert "prompts differ" in registration_problem(registration(), "fp", [5, 6, 7, 9])
    assert "prompts differ" in registration_problem(registration(num_tokens=5), "fp", ids)
    assert "destination slots" in registration_problem(registration(slots=[1]), "fp", ids)
    assert "destination slots" in registration_problem(registration(start=4, slots=[]), "fp", ids)


def test_unknown_backend_is_a_value_error():
    with pytest.raises(ValueError, match="unknown transfer backend"):
        make_transfer_engine("nixl", "127.0.0.1", "tcp", None)


@pytest.fixture(scope="module")
def engines():
    pytest.importorskip("mooncake.engine", reason="mooncake-transfer-engine is not installed")
    return [make_transfer_engine("mooncake", "127.0.0.1", "tcp", None) for _ in range(2)]


def test_mooncake_writes_kv_pages_between_two_engines(engines):
    src_engine, dst_engine = engines
    k, v = pool(fill=1.0)
    dk, dv = pool(fill=-100.0)
    src_engine.register(k + v)
    dst_engine.register(dk + dv)
    local = KVLayout.of_pool(k, v, 1, "m")
    remote = KVLayout.of_pool(dk, dv, 1, "m")
    writes = kv_writes(local, list(remote.k_addrs), list(remote.v_addrs), [3, 4, 8], [0, 1, 5])
    src_engine.write_batch(dst_engine.session_id, *writes)
    for layer in range(2):
        assert torch.equal(dk[layer][[0, 1, 5]], k[layer][[3, 4, 8]])
        assert torch.equal(dv[layer][[0, 1, 5]], v[layer][[3, 4, 8]])
        assert torch.all(dk[layer][2] == -100.0 + layer)  # untouched


def test_mooncake_write_to_a_gone_peer_raises(engines):
    k, _ = pool()
    with pytest.raises(TransferError):
        engines[0].write_batch("127.0.0.1:1", [k[0].data_ptr()], [k[0].data_ptr()], [8])


def test_mooncake_takes_thousands_of_scattered_page_writes(engines):
    # one write per run: a long prompt over scattered slots; the TCP transport refuses a single
    # batch this large ("queue-full"), so the engine submits it in parts
    src_engine, dst_engine = engines
    k, v = pool(num_slots=2048, fill=3.0)
    dk, dv = pool(num_slots=2048, fill=-1.0)
    src_engine.register(k + v)
    dst_engine.register(dk + dv)
    local, remote = KVLayout.of_pool(k, v, 1, "m"), KVLayout.of_pool(dk, dv, 1, "m")
    src, dst = list(range(0, 2048, 2)), list(range(1, 2048, 2))
    writes = kv_writes(local, list(remote.k_addrs), list(remote.v_addrs), src, dst)
    assert len(writes[0]) == 4 * 1024
    src_engine.write_batch(dst_engine.session_id, *writes)
    assert torch.equal(dv[1][dst], v[1][src])


@pytest.mark.parametrize(
    "options, message",
    [
        ({"disaggregation_mode": "both"}, "disaggregation_mode must be one of"),
        ({"disaggregation_mode": "decode", "tp_size": 2}, "tp_size 1"),
        ({"disaggregation_mode": "prefill", "disaggregation_bootstrap_port": 0}, "bootstrap_port"),
        ({"disaggregation_mode": "decode", "disaggregation_transfer_timeout_s": 0}, "timeout"),
        ({"disaggregation_mode": "prefill", "speculative_algorithm": "ngram"}, "speculative"),
        ({"disaggregation_transfer_backend": "nixl"}, "must be one of"),
    ],
)
def test_the_disaggregation_flags_are_checked_at_start_up(options, message):
    from radixlm.srt.config import ServerConfig, validate

    with pytest.raises(ValueError, match=message):
        validate(ServerConfig(**options))
    validate(ServerConfig(disaggregation_mode="prefill"))  # the defaults are valid
