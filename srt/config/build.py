"""A ``ServerConfig`` from what a user gives: ``radixlm serve`` flags (one per field, generated
here) or ``Engine(**options)`` keywords, with other projects' spellings of names and values."""

from __future__ import annotations

import argparse
import logging
import os
from dataclasses import fields
from typing import Any, get_args, get_origin, get_type_hints

from radixlm.srt.config.options import ServerConfig
from radixlm.srt.config.validation import validate

logger = logging.getLogger(__package__)

# SGLang's names of the speculative algorithms (any case) -> ours
SPECULATIVE_ALIASES = {
    "ngram": "ngram",
    "lookahead": "ngram",
    "standalone": "draft",
    "draft": "draft",
}
# option names of SGLang (and vLLM) accepted as another spelling of a field
OPTION_ALIASES = {
    "tensor_parallel_size": "tp_size",
    "oltp_traces_endpoint": "otlp_traces_endpoint",  # SGLang's spelling
    "dump_requests_folder": "dump_requests_dir",  # SGLang's /configure_logging field
    "data_parallel_size": "dp_size",
}
# SGLang's grammar engines -> the one here that serves the same grammars (JSON schema, regex,
# EBNF); a warning says so at start
GRAMMAR_ALIASES = {"xgrammar": "llguidance"}
# SGLang's file storage backend's folder when --hicache-storage-dir does not give one
HICACHE_FILE_DIR_ENV = "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"
HICACHE_FILE_DIR_DEFAULT = "/tmp/hicache"


def config_from_kwargs(**options: Any) -> ServerConfig:
    """Builds a config from keyword options, rejecting unknown names with the list of known ones."""
    known = {f.name for f in fields(ServerConfig)}
    options = _apply_aliases(options)
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"unknown option(s) {unknown}; known options: {sorted(known)}")
    cfg = ServerConfig(**options)
    validate(cfg)
    return cfg


def _apply_aliases(options: dict[str, Any]) -> dict[str, Any]:
    """Other projects' spellings of option names and values, turned into ours."""
    out = dict(options)
    for alias, name in OPTION_ALIASES.items():
        if alias in out:
            value = out.pop(alias)
            if name in out and out[name] != value:
                raise ValueError(f"{alias} and {name} name the same option; give one")
            out[name] = value
    grammar = out.get("grammar_backend")
    if grammar in GRAMMAR_ALIASES:
        out["grammar_backend"] = GRAMMAR_ALIASES[grammar]
        logger.warning(
            "grammar_backend %s is not included; %s serves the same grammars",
            grammar,
            out["grammar_backend"],
        )
    if out.get("hicache_storage_backend") == "file" and not out.get("hicache_storage_dir"):
        out["hicache_storage_dir"] = (
            os.environ.get(HICACHE_FILE_DIR_ENV) or HICACHE_FILE_DIR_DEFAULT
        )
    for name, ours in (("hicache_io_backend", "direct"), ("hicache_mem_layout", "layer_first")):
        if out.get(name) not in (None, ours):
            logger.warning(
                "%s %s is taken as %s, the one this server has (docs/operations/hicache.md)",
                name,
                out[name],
                ours,
            )
            out[name] = ours
    target = out.get("log_requests_target")
    if isinstance(target, str):
        out["log_requests_target"] = (target,)
    elif target is not None:
        out["log_requests_target"] = tuple(target)
    algo = out.get("speculative_algorithm")
    if isinstance(algo, str):
        out["speculative_algorithm"] = SPECULATIVE_ALIASES.get(algo.lower(), algo.lower())
    elif algo is None and "speculative_algorithm" in out:
        out["speculative_algorithm"] = "none"
    return out


def _base_type(tp: Any) -> type:
    if get_origin(tp) is not None:  # Optional[X] / X | None
        return next(a for a in get_args(tp) if a is not type(None))
    return tp


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Adds one ``--flag`` per ServerConfig field."""
    hints = get_type_hints(ServerConfig)
    aliases = {name: alias for alias, name in OPTION_ALIASES.items()}
    for f in fields(ServerConfig):
        flags = ["--" + f.name.replace("_", "-")]
        if f.name in aliases:
            flags.append("--" + aliases[f.name].replace("_", "-"))
        tp = _base_type(hints[f.name])
        if tp is bool:
            parser.add_argument(*flags, action="store_true", help=f.metadata["help"])
        elif get_origin(tp) is tuple:  # one or more values after the flag
            parser.add_argument(
                *flags, nargs="+", type=get_args(tp)[0], default=f.default, help=f.metadata["help"]
            )
        else:
            parser.add_argument(
                *flags,
                type=tp,
                default=f.default,
                choices=_cli_choices(f.name, f.metadata.get("choices")),
                help=f"{f.metadata['help']} (default: {f.default})",
            )


def _cli_choices(name: str, choices: tuple[str, ...] | None) -> tuple[str, ...] | None:
    """A flag's choices with other projects' spellings: speculative_algorithm takes any case
    (NGRAM, STANDALONE), grammar_backend SGLang's engine names."""
    if name == "speculative_algorithm":
        return None
    if name == "grammar_backend" and choices:
        return (*choices, *GRAMMAR_ALIASES)
    return choices


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    return config_from_kwargs(**{f.name: getattr(args, f.name) for f in fields(ServerConfig)})
