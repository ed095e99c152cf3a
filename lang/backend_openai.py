"""Programs over an OpenAI-compatible chat API (``/v1/chat/completions``).

Chat servers complete assistant messages, so ``gen`` and ``select`` must come right after
``assistant_begin()`` (or as the whole content of ``assistant(...)``). ``select`` works by
prompting: the options are listed in the request, the reply is mapped to the closest option
(with ``supports_regex=True`` the reply is also constrained to them, as radixlm and SGLang
servers allow). ``json_schema`` goes as ``response_format``; ``regex``, ``top_k`` and ``min_p``
go in the request body only when set, for servers that take them.
"""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Iterator
from typing import Any

from radixlm.lang.backend_base import BaseBackend, Prompt
from radixlm.lang.chat_template import ChatTemplate
from radixlm.lang.choices import ChoiceLogprobs, ChoicesMethod, SelectResult
from radixlm.lang.errors import BackendError
from radixlm.lang.ir import GenParams

SELECT_INSTRUCTION = "Answer with exactly one of the following options and nothing else:\n"


def closest_choice(reply: str, choices: list[str]) -> int:
    """The option a free-text reply names: an exact match, else one the reply starts with or
    contains (the longest), else the most similar string."""
    text = reply.strip()
    for i, c in enumerate(choices):
        if text == c.strip():
            return i
    hits = [i for i, c in enumerate(choices) if c.strip() and c.strip().lower() in text.lower()]
    if hits:
        return max(hits, key=lambda i: len(choices[i].strip()))
    ratios = [
        difflib.SequenceMatcher(None, text.lower(), c.strip().lower()).ratio() for c in choices
    ]
    return max(range(len(choices)), key=lambda i: (ratios[i], -i))


class OpenAI(BaseBackend):
    """``OpenAI(model_name, base_url=None, api_key=None, supports_regex=False)``; other keyword
    arguments go to ``openai.OpenAI``."""

    def __init__(
        self,
        model_name: str = "default",
        base_url: str | None = None,
        api_key: str | None = None,
        supports_regex: bool = False,
        chat_template: ChatTemplate | None = None,
        **client_kwargs: Any,
    ) -> None:
        super().__init__()
        try:
            import openai
        except ImportError as e:
            raise ImportError(
                "the OpenAI backend needs the openai package: pip install openai"
            ) from e
        self.model_name = model_name
        self.supports_regex = supports_regex
        self.chat_template = chat_template or ChatTemplate.chatml()
        self.client = openai.OpenAI(base_url=base_url, api_key=api_key or "EMPTY", **client_kwargs)
        self._openai = openai

    def _messages(self, prompt: Prompt, primitive: str) -> list[dict[str, str]]:
        if prompt.role != "assistant" or prompt.role_text:
            raise ValueError(
                f"{primitive} over a chat API must come right after assistant_begin() "
                f"(chat servers complete whole assistant messages)"
            )
        return [dict(m) for m in prompt.messages]

    def _request(self, params: GenParams) -> dict[str, Any]:
        names = list(params.request_options())
        if params.min_new_tokens is not None:
            names.append("min_tokens")
        if names:
            raise ValueError(
                f"gen(): {', '.join(names)} cannot go over a chat API (its logprobs and "
                "lengths are not SGLang's); use LocalBackend or RuntimeEndpoint"
            )
        kw: dict[str, Any] = {
            "model": self.model_name,
            "max_tokens": params.max_new_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "frequency_penalty": params.frequency_penalty,
            "presence_penalty": params.presence_penalty,
            "seed": params.seed,
        }
        if params.stop is not None:
            kw["stop"] = [params.stop] if isinstance(params.stop, str) else list(params.stop)
        if params.json_schema is not None:
            kw["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "output", "schema": json.loads(params.json_schema)},
            }
        extra = {
            k: getattr(params, k)
            for k in ("regex", "top_k", "min_p", "ignore_eos", "stop_regex")
            if getattr(params, k) is not None
        }
        if isinstance(extra.get("stop_regex"), tuple):
            extra["stop_regex"] = list(extra["stop_regex"])
        if extra:
            kw["extra_body"] = extra
        return {k: v for k, v in kw.items() if v is not None}

    def _create(self, **kwargs: Any) -> Any:
        try:
            return self.client.chat.completions.create(**kwargs)
        except self._openai.OpenAIError as e:
            raise BackendError(f"the chat API failed: {e}") from e

    def _count(self, usage: Any) -> dict[str, Any]:
        if usage is None:
            return {}
        details = getattr(usage, "prompt_tokens_details", None)
        meta = {
            "prompt_tokens": usage.prompt_tokens,
            "completion_tokens": usage.completion_tokens,
            "cached_tokens": getattr(details, "cached_tokens", 0) or 0,
        }
        self.usage.add_meta(meta)
        return meta

    def generate(self, prompt: Prompt, params: GenParams) -> tuple[str, dict[str, Any]]:
        messages = self._messages(prompt, "gen()")
        r = self._create(messages=messages, **self._request(params))
        choice = r.choices[0]
        return choice.message.content or "", {
            "finish_reason": choice.finish_reason,
            **self._count(r.usage),
        }

    def generate_stream(
        self, prompt: Prompt, params: GenParams
    ) -> Iterator[tuple[str, dict | None]]:
        messages = self._messages(prompt, "gen()")
        reason, usage = None, None
        for chunk in self._create(messages=messages, stream=True, **self._request(params)):
            usage = getattr(chunk, "usage", None) or usage
            if not chunk.choices:
                continue
            delta = chunk.choices[0].delta.content
            reason = chunk.choices[0].finish_reason or reason
            if delta:
                yield delta, None
        yield "", {"finish_reason": reason, **self._count(usage)}

    def score_choices(
        self, prompt: Prompt, choices: list[str], unconditional: bool
    ) -> ChoiceLogprobs:
        raise NotImplementedError(
            "a chat API gives no input-token logprobs; select prompts instead"
        )

    def select(self, prompt: Prompt, choices: list[str], method: ChoicesMethod) -> SelectResult:
        messages = self._messages(prompt, "select()")
        listing = SELECT_INSTRUCTION + "\n".join(f"- {c}" for c in choices)
        if messages and messages[-1]["role"] == "user":
            messages[-1] = {**messages[-1], "content": messages[-1]["content"] + "\n\n" + listing}
        else:
            messages.append({"role": "user", "content": listing})
        longest = max(len(c) for c in choices)
        params = GenParams(
            max_new_tokens=min(longest + 16, 256),
            temperature=0.0,
            regex="|".join(re.escape(c) for c in choices) if self.supports_regex else None,
        )
        r = self._create(messages=messages, **self._request(params))
        reply = r.choices[0].message.content or ""
        index = closest_choice(reply, choices)
        scores = [1.0 if i == index else 0.0 for i in range(len(choices))]
        meta = {"choices_method": "prompting", "reply": reply, **self._count(r.usage)}
        return SelectResult(choices[index], index, scores, meta)

    def shutdown(self) -> None:
        self.client.close()
