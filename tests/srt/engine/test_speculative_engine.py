"""Speculative decoding through the Engine: n > 1, streaming and server info on a tiny random
Llama (CPU); greedy identity with the triton and flashinfer backends (GPU, overlap scheduling
and CUDA graphs on); n-gram speculation on the default model with a copy-heavy prompt (slow)."""

from __future__ import annotations

import os
import random
from collections.abc import Sequence
from typing import Any

import pytest

from radixlm.srt.speculative import Draft, Drafter


def _engine(model_dir, **options):
    from radixlm.srt import Engine

    return Engine(model_path=str(model_dir), log_level="warning", **options)


def _repetitive(seed: int, num: int) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(num):
        phrase = [rng.randrange(100, 2000) for _ in range(rng.randrange(4, 9))]
        out.append([rng.randrange(100, 2000) for _ in range(3)] + phrase * 4)
    return out


def _idle(engine) -> None:
    assert engine.scheduler.check_idle()
    assert not engine.scheduler.spec.plans


GREEDY = {"temperature": 0, "max_new_tokens": 32, "ignore_eos": True}


def test_n_samples_stream_and_server_info(tiny_llama_dir):
    prompt = _repetitive(1, 1)[0]
    plain = _engine(tiny_llama_dir, max_total_tokens=4096)
    try:
        want = plain.generate(input_ids=prompt, sampling_params=GREEDY)["output_ids"]
        assert "speculative" not in plain.get_server_info()
    finally:
        plain.shutdown()
    engine = _engine(tiny_llama_dir, max_total_tokens=4096, speculative_algorithm="NGRAM")
    try:
        outs = engine.generate(input_ids=prompt, sampling_params={**GREEDY, "n": 3})
        assert [o["output_ids"] for o in outs] == [want] * 3
        chunks = list(engine.generate(input_ids=prompt, sampling_params=GREEDY, stream=True))
        assert chunks[-1]["output_ids"] == want
        assert 1 < len(chunks) < len(want)  # several tokens per step
        info = engine.get_server_info()["speculative"]
        assert info["algorithm"] == "ngram" and info["num_accepted_tokens"] > 0
        assert info["mean_accept_length"] > 1.5, info
        _idle(engine)
    finally:
        engine.shutdown()


class _SpoiledOracle(Drafter):
    """The reference continuation, one token spoiled at a cycling position."""

    name = "spoiled-oracle"

    def __init__(self, reference: dict[tuple[int, ...], list[int]]) -> None:
        self.reference = reference
        self.step = 0

    def propose(self, reqs: Sequence[Any], max_tokens: Sequence[int]) -> list[Draft]:
        out = []
        for req, n in zip(reqs, max_tokens, strict=True):
            pos = len(req.output_ids)
            draft = list(self.reference[tuple(req.prompt_ids)][pos : pos + n])
            self.step += 1
            if self.step % (n + 1) < len(draft):
                draft[self.step % (n + 1)] += 1
            out.append(Draft(draft))
        return out

    def stats(self) -> dict[str, float]:
        return {"num_proposed": 0.0, "num_accepted": 0.0}


BACKENDS = os.environ.get("RADIXLM_GPU_TEST_BACKENDS", "triton,flashinfer").split(",")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "flashinfer"])
def test_gpu_greedy_outputs_unchanged_by_speculation(tmp_path, backend):
    """The same random model (dummy weights, seeded; LM head scaled so that logits are sharp)
    with and without speculation: n-gram drafts on repetitive prompts, and drafts right up to
    a spoiled token; overlap scheduling and CUDA graphs as configured by default."""
    import torch

    from radixlm.srt.bench.bench_gpu import TINY_LLAMA, make_model_folder

    if backend not in BACKENDS:
        pytest.skip(f"{backend} not in RADIXLM_GPU_TEST_BACKENDS")
    shape = TINY_LLAMA
    folder = make_model_folder(tmp_path, shape)
    dtype = "float32" if backend == "triton" else "float16"  # flashinfer has no fp32 kernels
    prompts = _repetitive(2, 4) + [
        [random.Random(i).randrange(2, 2048) for _ in range(40)] for i in range(2)
    ]

    def run(drafter=None, **options):
        engine = _engine(
            folder,
            load_format="dummy",
            attention_backend=backend,
            dtype=dtype,
            max_total_tokens=16384,
            **options,
        )
        try:
            with torch.inference_mode():
                for name, p in engine.scheduler.runner.model.named_parameters():
                    if "lm_head" in name:
                        p.mul_(20.0)
            if drafter is not None:
                engine.scheduler.spec.drafter = drafter
            # twice: the second time the n-gram drafter also finds the first outputs in the
            # prefix cache
            runs = [engine.generate(input_ids=prompts, sampling_params=GREEDY) for _ in "ab"]
            _idle(engine)
            info = engine.get_server_info().get("speculative")
            ids = [[o["output_ids"] for o in r] for r in runs]
            assert ids[0] == ids[1]
            return ids[1], info
        finally:
            engine.shutdown()

    want, _ = run()
    for page_size in (1, 16):
        got, info = run(speculative_algorithm="ngram", page_size=page_size)
        assert got == want and info["num_accepted_tokens"] > 0, (page_size, info)
    oracle = _SpoiledOracle({tuple(p): w for p, w in zip(prompts, want, strict=True)})
    got, info = run(oracle, speculative_algorithm="ngram")
    assert got == want and info["acceptance_rate"] > 0.3, info


@pytest.mark.slow
def test_default_model_ngram_copy_heavy_prompt(smol_engine, default_model_dir):
    """The default model asked to copy a passage: the same greedy text with n-gram speculation
    as without (the session's engine), with drafts accepted."""
    passage = (
        "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. "
        "How vexingly quick daft zebras jump! Sphinx of black quartz, judge my vow."
    )
    prompt = f"{passage}\n{passage}\n{passage}\n{passage[:40]}"
    params = {"temperature": 0, "max_new_tokens": 32}
    want = smol_engine.generate(prompt, params)["text"]
    engine = _engine(default_model_dir, max_total_tokens=4096, speculative_algorithm="ngram")
    try:
        got = engine.generate(prompt, params)["text"]
        info = engine.get_server_info()["speculative"]
        _idle(engine)
    finally:
        engine.shutdown()
    assert got == want
    assert info["acceptance_rate"] > 0.3 and info["mean_accept_length"] > 2, info
