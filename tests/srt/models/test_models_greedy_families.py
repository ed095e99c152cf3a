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


CPU = ("torch", "cpu")
GPU = pytest.param("triton", "cuda", marks=pytest.mark.gpu)


# On a GPU the two checkpoints that between them hold every feature (windows, soft-caps,
# local/global layers, per-head q/k norms in the fused rope): one Engine each
@pytest.mark.parametrize(
    "name,backend,device",
    [
        ("mistral_window", *CPU),
        ("phi3_fused_window", *CPU),
        ("gemma2_softcap", *CPU),
        ("gemma3_local_global", *CPU),
        pytest.param("gemma2_softcap", *GPU.values, marks=GPU.marks),
        pytest.param("gemma3_local_global", *GPU.values, marks=GPU.marks),
        pytest.param("gpt_oss", *GPU.values, marks=GPU.marks),  # sinks in the Triton kernels
    ],
)
def test_greedy_ids_equal_transformers(name, backend, device, tmp_path):
    from radixlm.srt import Engine
    from radixlm.srt.bench.bench_gpu import write_word_tokenizer

    folder = write_checkpoint(name, tmp_path)
    write_word_tokenizer(folder, VOCAB)  # no downloaded tokenizer: the GPU machine has none
    refs = [hf_greedy(folder, p) for p in (*PROMPTS, EXTENDED)]
    with Engine(
        str(folder),
        device=device,
        attention_backend=backend,
        dtype="float32",
        chunked_prefill_size=CHUNK,
        max_total_tokens=2048,
        cuda_graph_max_bs=2,  # two graphs to capture, not the default's dozens
        log_level="warning",
    ) as engine:
        outs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        again = engine.generate(input_ids=EXTENDED, sampling_params=GREEDY)
    assert [o["output_ids"] for o in outs] == refs[:2]
    assert again["meta_info"]["cached_tokens"] >= len(PROMPTS[1]) - 1
    assert again["output_ids"] == refs[2]
