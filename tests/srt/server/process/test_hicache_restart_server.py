"""The report behind issue 40, as a user met it: `radixlm serve` with a disk KV tier serves
multi-turn conversations through /generate, stops on SIGTERM, and a server restarted on the
same folder serves each conversation's opening from its tiers (before: 0 cached tokens for the
openings pushed off the device before their second hit)."""

from __future__ import annotations

import random

import httpx
import pytest

NUM_CONVERSATIONS, NUM_ROUNDS, TURN_LEN = 6, 3, 100
PAGE = 16


def _generate(server, ids: list[int]) -> dict:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}
    reply = httpx.post(f"{server.url}/generate", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()


@pytest.mark.slow  # two servers on a tiny model
def test_a_server_restarted_on_its_disk_folder_serves_what_it_served(
    start_server, tiny_llama_dir, tmp_path
):
    args = (
        "--model-path", tiny_llama_dir, "--device", "cpu", "--max-total-tokens", "768",
        "--enable-hierarchical-cache", "--hicache-storage-dir", tmp_path,
    )  # fmt: skip
    rng = random.Random(0)
    turns = [
        [[rng.randrange(100, 40000) for _ in range(TURN_LEN)] for _ in range(NUM_ROUNDS)]
        for _ in range(NUM_CONVERSATIONS)
    ]
    first = start_server(*args)
    history: list[list[int]] = [[] for _ in turns]
    for r in range(NUM_ROUNDS):
        for c in range(NUM_CONVERSATIONS):
            history[c] += turns[c][r]
            history[c] += _generate(first, history[c])["output_ids"]
    assert first.stop() == 0  # SIGTERM: the scheduler drains and flushes its disk tier
    again = start_server(*args)
    opening = TURN_LEN // PAGE * PAGE
    for c in range(NUM_CONVERSATIONS):
        cached = _generate(again, turns[c][0] + [7])["meta_info"]["cached_tokens"]
        assert cached >= opening, (c, cached)
