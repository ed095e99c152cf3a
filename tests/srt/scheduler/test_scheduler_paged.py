"""KV pages of more than one token change nothing a user sees: the same greedy outputs as
page size 1, with shared prefixes served from the radix cache, chunked prefill and requests
of every length, and no slot left behind."""

from __future__ import annotations

import random

import pytest

GREEDY = {"temperature": 0, "max_new_tokens": 9, "ignore_eos": True}


def _prompts() -> list[list[int]]:
    rng = random.Random(11)
    shared = [rng.randrange(100, 40000) for _ in range(21)]
    own = [[rng.randrange(100, 40000) for _ in range(n)] for n in (1, 3, 4, 7, 30)]
    return [shared + tail for tail in own] + own


def _run(model_dir, page_size: int) -> list[list[int]]:
    from radixlm.srt import Engine

    with Engine(
        model_path=str(model_dir),
        page_size=page_size,
        max_total_tokens=1024,
        chunked_prefill_size=16,
        log_level="warning",
    ) as engine:
        outs = [engine.generate(input_ids=_prompts(), sampling_params=GREEDY)]
        outs.append(engine.generate(input_ids=_prompts()[::-1], sampling_params=GREEDY)[::-1])
        info = engine.get_server_info()
        assert info["available"] + info["evictable"] + info["protected"] == info["max_total_tokens"]
        assert engine.scheduler.check_idle()
        engine.scheduler.cache.check_integrity()
        cached = sum(o["meta_info"]["cached_tokens"] for o in outs[1])
    assert cached > 0  # the second round is served from the cache
    return [[o["output_ids"] for o in round_] for round_ in outs]


@pytest.mark.parametrize("page_size", [4, 16])
def test_paged_kv_gives_page_size_1_outputs(tiny_llama_dir, page_size):
    want = _run(tiny_llama_dir, 1)
    assert _run(tiny_llama_dir, page_size) == want
