"""A /generate call split into sequences (managers/generate_call.py), as both fronts do it:
batch x n with sample rids and abort keys, per-prompt fields and their lengths, the sequence
cap, the call read from fields by name, the Engine's shape checks."""

from __future__ import annotations

import pytest

from radixlm.srt.managers.generate_call import (
    MAX_SEQUENCES_PER_REQUEST,
    GenerateCall,
    engine_prompts,
    split_call,
)
from radixlm.srt.managers.request_group import GenerateError
from radixlm.srt.sampling.params import MAX_N


def refusal(fn, *args, **kwargs) -> GenerateError:
    with pytest.raises(GenerateError) as err:
        fn(*args, **kwargs)
    assert err.value.status_code == 400
    return err.value


def test_a_batch_times_n_gets_sample_rids_and_abort_keys() -> None:
    call = GenerateCall(text=["a", "b"], sampling_params={"n": 2}, rid="r", stream=True)
    inputs, is_batch = split_call(call)
    assert is_batch and [i.text for i in inputs] == ["a", "a", "b", "b"]
    assert [i.rid for i in inputs] == ["r_0_0", "r_0_1", "r_1_0", "r_1_1"]
    assert [i.abort_keys for i in inputs] == [("r", "r_0")] * 2 + [("r", "r_1")] * 2
    assert all(i.stream and i.log_metrics and not i.return_logprob for i in inputs)
    single, is_batch = split_call(GenerateCall(input_ids=[1, 2], rid="x"))
    assert not is_batch and single[0].rid == "x" and single[0].abort_keys == ()
    samples, is_batch = split_call(
        GenerateCall(input_ids=[1, 2], rid="x", sampling_params={"n": 3})
    )
    assert is_batch and [(s.rid, s.abort_keys) for s in samples] == [
        ("x_0", ("x",)),
        ("x_1", ("x",)),
        ("x_2", ("x",)),
    ]


def test_per_prompt_fields_are_picked_and_their_lengths_checked() -> None:
    call = GenerateCall(
        input_ids=[[1], [2]],
        return_logprob=[True, None],
        top_logprobs_num=2,
        token_ids_logprob=[[5], None],
        rid=["p", "q"],
    )
    inputs, _ = split_call(call)
    assert [i.return_logprob for i in inputs] == [True, False]  # null: the default
    assert [i.top_logprobs_num for i in inputs] == [2, 2]
    assert [i.logprob_start_len for i in inputs] == [-1, -1]
    assert [i.token_ids_logprob for i in inputs] == [[5], None]
    assert [i.rid for i in inputs] == ["p", "q"]
    err = refusal(split_call, GenerateCall(text=["a", "b"], return_logprob=[True] * 3))
    assert err.message == "return_logprob has 3 entries for 2 prompts"
    assert err.param == "return_logprob"
    err = refusal(split_call, GenerateCall(text=["a", "b"], sampling_params=[{}]))
    assert err.param == "sampling_params"
    assert "unique" in refusal(split_call, GenerateCall(text=["a", "b"], rid=["s", "s"])).message
    assert "exactly one" in refusal(split_call, GenerateCall()).message
    assert refusal(split_call, GenerateCall(text=[])).message == "the batch is empty"
    assert refusal(split_call, GenerateCall(text="a", sampling_params={"n": 0})).param == "n"


def test_the_sequence_cap() -> None:
    num_prompts = MAX_SEQUENCES_PER_REQUEST // MAX_N + 1
    call = GenerateCall(text=["a"] * num_prompts, sampling_params={"n": MAX_N})
    err = refusal(split_call, call)
    assert err.param == "n"
    assert err.message == (
        f"this request asks for {num_prompts * MAX_N} sequences (prompts x n); at most "
        f"{MAX_SEQUENCES_PER_REQUEST} per request"
    )
    inputs, _ = split_call(call, capped=False)  # the Engine has no cap
    assert len(inputs) == num_prompts * MAX_N


def test_a_call_is_read_from_fields_by_name_and_the_engine_shapes_are_checked() -> None:
    call = GenerateCall.from_fields({"text": "a", "stream": True, "model": "m", "priority": 1})
    assert call == GenerateCall(text="a", stream=True, priority=1)
    engine_prompts("a", None, [{}])
    with pytest.raises(GenerateError, match="pass exactly one of prompt"):
        engine_prompts(None, None, None)
    with pytest.raises(GenerateError, match="prompt must be a non-empty str or list of str"):
        engine_prompts([1], None, None)
    with pytest.raises(GenerateError, match="non-empty list of ints or of non-empty lists"):
        engine_prompts(None, [[1], []], None)
    with pytest.raises(GenerateError, match="got 1 sampling_params for 2 prompts"):
        engine_prompts(None, [[1], [2]], [{}])


def test_bootstrap_fields_are_spread_one_per_sequence() -> None:
    # sglang-router's PD mode: one value for one sequence, a list of one per sequence else
    call = GenerateCall(text="a", bootstrap_host="h", bootstrap_port=9, bootstrap_room=7)
    (one,), _ = split_call(call)
    assert (one.bootstrap_host, one.bootstrap_port, one.bootstrap_room) == ("h", 9, 7)
    call = GenerateCall(
        text=["a", "b"],
        sampling_params={"n": 2},
        bootstrap_host=["h"] * 4,
        bootstrap_port=9,
        bootstrap_room=[1, 2, 3, 4],
    )
    inputs, _ = split_call(call)
    assert [i.bootstrap_room for i in inputs] == [1, 2, 3, 4]
    assert {i.bootstrap_port for i in inputs} == {9}
    assert split_call(GenerateCall(text="a"))[0][0].bootstrap_room is None


def test_a_bootstrap_room_is_never_shared_by_two_sequences() -> None:
    call = GenerateCall(text=["a", "b"], bootstrap_room=5)
    assert refusal(split_call, call).param == "bootstrap_room"
    call = GenerateCall(text=["a", "b"], sampling_params={"n": 2}, bootstrap_room=[1, 2])
    err = refusal(split_call, call)
    assert err.param == "bootstrap_room" and "2 entries for 4 sequences" in str(err)
