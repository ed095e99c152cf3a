"""End to end: lm-evaluation-harness's API models (``local-completions``,
``local-chat-completions``) on `radixlm serve` (default model), unchanged. lm-eval finds the
server's tokenizer endpoints by itself (``/tokenizer_info``, ``/tokenize``, ``/detokenize``),
scores continuations through ``/v1/completions`` with ``echo`` + ``logprobs`` on batched token
prompts, and generates with stop strings. Scores are checked against transformers on the
same weights."""

from __future__ import annotations

import json
import math

import pytest
import torch

from radixlm.srt.server.process.server_process import ServerProcess

pytestmark = pytest.mark.slow
pytest.importorskip("lm_eval")

PAIRS = [
    ("The capital of France is", " Paris"),
    ("The capital of France is", " a large potato"),
    ("One, two, three,", " four"),
    ("Question: What color is the sky?\nAnswer:", " blue"),
]
GENERATE = [
    ("Q: What is 2+2?\nA:", {"until": ["\n"], "max_gen_toks": 16}),
    ("List three colors:", {"until": ["."], "max_gen_toks": 24, "temperature": 0}),
]


@pytest.fixture(scope="module")
def hf(default_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32)
    return model.eval(), AutoTokenizer.from_pretrained(default_model_dir)


def completions_lm(server: ServerProcess, **kw):
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    return LocalCompletionsAPI(
        base_url=server.url + "/v1/completions", model="default", max_length=2048, **kw
    )


def instances(kind: str, args: list[tuple]) -> list:
    from lm_eval.api.instance import Instance

    return [Instance(kind, {}, a, i) for i, a in enumerate(args)]


def reference_score(hf, context: str, continuation: str) -> tuple[float, bool]:
    """Sum of the continuation's log-probabilities and whether each of its tokens is the
    argmax, tokenised as lm-eval does (the whole text, split after the context's tokens)."""
    model, tok = hf
    whole = tok.encode(context + continuation, add_special_tokens=False)
    n_ctx = len(tok.encode(context, add_special_tokens=False))
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([whole])).logits[0].float(), dim=-1)
    rows = logp[n_ctx - 1 : len(whole) - 1]
    targets = torch.tensor(whole[n_ctx:])
    score = rows.gather(1, targets[:, None]).sum().item()
    return score, bool((rows.argmax(-1) == targets).all())


def test_remote_tokenizer_is_detected(idle_server: ServerProcess, hf) -> None:
    lm = completions_lm(idle_server, tokenizer_backend="auto")
    assert lm.tokenizer_backend == "remote"
    text = "Hello world, this is lm-eval."
    assert lm.tok_encode(text) == hf[1].encode(text, add_special_tokens=False)
    assert lm.tokenizer.decode(lm.tok_encode(text)) == text
    assert lm.eot_token_id == hf[1].eos_token_id


def test_loglikelihood_matches_transformers(idle_server: ServerProcess, hf) -> None:
    lm = completions_lm(idle_server, tokenizer_backend="auto", batch_size=4)
    scores = lm.loglikelihood(instances("loglikelihood", PAIRS))
    for (context, continuation), (score, greedy) in zip(PAIRS, scores, strict=True):
        ref_score, ref_greedy = reference_score(hf, context, continuation)
        assert math.isclose(score, ref_score, rel_tol=1e-3, abs_tol=2e-3), (continuation, score)
        assert greedy == ref_greedy, continuation
    assert scores[0][0] > scores[1][0]  # " Paris" beats " a large potato"


def test_loglikelihood_rolling_is_the_sum_over_the_text(idle_server: ServerProcess, hf) -> None:
    text = "Hello world. This is a test of rolling loglikelihood."
    lm = completions_lm(idle_server, tokenizer_backend="auto")
    (score,) = lm.loglikelihood_rolling(instances("loglikelihood_rolling", [(text,)]))
    # one window: every token scored after the end-of-text token lm-eval puts in front
    model, tok = hf
    ids = [lm.prefix_token_id, *tok.encode(text, add_special_tokens=False)]
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    ref = logp[:-1].gather(1, torch.tensor(ids[1:])[:, None]).sum().item()
    assert math.isclose(score, ref, rel_tol=1e-3), (score, ref)


def test_generate_until_stops_and_matches_greedy(idle_server: ServerProcess, hf) -> None:
    token_lm = completions_lm(idle_server, tokenizer_backend="auto", batch_size=2)
    text_lm = completions_lm(idle_server, tokenizer_backend=None, tokenized_requests=False)
    outs = token_lm.generate_until(instances("generate_until", GENERATE))
    assert text_lm.generate_until(instances("generate_until", GENERATE)) == outs
    model, tok = hf
    for (prompt, kw), out in zip(GENERATE, outs, strict=True):
        assert out and not any(stop in out for stop in kw["until"]), out
        ids = tok.encode(prompt, add_special_tokens=False)
        with torch.no_grad():
            ref = model.generate(
                torch.tensor([ids]), max_new_tokens=kw["max_gen_toks"], do_sample=False
            )
        ref_text = tok.decode(ref[0, len(ids) :])
        for stop in kw["until"]:
            ref_text = ref_text.split(stop)[0]
        assert out == ref_text


def test_chat_completions_model(idle_server: ServerProcess) -> None:
    from lm_eval.models.api_models import JsonChatStr
    from lm_eval.models.openai_completions import LocalChatCompletion

    lm = LocalChatCompletion(
        base_url=idle_server.url + "/v1/chat/completions", model="default", tokenized_requests=False
    )
    chat = JsonChatStr(json.dumps([{"role": "user", "content": "Say hello."}]))
    (out,) = lm.generate_until(
        instances("generate_until", [(chat, {"until": ["\n"], "max_gen_toks": 16})])
    )
    assert isinstance(out, str) and out and "\n" not in out
