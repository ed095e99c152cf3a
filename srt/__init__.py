"""The serving runtime. ``from radixlm.srt import Engine`` gives the in-process engine."""

from __future__ import annotations

from typing import Any

__all__ = ["Engine", "ServerConfig"]


def __getattr__(name: str) -> Any:  # imported lazily: torch and the model stack are heavy
    if name == "Engine":
        from radixlm.srt.engine import Engine

        return Engine
    if name == "ServerConfig":
        from radixlm.srt.config import ServerConfig

        return ServerConfig
    raise AttributeError(name)
