"""The Engine on the embedded SmolLM2: correctness against transformers, sampling, limits."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.slow  # the default model (smol_engine)

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "1, 2, 3, 4,",
]
GREEDY = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}


def test_capital_of_france(smol_engine):
    prompt = smol_engine.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}]
    )
    out = smol_engine.generate(prompt, {"temperature": 0, "max_new_tokens": 32})
    assert "Paris" in out["text"]
    assert out["meta_info"]["finish_reason"]["type"] == "stop"


def test_greedy_matches_transformers_generate(smol_engine, default_model_dir):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(default_model_dir, torch_dtype=torch.float32)
    tok = smol_engine.tokenizer
    for prompt in PROMPTS:
        ids = tok.encode(prompt)
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([ids]),
                max_new_tokens=16,
                do_sample=False,
                min_new_tokens=16,
                pad_token_id=tok.eos_token_id,
            )
        ours = smol_engine.generate(input_ids=ids, sampling_params=GREEDY)
        assert ours["output_ids"] == ref[0, len(ids) :].tolist(), prompt


def test_batch_of_mixed_lengths_equals_each_alone(smol_engine):
    alone = [smol_engine.generate(p, GREEDY)["output_ids"] for p in PROMPTS]
    batched = smol_engine.generate(PROMPTS, GREEDY)
    assert [b["output_ids"] for b in batched] == alone


def test_seeded_sampling_is_reproducible_whatever_the_batch(smol_engine):
    params = {
        "temperature": 1.0,
        "top_p": 0.95,
        "max_new_tokens": 12,
        "seed": 1234,
        "ignore_eos": True,
    }
    first = smol_engine.generate(PROMPTS[0], params)["output_ids"]
    again = smol_engine.generate(PROMPTS[0], params)["output_ids"]
    others = [{**params, "seed": None}, {**params, "seed": 7}, params]
    in_batch = smol_engine.generate([PROMPTS[1], PROMPTS[2], PROMPTS[0]], others)[2]["output_ids"]
    other_seed = smol_engine.generate(PROMPTS[0], {**params, "seed": 99})["output_ids"]
    assert first == again == in_batch
    assert other_seed != first


def test_every_kv_slot_is_free_after_requests_finish(smol_engine):
    smol_engine.generate(PROMPTS * 3, {"temperature": 0.7, "max_new_tokens": 8})
    info = smol_engine.get_server_info()
    assert info["num_running"] == 0 and info["num_waiting"] == 0
    assert info["available"] + info["evictable"] + info["protected"] == info["max_total_tokens"]
    assert smol_engine.scheduler.check_idle()
    assert smol_engine.flush_cache()
    assert smol_engine.get_server_info()["available"] == info["max_total_tokens"]


def test_stop_conditions(smol_engine):
    # every stop below falls within the first few tokens: 12 leave a tail behind each of them
    base = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    full = smol_engine.generate(PROMPTS[3], base)
    text = full["text"]
    stop = text[4:7]
    cut = smol_engine.generate(PROMPTS[3], {**base, "stop": stop})
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert cut["text"] == text[: text.index(stop)]
    kept = smol_engine.generate(PROMPTS[3], {**base, "stop": [stop], "no_stop_trim": True})
    assert kept["text"].endswith(stop)
    tok_id = full["output_ids"][3]
    by_id = smol_engine.generate(
        PROMPTS[3], {**base, "ignore_eos": False, "stop_token_ids": [tok_id]}
    )
    first = full["output_ids"].index(tok_id)
    assert by_id["output_ids"] == full["output_ids"][: first + 1]
    assert by_id["meta_info"]["finish_reason"] == {"type": "stop", "matched": tok_id}
    # SGLang's rule: ignore_eos turns stop_token_ids off too
    ignored = smol_engine.generate(PROMPTS[3], {**base, "stop_token_ids": [tok_id]})
    assert ignored["output_ids"] == full["output_ids"]
    length = smol_engine.generate(PROMPTS[3], {**base, "max_new_tokens": 5})
    assert length["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
    assert length["meta_info"]["completion_tokens"] == 5


def test_stop_string_ends_the_request_before_min_new_tokens(smol_engine):
    """min_new_tokens holds back EOS and stop ids only; a stop string ends the request where it
    appears (SGLang's rule), so the text, the ids and the streamed text agree."""
    prompt = "The capital of France is"
    free = smol_engine.generate(prompt, {"temperature": 0, "max_new_tokens": 8})
    assert free["text"].startswith(" Paris.")
    params = {"temperature": 0, "max_new_tokens": 8, "min_new_tokens": 6, "stop": "."}
    out = smol_engine.generate(prompt, params)
    assert out["text"] == " Paris"
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": "."}
    ids = out["output_ids"]
    assert smol_engine.tokenizer.decode(ids).startswith(" Paris.") and len(ids) < 6
    chunks = list(smol_engine.generate(prompt, params, stream=True))
    assert chunks[-1]["text"] == " Paris"  # the text so far, at the end


def test_stop_string_of_a_special_token(smol_engine):
    """The chatml stop SGLang's frontend sends ("<|im_end|>") matches the special token even
    when EOS is ignored; the special token's text is not in the output."""
    prompt = smol_engine.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}]
    )
    params = {"temperature": 0, "max_new_tokens": 48, "ignore_eos": True}
    out = smol_engine.generate(prompt, {**params, "stop": "<|im_end|>"})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": "<|im_end|>"}
    assert "Paris" in out["text"] and "<|im_end|>" not in out["text"]
    end = smol_engine.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert out["output_ids"][-1] == end and end not in out["output_ids"][:-1]


def test_min_new_tokens_holds_back_eos(smol_engine):
    prompt = smol_engine.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}]
    )
    short = smol_engine.generate(prompt, {"temperature": 0, "max_new_tokens": 64})
    assert short["meta_info"]["finish_reason"]["type"] == "stop"
    n = short["meta_info"]["completion_tokens"] + 5
    longer = smol_engine.generate(
        prompt, {"temperature": 0, "max_new_tokens": 64, "min_new_tokens": n}
    )
    assert longer["meta_info"]["completion_tokens"] >= n


def test_logprobs(smol_engine):
    ids = smol_engine.tokenizer.encode(PROMPTS[0])
    out = smol_engine.generate(
        input_ids=ids,
        sampling_params={**GREEDY, "max_new_tokens": 4},
        return_logprob=True,
        logprob_start_len=0,
        top_logprobs_num=3,
    )
    meta = out["meta_info"]
    inp = meta["input_token_logprobs"]
    assert [t for _, t, _ in inp] == ids and inp[0][0] is None
    assert all(lp <= 0 for lp, _, _ in inp[1:])
    outp = meta["output_token_logprobs"]
    assert [t for _, t, _ in outp] == out["output_ids"]
    for (lp, tok, _), top in zip(outp, meta["output_top_logprobs"], strict=True):
        assert len(top) == 3 and top[0][1] == tok and abs(top[0][0] - lp) < 1e-5  # greedy = top-1
    # the same input logprobs from a later start position, with the prefix now cached
    later = smol_engine.generate(
        input_ids=ids,
        sampling_params={**GREEDY, "max_new_tokens": 1},
        return_logprob=True,
        logprob_start_len=2,
    )
    tail = later["meta_info"]["input_token_logprobs"]
    assert [t for _, t, _ in tail] == ids[2:]
    assert all(abs(a[0] - b[0]) < 1e-4 for a, b in zip(tail, inp[2:], strict=True))


def test_streaming_yields_the_same_text(smol_engine):
    params = {**GREEDY, "max_new_tokens": 24}
    whole = smol_engine.generate(PROMPTS[2], params)
    chunks = list(smol_engine.generate(PROMPTS[2], params, stream=True))
    assert len(chunks) > 2
    assert chunks[-1]["text"] == whole["text"]
    texts = [c["text"] for c in chunks]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:], strict=False))


def test_prefill_only_request(smol_engine):
    out = smol_engine.generate(PROMPTS[0], {"max_new_tokens": 0})
    assert out["output_ids"] == [] and out["meta_info"]["finish_reason"]["type"] == "length"


@pytest.mark.parametrize(
    "params, name",
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"min_p": 2}, "min_p"),
        ({"max_new_tokens": -1}, "max_new_tokens"),
        ({"frequency_penalty": 5}, "frequency_penalty"),
        ({"bogus": 1}, "bogus"),
    ],
)
def test_invalid_sampling_params_raise_value_error(smol_engine, params, name):
    with pytest.raises(ValueError, match=name):
        smol_engine.generate(PROMPTS[0], params)


def test_too_long_prompt_is_rejected(smol_engine):
    with pytest.raises(ValueError, match="prompt has"):
        smol_engine.generate(input_ids=[1] * 9000, sampling_params={"max_new_tokens": 1})
