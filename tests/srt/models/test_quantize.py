"""``--quantization int4``: tiny random models stay close to their dense logits, the engine
serves them, and the real SmolLM2 keeps its GGUF codes and still answers "Paris"."""

from __future__ import annotations

import pytest
import torch
from model_batches import KVSession, max_rel_err
from tiny_checkpoints import VOCAB, write_checkpoint
from torch import nn

from radixlm.kernels import gguf_cpu
from radixlm.kernels.int4_cpu import (
    PACKED_INT4_ROWS,
    PROMPT_ROWS,
    Int4Linear,
    dequantize_int4,
    quantize_int4,
)
from radixlm.kernels.int8_cpu import dequantize_int8, quantize_int8
from radixlm.srt.config import config_from_kwargs
from radixlm.srt.executor.forward_batch import ForwardMode
from radixlm.srt.models.layers import Linear
from radixlm.srt.models.loader import load_model
from radixlm.srt.models.quantize import SmallBatchLMHead, quantize_model

EXTEND, DECODE = ForwardMode.EXTEND, ForwardMode.DECODE
CPU = torch.device("cpu")
PROMPT = torch.randint(0, VOCAB, (14,), generator=torch.Generator().manual_seed(2)).tolist()


def int4_model(folder):
    model = load_model(folder, torch.float32, "cpu")
    quantize_model(model, "int4", CPU)
    return model


@torch.inference_mode()
def dequantized_reference(folder) -> nn.Module:
    """The dense model with the values the int4 model multiplies by: every Linear weight is
    ``dequantize_int4(quantize_int4(w))`` and the LM head's is its Q8_0 blocks where the C++
    kernels run, else its per-channel int8 (untied)."""
    model = load_model(folder, torch.float32, "cpu")
    for module in model.modules():
        if isinstance(module, Linear):
            module.weight.copy_(dequantize_int4(quantize_int4(module.weight)))
    w = model.lm_head.weight
    if gguf_cpu.available():
        head = gguf_cpu.dequantize_q8_0(gguf_cpu.quantize_q8_0(w))
    else:
        head = dequantize_int8(quantize_int8(w))
    model.lm_head.weight = nn.Parameter(head, requires_grad=False)
    return model


SMALL_CHUNKS = (5, 1, 1, 4, 1, 2)  # extends and decodes over the cache, each within the int4 path


@torch.inference_mode()
def logits_in_chunks(model, ids: list[int], sizes: tuple[int, ...] = SMALL_CHUNKS) -> torch.Tensor:
    """Logits ``[len(ids), vocab]``, feeding ``ids`` in forwards of ``sizes`` tokens."""
    assert sum(sizes) == len(ids)
    session = KVSession(model.config)
    req, out, start = session.new_request(), [], 0
    for size in sizes:
        chunk, start = ids[start : start + size], start + size
        fb = session.batch(EXTEND if size > 1 else DECODE, [(req, chunk)])
        out.append(model.compute_logits(model(fb.input_ids, fb.positions, fb)))
    return torch.cat(out)


@pytest.mark.parametrize("name", ["llama", "qwen2_bias", "qwen3_bias_tied"])
def test_int4_logits_match_the_dequantized_dense_model(name, tmp_path):
    folder = write_checkpoint(name, tmp_path)
    model = int4_model(folder)
    assert isinstance(model.model.layers[0].self_attn.qkv_proj.forward, Int4Linear)
    assert isinstance(model.lm_head.forward, SmallBatchLMHead)
    ours = logits_in_chunks(model, PROMPT)
    ref = logits_in_chunks(dequantized_reference(folder), PROMPT)
    # Same weights; what is left is the activations' rounding into every int4 matmul and the
    # head: int8 per block of 32 in the C++ GEMVs (half a step of max|block| / 127, about
    # 2**-9 of a block's largest value; measured 1.2-1.4e-2 here), else bfloat16 (about 2**-9
    # relative, also on scales, zeros and outputs; 0.7-0.8e-2), 6 matmuls deep.
    assert max_rel_err(ours, ref) < 2e-2
    dense = logits_in_chunks(load_model(folder, torch.float32, "cpu"), PROMPT)
    # Against the original weights (random, not Q4_1) int4 is lossy: 16 levels per group of 32
    # Gaussian weights leave noise of about range/15/sqrt(12) ~ 8% of their spread in every
    # matmul, which moves these small random logits by ~20% of their largest value. The int4
    # model must depart from them as much as the dequantized dense model does, and no more.
    quantization_err = max_rel_err(ref, dense)
    assert quantization_err < 0.5
    assert abs(max_rel_err(ours, dense) - quantization_err) < 2e-2


def test_prefill_rows_use_the_dense_weights(tmp_path):
    folder = write_checkpoint("llama", tmp_path)
    model, dense = int4_model(folder), load_model(folder, torch.float32, "cpu")
    step = 9  # every forward has more rows than the int4 paths take (8 here)
    ids = torch.randint(0, VOCAB, (2 * step,), generator=torch.Generator().manual_seed(3)).tolist()
    sizes = (step, step)
    with gguf_cpu.rows_limit(8):
        int4 = logits_in_chunks(model, ids, sizes)
    assert torch.equal(int4, logits_in_chunks(dense, ids, sizes))
    with gguf_cpu.disabled():  # torch's packed int4 kernel takes at most PACKED_INT4_ROWS rows
        step = PACKED_INT4_ROWS + 1
        ids = torch.randint(0, VOCAB, (step,), generator=torch.Generator().manual_seed(4)).tolist()
        int4 = logits_in_chunks(model, ids, (step,))
    assert torch.equal(int4, logits_in_chunks(dense, ids, (step,)))


def test_the_runner_keeps_prompt_forwards_to_the_prompt_rows():
    """An int4 model's decode forwards take the int4 kernels up to gguf_cpu.MATMUL_ROWS rows,
    its forwards with prompt tokens up to PROMPT_ROWS; other models are left alone."""
    from types import SimpleNamespace

    from radixlm.srt.executor.model_runner import ModelRunner

    def limit_in(quantization: str, mode: ForwardMode) -> int:
        runner = SimpleNamespace(cfg=SimpleNamespace(quantization=quantization))
        with ModelRunner._int4_rows(runner, SimpleNamespace(mode=mode)):  # type: ignore[arg-type]
            return gguf_cpu.matmul_rows()

    assert limit_in("int4", EXTEND) == PROMPT_ROWS < gguf_cpu.MATMUL_ROWS
    assert limit_in("int4", DECODE) == gguf_cpu.MATMUL_ROWS
    assert limit_in("none", EXTEND) == gguf_cpu.MATMUL_ROWS
    assert gguf_cpu.matmul_rows() == gguf_cpu.MATMUL_ROWS


def test_tied_embedding_and_parameters_are_untouched(tmp_path):
    folder = write_checkpoint("qwen3_bias_tied", tmp_path)
    dense = load_model(folder, torch.float32, "cpu")
    model = int4_model(folder)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    for (name, p), (_, q) in zip(model.named_parameters(), dense.named_parameters(), strict=True):
        assert torch.equal(p, q), name


def test_int4_is_rejected_off_the_cpu(tmp_path):
    with pytest.raises(ValueError, match="CPU only"):
        config_from_kwargs(quantization="int4", device="cuda")
    with pytest.raises(ValueError, match="quantization must be one of"):
        config_from_kwargs(quantization="int8")
    model = load_model(write_checkpoint("llama", tmp_path), torch.float32, "cpu")
    with pytest.raises(ValueError, match="CPU only"):
        quantize_model(model, "int4", torch.device("cuda"))


def test_cli_flag_reaches_the_config():
    from radixlm.srt.cli import build_parser
    from radixlm.srt.config import config_from_args

    args = build_parser().parse_args(["serve", "--quantization", "int4"])
    assert config_from_args(args).quantization == "int4"
    assert config_from_args(build_parser().parse_args(["serve"])).quantization == "none"


@torch.inference_mode()
def reference_greedy(model, prompt: list[int], n: int) -> list[int]:
    """What the engine computes: prefill the prompt, logits of its last row, then decode."""
    session = KVSession(model.config, max_total_tokens=1024, max_context_len=512)
    req, out, tokens = session.new_request(), [], prompt
    for _ in range(n):
        fb = session.batch(EXTEND if len(tokens) > 1 else DECODE, [(req, tokens)])
        hidden = model(fb.input_ids, fb.positions, fb)
        out.append(int(model.compute_logits(hidden[-1:])[0].argmax()))
        tokens = out[-1:]
    return out


def test_engine_generates_with_int4(tiny_llama_dir):
    from radixlm.srt import Engine

    prompts = [list(range(100, 140)), list(range(500, 503)), [7]]
    ref_model = int4_model(tiny_llama_dir)
    greedy = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    with Engine(
        model_path=str(tiny_llama_dir),
        quantization="int4",
        max_total_tokens=2048,
        log_level="warning",
    ) as engine:
        assert engine.config.quantization == "int4"
        runner_model = engine.scheduler.runner.model
        assert isinstance(runner_model.model.layers[1].mlp.down_proj.forward, Int4Linear)
        for prompt in prompts:
            out = engine.generate(input_ids=prompt, sampling_params=greedy)
            assert out["output_ids"] == reference_greedy(ref_model, prompt, 12), prompt
        batch = engine.generate(input_ids=prompts, sampling_params=greedy)  # decode rows: 3
        assert [len(o["output_ids"]) for o in batch] == [12, 12, 12]


# --- the real default model (SmolLM2-135M-Instruct, Q4_1 linear weights) -------------------

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.mark.slow  # loads the default model
def test_smollm2_int4_codes_are_the_gguf_codes(default_model_dir):
    model = load_model(default_model_dir, torch.float32, "cpu")
    layer = model.model.layers[3]
    for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.down_proj):
        w = linear.weight.data
        # a recovered code gives back the weight up to float32 rounding of the scale; one code
        # off would be an error of a whole quantization step (around 1e-2 here)
        assert (dequantize_int4(quantize_int4(w)) - w).abs().max() < 1e-6


@pytest.mark.slow  # loads the default model
def test_smollm2_int4_answers_paris(default_model_dir):
    from radixlm.srt import Engine

    with Engine(quantization="int4", max_total_tokens=4096, log_level="warning") as engine:
        prompt = engine.apply_chat_template(QUESTION)
        out = engine.generate(prompt, {"temperature": 0, "max_new_tokens": 24})
    assert "Paris" in out["text"], out["text"]
