"""Checks of one request against the model's limits (HTTP 400s that name the parameter)."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from radixlm.srt.managers.request_group import GenerateError
from radixlm.srt.sampling.params import MAX_SEED, OFF_ONLY, SEED_ALIAS, SamplingParams

MAX_TOP_LOGPROBS = 20
MAX_TOKEN_IDS_LOGPROB = 1024  # token ids one request may ask the logprobs of
# logprob values (positions x token ids) the token_ids_logprob of one request may return
MAX_TOKEN_IDS_LOGPROB_VALUES = 4_194_304
MAX_CACHE_SALT_CHARS = 256


def check_cache_salt(salt: Any) -> str | None:
    """A request's ``cache_salt`` (vLLM's and SGLang's): a string of at most
    MAX_CACHE_SALT_CHARS characters; "" and None mean no salt (the shared cache)."""
    return check_label(salt, "cache_salt")


def check_label(value: Any, field: str) -> str | None:
    """A request's string label ``field`` (``cache_salt``, ``routing_key``): at most
    MAX_CACHE_SALT_CHARS characters; "" and None mean none."""
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise GenerateError(f"{field} must be a string, got {type(value).__name__}", 400, field)
    if len(value) > MAX_CACHE_SALT_CHARS:
        raise GenerateError(
            f"{field} has {len(value)} characters; at most {MAX_CACHE_SALT_CHARS}", 400, field
        )
    return value


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


def check_vocab_ids(ids: list[Any], vocab_size: int, param: str) -> None:
    """Every entry is an integer token id of the vocabulary (a bool is not)."""
    bad = [t for t in ids if type(t) is not int or not 0 <= t < vocab_size]
    if bad:
        raise GenerateError(
            f"{param} must be token ids in [0, {vocab_size}), got {bad[:5]}", 400, param
        )


def check_token_ids_logprob(
    ids: Any, vocab_size: int, num_positions: int, param: str = "token_ids_logprob"
) -> list[int] | None:
    """SGLang's ``token_ids_logprob`` of one sequence: a flat list of token ids of the
    vocabulary (an empty list or None: none), at most MAX_TOKEN_IDS_LOGPROB of them, whose
    logprobs at ``num_positions`` positions stay within MAX_TOKEN_IDS_LOGPROB_VALUES."""
    if ids is None or (isinstance(ids, list) and not ids):
        return None
    if not isinstance(ids, list) or not all(type(t) is int for t in ids):
        raise GenerateError(f"{param} must be a flat list of token ids (integers)", 400, param)
    if len(ids) > MAX_TOKEN_IDS_LOGPROB:
        raise GenerateError(
            f"{param} has {len(ids)} token ids; at most {MAX_TOKEN_IDS_LOGPROB} per request "
            "(use top_logprobs_num for the most likely tokens)",
            400,
            param,
        )
    check_vocab_ids(ids, vocab_size, param)
    if len(ids) * num_positions > MAX_TOKEN_IDS_LOGPROB_VALUES:
        raise GenerateError(
            f"{param} asks for {len(ids)} logprobs at each of {num_positions} positions "
            f"(prompt from logprob_start_len, and max_new_tokens): more than "
            f"{MAX_TOKEN_IDS_LOGPROB_VALUES} values; send fewer ids, a later "
            "logprob_start_len or a lower max_new_tokens",
            400,
            param,
        )
    return list(ids)


def token_ids_logprob_per_prompt(value: Any, num_prompts: int) -> list[Any]:
    """SGLang's batch forms of ``token_ids_logprob``: one flat list shared by every prompt, or
    one list (or null) per prompt; each entry is checked by :func:`check_token_ids_logprob`."""
    if isinstance(value, list) and value and (value[0] is None or isinstance(value[0], list)):
        if len(value) != num_prompts:
            raise GenerateError(
                f"token_ids_logprob has {len(value)} lists for {num_prompts} prompts; send one "
                "list per prompt, or one flat list for all",
                400,
                "token_ids_logprob",
            )
        return list(value)
    return [value] * num_prompts


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


MAX_BOOTSTRAP_ROOM = 2**64 - 1  # sglang-router draws rooms as unsigned 64-bit integers


def check_bootstrap(mode: str, host: str | None, port: int | None, room: int | None) -> None:
    """The bootstrap fields of prefill-decode disaggregation: refused on a whole server (its
    ``--disaggregation-mode`` is null); on a prefill or decode worker all three or none (a
    request without them runs whole there)."""
    given = {"bootstrap_host": host, "bootstrap_port": port, "bootstrap_room": room}
    named = [k for k, v in given.items() if v is not None]
    if not named:
        return
    if mode == "null":
        raise GenerateError(
            f"{named[0]} is for prefill-decode disaggregation; this server is not a prefill or "
            "decode worker (start it with --disaggregation-mode prefill or decode)",
            400,
            named[0],
            "unsupported_parameter",
        )
    missing = [k for k, v in given.items() if v is None]
    if missing:
        raise GenerateError(f"{missing[0]} is needed with {named[0]}", 400, missing[0])
    if type(host) is not str or not host:
        raise GenerateError("bootstrap_host must be a non-empty string", 400, "bootstrap_host")
    if type(port) is not int or not 0 < port < 65536:
        raise GenerateError(
            f"bootstrap_port must be a port number, got {port!r}", 400, "bootstrap_port"
        )
    if type(room) is not int or not 0 <= room <= MAX_BOOTSTRAP_ROOM:
        raise GenerateError(
            f"bootstrap_room must be an unsigned 64-bit integer, got {room!r}",
            400,
            "bootstrap_room",
        )
