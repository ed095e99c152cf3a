"""Checks of one request against the model's limits (HTTP 400s that name the parameter)."""

from __future__ import annotations

import dataclasses
import re

from radixlm.srt.managers.request_group import GenerateError
from radixlm.srt.sampling.params import MAX_SEED, OFF_ONLY, SEED_ALIAS, SamplingParams

MAX_TOP_LOGPROBS = 20


def check_lengths(
    num_input: int, params: SamplingParams, context_length: int, max_total_tokens: int
) -> None:
    limit = min(context_length, max_total_tokens)
    if num_input >= limit:
        raise GenerateError(
            f"the prompt has {num_input} tokens, but this server takes at most {limit - 1} "
            f"(context length {context_length}, KV pool {max_total_tokens} tokens); "
            "shorten the prompt",
            400,
        )
    if num_input + params.max_new_tokens > context_length:
        raise GenerateError(
            f"the prompt ({num_input} tokens) plus max_new_tokens ({params.max_new_tokens}) "
            f"exceeds the context length of {context_length} tokens; "
            "lower max_new_tokens or shorten the prompt",
            400,
            "max_new_tokens",
        )


def check_logprob_args(logprob_start_len: int, top_logprobs_num: int, num_input: int) -> None:
    if not -1 <= logprob_start_len <= num_input:
        raise GenerateError(
            f"logprob_start_len must be -1 (none) or in [0, {num_input}] for this "
            f"{num_input}-token prompt, got {logprob_start_len}",
            400,
            "logprob_start_len",
        )
    if not 0 <= top_logprobs_num <= MAX_TOP_LOGPROBS:
        raise GenerateError(
            f"top_logprobs_num must be in [0, {MAX_TOP_LOGPROBS}], got {top_logprobs_num}",
            400,
            "top_logprobs_num",
        )


_PARAM_IN_MESSAGE = re.compile(
    r"^(?:sampling parameter |unknown sampling parameter\(s\): )?"
    r"([a-z_]+)"
)
_SAMPLING_FIELDS = (
    frozenset(f.name for f in dataclasses.fields(SamplingParams))
    | {SEED_ALIAS}
    | frozenset(OFF_ONLY)
)


def sampling_param_named(message: str) -> str | None:
    """The parameter a SamplingParams ValueError is about (its messages start with it)."""
    m = _PARAM_IN_MESSAGE.match(message)
    if m is None:
        return None
    if message.startswith("unknown sampling parameter"):
        return m.group(1)  # the first unknown name, as the client spelled it
    return m.group(1) if m.group(1) in _SAMPLING_FIELDS else None


def sample_seed(seed: int, index: int) -> int:
    """The seed of sample ``index`` of a seeded n > 1 request (stays in the valid range)."""
    return (seed + index) % (MAX_SEED + 1)
