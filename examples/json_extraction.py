"""Extraction into a JSON schema: free text in, validated JSON records out.

``gen(json_schema=...)`` asks the server to constrain decoding to the schema, so the output
parses and validates; the records are extracted in one ``run_batch``.

    python examples/json_extraction.py
    python examples/json_extraction.py --url http://127.0.0.1:30000
"""

from __future__ import annotations

import json

from _backend import connect, example_parser, print_usage

import radixlm.lang as rl

PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"type": "string", "maxLength": 40},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
TEXTS = [
    "Maria Lopez is a 34 year old architect who lives in Barcelona.",
    "At 71, retired teacher John Smith still walks his dog every morning in Boston.",
    "The new intern, Aiko Tanaka (22), just moved to Osaka for the job.",
]


@rl.function
def extract_person(s, text: str):
    s += rl.system(
        "You extract facts from text. Reply with a JSON object with the keys name, age and city."
    )
    s += rl.user(text)
    s += rl.assistant(rl.gen("json", max_tokens=64, json_schema=PERSON_SCHEMA))


def check(raw: str) -> str:
    """'valid', or why the text is not a record of the schema."""
    try:
        record = json.loads(raw)
    except json.JSONDecodeError as e:
        return f"not JSON ({e})"
    try:
        import jsonschema
    except ImportError:
        return "parsed (install jsonschema to validate)"
    try:
        jsonschema.validate(record, PERSON_SCHEMA)
    except jsonschema.ValidationError as e:
        return f"does not match the schema ({e.message})"
    return "valid"


def main() -> None:
    args = example_parser(__doc__).parse_args()
    with connect(args) as backend:
        rl.set_default_backend(backend)
        states = extract_person.run_batch([{"text": t} for t in TEXTS], temperature=0)
        for text, state in zip(TEXTS, states, strict=True):
            print(text)
            print(f"  -> {state['json']}   [{check(state['json'])}]")
        print_usage(backend)


if __name__ == "__main__":
    main()
