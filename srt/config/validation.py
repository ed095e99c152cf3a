"""``validate``: every start-up check of a ``ServerConfig``, each failure a ValueError naming
the option; and the readers of the files options point to (chat template, fp8 KV scales)."""

from __future__ import annotations

import json
import math
from dataclasses import fields

from radixlm.srt.config.access import split_list
from radixlm.srt.config.options import KV_CACHE_SCALE_MODES, SECRET_FIELDS, ServerConfig

# lower bounds of numeric fields: (fields, bound, strict); a field whose value is None (left out)
# is not checked
_AT_LEAST_1 = (
    "page_size max_sessions_per_caller max_running_requests max_prefill_tokens default_max_tokens"
    " stream_interval session_retention_max_tokens session_retention_max_tokens_per_session"
    " max_queued_requests mixed_chunk_size cuda_graph_max_bs"
).split()
_ABOVE_0 = (
    "ttft_target_ms tpot_target_ms mixed_step_target_ms grammar_compile_timeout_s dump_requests_max_mb"
    " max_request_body_mb"
).split()
_BOUNDS = (
    (_AT_LEAST_1, 1, False),
    (["max_total_tokens"], 16, False),
    (_ABOVE_0, 0, True),
)


def _check_bounds(cfg: ServerConfig) -> None:
    for names, bound, strict in _BOUNDS:
        for name in names:
            value = getattr(cfg, name)
            if value is not None and not (value > bound if strict else value >= bound):
                sign = ">" if strict else ">="
                raise ValueError(f"{name} must be {sign} {bound}, got {value}")


def validate(cfg: ServerConfig) -> None:
    for f in fields(cfg):
        choices = f.metadata.get("choices")
        if choices and getattr(cfg, f.name) not in choices:
            raise ValueError(
                f"{f.name} must be one of {list(choices)}, got {getattr(cfg, f.name)!r}"
            )
    if cfg.quantization == "int4" and cfg.device not in ("auto", "cpu"):
        raise ValueError(
            f"quantization {cfg.quantization!r} runs on the CPU only; got device {cfg.device!r}"
        )
    _check_bounds(cfg)
    if cfg.session_retention_ttl < 0:
        raise ValueError(f"session_retention_ttl must be >= 0, got {cfg.session_retention_ttl}")
    if not 0 <= cfg.schedule_conservativeness <= 100:
        raise ValueError(
            f"schedule_conservativeness must be in [0, 100], got {cfg.schedule_conservativeness}"
        )
    if cfg.disable_mixed_chunk and (
        cfg.mixed_chunk_size is not None or cfg.mixed_step_target_ms is not None
    ):
        raise ValueError(
            "mixed_chunk_size and mixed_step_target_ms cap mixed steps: not with disable_mixed_chunk"
        )
    if cfg.chat_template is not None:
        read_chat_template(cfg.chat_template)
    _validate_access(cfg)
    _validate_kv_cache_scales(cfg)
    _validate_hicache(cfg)
    _validate_speculative(cfg)
    _validate_disaggregation(cfg)
    _validate_parallel(cfg)
    if cfg.enable_mixed_chunk and cfg.disable_mixed_chunk:
        raise ValueError("give at most one of enable_mixed_chunk and disable_mixed_chunk")
    if cfg.chunked_prefill_size is not None and (
        cfg.chunked_prefill_size == 0 or cfg.chunked_prefill_size < -1
    ):
        raise ValueError(
            f"chunked_prefill_size must be -1 (off) or > 0, got {cfg.chunked_prefill_size}"
        )


def read_chat_template(value: str) -> str:
    """The template text of ``--chat-template``: the file at that path, else the value itself
    when it is Jinja text; checked to parse. ValueError naming chat_template otherwise."""
    import os

    import jinja2

    if os.path.isfile(value):
        try:
            with open(value, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"chat_template: cannot read {value!r}: {e}") from e
        where = f"the file {value!r}"
    elif "{{" in value or "{%" in value:
        text, where = value, "the template text"
    else:
        raise ValueError(
            f"chat_template must be a Jinja template file's path or the template text; "
            f"{value!r} is neither (no such file, no {{{{ or {{% in it)"
        )
    try:  # as transformers compiles it (its own tags and extensions), else plain Jinja
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:
        _compile_jinja_template = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse
    try:
        _compile_jinja_template(text)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"chat_template: {where} is not a valid Jinja template: {e}") from e
    return text


def _validate_kv_cache_scales(cfg: ServerConfig) -> None:
    if cfg.kv_cache_scales in KV_CACHE_SCALE_MODES:
        return
    if not isinstance(cfg.kv_cache_scales, str) or not cfg.kv_cache_scales:
        raise ValueError(
            f"kv_cache_scales must be calibrate, unit or a JSON file's path, "
            f"got {cfg.kv_cache_scales!r}"
        )
    if cfg.kv_cache_dtype == "auto":
        raise ValueError(
            f"kv_cache_scales {cfg.kv_cache_scales!r} is a scales file, which needs an fp8 "
            "kv_cache_dtype (fp8_e4m3 or fp8_e5m2)"
        )
    read_kv_scales_file(cfg.kv_cache_scales)


def read_kv_scales_file(path: str) -> tuple[list[float], list[float]]:
    """``(k_scales, v_scales)`` from a ``--kv-cache-scales`` JSON file ``{"k_scales": [...],
    "v_scales": [...]}``: equally long lists of finite floats > 0 (one per layer; the runner
    checks the count against the model). ValueError naming kv_cache_scales otherwise."""
    where = f"kv_cache_scales file {path!r}"
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as e:
        raise ValueError(
            f"kv_cache_scales must be calibrate, unit or a JSON file; cannot read {path!r}: {e}"
        ) from e
    except json.JSONDecodeError as e:
        raise ValueError(f"{where} is not valid JSON: {e}") from e
    if not isinstance(data, dict) or not {"k_scales", "v_scales"} <= data.keys():
        raise ValueError(f'{where} must hold an object {{"k_scales": [...], "v_scales": [...]}}')
    out = []
    for name in ("k_scales", "v_scales"):
        values = data[name]
        if not isinstance(values, list) or not values:
            raise ValueError(f"{where}: {name} must be a non-empty list of numbers")
        for i, s in enumerate(values):
            ok = isinstance(s, int | float) and not isinstance(s, bool)
            if not (ok and math.isfinite(s) and s > 0):
                raise ValueError(f"{where}: {name}[{i}] must be a finite number > 0, got {s!r}")
        out.append([float(s) for s in values])
    if len(out[0]) != len(out[1]):
        raise ValueError(
            f"{where}: k_scales has {len(out[0])} entries, v_scales {len(out[1])} (one per layer)"
        )
    return out[0], out[1]


def _validate_access(cfg: ServerConfig) -> None:
    for name in SECRET_FIELDS:
        key = getattr(cfg, name)
        if key is not None and not key.strip():
            flag = "--" + name.replace("_", "-")
            raise ValueError(
                f"{name} is empty ({flag} ''): an unset variable in a launch script? An empty "
                f"key would open the routes it guards; leave {flag} out or give a key"
            )
        if key is not None and key != key.strip():
            raise ValueError(f"{name} has leading or trailing spaces, which no client can send")
    if cfg.allowed_hosts is not None and not split_list(cfg.allowed_hosts):
        raise ValueError("allowed_hosts is empty: give host names, or * to turn the check off")
    if not (cfg.paused_request_timeout_s > 0 and math.isfinite(cfg.paused_request_timeout_s)):
        raise ValueError(
            f"paused_request_timeout_s must be a finite number > 0, got "
            f"{cfg.paused_request_timeout_s}"
        )
    if cfg.weight_update_roots is not None and not split_list(cfg.weight_update_roots):
        raise ValueError("weight_update_roots is empty: give folders, or leave it out")


def _validate_speculative(cfg: ServerConfig) -> None:
    if not 1 <= cfg.speculative_num_draft_tokens <= 64:
        raise ValueError(
            f"speculative_num_draft_tokens must be in 1..64, got {cfg.speculative_num_draft_tokens}"
        )
    if not 1 <= cfg.speculative_ngram_min_match <= cfg.speculative_ngram_max_match <= 64:
        raise ValueError(
            "need 1 <= speculative_ngram_min_match <= speculative_ngram_max_match <= 64, got "
            f"{cfg.speculative_ngram_min_match} and {cfg.speculative_ngram_max_match}"
        )
    if cfg.speculative_algorithm == "draft" and not cfg.speculative_draft_model_path:
        raise ValueError("speculative_algorithm draft needs speculative_draft_model_path")
    if cfg.speculative_draft_model_path and cfg.speculative_algorithm != "draft":
        raise ValueError("speculative_draft_model_path needs speculative_algorithm draft")


def _validate_parallel(cfg: ServerConfig) -> None:
    if cfg.tp_size < 1:
        raise ValueError(f"tp_size must be >= 1, got {cfg.tp_size}")
    if cfg.nnodes < 1 or not 0 <= cfg.node_rank < cfg.nnodes:
        raise ValueError(
            f"need nnodes >= 1 and 0 <= node_rank < nnodes, got {cfg.nnodes} and {cfg.node_rank}"
        )
    if cfg.tp_size % cfg.nnodes:
        raise ValueError(f"tp_size ({cfg.tp_size}) must be a multiple of nnodes ({cfg.nnodes})")
    if cfg.ep_size < 1 or cfg.tp_size % cfg.ep_size:
        raise ValueError(
            f"ep_size ({cfg.ep_size}) must be >= 1 and divide tp_size ({cfg.tp_size}): expert "
            "parallelism splits the tensor-parallel ranks"
        )
    if cfg.nnodes > 1 and not cfg.dist_init_addr:
        raise ValueError("nnodes > 1 needs dist_init_addr (host:port of node 0)")
    if not (cfg.dist_timeout_s > 0 and math.isfinite(cfg.dist_timeout_s)):
        raise ValueError(f"dist_timeout_s must be a finite number > 0, got {cfg.dist_timeout_s}")


def _validate_disaggregation(cfg: ServerConfig) -> None:
    if cfg.disaggregation_mode == "null":
        return
    if not 0 < cfg.disaggregation_bootstrap_port < 65536:
        raise ValueError(
            f"disaggregation_bootstrap_port must be in [1, 65535], got "
            f"{cfg.disaggregation_bootstrap_port}"
        )
    if not (cfg.disaggregation_transfer_timeout_s > 0):
        raise ValueError(
            f"disaggregation_transfer_timeout_s must be > 0, got "
            f"{cfg.disaggregation_transfer_timeout_s}"
        )
    if cfg.tp_size > 1:
        raise ValueError("disaggregation_mode needs tp_size 1 (one KV pool per worker) for now")
    if cfg.speculative_algorithm != "none":
        raise ValueError("disaggregation_mode does not run with speculative decoding yet")
    if cfg.enable_hierarchical_cache:
        raise ValueError("disaggregation_mode does not run with the hierarchical cache yet")


def _validate_hicache(cfg: ServerConfig) -> None:
    if not (cfg.hicache_ratio > 0 and math.isfinite(cfg.hicache_ratio)):
        raise ValueError(f"hicache_ratio must be a finite number > 0, got {cfg.hicache_ratio}")
    if not (cfg.hicache_size >= 0 and math.isfinite(cfg.hicache_size)):
        raise ValueError(
            f"hicache_size must be >= 0 (GiB; 0: use the ratio), got {cfg.hicache_size}"
        )
    if cfg.hicache_storage_max_bytes < 1:
        raise ValueError(
            f"hicache_storage_max_bytes must be >= 1, got {cfg.hicache_storage_max_bytes}"
        )
    if cfg.enable_hierarchical_cache and cfg.disable_radix_cache:
        raise ValueError(
            "enable_hierarchical_cache needs the prefix cache: drop disable_radix_cache"
        )
    if cfg.hicache_storage_backend not in (None, "file"):
        raise ValueError(
            f"hicache_storage_backend {cfg.hicache_storage_backend!r} is not available: 'file' "
            "(the disk tier, or --hicache-storage-dir) is the one storage backend here"
        )
    if cfg.num_continuous_decode_steps < 1:
        raise ValueError(
            f"num_continuous_decode_steps must be >= 1, got {cfg.num_continuous_decode_steps}"
        )
    if cfg.dp_size != 1:
        raise ValueError(
            f"dp_size must be 1, got {cfg.dp_size}: run several servers behind sglang-router "
            "for data parallelism"
        )
    if cfg.hicache_storage_dir and not cfg.enable_hierarchical_cache:
        raise ValueError("hicache_storage_dir needs enable_hierarchical_cache")
