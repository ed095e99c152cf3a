"""The in-process backend: programs call an :class:`radixlm.srt.Engine` directly.

engine = Engine()                                   # or rl.Runtime() to own one
rl.set_default_backend(rl.LocalBackend(engine))
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

from radixlm.lang.backend_base import BaseBackend, Prompt, choice_start, logprob_values
from radixlm.lang.chat_template import ChatTemplate
from radixlm.lang.choices import ChoiceLogprobs
from radixlm.lang.ir import GenParams

PREFILL_ONLY = {"max_new_tokens": 0}


class LocalBackend(BaseBackend):
    """Programs over an Engine in this process. The engine's tokenizer gives exact token
    boundaries for ``select``."""

    def __init__(self, engine: Any, chat_template: ChatTemplate | None = None) -> None:
        super().__init__()
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.chat_template = chat_template or ChatTemplate.from_tokenizer(self.tokenizer)
        config = getattr(engine, "config", None)
        self.is_cache_enabled = not getattr(config, "disable_radix_cache", False)

    def _run(self, **kwargs: Any) -> Any:
        out = self.engine.generate(**kwargs)
        for item in out if isinstance(out, list) else [out]:
            self.usage.add_meta(item["meta_info"])
        return out

    def cache_prefix(self, prompt: Prompt) -> None:
        if self.is_cache_enabled and prompt.text:
            self._run(prompt=prompt.text, sampling_params=PREFILL_ONLY)

    def generate(self, prompt: Prompt, params: GenParams) -> tuple[str, dict[str, Any]]:
        out = self._run(
            prompt=prompt.text,
            sampling_params=params.to_sampling_params(),
            **params.request_options(),
        )
        return out["text"], out["meta_info"]

    def generate_stream(
        self, prompt: Prompt, params: GenParams
    ) -> Iterator[tuple[str, dict | None]]:
        sent = 0
        last: dict[str, Any] | None = None
        for chunk in self.engine.generate(
            prompt=prompt.text,
            stream=True,
            sampling_params=params.to_sampling_params(),
            **params.request_options(),
        ):
            text = chunk["text"]
            if len(text) > sent:
                yield text[sent:], None
                sent = len(text)
            last = chunk
        assert last is not None, "the engine's stream ended without a result"
        self.usage.add_meta(last["meta_info"])
        yield "", last["meta_info"]

    def score_choices(
        self, prompt: Prompt, choices: list[str], unconditional: bool
    ) -> ChoiceLogprobs:
        encode = self.tokenizer.encode
        prefix_ids = encode(prompt.text)
        if self.is_cache_enabled and prefix_ids:  # the prefix first, so that every choice reuses it
            self._run(input_ids=prefix_ids, sampling_params=PREFILL_ONLY)
        full = [encode(prompt.text + c) for c in choices]
        starts = [choice_start(prefix_ids, ids) for ids in full]
        first = min(starts)
        outs = self._run(
            input_ids=full,
            sampling_params=[PREFILL_ONLY] * len(full),
            return_logprob=True,
            logprob_start_len=first,
        )
        conditional = [
            logprob_values(out["meta_info"]["input_token_logprobs"][start - first :])
            for out, start in zip(outs, starts, strict=True)
        ]
        uncond = self._unconditional(choices) if unconditional else None
        return ChoiceLogprobs(conditional, uncond, [o["meta_info"]["cached_tokens"] for o in outs])

    def _unconditional(self, choices: list[str]) -> list[list[float]]:
        outs = self._run(
            prompt=list(choices),
            sampling_params=[PREFILL_ONLY] * len(choices),
            return_logprob=True,
            logprob_start_len=0,
        )
        return [logprob_values(out["meta_info"]["input_token_logprobs"]) for out in outs]

    def flush_cache(self) -> bool:
        return bool(self.engine.flush_cache())

    def get_model_info(self) -> dict[str, Any]:
        return self.engine.get_model_info()

    def get_server_info(self) -> dict[str, Any]:
        return self.engine.get_server_info()


class Runtime(LocalBackend):
    """A LocalBackend that starts (and on :meth:`shutdown` stops) its own Engine;
    ``Runtime(model_path=None, **options)`` takes the Engine's options."""

    def __init__(
        self,
        model_path: str | None = None,
        chat_template: ChatTemplate | None = None,
        **engine_options: Any,
    ) -> None:
        from radixlm.srt import Engine

        super().__init__(Engine(model_path, **engine_options), chat_template)

    def shutdown(self) -> None:
        self.engine.shutdown()

    # SGLang's Runtime methods, for scripts that call the runtime directly
    def generate(self, prompt: Any, params: Any = None, **options: Any) -> Any:
        """A program's generation (``Prompt``, ``GenParams``), or SGLang's
        ``Runtime.generate(prompt, sampling_params, return_logprob=..., ...)``: the
        ``/generate`` answer as JSON text."""
        if isinstance(prompt, Prompt):
            return super().generate(prompt, params)
        return json.dumps(self.engine.generate(prompt, params, **options))

    async def async_generate(
        self, prompt: str, sampling_params: dict | None = None, session_id: str | None = None
    ) -> AsyncIterator[str]:
        """SGLang's ``Runtime.async_generate``: the new text of each streamed piece."""
        stream = await self.engine.async_generate(
            prompt, sampling_params, stream=True, session_id=session_id
        )
        sent = 0
        async for chunk in stream:
            if len(chunk["text"]) > sent:
                yield chunk["text"][sent:]
                sent = len(chunk["text"])

    add_request = async_generate

    def get_tokenizer(self) -> Any:
        return self.tokenizer
