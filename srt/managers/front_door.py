"""The one way in for a generate request, shared by the HTTP tokenizer manager and the Engine.

A request is checked here once, before the scheduler sees it: the prompt is tokenized (a text
too long for the context is refused before the tokenizer runs) or its token ids are checked
against the vocabulary; the sampling parameters are parsed and validated (names, types,
ranges, token ids, grammar size and syntax limits); the prompt length is checked against the
context and the KV pool; the logprob arguments against the prompt; and the grammar kind is
decided (``json_object`` for a schema that accepts any object, so it compiles as that kind
without the scheduler reading the schema text again). The result is the
:class:`~radixlm.srt.messages.TokenizedGenerateReq` the scheduler consumes.

Every refusal is a :class:`GenerateError` (HTTP 400, naming the parameter); the Engine turns
it into a ``ValueError`` with the same message. The scheduler keeps only what needs its state
(a prompt its KV pool can never hold).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from radixlm.srt.managers.request_checks import (
    check_bootstrap,
    check_cache_salt,
    check_label,
    check_lengths,
    check_logprob_args,
    check_token_ids_logprob,
    check_vocab_ids,
    sampling_param_named,
)
from radixlm.srt.managers.request_group import GenerateError
from radixlm.srt.messages import TokenizedGenerateReq
from radixlm.srt.sampling.params import UP_TO_CONTEXT, SamplingParams

__all__ = ["FrontDoor", "ModelLimits", "grammar_kind"]

ANY_OBJECT_SCHEMA = {"type": "object"}


@dataclass(frozen=True)
class ModelLimits:
    """What a request is checked against: the model's vocabulary and context, the KV pool."""

    vocab_size: int
    context_length: int
    max_total_tokens: int  # tokens the KV pool holds
    disaggregation_mode: str = "null"  # prefill | decode: bootstrap fields are taken

    @classmethod
    def from_info(cls, info: Mapping[str, Any]) -> ModelLimits:
        """From the scheduler's ``ready_info()``."""
        return cls(
            int(info["vocab_size"]),
            int(info["context_length"]),
            int(info["max_total_tokens"]),
            str(info.get("disaggregation_mode", "null")),
        )


def grammar_kind(params: SamplingParams) -> str | None:
    """The GrammarSpec kind of validated params: ``json_object`` for the any-object schema
    (the same language, and llguidance compiles it far faster), else the field that is set."""
    if params.json_schema is not None:
        try:
            is_any_object = json.loads(params.json_schema) == ANY_OBJECT_SCHEMA
        except ValueError:  # validate() parsed it; a caller that skipped it gets json_schema
            is_any_object = False
        return "json_object" if is_any_object else "json_schema"
    for kind in ("regex", "ebnf", "choices", "structural_tag"):
        if getattr(params, kind) is not None:
            return kind
    return None


class FrontDoor:
    """Tokenizes and validates requests for one model; stateless apart from caches."""

    def __init__(self, tokenizer: Any, limits: ModelLimits) -> None:
        self.tokenizer = tokenizer
        self.limits = limits

    # ------------------------------------------------------------------ prompts
    @cached_property
    def max_token_chars(self) -> int:
        """The most characters one vocabulary entry spells (byte-level entries spell one
        character per byte, so this bounds the characters a token can cover)."""
        return max((len(t) for t in self.tokenizer.get_vocab()), default=1) or 1

    @property
    def max_prompt_chars(self) -> int:
        """Any text longer than this has more tokens than the context holds."""
        return self.limits.context_length * self.max_token_chars

    def check_prompt_chars(self, num_chars: int, param: str = "prompt") -> None:
        if num_chars > self.max_prompt_chars:
            raise GenerateError(
                f"the prompt has {num_chars} characters, more than the "
                f"{self.limits.context_length}-token context length can hold (at most "
                f"{self.max_prompt_chars} characters); shorten the prompt",
                400,
                param,
            )

    def tokenize(
        self, text: str, add_special_tokens: bool = True, param: str = "prompt"
    ) -> list[int]:
        """The token ids of ``text``, its size checked first (blocking: the tokenizer
        manager runs it on its thread pool)."""
        self.check_prompt_chars(len(text), param)
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def check_token_ids(self, ids: list[Any], param: str) -> None:
        check_vocab_ids(ids, self.limits.vocab_size, param)

    def check_input_ids(self, ids: list[Any], param: str = "input_ids") -> list[int]:
        """A copy of client token ids, checked against the vocabulary; a prompt too long for
        the context is refused first (the per-id check of millions of ids would stall)."""
        limits = self.limits
        if len(ids) >= limits.context_length:
            check_lengths(
                len(ids),
                SamplingParams(max_new_tokens=0),
                limits.context_length,
                limits.max_total_tokens,
            )
        self.check_token_ids(ids, param)
        return list(ids)

    # ------------------------------------------------------------------ parameters
    def parse_params(self, sampling_params: Mapping[str, Any] | None) -> SamplingParams:
        """Parsed and validated sampling parameters (grammar spec limits included)."""
        try:
            params = SamplingParams.from_dict(sampling_params)
            params.validate(self.limits.vocab_size)
        except ValueError as e:
            raise GenerateError(str(e), 400, sampling_param_named(str(e))) from None
        return params

    # ------------------------------------------------------------------ the message
    def admit(
        self,
        rid: str,
        input_ids: list[int],
        params: SamplingParams,
        *,
        return_logprob: bool = False,
        logprob_start_len: int = -1,
        top_logprobs_num: int = 0,
        token_ids_logprob: list[int] | None = None,
        stream: bool = False,
        priority: int | None = None,
        cache_salt: str | None = None,
        routing_key: str | None = None,
        bootstrap_host: str | None = None,
        bootstrap_port: int | None = None,
        bootstrap_room: int | None = None,
    ) -> TokenizedGenerateReq:
        """The scheduler's message for one sequence (``n`` samples are sent as n messages)
        after the length and logprob checks; ``input_ids`` and ``params`` come from this
        door (:meth:`tokenize` or :meth:`check_input_ids`, :meth:`parse_params`)."""
        if not input_ids:
            raise GenerateError("the prompt is empty; send at least one token", 400)
        if priority is not None and (type(priority) is not int or abs(priority) >= 2**62):
            raise GenerateError(
                f"priority must be an integer below 2**62 in size, got {priority!r}",
                400,
                "priority",
            )
        limits = self.limits
        check_bootstrap(limits.disaggregation_mode, bootstrap_host, bootstrap_port, bootstrap_room)
        if bootstrap_room is not None and return_logprob:
            raise GenerateError(
                "return_logprob is not supported with prefill-decode disaggregation yet (the "
                "first token's logprobs stay on the prefill worker)",
                400,
                "return_logprob",
                "unsupported_parameter",
            )
        if params.max_new_tokens == UP_TO_CONTEXT:  # max_new_tokens: null
            left = max(limits.context_length - len(input_ids), 0)
            params = params.replace(max_new_tokens=max(left, params.min_new_tokens))
        check_lengths(len(input_ids), params, limits.context_length, limits.max_total_tokens)
        check_logprob_args(logprob_start_len, top_logprobs_num, len(input_ids))
        num_input_positions = len(input_ids) - logprob_start_len if logprob_start_len >= 0 else 0
        token_ids = check_token_ids_logprob(
            token_ids_logprob,
            limits.vocab_size,
            num_input_positions + max(params.max_new_tokens, 1),
        )
        return TokenizedGenerateReq(
            rid=rid,
            input_ids=input_ids,
            sampling_params=params.replace(n=1).to_dict(),
            return_logprob=return_logprob,
            logprob_start_len=logprob_start_len if return_logprob else -1,
            top_logprobs_num=top_logprobs_num if return_logprob else 0,
            token_ids_logprob=token_ids if return_logprob else None,
            stream=stream,
            grammar_kind=grammar_kind(params),
            priority=priority,
            cache_salt=check_cache_salt(cache_salt),
            routing_key=check_label(routing_key, "routing_key"),
            bootstrap_host=bootstrap_host,
            bootstrap_port=bootstrap_port,
            bootstrap_room=bootstrap_room,
        )

    def prepare(
        self,
        rid: str,
        *,
        text: str | None = None,
        input_ids: list[Any] | None = None,
        sampling_params: Mapping[str, Any] | None = None,
        **options: Any,
    ) -> tuple[SamplingParams, TokenizedGenerateReq]:
        """Every check of one request, in the order the tokenizer manager runs them: the
        parameters, the prompt, then :meth:`admit` (``options`` are its keywords)."""
        params = self.parse_params(sampling_params)
        if (text is None) == (input_ids is None):
            raise GenerateError("send exactly one of text and input_ids", 400)
        ids = (
            self.check_input_ids(input_ids)
            if input_ids is not None
            else self.tokenize(text or "", param="text")
        )
        return params, self.admit(rid, ids, params, **options)
