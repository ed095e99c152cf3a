"""A batch in which one request is rejected: the error reaches the caller once every request of
the batch has finished, and nothing stays behind in the engine or the KV pool."""

from __future__ import annotations

import pytest


def test_batch_with_one_invalid_grammar_raises_after_all_finished(tiny_llama_dir):
    from radixlm.srt import Engine

    with Engine(
        model_path=str(tiny_llama_dir), log_level="warning", max_total_tokens=2048
    ) as engine:
        good = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
        # well-formed for the front door, refused by the grammar compiler in the scheduler
        bad = {"temperature": 0, "max_new_tokens": 6, "regex": "[z-a]"}
        with pytest.raises(ValueError, match="Failed to compile regex grammar"):
            engine.generate(
                input_ids=[[5, 6, 7], [8, 9, 10], [11, 12]], sampling_params=[good, bad, good]
            )
        engine.front.assert_no_requests()
        out = engine.generate(input_ids=[5, 6, 7], sampling_params=good)  # still serves
        assert out["meta_info"]["completion_tokens"] == 6
        info = engine.get_server_info()
        assert info["available"] + info["evictable"] + info["protected"] == info["max_total_tokens"]
