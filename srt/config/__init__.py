"""Typed, frozen configuration. The command line is generated from the dataclass fields.

``ServerConfig`` is the one object a user fills (CLI flags or ``Engine(**options)``); ``"auto"``
values are resolved once by :func:`resolve` at start-up and the resolved config is logged.

By concern: ``options.py`` (the dataclass, a help text and the allowed values per field, the
constants they name), ``validation.py`` (``validate``: the start-up checks, each naming its
option; the chat template and KV scales files), ``startup.py`` (``resolve`` and the per-device
defaults, ``describe``), ``build.py`` (a config from CLI flags or keywords, other projects'
spellings included) and ``access.py`` (allowed Host names, the profiler's folder). Import from
here: ``from radixlm.srt.config import ServerConfig``.
"""

from __future__ import annotations

from radixlm.srt.config.access import (
    allowed_host_names,
    is_loopback_host,
    split_list,
    torch_profiler_dir,
)
from radixlm.srt.config.build import (
    OPTION_ALIASES,
    SPECULATIVE_ALIASES,
    add_cli_args,
    config_from_args,
    config_from_kwargs,
)
from radixlm.srt.config.options import (
    ADMIN_ROUTES,
    ADMIN_VERBS,
    ATTENTION_BACKENDS,
    AUTO_IS_A_MODE,
    DISAGGREGATION_MODES,
    DTYPES,
    GRAMMAR_BACKENDS,
    HICACHE_PAGE_SIZE,
    HICACHE_WRITE_POLICIES,
    KV_CACHE_DTYPES,
    KV_CACHE_SCALE_MODES,
    LOOPBACK_HOSTS,
    OPEN_PATHS,
    QUANTIZATIONS,
    REASONING_PARSERS,
    SCHEDULE_POLICIES,
    SECRET_FIELDS,
    SPECULATIVE_ALGORITHMS,
    TOOL_CALL_PARSERS,
    TRANSFER_BACKENDS,
    ServerConfig,
)
from radixlm.srt.config.startup import (
    CPU_DEFAULT_CHUNK,
    GPU_DEFAULT_CHUNK,
    MIXED_CHUNK_BY_BACKEND,
    MIXED_CHUNK_BY_DEVICE,
    describe,
    mixed_by_default,
    resolve,
)
from radixlm.srt.config.validation import read_chat_template, read_kv_scales_file, validate

__all__ = [
    "ADMIN_ROUTES",
    "ADMIN_VERBS",
    "ATTENTION_BACKENDS",
    "AUTO_IS_A_MODE",
    "CPU_DEFAULT_CHUNK",
    "DISAGGREGATION_MODES",
    "DTYPES",
    "GPU_DEFAULT_CHUNK",
    "GRAMMAR_BACKENDS",
    "HICACHE_PAGE_SIZE",
    "HICACHE_WRITE_POLICIES",
    "KV_CACHE_DTYPES",
    "KV_CACHE_SCALE_MODES",
    "LOOPBACK_HOSTS",
    "MIXED_CHUNK_BY_BACKEND",
    "MIXED_CHUNK_BY_DEVICE",
    "OPEN_PATHS",
    "OPTION_ALIASES",
    "QUANTIZATIONS",
    "REASONING_PARSERS",
    "SCHEDULE_POLICIES",
    "SECRET_FIELDS",
    "SPECULATIVE_ALGORITHMS",
    "SPECULATIVE_ALIASES",
    "TOOL_CALL_PARSERS",
    "TRANSFER_BACKENDS",
    "ServerConfig",
    "add_cli_args",
    "allowed_host_names",
    "config_from_args",
    "config_from_kwargs",
    "describe",
    "is_loopback_host",
    "read_chat_template",
    "read_kv_scales_file",
    "resolve",
    "split_list",
    "torch_profiler_dir",
    "validate",
    "mixed_by_default",
]
