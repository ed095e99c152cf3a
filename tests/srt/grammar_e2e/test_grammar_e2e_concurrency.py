"""40 concurrent requests on SmolLM2 mixing constrained and unconstrained ones, arriving from
threads while others decode: constrained outputs match, unconstrained ones are untouched by
the masks of their batch neighbours, and nothing leaks."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest

pytestmark = pytest.mark.slow

NUM_REQUESTS = 40
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 16},
        "country": {"type": "string", "maxLength": 16},
        "population_millions": {"type": "integer", "minimum": 0, "maximum": 999},
    },
    "required": ["city", "country", "population_millions"],
    "additionalProperties": False,
}
REGEX = r"\d{1,2}:\d{2} (AM|PM)"
CHOICES = ["north", "south", "east", "west"]
FREE_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "1, 2, 3, 4,",
    "Once upon a time, there was",
]
FREE = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}


def _job(i: int) -> tuple[str, dict, str]:
    """(prompt, sampling params, kind) of request i: a quarter each of JSON, regex, choices
    and unconstrained requests."""
    kind = ("json", "regex", "choices", "free")[i % 4]
    if kind == "json":
        return (
            f"Describe city number {i} as JSON: ",
            {
                "temperature": 0.8,
                "seed": i,
                "max_new_tokens": 96,
                "json_schema": json.dumps(SCHEMA),
            },
            kind,
        )
    if kind == "regex":
        return (
            f"Meeting {i} starts at ",
            {"temperature": 0.8, "seed": i, "max_new_tokens": 12, "regex": REGEX},
            kind,
        )
    if kind == "choices":
        return (
            f"Compass direction {i}: ",
            {"temperature": 1.0, "seed": i, "max_new_tokens": 8, "choices": CHOICES},
            kind,
        )
    return FREE_PROMPTS[(i // 4) % len(FREE_PROMPTS)], FREE, kind


def test_forty_concurrent_mixed_requests(smol_engine):
    alone = {p: smol_engine.generate(p, FREE)["output_ids"] for p in FREE_PROMPTS}
    jobs = [_job(i) for i in range(NUM_REQUESTS)]
    with ThreadPoolExecutor(NUM_REQUESTS) as pool:
        outs = list(pool.map(lambda job: smol_engine.generate(job[0], job[1]), jobs))
    for (prompt, _, kind), out in zip(jobs, outs, strict=True):
        reason = out["meta_info"]["finish_reason"]
        if kind == "free":
            assert out["output_ids"] == alone[prompt], prompt
            continue
        assert reason["type"] == "stop", (kind, out["text"], reason)
        if kind == "json":
            jsonschema.validate(json.loads(out["text"]), SCHEMA)
        elif kind == "regex":
            assert re.fullmatch(REGEX, out["text"]), out["text"]
        else:
            assert out["text"] in CHOICES
    info = smol_engine.get_server_info()
    assert info["num_running"] == 0 and info["num_waiting"] == 0
    assert info["grammar"]["num_queued"] == 0
    assert smol_engine.scheduler.check_idle()
