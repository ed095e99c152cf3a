"""Constrained decoding on a GPU: the Triton mask kernel, mask rows prefetched during the forward
pass, CUDA graphs and the outlines-core worker process together give the CPU engine's greedy
outputs on the same weights, and sampled outputs obey their grammars."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest

pytestmark = pytest.mark.gpu

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "kind", "ok"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{3}-[0-9]{2,4}"
CHOICES = ["alpha", "beta", "gamma"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tiny_model_writer):
    """A random 2-layer Llama over a small byte-level BPE tokenizer."""
    from radixlm.grammar.testing import train_byte_level_tokenizer

    tok = train_byte_level_tokenizer()
    return tiny_model_writer(
        tmp_path_factory.mktemp("gpu-grammar-llama"),
        tok,
        hidden_size=128,
        intermediate_size=256,
        bos_token_id=tok.eos_token_id,
        tie_word_embeddings=False,
    )


def _requests(n_each: int, temperature: float) -> tuple[list[list[int]], list[dict]]:
    rng = random.Random(3)
    prompts, params = [], []
    grammars = [{"json_schema": json.dumps(SCHEMA)}, {"regex": REGEX}, {"choices": CHOICES}, {}]
    for i in range(n_each * len(grammars)):
        prompts.append([rng.randrange(3, 400) for _ in range(rng.randrange(4, 40))])
        params.append(
            {
                "temperature": temperature,
                "max_new_tokens": 48,
                "seed": i,
                **grammars[i % len(grammars)],
            }
        )
    return prompts, params


def _run(model_dir, device: str, temperature: float) -> list[dict]:
    from radixlm.srt import Engine

    engine = Engine(
        model_path=str(model_dir),
        device=device,
        dtype="float32",
        max_total_tokens=8192,
        log_level="warning",
    )
    try:
        prompts, params = _requests(3, temperature)
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        stats = engine.scheduler.grammars.stats
        assert stats.num_mask_rows > 0
        if device == "cuda":  # rows were filled on the worker thread during forward passes
            assert 0 < stats.num_prefetched_rows <= stats.num_mask_rows
        return outs
    finally:
        engine.shutdown()


def _check(outs: list[dict], params: list[dict]) -> None:
    for out, p in zip(outs, params, strict=True):
        if out["meta_info"]["finish_reason"]["type"] != "stop":
            continue  # cut by the token limit: a prefix only
        if "json_schema" in p:
            jsonschema.validate(json.loads(out["text"]), SCHEMA)
        elif "regex" in p:
            assert re.fullmatch(REGEX, out["text"]), out["text"]
        elif "choices" in p:
            assert out["text"] in CHOICES


def test_gpu_constrained_greedy_equals_cpu(model_dir):
    gpu = _run(model_dir, "cuda", 0.0)
    cpu = _run(model_dir, "cpu", 0.0)
    _, params = _requests(3, 0.0)
    _check(gpu, params)
    finished = [o for o, p in zip(gpu, params, strict=True) if p.get("choices") or p.get("regex")]
    assert all(o["meta_info"]["finish_reason"]["type"] == "stop" for o in finished)
    assert [o["output_ids"] for o in gpu] == [o["output_ids"] for o in cpu]


def test_gpu_sampled_outputs_obey_their_grammars(model_dir):
    _, params = _requests(3, 1.0)
    _check(_run(model_dir, "cuda", 1.0), params)
