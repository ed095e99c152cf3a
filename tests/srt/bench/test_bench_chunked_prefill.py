"""bench_chunked_prefill on a tiny model: the step and token counts its table reports."""

from __future__ import annotations

import pytest

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
