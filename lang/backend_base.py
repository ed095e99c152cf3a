"""The contract between the interpreter and a serving backend.

A backend is shared by every program and branch running at once, so each method must be safe
to call from many threads. Backends count what the server reported (prompt, cached and
completion tokens) in :attr:`BaseBackend.usage`.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from radixlm.lang.chat_template import ChatTemplate
from radixlm.lang.choices import ChoiceLogprobs, ChoicesMethod, SelectResult
from radixlm.lang.ir import GenParams

# How many tokens before the end of a prefix are re-scored when the backend cannot tokenize:
# a choice's first token may merge with the prefix's last ones, and that is detected there.
BOUNDARY_TOKENS = 4


@dataclass(frozen=True)
class Prompt:
    """What a primitive sees of the program state when it runs."""

    text: str
    messages: tuple[dict[str, str], ...] = ()
    role: str | None = None  # the open role, if any
    role_text: str = ""  # the content of the open role so far


@dataclass
class Usage:
    num_requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0

    @property
    def cache_hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class UsageCounter:
    """Thread-safe sums of the token counts of every answer a backend received."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._usage = Usage()

    def add(self, prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> None:
        with self._lock:
            u = self._usage
            u.num_requests += 1
            u.prompt_tokens += prompt_tokens
            u.cached_tokens += cached_tokens
            u.completion_tokens += completion_tokens

    def add_meta(self, meta: dict[str, Any]) -> None:
        self.add(
            meta.get("prompt_tokens", 0) or 0,
            meta.get("cached_tokens", 0) or 0,
            meta.get("completion_tokens", 0) or 0,
        )

    def snapshot(self) -> Usage:
        with self._lock:
            return Usage(**vars(self._usage))

    def reset(self) -> None:
        with self._lock:
            self._usage = Usage()


class BaseBackend:
    """What the interpreter needs. ``generate`` and ``score_choices`` are required; ``select``
    defaults to scoring then ranking; ``cache_prefix`` defaults to doing nothing."""

    chat_template: ChatTemplate = ChatTemplate.chatml()

    def __init__(self) -> None:
        self.usage = UsageCounter()

    def cache_prefix(self, prompt: Prompt) -> None:
        """Prefill ``prompt.text`` without generating, so that later requests reuse it."""

    def generate(self, prompt: Prompt, params: GenParams) -> tuple[str, dict[str, Any]]:
        """The generated text and the server's meta_info."""
        raise NotImplementedError

    def generate_stream(
        self, prompt: Prompt, params: GenParams
    ) -> Iterator[tuple[str, dict | None]]:
        """Pieces of the generated text as they come, then ("", meta_info) last. The default
        yields the whole text at once."""
        text, meta = self.generate(prompt, params)
        yield text, None
        yield "", meta

    def score_choices(
        self, prompt: Prompt, choices: list[str], unconditional: bool
    ) -> ChoiceLogprobs:
        raise NotImplementedError

    def select(self, prompt: Prompt, choices: list[str], method: ChoicesMethod) -> SelectResult:
        logprobs = self.score_choices(prompt, choices, method.needs_unconditional)
        return method(choices, logprobs)

    def flush_cache(self) -> bool:
        return False

    def get_model_info(self) -> dict[str, Any]:
        return {}

    def get_server_info(self) -> dict[str, Any]:
        """The runtime's ``/get_server_info`` (empty where there is none)."""
        return {}

    def shutdown(self) -> None:
        """Release what the backend owns (an engine it started, connections)."""

    def __enter__(self) -> BaseBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def choice_start(prefix_ids: list[int], full_ids: list[int]) -> int:
    """Where the choice's tokens start in ``full_ids`` (prefix + choice tokenized together):
    at the first token that differs from the prefix's tokenization, never at 0 (the first
    token has no logprob) and leaving at least one token."""
    start = common_prefix_len(prefix_ids, full_ids)
    return max(1, min(start, len(full_ids) - 1))


def logprob_values(entries: list[list[Any]]) -> list[float]:
    """The logprobs of ``[logprob, token_id, text]`` entries, without the unscored first one."""
    return [float(e[0]) for e in entries if e[0] is not None]
