"""radixlm's frontend language: multi-call generation programs in plain Python.

import radixlm.lang as rl

@rl.function
def classify(s, review):
    s += rl.user("Is this review positive or negative?\\n" + review)
    s += rl.assistant(rl.select("label", choices=["positive", "negative"]))

rl.set_default_backend(rl.Runtime())                  # or rl.RuntimeEndpoint(url)
print(classify.run(review="Loved it.")["label"])
"""

from __future__ import annotations

from typing import Any

from radixlm.lang.backend_base import BaseBackend, Prompt, Usage
from radixlm.lang.backend_http import RuntimeEndpoint
from radixlm.lang.backend_local import LocalBackend, Runtime
from radixlm.lang.backend_openai import OpenAI
from radixlm.lang.chat_template import ChatTemplate
from radixlm.lang.choices import (
    ChoicesMethod,
    greedy_token,
    greedy_token_selection,
    token_length_normalized,
    unconditional_likelihood_normalized,
)
from radixlm.lang.errors import BackendError, ProgramError
from radixlm.lang.primitives import (
    assistant,
    assistant_begin,
    assistant_end,
    gen,
    gen_int,
    gen_string,
    image,
    select,
    separate_reasoning,
    system,
    system_begin,
    system_end,
    user,
    user_begin,
    user_end,
    video,
)
from radixlm.lang.program import Program, function, get_default_backend, set_default_backend
from radixlm.lang.state import ProgramState, ProgramStateGroup

OpenAIBackend = OpenAI


def flush_cache(backend: BaseBackend | None = None) -> bool:
    """Empty the backend's prefix cache (the default backend's when none is given)."""
    target = backend or get_default_backend()
    if target is None:
        raise ValueError("no backend to flush: pass one or call rl.set_default_backend(...)")
    return target.flush_cache()


def get_server_info(backend: BaseBackend | None = None) -> dict[str, Any]:
    """The runtime's server info (the default backend's when none is given), as SGLang's."""
    target = backend or get_default_backend()
    if target is None:
        raise ValueError("no backend to ask: pass one or call rl.set_default_backend(...)")
    return target.get_server_info()


def __getattr__(name: str) -> Any:
    if name == "Engine":  # imported on first use: it loads torch
        from radixlm.srt import Engine

        return Engine
    raise AttributeError(f"module 'radixlm.lang' has no attribute {name!r}")


__all__ = [
    "BackendError",
    "BaseBackend",
    "ChatTemplate",
    "ChoicesMethod",
    "Engine",
    "LocalBackend",
    "OpenAI",
    "OpenAIBackend",
    "Program",
    "ProgramError",
    "ProgramState",
    "ProgramStateGroup",
    "Prompt",
    "Runtime",
    "RuntimeEndpoint",
    "Usage",
    "assistant",
    "assistant_begin",
    "assistant_end",
    "flush_cache",
    "function",
    "gen",
    "gen_int",
    "gen_string",
    "get_default_backend",
    "get_server_info",
    "greedy_token",
    "greedy_token_selection",
    "image",
    "select",
    "separate_reasoning",
    "set_default_backend",
    "system",
    "system_begin",
    "system_end",
    "token_length_normalized",
    "unconditional_likelihood_normalized",
    "user",
    "user_begin",
    "user_end",
    "video",
]
