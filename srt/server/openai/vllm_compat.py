"""vLLM's structured-output request fields on the OpenAI routes, read as this server's own.

Clients written for vLLM send ``guided_json`` / ``guided_regex`` / ``guided_grammar`` /
``guided_choice`` (older vLLM) or ``structured_outputs: {json, regex, grammar, choice,
json_object}`` (newer vLLM). They become ``json_schema`` / ``regex`` / ``ebnf`` / ``choices``
(and ``response_format: {"type": "json_object"}``) before the body is validated, so every
check of those fields applies. Options that would change the grammar in ways this server does
not implement (a custom whitespace pattern, no fallback) are a 400 naming them; the backend
choice (``guided_decoding_backend``) is accepted and has no effect: this server picks its own
grammar engine, and the output is constrained either way. ``include_stop_str_in_output`` is
SGLang's ``no_stop_trim``.
"""

from __future__ import annotations

from typing import Any

GUIDED_FIELDS = {
    "guided_json": "json_schema",
    "guided_regex": "regex",
    "guided_grammar": "ebnf",
    "guided_choice": "choices",
}
STRUCTURED_OUTPUT_FIELDS = {
    "json": "json_schema",
    "regex": "regex",
    "grammar": "ebnf",
    "choice": "choices",
}
# structured_outputs options and their "off" values
STRUCTURED_OUTPUT_OPTIONS = {
    "disable_fallback": (None, False),
    "disable_any_whitespace": (None, False),
    "disable_additional_properties": (None, False),
    "whitespace_pattern": (None,),
    "structural_tag": (None,),
    "backend": None,  # any value: the server picks its grammar engine
}
IGNORED_FIELDS = ("guided_decoding_backend",)


def _set(data: dict[str, Any], name: str, value: Any, source: str) -> None:
    if data.get(name) is not None:
        raise ValueError(f"{source} and {name} ask for the same thing; send one of them")
    data[name] = value


def translate_vllm_fields(data: dict[str, Any]) -> None:
    """Rewrites vLLM's structured-output fields of the body ``data`` in place; ``ValueError``
    (whose first word names the field) for options this server cannot honour or a field given
    twice under both names."""
    for name in IGNORED_FIELDS:
        data.pop(name, None)
    keep = data.pop("include_stop_str_in_output", None)  # vLLM's name for no_stop_trim
    if keep is not None:
        if not isinstance(keep, bool):
            raise ValueError("include_stop_str_in_output must be a boolean")
        if data.get("no_stop_trim") not in (None, keep):
            raise ValueError(
                "include_stop_str_in_output and no_stop_trim are the same option and differ; "
                "send one of them"
            )
        data["no_stop_trim"] = keep
    if data.get("guided_whitespace_pattern") is not None:
        raise ValueError(
            "guided_whitespace_pattern is not supported; the grammar engines use their own "
            "whitespace rules"
        )
    data.pop("guided_whitespace_pattern", None)
    for name, ours in GUIDED_FIELDS.items():
        value = data.pop(name, None)
        if value is not None:
            _set(data, ours, value, name)
    outputs = data.pop("structured_outputs", None)
    if outputs is None:
        return
    if not isinstance(outputs, dict):
        raise ValueError("structured_outputs must be an object")
    for key, value in outputs.items():
        if key in STRUCTURED_OUTPUT_FIELDS:
            if value is not None:
                _set(data, STRUCTURED_OUTPUT_FIELDS[key], value, f"structured_outputs.{key}")
        elif key == "json_object":
            if value:
                _set(data, "response_format", {"type": "json_object"}, "structured_outputs")
        elif key in STRUCTURED_OUTPUT_OPTIONS:
            off = STRUCTURED_OUTPUT_OPTIONS[key]
            if off is not None and value not in off:
                raise ValueError(
                    f"structured_outputs.{key} is not supported by this server (send it off "
                    "or leave it out)"
                )
        else:
            raise ValueError(f"structured_outputs.{key} is not a structured-outputs field")
