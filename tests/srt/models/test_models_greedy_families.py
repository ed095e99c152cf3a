"""Mistral, Phi-3, Gemma 2 and Gemma 3 served by the Engine (CPU, torch attention) give
transformers' greedy ids for 32 steps: fresh prefills, a prompt longer than the prefill chunk
(chunked prefill), and a prompt that extends an earlier one (its prefix from the radix cache).
Every checkpoint's sliding window (6 keys) is shorter than the prompts. On a GPU the Triton
kernels run the same check in float32."""

from __future__ import annotations

import pytest
import torch
from tiny_checkpoints import VOCAB, write_checkpoint

pytestmark = pytest.mark.slow

STEPS = 32
CHUNK = 16
GREEDY = {"temperature": 0, "max_new_tokens": STEPS, "ignore_eos": True}


def _ids(n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (n,), generator=gen).tolist()


PROMPTS = [_ids(5, 1), _ids(40, 2)]  # the second runs in three chunks
EXTENDED = PROMPTS[1] + _ids(7, 3)  # reuses the second prompt's cached tokens


@torch.no_grad()
def hf_greedy(folder, prompt: list[int]) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    )
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=STEPS,
        min_new_tokens=STEPS,
        do_sample=False,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize(
    "backend,device",
    [("torch", "cpu"), pytest.param("triton", "cuda", marks=pytest.mark.gpu)],
)
@pytest.mark.parametrize(
    "name", ["mistral_window", "phi3_fused_window", "gemma2_softcap", "gemma3_local_global"]
)
def test_greedy_ids_equal_transformers(name, backend, device, tmp_path, default_model_dir):
    from transformers import AutoTokenizer

    from radixlm.srt import Engine

    folder = write_checkpoint(name, tmp_path)
    AutoTokenizer.from_pretrained(default_model_dir).save_pretrained(folder)
    refs = [hf_greedy(folder, p) for p in (*PROMPTS, EXTENDED)]
    with Engine(
        str(folder),
        device=device,
        attention_backend=backend,
        dtype="float32",
        chunked_prefill_size=CHUNK,
        max_total_tokens=2048,
        log_level="warning",
    ) as engine:
        outs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        again = engine.generate(input_ids=EXTENDED, sampling_params=GREEDY)
    assert [o["output_ids"] for o in outs] == refs[:2]
    assert again["meta_info"]["cached_tokens"] >= len(PROMPTS[1]) - 1
    assert again["output_ids"] == refs[2]
