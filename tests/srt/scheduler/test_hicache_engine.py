"""HiCache on the default model: greedy outputs token-identical with the cache off, on the
device only, with the host tier, with the disk tier, and after a restart with a warm disk tier;
hits reported per tier; no slot of any tier leaked."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

from radixlm.srt import Engine

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "hicache"))
from faulty_store import flip_payload_byte, shift_token_ids, truncate_file  # noqa: E402

pytestmark = pytest.mark.slow  # loads the default model

WORDS = (
    "river mountain lantern copper violet orchard harbor meadow signal quiet ember "
    "granite willow thunder pepper marble canyon silver feather island winter garden"
).split()
# a few tokens a turn: a wrong prefix (a bad page, a stale slot) changes the first of them; each
# decode step costs about 0.1 s on this model, 72 of them a workload at 12 tokens a turn
GREEDY = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}
POOL = 256  # device KV tokens: the conversations below hold about twice that
NUM_CONVERSATIONS, NUM_ROUNDS = 3, 3


def _conversation_turns(seed: int) -> list[list[str]]:
    rng = random.Random(seed)
    return [
        [" ".join(rng.choice(WORDS) for _ in range(30)) for _ in range(NUM_ROUNDS)]
        for _ in range(NUM_CONVERSATIONS)
    ]


def _run_workload(engine: Engine, turns: list[list[str]]) -> list[list[int]]:
    """Round-robin multi-turn chats: each round's prompt is the whole history so far."""
    tok = engine.tokenizer
    histories: list[list[int]] = [[] for _ in turns]
    outputs: list[list[int]] = []
    for r in range(NUM_ROUNDS):
        for c, conv in enumerate(turns):
            histories[c] += tok.encode(f"\nUser: {conv[r]}\nAssistant:")
            out = engine.generate(input_ids=histories[c], sampling_params=GREEDY)
            reason = out["meta_info"]["finish_reason"]
            assert len(out["output_ids"]) == GREEDY["max_new_tokens"], (r, c, reason)
            outputs.append(out["output_ids"])
            histories[c] += out["output_ids"]
    return outputs


def _check_idle(engine: Engine) -> dict:
    assert engine.scheduler.check_idle()
    engine.scheduler.cache.check_integrity()
    return engine.get_server_info()


@pytest.fixture(scope="module")
def reference(default_model_dir):
    """Outputs with the prefix cache off."""
    turns = _conversation_turns(0)
    with Engine(
        str(default_model_dir), disable_radix_cache=True, max_total_tokens=POOL, log_level="warning"
    ) as engine:
        return turns, _run_workload(engine, turns)


@pytest.mark.parametrize("policy", ["write_through_selective", "write_through", "write_back"])
def test_host_tier_matches_no_cache(default_model_dir, reference, policy):
    turns, expected = reference
    with Engine(
        str(default_model_dir),
        enable_hierarchical_cache=True,
        hicache_write_policy=policy,
        hicache_ratio=4.0,
        max_total_tokens=POOL,
        log_level="warning",
    ) as engine:
        assert _run_workload(engine, turns) == expected
        tiers = _check_idle(engine)["hicache"]
    if policy != "write_through_selective":  # selective backs up only twice-hit nodes
        assert tiers["host_hit_tokens"] > 0, tiers


def test_device_only_matches_no_cache(default_model_dir, reference):
    turns, expected = reference
    with Engine(str(default_model_dir), max_total_tokens=POOL, log_level="warning") as engine:
        assert _run_workload(engine, turns) == expected
        _check_idle(engine)


def test_disk_tier_warm_restart_and_damaged_pages_match_no_cache(
    default_model_dir, reference, tmp_path
):
    turns, expected = reference
    options = dict(
        enable_hierarchical_cache=True,
        hicache_write_policy="write_through",
        hicache_ratio=1.0,  # a small host tier: later rounds come back from disk
        hicache_storage_dir=str(tmp_path),
        max_total_tokens=POOL,
        log_level="warning",
    )
    with Engine(str(default_model_dir), **options) as engine:
        assert _run_workload(engine, turns) == expected
        tiers = _check_idle(engine)["hicache"]
        assert tiers["disk_pages"] > 0, tiers
    with Engine(str(default_model_dir), **options) as engine:  # a restart: device, host empty
        assert _run_workload(engine, turns) == expected
        tiers = _check_idle(engine)["hicache"]
        assert tiers["disk_hit_tokens"] > 0, tiers
    # every stored page damaged (truncated, a payload byte flipped, another page's token ids):
    # the next restart recomputes them instead of a wrong hit (pages it writes again may hit
    # later in the run), with the same outputs
    pages = sorted(tmp_path.rglob("*.page"))
    assert pages
    damage = (truncate_file, flip_payload_byte, shift_token_ids)
    for i, path in enumerate(pages):
        damage[i % 3](path)
    with Engine(str(default_model_dir), **options) as engine:
        assert _run_workload(engine, turns) == expected
        tiers = _check_idle(engine)["hicache"]
    assert tiers["disk_corrupt_deleted"] + tiers["disk_invalid_files_removed"] > 0, tiers
