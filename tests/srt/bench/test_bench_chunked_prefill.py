"""bench_chunked_prefill on a tiny model: the step and token counts its table reports."""

from __future__ import annotations

import json

import pytest
import torch

from radixlm.srt.bench.bench_chunked_prefill import main, parse_chunk


def test_chunk_sizes_parse():
    assert parse_chunk("-1") == (-1, True)
    assert parse_chunk("512u") == (512, False)
    with pytest.raises(ValueError, match="chunk sizes"):
        parse_chunk("0")


def test_running_requests_get_a_token_per_chunk_only_when_mixed(tiny_llama_dir):
    off, mixed, alone = main(
        [
            *("--model-path", str(tiny_llama_dir), "--prompt-len", "100"),
            *("--num-decodes", "4", "--chunk-sizes=-1,16,16u", "--max-total-tokens", "1024"),
        ]
    )
    assert (off["steps"], off["tokens_meanwhile"]) == (1, 0)
    assert mixed["steps"] == -(-100 // (16 - 4))  # 4 decode tokens share each 16-token chunk
    assert mixed["tokens_meanwhile"] == mixed["steps"]
    assert (alone["steps"], alone["tokens_meanwhile"]) == (-(-100 // 16), 0)


def test_decode_prompt_len_sets_the_running_contexts_and_profile_needs_cuda(
    tiny_llama_dir, tmp_path
):
    common = ["--model-path", str(tiny_llama_dir), "--prompt-len", "40", "--num-decodes", "2"]
    out = tmp_path / "rows.json"
    (row,) = main([*common, "--decode-prompt-len", "200", "--chunk-sizes=16", "--json", str(out)])
    # 2 decode tokens share each 16-token chunk; the 200-token prompts fit the default pool
    assert row["steps"] == -(-40 // (16 - 2)) and row["tokens_meanwhile"] == row["steps"]
    assert json.loads(out.read_text())[0]["steps"] == row["steps"]
    with pytest.raises(ValueError, match="CUDA"):
        main([*common, "--chunk-sizes=16", "--profile"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_profile_splits_a_mixed_step_by_kernel(offline_tiny_llama_dir):
    mixed, alone = main(
        [
            *("--model-path", str(offline_tiny_llama_dir)),
            *("--prompt-len", "100", "--num-decodes", "4"),
            *("--chunk-sizes=32,32u", "--profile"),
        ]
    )
    for row in (mixed, alone):
        pr = row["profile"]
        assert 0 < pr["busy_share"] <= 1.0 and pr["top_kernels"]
        assert pr["category_ms_per_step"].get("gemm", 0) > 0
    assert mixed["tokens_meanwhile"] == mixed["steps"] and alone["tokens_meanwhile"] == 0
