"""JSON schema, JSON object and EBNF constraints through the Engine on SmolLM2: outputs
validate with ``jsonschema``; truncation reports ``length``; jump-forward saves decode steps."""

from __future__ import annotations

import json

import jsonschema
import pytest

pytestmark = pytest.mark.slow

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer"},
        "city": {"type": "string"},
        "is_student": {"type": "boolean"},
    },
    "required": ["name", "age", "city", "is_student"],
    "additionalProperties": False,
}
SCHEMAS = {
    "person": PERSON,
    "enum and array": {
        "type": "object",
        "properties": {
            "status": {"enum": ["active", "inactive", "banned"]},
            "tags": {
                "type": "array",
                "items": {"type": "string", "maxLength": 12},
                "minItems": 1,
                "maxItems": 3,
            },
        },
        "required": ["status", "tags"],
        "additionalProperties": False,
    },
    "nested with refs": {
        "$defs": {
            "point": {
                "type": "object",
                "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                "required": ["x", "y"],
                "additionalProperties": False,
            }
        },
        "type": "object",
        "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
        "required": ["start", "end"],
        "additionalProperties": False,
    },
    "numeric bounds": {  # auto compiles these with llguidance (outlines-core ignores bounds)
        "type": "object",
        "properties": {
            "rating": {"type": "integer", "minimum": 1, "maximum": 5},
            "score": {"type": "number", "minimum": 0, "maximum": 1},
        },
        "required": ["rating", "score"],
        "additionalProperties": False,
    },
    "pattern and format": {
        "type": "object",
        "properties": {
            "sku": {"type": "string", "pattern": "^[A-Z]{3}-\\d{4}$"},
            "released": {"type": "string", "format": "date"},
            "price": {"anyOf": [{"type": "number"}, {"type": "null"}]},
        },
        "required": ["sku", "released", "price"],
        "additionalProperties": False,
    },
}
QUESTION = "Reply with a JSON object for this request: {}"


def _prompt(engine, text: str) -> str:
    return engine.apply_chat_template([{"role": "user", "content": text}])


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_outputs_validate_against_the_schema(smol_engine, name):
    schema = SCHEMAS[name]
    prompt = _prompt(smol_engine, QUESTION.format(name))
    params = [{"temperature": 0, "max_new_tokens": 96, "json_schema": json.dumps(schema)}]
    params += [
        {"temperature": 1.0, "seed": s, "max_new_tokens": 96, "json_schema": json.dumps(schema)}
        for s in range(3)
    ]
    outs = smol_engine.generate([prompt] * len(params), params)
    # greedy must finish; a sampled run may wander (e.g. a 90-digit number at T = 1) and be cut
    # at the token limit, which must then be reported as such; every finished one validates
    assert outs[0]["meta_info"]["finish_reason"]["type"] == "stop", outs[0]
    finished = 0
    for out in outs:
        reason = out["meta_info"]["finish_reason"]
        if reason["type"] == "length":
            assert out["meta_info"]["completion_tokens"] == reason["length"] == 96, out
            continue
        assert reason["type"] == "stop", out
        jsonschema.validate(json.loads(out["text"]), schema)
        finished += 1
    assert finished >= 3, [o["meta_info"]["finish_reason"] for o in outs]


def test_json_object_response_is_an_object(smol_engine):
    prompt = _prompt(smol_engine, "Give me a JSON object describing a person.")
    out = smol_engine.generate(
        prompt, {"temperature": 0, "max_new_tokens": 96, "json_schema": '{"type": "object"}'}
    )
    assert out["meta_info"]["finish_reason"]["type"] == "stop"
    assert isinstance(json.loads(out["text"]), dict)


def test_ebnf_grammar_output_is_in_the_language(smol_engine):
    grammar = 'start: answer " because " reason\nanswer: "yes" | "no"\nreason: /[a-z ]{3,30}/'
    prompt = _prompt(smol_engine, "Is the sky blue? Answer yes or no and give a reason.")
    out = smol_engine.generate(prompt, {"temperature": 0, "max_new_tokens": 40, "ebnf": grammar})
    text = out["text"]
    assert text.split(" because ")[0] in ("yes", "no"), text
    assert 3 <= len(text.split(" because ", 1)[1]) <= 30, text


def test_truncated_output_reports_length(smol_engine):
    prompt = _prompt(smol_engine, QUESTION.format("person"))
    out = smol_engine.generate(
        prompt, {"temperature": 0, "max_new_tokens": 5, "json_schema": json.dumps(PERSON)}
    )
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
    assert out["meta_info"]["completion_tokens"] == 5
    assert out["text"].startswith("{")
    with pytest.raises(ValueError):
        json.loads(out["text"])


def _run_counting_steps(engine, prompt: str, jump_forward: bool) -> tuple[dict, int]:
    grammars = engine.scheduler.grammars
    saved = grammars.jump_forward_enabled
    grammars.jump_forward_enabled = jump_forward
    try:
        before = engine.scheduler.num_forward_steps
        out = engine.generate(
            prompt, {"temperature": 0, "max_new_tokens": 80, "json_schema": json.dumps(PERSON)}
        )
        return out, engine.scheduler.num_forward_steps - before
    finally:
        grammars.jump_forward_enabled = saved


def test_jump_forward_gives_the_same_json_in_fewer_steps(smol_engine):
    prompt = _prompt(smol_engine, "Give me a JSON object describing a person.")
    stepped, stepped_steps = _run_counting_steps(smol_engine, prompt, jump_forward=False)
    jumped, jumped_steps = _run_counting_steps(smol_engine, prompt, jump_forward=True)
    for out in (stepped, jumped):
        assert out["meta_info"]["finish_reason"]["type"] == "stop"
        jsonschema.validate(json.loads(out["text"]), PERSON)
    assert json.loads(jumped["text"]) == json.loads(stepped["text"])
    # without jump-forward every output token costs one forward step (the first: the prefill)
    assert stepped_steps == stepped["meta_info"]["completion_tokens"]
    assert jumped_steps <= stepped_steps - 4, (jumped_steps, stepped_steps)
