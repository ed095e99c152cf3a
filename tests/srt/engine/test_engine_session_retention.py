"""Session-aware retention end to end (Engine on a tiny random Llama): a session's prefix held
between its turns survives a flood of other traffic that evicts a plain conversation's; closing
the session lets it go; /server_info shows the holds; the idle rule holds."""

from __future__ import annotations

import random

import pytest

from radixlm.srt import Engine

pytestmark = pytest.mark.slow  # an Engine and a dozen prefills (about 5 s on 2 cores)

POOL = 1024
GREEDY = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 40000) for _ in range(n)]


def test_a_held_session_prefix_survives_a_flood_and_close_lets_it_go(tiny_llama_dir):
    rng = random.Random(0)
    with Engine(
        str(tiny_llama_dir),
        max_total_tokens=POOL,
        session_retention_ttl=600.0,
        session_retention_max_tokens=512,
        log_level="warning",
    ) as engine:
        sid = engine.open_session(capacity_of_str_len=2048)
        t1 = engine.generate(
            input_ids=_ids(rng, 300), sampling_params=GREEDY, session_params={"id": sid}
        )
        plain = _ids(rng, 300)
        engine.generate(input_ids=plain, sampling_params=GREEDY)
        held = engine.get_server_info()["session_retention"]
        assert held["held_sessions"] == 1 and held["held_tokens"] >= 288, held
        for _ in range(8):  # other traffic: four times the pool
            engine.generate(input_ids=_ids(rng, 500), sampling_params=GREEDY)
        again = engine.generate(input_ids=plain + [5], sampling_params=GREEDY)
        assert again["meta_info"]["cached_tokens"] == 0  # evicted: no hold
        t2 = engine.generate(
            input_ids=_ids(rng, 20),
            sampling_params=GREEDY,
            session_params={"id": sid, "rid": t1["meta_info"]["id"]},
        )
        assert t2["meta_info"]["cached_tokens"] >= 288, t2["meta_info"]
        engine.close_session(sid)
        info = engine.get_server_info()
        assert info["session_retention"]["held_sessions"] == 0, info["session_retention"]
        assert info["protected"] == 0
        assert info["available"] + info["evictable"] + info["protected"] == POOL
        assert engine.scheduler.check_idle()
