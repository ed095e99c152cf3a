"""A chat request -> native generate inputs (the plan), and native outputs -> the pieces of a
chat answer (finish reasons, usage, logprobs); the OpenAI completion route builds its plan from
the same parts (openai/completions.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from radixlm.srt.managers.generate_call import check_num_sequences
from radixlm.srt.managers.tokenizer_manager import (
    GenerateError,
    GenerateInput,
    TokenizerManager,
    sample_seed,
)
from radixlm.srt.sampling.params import MAX_N, MAX_SEED
from radixlm.srt.server.chat.prompt import chat_input_ids
from radixlm.srt.server.chat.request import (
    ChatCompletionRequest,
    OpenAISamplingFields,
    ResponseFormat,
)
from radixlm.srt.server.chat.token_bytes import TEXT_BYTES, TokenBytes, token_bytes_for
from radixlm.srt.server.chat.tools import (
    ChatParsing,
    chat_parsing,
    output_constraint,
    prompt_layout,
    reads_harmony,
    reasoning_wrapped,
    template_kwargs,
    with_prompt,
)

MAX_CHAT_TOP_LOGPROBS = 20
JSON_OBJECT: dict[str, Any] = {"type": "object"}

# OpenAI / SGLang-extra field -> native sampling parameter
_PASSTHROUGH = {
    "temperature": "temperature",
    "top_p": "top_p",
    "stop": "stop",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "logit_bias": "logit_bias",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "min_tokens": "min_new_tokens",
    "regex": "regex",
    "json_schema": "json_schema",
    "ebnf": "ebnf",
    "choices": "choices",
    "ignore_eos": "ignore_eos",
    "stop_token_ids": "stop_token_ids",
    "no_stop_trim": "no_stop_trim",
    "skip_special_tokens": "skip_special_tokens",
    "spaces_between_special_tokens": "spaces_between_special_tokens",
    "stop_regex": "stop_regex",
    "custom_params": "custom_params",
    "stream_interval": "stream_interval",
}


@dataclass
class OpenAIPlan:
    """The native requests behind one OpenAI request: ``n`` per prompt, prompt-major."""

    inputs: list[GenerateInput] = field(default_factory=list)
    prompt_texts: list[str] = field(default_factory=list)  # one per prompt
    n: int = 1
    num_prompts: int = 1
    parsing: ChatParsing = field(default_factory=ChatParsing)  # chat: tools, reasoning
    token_bytes: TokenBytes = TEXT_BYTES  # chat: the tokenizer's bytes, for logprobs' ``bytes``

    def prompt_of(self, choice: int) -> int:
        return choice // self.n


def sampling_params(req: OpenAISamplingFields, max_new_tokens: int) -> dict[str, Any]:
    sp: dict[str, Any] = {"max_new_tokens": max_new_tokens}
    for name, native in _PASSTHROUGH.items():
        value = getattr(req, name)
        if value is not None:
            sp[native] = value
    return sp


def check_counts(n: int, num_prompts: int) -> None:
    if not 1 <= n <= MAX_N:
        raise GenerateError(f"n must be in [1, {MAX_N}], got {n}", 400, "n")
    check_num_sequences(n * num_prompts)


def check_max_tokens(value: int | None, name: str) -> None:
    if value is not None and value < 0:
        raise GenerateError(f"{name} must be >= 0, got {value}", 400, name)


def expand(
    plan: OpenAIPlan,
    req: OpenAISamplingFields,
    ids: list[int],
    sp: dict[str, Any],
    logprob: tuple[bool, int, int],
) -> None:
    """Adds ``req.n`` native inputs for one prompt (seeded samples get seeds seed, seed+1, ...).
    With several choices, choice j of prompt p shows rid ``{rid}-{p}-{j}``; ``rid`` aborts all."""
    return_logprob, start_len, top_num = logprob
    prompt_index = len(plan.prompt_texts) - 1
    is_single = plan.n == 1 and plan.num_prompts == 1
    for j in range(req.n):
        sample_sp = dict(sp)
        if req.seed is not None:
            # an out-of-range seed is passed on unchanged, for validation to reject
            in_range = 0 <= req.seed <= MAX_SEED
            sample_sp["seed"] = sample_seed(req.seed, j) if in_range else req.seed
        rid, keys = None, ()
        if req.rid is not None:
            rid = req.rid if is_single else f"{req.rid}-{prompt_index}-{j}"
            keys = () if is_single else (req.rid,)
        plan.inputs.append(
            GenerateInput(
                input_ids=ids,
                sampling_params=sample_sp,
                rid=rid,
                abort_keys=keys,
                return_logprob=return_logprob,
                logprob_start_len=start_len,
                top_logprobs_num=top_num,
                return_text_in_logprobs=True,
                stream=req.stream,
                priority=req.priority,
                cache_salt=req.cache_salt,
                **bootstrap_of(req, len(plan.inputs), is_single),
            )
        )


def bootstrap_of(req: OpenAISamplingFields, index: int, is_single: bool) -> dict[str, Any]:
    """The bootstrap fields of the request's ``index``-th sequence (prefill-decode
    disaggregation): a list holds one per sequence; one value serves every sequence, but two
    sequences never share a room."""
    out: dict[str, Any] = {}
    for name in ("bootstrap_host", "bootstrap_port", "bootstrap_room"):
        value = getattr(req, name)
        if name == "bootstrap_room" and type(value) is int and not is_single:
            raise GenerateError("bootstrap_room needs one room per sequence (a list)", 400, name)
        if isinstance(value, list):
            if index >= len(value):
                raise GenerateError(
                    f"{name} has {len(value)} entries; this request has more sequences", 400, name
                )
            value = value[index]
        out[name] = value
    return out


# ---------------------------------------------------------------------- chat
def response_format_parts(
    fmt: ResponseFormat | None,
) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """(JSON schema, structural tag) that ``response_format`` asks for; at most one is set."""
    if fmt is None or fmt.type == "text":
        return None, None
    if fmt.type == "json_object":
        return dict(JSON_OBJECT), None
    if fmt.type == "structural_tag":
        return None, fmt.model_dump(by_alias=True, exclude_none=True, exclude={"json_schema"})
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise GenerateError(
            "response_format json_schema needs json_schema.schema", 400, "response_format"
        )
    return fmt.json_schema.schema_, None


def format_params(fmt: ResponseFormat | None, req: OpenAISamplingFields) -> dict[str, Any]:
    """The native grammar params of ``response_format`` alone (no tools, no reasoning)."""
    return output_constraint(ChatParsing(), *_format_parts_alone(fmt, req))


def _format_parts_alone(
    fmt: ResponseFormat | None, req: OpenAISamplingFields
) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    schema, tag = response_format_parts(fmt)
    if (schema is not None or tag is not None) and req.json_schema is not None:
        raise GenerateError("give response_format or json_schema, not both", 400, "json_schema")
    return schema, tag


def raw_grammar(req: OpenAISamplingFields) -> dict[str, Any]:
    """The grammar params sent as such (SGLang extras), by name."""
    names = ("regex", "ebnf", "json_schema", "choices")
    return {n: getattr(req, n) for n in names if getattr(req, n) is not None}


def check_grammar_conflicts(raw: dict[str, Any], constraint: dict[str, Any]) -> None:
    """Tools and response_format constrain the output; a raw grammar next to them is a 400."""
    if constraint and raw:
        name = next(iter(raw))
        raise GenerateError(
            f"{name} cannot be combined with tools or response_format, which constrain "
            "the output themselves",
            400,
            name,
        )


def _chat_max_tokens(req: ChatCompletionRequest, tm: TokenizerManager, num_ids: int) -> int:
    """max_completion_tokens, else max_tokens, else --default-max-tokens capped by the context
    the prompt leaves."""
    check_max_tokens(req.max_tokens, "max_tokens")
    check_max_tokens(req.max_completion_tokens, "max_completion_tokens")
    if req.max_completion_tokens is not None:
        return req.max_completion_tokens
    if req.max_tokens is not None:
        return req.max_tokens
    return max(0, min(tm.cfg.default_max_tokens, tm.context_length - num_ids))


def _check_top_logprobs(req: ChatCompletionRequest) -> int:
    top = req.top_logprobs or 0
    if not 0 <= top <= MAX_CHAT_TOP_LOGPROBS:
        raise GenerateError(
            f"top_logprobs must be in [0, {MAX_CHAT_TOP_LOGPROBS}], got {top}", 400, "top_logprobs"
        )
    if top and not req.logprobs:
        raise GenerateError("top_logprobs needs logprobs: true", 400, "top_logprobs")
    return top


async def chat_plan(req: ChatCompletionRequest, tm: TokenizerManager) -> OpenAIPlan:
    check_counts(req.n, 1)
    top = _check_top_logprobs(req)
    schema, tag = _format_parts_alone(req.response_format, req)
    parsing = chat_parsing(req, tm)
    prompt, ids = await chat_input_ids(
        tm,
        req.messages,
        prompt_layout(parsing, req.messages),
        template_kwargs(req, reads_harmony(parsing)),
    )
    parsing = with_prompt(parsing, prompt)
    raw = raw_grammar(req)
    constraint = output_constraint(parsing, schema, tag)
    check_grammar_conflicts(raw, constraint)
    constraint = constraint or reasoning_wrapped(parsing, raw)
    sp = sampling_params(req, _chat_max_tokens(req, tm, len(ids)))
    if parsing.special_markup and req.skip_special_tokens is None:
        sp["skip_special_tokens"] = False  # the calls' markup must reach the parser
    if constraint:
        for name in raw:
            del sp[_PASSTHROUGH[name]]
    sp.update(constraint)
    plan = OpenAIPlan(
        prompt_texts=[prompt], n=req.n, parsing=parsing, token_bytes=token_bytes_for(tm.tokenizer)
    )
    expand(plan, req, ids, sp, (req.logprobs, -1, top))
    return plan


# ---------------------------------------------------------------------- outputs
def finish_reason(out: dict[str, Any]) -> str | None:
    reason = out["meta_info"]["finish_reason"]
    if reason is None:
        return None
    if reason["type"] == "abort":
        raise GenerateError(f"the request was aborted: {reason.get('message', '')}", 400)
    return "length" if reason["type"] == "length" else "stop"


def usage(outs: list[dict[str, Any]], plan: OpenAIPlan) -> dict[str, Any]:
    """Prompt tokens count once per prompt, completion tokens once per choice."""
    firsts = [outs[p * plan.n]["meta_info"] for p in range(len(plan.prompt_texts))]
    prompt = sum(m["prompt_tokens"] for m in firsts)
    completion = sum(o["meta_info"]["completion_tokens"] for o in outs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(m["cached_tokens"] for m in firsts)},
    }


def chat_logprobs(
    entries: list[list[Any]], tops: list[Any], token_bytes: TokenBytes = TEXT_BYTES
) -> dict[str, Any]:
    """OpenAI's ``logprobs`` of a chat choice from ``[logprob, token_id, text]`` entries (and
    their rows of top entries). ``token`` is the token's display text, as SGLang and vLLM send
    it (U+FFFD where the token holds part of a character); ``bytes`` are the token's own bytes
    from ``token_bytes``, so that joined over the reply they are its text's UTF-8."""

    def entry(lp: float, token_id: int, text: str | None) -> dict[str, Any]:
        return {"token": text or "", "logprob": lp, "bytes": token_bytes.of(token_id, text)}

    content = []
    for i, (lp, token_id, text) in enumerate(entries):
        row = tops[i] if i < len(tops) and tops[i] else []
        content.append({**entry(lp, token_id, text), "top_logprobs": [entry(*e) for e in row]})
    return {"content": content, "refusal": None}


# the native fields a grammar error names (srt/scheduler/grammar_queue.py)
GRAMMAR_PARAMS = frozenset(
    {"json_schema", "regex", "ebnf", "choices", "json_object", "structural_tag"}
)
_GRAMMAR_FIELDS = ("json_schema", "regex", "ebnf", "choices")


def grammar_field(body: Any) -> str | None:
    """The request field that asked for the output grammar: ``response_format``, an extension
    field (``json_schema``, ``regex``, ``ebnf``, ``choices``; vLLM's ``guided_*`` arrive under
    these names) or ``tools``; None when there is none."""
    fmt = getattr(body, "response_format", None)
    if fmt is not None and getattr(fmt, "type", None) not in (None, "text"):
        return "response_format"
    for name in _GRAMMAR_FIELDS:
        if getattr(body, name, None) is not None:
            return name
    return "tools" if getattr(body, "tools", None) else None


def name_grammar_error(error: Any, body: Any, renames: dict[str, str] | None = None) -> None:
    """Points a grammar's 400 (``error.param`` a native kind) at the request field of ``body``
    that asked for the grammar (``grammar_field``), renamed through ``renames``."""
    if error.param in GRAMMAR_PARAMS:
        field = grammar_field(body)
        if field is not None:
            error.param = (renames or {}).get(field, field)
