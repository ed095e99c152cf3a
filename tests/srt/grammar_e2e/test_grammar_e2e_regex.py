"""Regex and choices constraints through the Engine on SmolLM2: every output matches in full."""

from __future__ import annotations

import re

import pytest

pytestmark = pytest.mark.slow

CASES = {
    "email": (
        "Write the email address of the support team.\nEmail: ",
        r"[a-z]{2,10}\.?[a-z]{0,10}@[a-z]{2,10}\.(com|org|net)",
    ),
    "alternation": ("The colour of the sky on a clear day is ", r"(blue|grey|red|green)"),
    "three digits": ("The area code of the phone number is ", r"\d{3}"),
    "date": (
        "The Apollo 11 moon landing happened on (YYYY-MM-DD) ",
        r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])",
    ),
    "hex colour": ("The HTML hex code of pure red is ", r"#[0-9a-fA-F]{6}"),
    "phone": ("Call us at ", r"\(\d{3}\) \d{3}-\d{4}"),
}


def _check_full_match(out: dict, pattern: str) -> None:
    assert re.fullmatch(pattern, out["text"]), (pattern, out["text"])
    assert out["meta_info"]["finish_reason"]["type"] == "stop", out["meta_info"]


@pytest.mark.parametrize("name", sorted(CASES))
def test_greedy_output_matches_the_regex(smol_engine, name):
    prompt, pattern = CASES[name]
    out = smol_engine.generate(prompt, {"temperature": 0, "max_new_tokens": 40, "regex": pattern})
    _check_full_match(out, pattern)


def test_sampled_outputs_match_every_regex_in_one_batch(smol_engine):
    prompts, params, patterns = [], [], []
    for seed, (prompt, pattern) in enumerate(CASES.values()):
        for k in range(2):
            prompts.append(prompt)
            patterns.append(pattern)
            params.append(
                {
                    "temperature": 1.2,
                    "top_p": 0.98,
                    "seed": 10 * seed + k,
                    "max_new_tokens": 40,
                    "regex": pattern,
                }
            )
    outs = smol_engine.generate(prompts, params)
    for out, pattern in zip(outs, patterns, strict=True):
        _check_full_match(out, pattern)


def test_the_unconstrained_answer_would_not_match(smol_engine):
    """The constraint is what makes the outputs match (guards against a vacuous test)."""
    prompt, pattern = CASES["three digits"]
    free = smol_engine.generate(prompt, {"temperature": 0, "max_new_tokens": 12})
    assert not re.fullmatch(pattern, free["text"])


def test_choices_pick_exactly_one_option(smol_engine):
    options = ["Paris", "London", "Berlin", "Madrid"]
    prompt = smol_engine.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
    )
    out = smol_engine.generate(prompt, {"temperature": 0, "max_new_tokens": 8, "choices": options})
    assert out["text"] == "Paris"
    sampled = smol_engine.generate(
        [prompt] * 4,
        [
            {"temperature": 1.5, "seed": s, "max_new_tokens": 8, "choices": options}
            for s in range(4)
        ],
    )
    assert all(o["text"] in options for o in sampled)


def test_a_regex_that_forbids_eos_runs_to_the_length_limit(smol_engine):
    out = smol_engine.generate(
        "Count: ", {"temperature": 0, "max_new_tokens": 6, "regex": r"(ab)+c{0,1}(ab)*x{100}"}
    )
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
    assert re.fullmatch(r"[abcx]*", out["text"])
