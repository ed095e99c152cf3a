"""Bad grammars end their own request with a clear error; the engine keeps serving."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

pytestmark = pytest.mark.slow

INVALID = {
    "regex": "[z-a]",  # well-formed; an unclosed group is refused before compiling
    "json_schema": '{"type": "object", "properties": {"a": {"type": "no-such-type"}}}',
    "ebnf": "start: (",
}
GREEDY = {"temperature": 0, "max_new_tokens": 4}


@pytest.mark.parametrize("kind", sorted(INVALID))
def test_an_invalid_grammar_is_rejected_with_its_kind(smol_engine, kind):
    with pytest.raises(ValueError, match=f"Failed to compile {kind} grammar: .+"):
        smol_engine.generate("Hello", {**GREEDY, kind: INVALID[kind]})


def test_unparsable_schema_text_is_rejected(smol_engine):
    with pytest.raises(ValueError, match="json_schema is not valid JSON"):
        smol_engine.generate("Hello", {**GREEDY, "json_schema": "{not json"})


def test_a_failure_is_cached_and_the_engine_stays_healthy(smol_engine):
    spec = {"regex": "[z-a]"}
    with pytest.raises(ValueError, match="Failed to compile regex grammar"):
        smol_engine.generate("Hello", {**GREEDY, **spec})
    cache = smol_engine.scheduler.grammars.compile_cache
    compiles, hits = cache.stats.compiles, cache.stats.hits
    with pytest.raises(ValueError, match="Failed to compile regex grammar"):
        smol_engine.generate("Hello", {**GREEDY, **spec})
    assert cache.stats.compiles == compiles and cache.stats.hits == hits + 1
    out = smol_engine.generate("The capital of France is", GREEDY)
    assert out["text"].startswith(" Paris")
    assert smol_engine.scheduler.check_idle()


def test_a_bad_grammar_fails_only_its_own_request(smol_engine):
    def run(params: dict) -> str:
        try:
            return smol_engine.generate("Is water wet? Answer: ", params)["text"]
        except ValueError as e:
            return str(e)

    params = [{**GREEDY, "regex": "(yes|no)"}, {**GREEDY, "regex": "[z-a]"}, GREEDY]
    with ThreadPoolExecutor(len(params)) as pool:
        good, bad, free = pool.map(run, params)
    assert good in ("yes", "no")
    assert bad.startswith("Failed to compile regex grammar")
    assert free == smol_engine.generate("Is water wet? Answer: ", GREEDY)["text"]


def test_more_than_one_grammar_is_rejected(smol_engine):
    with pytest.raises(ValueError, match="at most one of json_schema, regex, ebnf, choices"):
        smol_engine.generate("Hello", {**GREEDY, "regex": "a", "ebnf": 'start: "a"'})
    with pytest.raises(ValueError, match="at most one"):
        smol_engine.generate(
            "Hello",
            {**GREEDY, "json_schema": json.dumps({"type": "string"}), "choices": ["a", "b"]},
        )


def test_bad_choices_are_rejected(smol_engine):
    with pytest.raises(ValueError, match="choices must be a non-empty list of strings"):
        smol_engine.generate("Hello", {**GREEDY, "choices": []})
    with pytest.raises(ValueError, match="choices must be a non-empty list of strings"):
        smol_engine.generate("Hello", {**GREEDY, "choices": ["a", 3]})
