"""The int4 decode step in one C++ call (``kernels/cpu_step.py``, ``srt/models/int4_step.py``):
equal bit for bit to its kernels called one by one, close to the layer-by-layer path (torch
norms and silu), taken only where it serves, and the engine's greedy ids unchanged."""

from __future__ import annotations

import pytest
import torch
from model_batches import KVSession
from tiny_checkpoints import VOCAB, write_checkpoint

from radixlm.kernels import cpu_decode, cpu_step, gguf_cpu
from radixlm.kernels.attention.cpu_backend import CpuAttentionBackend
from radixlm.srt.executor.forward_batch import ForwardMode
from radixlm.srt.models.loader import load_model
from radixlm.srt.models.quantize import quantize_model

pytestmark = pytest.mark.skipif(
    not cpu_step.available(), reason="the CPU kernels could not be built (no C++ compiler)"
)

EXTEND, DECODE = ForwardMode.EXTEND, ForwardMode.DECODE
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = write_checkpoint("llama", tmp_path_factory.mktemp("int4-step"))
    model = load_model(folder, torch.float32, "cpu")
    quantize_model(model, "int4", CPU)
    return model


def prompts(lens: list[int], seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in lens]


def prefilled(model, lens: list[int], seed: int = 0) -> tuple[KVSession, list[int]]:
    """A session with one request per prompt length, each prompt prefilled."""
    session = KVSession(model.config, num_req_slots=len(lens), backend=CpuAttentionBackend())
    reqs = [session.new_request() for _ in lens]
    fb = session.batch(EXTEND, list(zip(reqs, prompts(lens, seed), strict=True)))
    with torch.inference_mode():
        model(fb.input_ids, fb.positions, fb)
    return session, reqs


@torch.inference_mode()
def kernels_one_by_one(model, fb) -> torch.Tensor:
    """The decoder stack through the step's kernels, one call each (the bit-exact reference)."""
    m = model.model
    residual = m.embed_tokens(fb.input_ids)
    cos, sin = m.rotary_emb.cos_sin(fb.positions, torch.float32)
    batch = fb.attn_backend.decode_batch(fb, torch.float32)
    x = None
    for i, layer in enumerate(m.layers):
        attn, mlp = layer.self_attn, layer.mlp
        norm1, norm2 = layer.input_layernorm, layer.post_attention_layernorm
        hn, residual = cpu_decode.rmsnorm(
            x if x is not None else residual,
            norm1.weight,
            norm1.eps,
            None if x is None else residual,
        )
        qkv = gguf_cpu.q4_1_matmul(hn, attn.qkv_proj.forward.q4_1)
        cpu_decode.rope_inplace(qkv, attn.num_heads + attn.num_kv_heads, attn.head_dim, cos, sin)
        q, k, v = attn.qkv_proj.split(qkv)
        k_buf, v_buf = fb.kv_pool.get_kv(i)
        out = cpu_decode.decode_attention(
            batch, q, k, v, k_buf, v_buf, attn.num_heads, attn.scaling
        )
        x = gguf_cpu.q4_1_matmul(out, attn.o_proj.forward.q4_1)
        hn, residual = cpu_decode.rmsnorm(x, norm2.weight, norm2.eps, residual)
        gate_up = gguf_cpu.q4_1_matmul(hn, mlp.gate_up_proj.forward.q4_1)
        x = gguf_cpu.q4_1_matmul(cpu_decode.silu_and_mul(gate_up), mlp.down_proj.forward.q4_1)
    out, _ = cpu_decode.rmsnorm(x, m.norm.weight, m.norm.eps, residual)
    return out


def next_batch(session, reqs, seed: int):
    tokens = torch.randint(0, VOCAB, (len(reqs),), generator=torch.Generator().manual_seed(seed))
    return session.batch(DECODE, [(r, [t]) for r, t in zip(reqs, tokens.tolist(), strict=True)])


def pool_state(session) -> list[torch.Tensor]:
    return [b.clone() for b in (*session.kv_pool.k_buffers, *session.kv_pool.v_buffers)]


@pytest.mark.parametrize("lens", [[20], [5, 40, 13], [3] * 16])
def test_step_equals_its_kernels_one_by_one(model, lens):
    session, reqs = prefilled(model, lens)
    for step in range(3):
        fb = next_batch(session, reqs, seed=step)
        ref = kernels_one_by_one(model, fb)
        ref_pool = pool_state(session)
        runner = model.int4_step()
        assert runner and runner.serves(fb.input_ids, fb) is not None
        with torch.inference_mode():
            out = model(fb.input_ids, fb.positions, fb)
        assert torch.equal(out, ref)
        assert all(torch.equal(a, b) for a, b in zip(pool_state(session), ref_pool, strict=True))


@pytest.mark.parametrize("lens", [[30], [30, 7, 100]])
def test_step_equals_the_layer_path(model, lens):
    """The layer path's torch norms and silu round as the kernels do: the same bits."""
    session, reqs = prefilled(model, lens)
    for step in range(2):
        fb = next_batch(session, reqs, seed=5 + step)
        with torch.inference_mode():
            with cpu_step.disabled():
                ref = model(fb.input_ids, fb.positions, fb)
            out = model(fb.input_ids, fb.positions, fb)
        assert torch.equal(out, ref)


def test_step_computes_the_lm_head_logits(model):
    session, reqs = prefilled(model, [12, 40])
    fb = next_batch(session, reqs, seed=9)
    with torch.inference_mode():
        with cpu_step.disabled():
            ref = model.compute_logits(model(fb.input_ids, fb.positions, fb))
        hidden = model(fb.input_ids, fb.positions, fb)
        assert model._step_logits is not None  # computed in the step's call
        logits = model.compute_logits(hidden)
        assert torch.equal(logits, ref)
        assert torch.equal(model.compute_logits(hidden), ref)  # taken once, then the head's
        assert torch.equal(model.compute_logits(hidden[:1]), ref[:1])  # other rows: the head


def test_step_serves_only_the_batches_it_can(model):
    session, reqs = prefilled(model, [9] * 17)
    fb = next_batch(session, reqs, seed=1)  # 17 rows: more than the GEMVs take
    with torch.inference_mode():
        model(fb.input_ids, fb.positions, fb)
    runner = model.int4_step()
    assert runner is not None and runner.serves(fb.input_ids, fb) is None
    fb = next_batch(session, reqs[:4], seed=2)
    assert runner.serves(fb.input_ids, fb) is not None
    with cpu_step.disabled():
        assert runner.serves(fb.input_ids, fb) is None
    with session.kv_pool.recording_amax():  # KV calibration: writes go through set_kv
        assert runner.serves(fb.input_ids, fb) is None
    torch_session = KVSession(model.config)  # the torch attention backend: no kernel indices
    req = torch_session.new_request()
    fb = torch_session.batch(EXTEND, [(req, [1, 2, 3])])
    assert runner.serves(fb.input_ids, fb) is None
    fb = torch_session.batch(DECODE, [(req, [4])])
    assert runner.serves(fb.input_ids, fb) is None


def test_layers_it_cannot_run_keep_the_layer_path(tmp_path):
    folder = write_checkpoint("qwen2_bias", tmp_path)  # biased q/k/v projections
    model = load_model(folder, torch.float32, "cpu")
    quantize_model(model, "int4", CPU)
    from radixlm.srt.models.int4_step import Int4StepRunner

    assert Int4StepRunner.for_model(model.model) is None
    dense = load_model(write_checkpoint("llama", tmp_path / "dense"), torch.float32, "cpu")
    assert Int4StepRunner.for_model(dense.model) is None  # not int4


def test_step_checks_its_weights_and_buffers(model):
    from radixlm.srt.models.int4_step import Int4StepRunner

    step = Int4StepRunner.for_model(model.model).step
    with pytest.raises(RuntimeError, match="bind_pool"):
        step.run(torch.zeros(1, 64), None, None, None)
    with pytest.raises(ValueError, match="float32"):
        step.bind_pool(
            [torch.zeros(4, 2, 16, dtype=torch.bfloat16)] * 2, [torch.zeros(4, 2, 16)] * 2
        )


def test_switches_turn_the_step_off(monkeypatch):
    with gguf_cpu.disabled():  # RADIXLM_CPU_GEMV=0's switch
        assert not cpu_step.available()
    with cpu_decode.disabled():  # RADIXLM_CPU_KERNELS=0's
        assert not cpu_step.available()
    monkeypatch.setenv("RADIXLM_CPU_STEP", "0")
    monkeypatch.setattr(cpu_step, "_state", {})  # built again: the variable is read then
    assert not cpu_step.available()
    monkeypatch.delenv("RADIXLM_CPU_STEP")
    monkeypatch.setattr(cpu_step, "_state", {})
    assert cpu_step.available()


def test_sliding_window_layers(tmp_path):
    model = load_model(write_checkpoint("llama", tmp_path), torch.float32, "cpu")
    quantize_model(model, "int4", CPU)
    for layer in model.model.layers:
        layer.self_attn.sliding_window = 6  # each query sees its last 6 keys
    session, reqs = prefilled(model, [20, 3])
    fb = next_batch(session, reqs, seed=3)
    with torch.inference_mode():
        with cpu_step.disabled():
            ref = model(fb.input_ids, fb.positions, fb)
        out = model(fb.input_ids, fb.positions, fb)
    assert model.int4_step().serves(fb.input_ids, fb) is not None
    assert torch.equal(out, ref)
    for layer in model.model.layers:
        layer.self_attn.sliding_window = None
    with torch.inference_mode(), cpu_step.disabled():
        unwindowed = model(fb.input_ids, fb.positions, fb)
    assert not torch.equal(unwindowed, out)  # the window took keys away
