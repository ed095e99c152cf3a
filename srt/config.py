"""Typed, frozen configuration. The command line is generated from the dataclass fields.

``ServerConfig`` is the one object a user fills (CLI flags or ``Engine(**options)``); ``"auto"``
values are resolved once by :func:`resolve` at start-up and the resolved config is logged.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
from dataclasses import dataclass, field, fields
from typing import Any, get_args, get_origin, get_type_hints

SCHEDULE_POLICIES = ("fcfs", "lpm", "dfs-weight")
ATTENTION_BACKENDS = ("auto", "torch", "cpu", "triton", "flashinfer")
GRAMMAR_BACKENDS = ("auto", "outlines", "llguidance", "none")
DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTIZATIONS = ("none", "int4", "fp8")
HICACHE_WRITE_POLICIES = ("write_through_selective", "write_through", "write_back")
KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "fp8_e5m2")
KV_CACHE_SCALE_MODES = ("calibrate", "unit")  # else kv_cache_scales is a JSON file's path
# speculative decoding; SGLang's NGRAM and STANDALONE are accepted as ngram and draft
SPECULATIVE_ALGORITHMS = ("none", "ngram", "draft")
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
}
HICACHE_PAGE_SIZE = 16  # page size --enable-hierarchical-cache raises page_size 1 to
# tool-call formats (srt/parsers): auto picks from the chat template; qwen25/qwen3 are hermes
TOOL_CALL_PARSERS = (
    "auto",
    "hermes",
    "qwen25",
    "qwen3",
    "qwen3_coder",
    "llama3",
    "pythonic",
    "mistral",
    "mistral_v11",
    "gpt-oss",
    "openai",
    "generic",
    "none",
)
REASONING_PARSERS = ("none", "qwen3", "deepseek-r1", "gpt-oss", "openai_gptoss")
# fields whose "auto" names a behaviour kept at run time, not a placeholder resolve() fills:
# load_format auto reads whatever checkpoint is there; grammar_backend auto picks per grammar
AUTO_IS_A_MODE = ("load_format", "grammar_backend", "tool_call_parser", "kv_cache_dtype")
SECRET_FIELDS = ("api_key", "admin_api_key")  # never logged
# Who may call what (docs/operations/production.md, "Keys", is checked against these lists):
# the routes served without a key, and the admin routes with whether each is one of the
# dangerous verbs that, without --admin-api-key, stay off unless
# --enable-admin-verbs-with-api-key turns them on for the ordinary key.
OPEN_PATHS = ("/health", "/ready", "/ping", "/metrics")
ADMIN_ROUTES: tuple[tuple[str, bool], ...] = (
    ("/flush_cache", False),
    ("/abort_request", False),  # only with abort_all: true
    ("/update_weights_from_disk", True),
    ("/update_weights_from_tensor", True),
    ("/update_weights_from_distributed", True),
    ("/update_weights_from_ipc", True),
    ("/init_weights_update_group", True),
    ("/destroy_weights_update_group", True),
    ("/get_weights_by_name", True),
    ("/update_weight_version", True),
    ("/pause_generation", True),
    ("/continue_generation", True),
    ("/start_profile", True),
    ("/stop_profile", True),
)
ADMIN_VERBS = tuple(path for path, is_dangerous in ADMIN_ROUTES if is_dangerous)
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
# chunked_prefill_size when not given. With mixed batches a running request waits at most one
# chunk step for its next token. GPU: an 8B model's chunk of N tokens costs ~N * 16 GFLOP
# (8,192: ~0.2 s at 650 TFLOP/s). Serving the 8B shape on an H200 (docs/results/serving.md),
# 2,048-token chunks cut prefill throughput below the offered load (goodput 2.8 req/s at 16
# req/s against 5.3 with 8,192 and 5.7 unchunked); 8,192 keeps most of it and still bounds the
# stall behind a long prompt.
# CPU (SmolLM2-135M fp32, 2 cores): 512 bounds the decode gap behind an 8K prompt at 1.8 s
# (15 s unchunked), prefilling within 7% of 1,024 or 2,048 (docs/results/serving.md).
GPU_DEFAULT_CHUNK = 8192
CPU_DEFAULT_CHUNK = 512
# Mixed steps (a chunk together with the running requests' decode tokens) by device, unless
# --enable-mixed-chunk / --disable-mixed-chunk says. CPU: on (the decode gap behind an 8K prompt
# is 1.8 s mixed, 17.6 s with 2,048-token chunks alone). GPU: off, as SGLang's default: on an
# H100 serving the 8B shape (docs/results/serving.md) mixed 8,192-token chunks gave 2.37 req/s of
# goodput at 16 req/s against 6.45 with the chunks alone and 6.42 unchunked (TTFT p50 1,150 vs
# 119 ms), and no better TPOT or ITL p99. The scheduler admits as much per mixed step
# (srt/bench/serving_sim.py), so that is a device cost of mixed steps, still to be measured
# (gpu_runs.sh servemix); --mixed-chunk-size / --mixed-step-target-ms turn bounded mixed steps on.
MIXED_CHUNK_BY_DEVICE = {"cpu": True, "cuda": False}

logger = logging.getLogger(__name__)


DISAGGREGATION_MODES = ("null", "prefill", "decode")
TRANSFER_BACKENDS = ("mooncake",)  # NIXL would be a second entry


def _opt(default: Any, help: str, choices: tuple[str, ...] | None = None) -> Any:
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass(frozen=True)
class ServerConfig:
    # model
    model_path: str | None = _opt(
        None, "HF folder, .gguf file or folder holding one (default: SmolLM2-135M-Instruct)"
    )
    tokenizer_path: str | None = _opt(None, "tokenizer folder (default: the model's)")
    served_model_name: str | None = _opt(
        None, "model id reported by the API (default: derived from the path)"
    )
    chat_template: str | None = _opt(
        None, "Jinja chat template: a file's path or the template text (default: the tokenizer's)"
    )
    load_format: str = _opt(
        "auto", "auto: read the checkpoint; dummy: random weights (benchmarks)", ("auto", "dummy")
    )
    dtype: str = _opt(
        "auto", "weight and activation dtype (auto: bfloat16 on GPU, float32 on CPU)", DTYPES
    )
    device: str = _opt("auto", "cpu, cuda or cuda:N (auto: cuda when available)")
    quantization: str = _opt(
        "none",
        "int4: 4-bit weights, bf16 activations in small-batch matmuls (CPU only); fp8: FP8 "
        "weights with per-channel scales, activations quantised per token (any device); a "
        "checkpoint's own quantization_config is read without this option",
        QUANTIZATIONS,
    )
    quantization_check: str = _opt(
        "on",
        "on: after a quantised model loads, compare its next-token distributions with the "
        "dequantised (or original) weights' over a built-in text (mean KL, top-1 agreement; "
        "start-up log and /server_info); off: skip",
        ("on", "off"),
    )
    context_length: int | None = _opt(None, "maximum prompt + output length (default: the model's)")
    # memory
    max_total_tokens: int | None = _opt(
        None, "KV pool size in tokens (default: from --mem-budget-gb or the free GPU memory)"
    )
    mem_budget_gb: float | None = _opt(
        None, "memory for the KV pool in GiB (CPU default: 2 GiB capped by free RAM)"
    )
    mem_fraction_static: float = _opt(0.85, "GPU: fraction of total memory for weights + KV pool")
    page_size: int = _opt(
        1, f"tokens per KV page (--enable-hierarchical-cache raises 1 to {HICACHE_PAGE_SIZE})"
    )
    kv_cache_dtype: str = _opt(
        "auto",
        "KV cache storage (auto: the model's dtype; fp8_*: one byte per value with a scale per "
        "layer, twice the tokens in the same memory)",
        KV_CACHE_DTYPES,
    )
    kv_cache_scales: str = _opt(
        "calibrate",
        "fp8 KV scales per layer: calibrate (from one forward over a built-in text at start-up), "
        'unit (all 1.0) or a JSON file {"k_scales": [...], "v_scales": [...]}, a float per layer',
    )
    # hierarchical cache (HiCache): host-memory and disk tiers under the prefix cache
    enable_hierarchical_cache: bool = _opt(
        False, "keep KV evicted from the device in host memory (and on disk) and load it back"
    )
    hicache_ratio: float = _opt(2.0, "host KV pool size as a multiple of the device pool's")
    hicache_size: float = _opt(
        0.0, "host KV pool size in GiB (0: from --hicache-ratio); overrides the ratio"
    )
    hicache_write_policy: str = _opt(
        "write_through_selective",
        "when a node is copied to host memory: at its second hit (write_through_selective), "
        "when inserted (write_through) or when evicted from the device (write_back)",
        HICACHE_WRITE_POLICIES,
    )
    hicache_storage_dir: str | None = _opt(
        None, "folder of the disk KV tier (default: no disk tier); survives restarts"
    )
    hicache_storage_max_bytes: int = _opt(
        16 * 2**30, "size cap of the disk KV tier in bytes (least recently used pages go first)"
    )
    # scheduling
    max_running_requests: int = _opt(256, "most requests decoding at once")
    max_prefill_tokens: int = _opt(8192, "token budget of one prefill step")
    chunked_prefill_size: int | None = _opt(
        None,
        "split prompts longer than this into chunks (-1: off; default: on, sized per device)",
    )
    enable_mixed_chunk: bool = _opt(
        False, "run prefill chunks together with the running decodes (default on a CPU only)"
    )
    disable_mixed_chunk: bool = _opt(
        False, "run prefill chunks alone, without the running decodes (default on a GPU)"
    )
    mixed_chunk_size: int | None = _opt(
        None,
        "most new prompt tokens of a mixed step (one that also decodes running requests); "
        "steps with nothing to decode keep --chunked-prefill-size (default: no cap)",
    )
    mixed_step_target_ms: float | None = _opt(
        None,
        "size a mixed step's prefill piece from the measured prefill rate so that the step, "
        "decode rows included, lasts about this long (default: no bound)",
    )
    schedule_policy: str = _opt("fcfs", "waiting-queue order", SCHEDULE_POLICIES)
    schedule_conservativeness: float = _opt(
        1.0,
        "how much KV a new request must leave for the running ones' future tokens (0: admit "
        "while the pool has room, retracting later; larger: fewer retractions, smaller batches)",
    )
    # priority, bounded queue and fairness (SGLang's flags; docs/operations/overload.md)
    enable_priority_scheduling: bool = _opt(
        False, "order the waiting queue by each request's priority (higher first), FCFS within one"
    )
    schedule_low_priority_values_first: bool = _opt(
        False, "with --enable-priority-scheduling: lower priority values run first"
    )
    priority_scheduling_preemption_threshold: int = _opt(
        10, "smallest priority difference for which a waiting request retracts running ones"
    )
    abort_on_priority_when_disabled: bool = _opt(
        False, "without --enable-priority-scheduling: refuse (503) requests that set a priority"
    )
    max_queued_requests: int | None = _opt(
        None, "most requests waiting for admission; a new one past it gets 503 (default: no cap)"
    )
    ttft_target_ms: float | None = _opt(
        None, "refuse (503) a new request whose estimated time to first token exceeds this"
    )
    enable_fair_scheduling: bool = _opt(
        False, "round robin between callers (API key, else `user`) within a priority"
    )
    disable_radix_cache: bool = _opt(False, "turn the prefix cache off")
    attention_backend: str = _opt("auto", "attention kernels", ATTENTION_BACKENDS)
    grammar_backend: str = _opt(
        "auto", "constrained decoding engine (none: reject grammars)", GRAMMAR_BACKENDS
    )
    grammar_cache_dir: str | None = _opt(
        None, "folder for compiled grammars shared across restarts (default: memory only)"
    )
    grammar_compile_timeout_s: float = _opt(
        60.0, "fail a grammar compilation after this many seconds"
    )
    grammar_whitespace_pattern: str | None = _opt(
        None,
        "regex for JSON whitespace between tokens (default: at most one space; '' for compact JSON)",
    )
    disable_jump_forward: bool = _opt(
        False, "decode text a grammar forces token by token instead of appending it at once"
    )
    disable_cuda_graph: bool = _opt(False, "run decode without CUDA graphs")
    cuda_graph_max_bs: int | None = _opt(
        None,
        "largest decode batch captured in a CUDA graph (default: max_running_requests, at most "
        "512); larger batches run without graphs. Each captured size holds its own buffers",
    )
    disable_overlap_schedule: bool = _opt(False, "do not prepare the next batch during the forward")
    random_seed: int = _opt(0, "seed of unseeded sampling")
    # speculative decoding
    speculative_algorithm: str = _opt(
        "none",
        "draft tokens to verify in one forward: ngram (from the prompt, the output and the "
        "prefix cache) or draft (a small model, --speculative-draft-model-path)",
        SPECULATIVE_ALGORITHMS,
    )
    speculative_num_draft_tokens: int = _opt(4, "most draft tokens verified per request and step")
    speculative_draft_model_path: str | None = _opt(
        None, "draft model (same tokenizer as the target) for --speculative-algorithm draft"
    )
    speculative_ngram_min_match: int = _opt(2, "ngram: shortest suffix that proposes a draft")
    speculative_ngram_max_match: int = _opt(8, "ngram: longest suffix looked up")
    speculative_disable_adaptive: bool = _opt(
        False, "keep the draft length fixed even when few drafts are accepted"
    )
    # parallelism
    tp_size: int = _opt(
        1, "tensor-parallel ranks (one process per rank; alias --tensor-parallel-size)"
    )
    ep_size: int = _opt(
        1,
        "MoE models: split the experts over this many groups of the tensor-parallel ranks "
        "(whole experts per group; must divide --tp-size); 1: every rank holds a slice of each",
    )
    nnodes: int = _opt(1, "machines the tensor-parallel ranks span")
    node_rank: int = _opt(0, "this machine's index among --nnodes")
    dist_init_addr: str | None = _opt(
        None,
        "host:port of rank 0's rendezvous (default: a free local port; needed with --nnodes > 1)",
    )
    dist_timeout_s: float = _opt(
        120.0, "a collective that waits longer than this fails and takes the server down"
    )
    num_threads: int | None = _opt(None, "CPU: torch intra-op threads (default: all cores)")
    # prefill-decode disaggregation (srt/disaggregation/; docs/operations/disaggregation.md)
    disaggregation_mode: str = _opt(
        "null",
        "prefill or decode: this server is one side of a prefill-decode pair behind "
        "sglang-router's PD mode (requests carry bootstrap_host/port/room); null: a whole server",
        DISAGGREGATION_MODES,
    )
    disaggregation_bootstrap_port: int = _opt(
        8998, "prefill: the port where decode workers reach this worker (give it to the router)"
    )
    disaggregation_transfer_backend: str = _opt(
        "mooncake", "the KV transfer engine (Mooncake's transfer engine)", TRANSFER_BACKENDS
    )
    disaggregation_transport: str = _opt(
        "tcp",
        "the transfer engine's transport: tcp, or rdma where RDMA devices exist",
        ("tcp", "rdma"),
    )
    disaggregation_ib_device: str | None = _opt(
        None, "rdma: the RDMA device names (comma-separated); default: every device found"
    )
    disaggregation_transfer_timeout_s: float = _opt(
        30.0,
        "a request whose KV transfer has not completed after this long fails on both sides "
        "and frees its slots",
    )
    # server
    host: str = _opt("127.0.0.1", "HTTP host")
    port: int = _opt(30000, "HTTP port")
    api_key: str | None = _opt(
        None,
        f"bearer key required on every route but {', '.join(OPEN_PATHS)}; without "
        "--admin-api-key it also guards /flush_cache and /abort_request's abort_all, while the "
        f"admin verbs ({', '.join(ADMIN_VERBS)}) stay off unless "
        "--enable-admin-verbs-with-api-key",
    )
    admin_api_key: str | None = _opt(
        None,
        "bearer key of the admin routes (accepted on every route): "
        f"{', '.join(path for path, _ in ADMIN_ROUTES)} (/abort_request: only abort_all)",
    )
    enable_admin_verbs_with_api_key: bool = _opt(
        False,
        f"serve the admin verbs ({', '.join(ADMIN_VERBS)}) without --admin-api-key: to "
        "--api-key holders, or to anyone on a non-loopback bind without keys (warned at start-up)",
    )
    allowed_hosts: str | None = _opt(
        None,
        "comma-separated Host header names served, against DNS rebinding (others: 400); "
        f"default on a loopback --host: {', '.join(LOOPBACK_HOSTS)} and --host; elsewhere "
        "off; * turns it off",
    )
    torch_profiler_dir: str | None = _opt(
        None,
        "folder of /start_profile traces; a client's output_dir must lie inside it (default: "
        "$RADIXLM_TORCH_PROFILER_DIR, $SGLANG_TORCH_PROFILER_DIR, else the system temp folder)",
    )
    weight_update_roots: str | None = _opt(
        None,
        "comma-separated folders /update_weights_from_disk may load from (default: the "
        "folder holding the served model's folder)",
    )
    paused_request_timeout_s: float = _opt(
        600.0,
        "a request held by /pause_generation longer than this ends with a 503 saying so",
    )
    max_sessions_per_caller: int = _opt(
        256,
        "most sessions one caller keeps open, of the server's 1,024 (a caller: an API key; "
        "without keys every client is one anonymous caller, not limited)",
    )
    session_retention_ttl: float = _opt(
        0.0,
        "seconds a session's prefix stays held in the KV cache after a turn, for its next turn "
        "(no eviction takes it; released at close or expiry); 0: off",
    )
    session_retention_max_tokens: int | None = _opt(
        None, "most KV tokens all held session prefixes take (default: a quarter of the pool)"
    )
    session_retention_max_tokens_per_session: int | None = _opt(
        None, "most KV tokens one session's held prefix takes (default: the total bound)"
    )
    max_request_body_mb: float = _opt(32.0, "largest request body in MiB (larger: 413)")
    default_max_tokens: int = _opt(
        1024, "max_tokens of chat completions that give none (capped by the context left)"
    )
    allow_special_tokens_in_chat: bool = _opt(
        False,
        "tokenize special-token text in chat message content (<|im_end|>) as control tokens (unsafe)",
    )
    stream_interval: int = _opt(1, "decode steps between streamed updates of a request")
    tool_call_parser: str = _opt(
        "auto",
        "tool-call format of the model (auto: from the chat template; generic: JSON replies "
        "for templates without one; none: refuse tools)",
        TOOL_CALL_PARSERS,
    )
    reasoning_parser: str = _opt(
        "none",
        "split reasoning into reasoning_content (<think> blocks; gpt-oss: the analysis channel)",
        REASONING_PARSERS,
    )
    log_level: str = _opt("info", "logging level")
    log_requests: bool = _opt(
        False,
        "log one line per finished request: rid, finish reason, token counts, latency "
        "(no prompt or output text)",
    )
    # observability (docs/operations/observability.md)
    enable_trace: bool = _opt(
        False,
        "OpenTelemetry traces, one per request across the three processes, sent over OTLP/HTTP "
        "(needs the [trace] extra)",
    )
    otlp_traces_endpoint: str | None = _opt(
        None,
        "OTLP/HTTP traces URL (host:port gets http:// and /v1/traces); default: "
        "$OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, else $OTEL_EXPORTER_OTLP_ENDPOINT/v1/traces, else "
        "http://localhost:4318/v1/traces (alias --oltp-traces-endpoint)",
    )
    trace_prompt_text: bool = _opt(
        False, "put the prompt text on the request's root span (off: token counts only)"
    )
    dump_requests_dir: str | None = _opt(
        None,
        "write every generate request (route, body, arrival time, output token ids, timings) "
        "as JSON lines into this folder, keys redacted (alias --dump-requests-folder)",
    )
    dump_requests_max_mb: float = _opt(
        256.0, "most MiB the request dump keeps: 4 files, the oldest removed on rotation"
    )
    # SGLang command lines and Engine(...) calls carry these; here they change nothing, truly:
    enable_metrics: bool = _opt(False, "accepted (SGLang's flag): /metrics is always served")
    trust_remote_code: bool = _opt(
        False,
        "accepted (SGLang's flag): no code is ever loaded from a checkpoint; the supported "
        "architectures are built in",
    )

    def replace(self, **changes: Any) -> ServerConfig:
        return dataclasses.replace(self, **changes)


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
    algo = out.get("speculative_algorithm")
    if isinstance(algo, str):
        out["speculative_algorithm"] = SPECULATIVE_ALIASES.get(algo.lower(), algo.lower())
    elif algo is None and "speculative_algorithm" in out:
        out["speculative_algorithm"] = "none"
    return out


# lower bounds of numeric fields: (fields, bound, strict); a field whose value is None (left out)
# is not checked
_AT_LEAST_1 = (
    "page_size max_sessions_per_caller max_running_requests max_prefill_tokens default_max_tokens"
    " stream_interval session_retention_max_tokens session_retention_max_tokens_per_session"
    " max_queued_requests mixed_chunk_size cuda_graph_max_bs"
).split()
_ABOVE_0 = (
    "ttft_target_ms mixed_step_target_ms grammar_compile_timeout_s dump_requests_max_mb"
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


def split_list(value: str) -> list[str]:
    """The items of a comma-separated flag value, stripped, without empty ones."""
    return [item.strip() for item in value.split(",") if item.strip()]


def is_loopback_host(host: str) -> bool:
    import ipaddress

    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def allowed_host_names(cfg: ServerConfig) -> frozenset[str] | None:
    """The Host header names served (lower case, no port); None when any is (``*``, or a
    non-loopback bind without ``allowed_hosts``)."""
    if cfg.allowed_hosts is None:
        if not is_loopback_host(cfg.host):
            return None
        return frozenset({*LOOPBACK_HOSTS, cfg.host.lower().strip("[]")})
    names = split_list(cfg.allowed_hosts)
    if "*" in names:
        return None
    return frozenset(n.lower().strip("[]") for n in names)


def torch_profiler_dir(cfg: ServerConfig) -> str:
    """The folder of profiler traces: ``torch_profiler_dir``, else the environment's, else the
    system temp folder; absolute, symlinks resolved."""
    import os
    import tempfile

    folder = cfg.torch_profiler_dir
    for name in ("RADIXLM_TORCH_PROFILER_DIR", "SGLANG_TORCH_PROFILER_DIR"):
        folder = folder or os.environ.get(name)
    return os.path.realpath(folder or tempfile.gettempdir())


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
    if cfg.hicache_storage_dir and not cfg.enable_hierarchical_cache:
        raise ValueError("hicache_storage_dir needs enable_hierarchical_cache")


def resolve(cfg: ServerConfig, *, head_dim: int | None = None) -> ServerConfig:
    """``cfg`` with every start-up ``auto`` made concrete, logged once: ``device`` (cuda when
    available), ``dtype`` (bfloat16 on a GPU, float32 on a CPU) and ``attention_backend``
    (``kernels.attention.registry``'s rule; ``head_dim`` is the model's, which FlashInfer may
    lack kernels for). Components read the result and never see ``auto`` again."""
    import torch  # here, not at the top: building the CLI parser needs no torch

    from radixlm.kernels.attention.registry import resolve_attention_backend

    device = cfg.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        torch_device = torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {cfg.device!r}") from e
    dtype = cfg.dtype
    if dtype == "auto":
        dtype = "bfloat16" if torch_device.type == "cuda" else "float32"
    backend = resolve_attention_backend(
        cfg.attention_backend, torch_device, head_dim, getattr(torch, dtype)
    )
    page_size = cfg.page_size
    if cfg.enable_hierarchical_cache and page_size == 1:
        page_size = HICACHE_PAGE_SIZE  # a disk file or a host copy per token costs too much
    chunk = cfg.chunked_prefill_size
    if chunk is None:
        chunk = GPU_DEFAULT_CHUNK if torch_device.type == "cuda" else CPU_DEFAULT_CHUNK
    capped = cfg.mixed_chunk_size is not None or cfg.mixed_step_target_ms is not None
    mixed = cfg.enable_mixed_chunk or (
        not cfg.disable_mixed_chunk
        and (capped or MIXED_CHUNK_BY_DEVICE.get(torch_device.type, True))
    )
    resolved = cfg.replace(
        device=device,
        dtype=dtype,
        attention_backend=backend,
        page_size=page_size,
        chunked_prefill_size=chunk,
        disable_mixed_chunk=not mixed,  # the scheduler reads this one
    )
    logger.info("config: %s", describe(resolved))
    return resolved


def describe(cfg: ServerConfig) -> str:
    """The fields that differ from their defaults, plus the resolved ones; secrets masked."""
    shown = []
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        if value == f.default and f.name not in (
            "device",
            "dtype",
            "attention_backend",
            "chunked_prefill_size",
        ):
            continue
        shown.append(f"{f.name}={'***' if f.name in SECRET_FIELDS and value else value!r}")
    return ", ".join(shown)


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
        else:
            parser.add_argument(
                *flags,
                type=tp,
                default=f.default,
                # speculative_algorithm also takes other spellings (NGRAM, STANDALONE)
                choices=None if f.name == "speculative_algorithm" else f.metadata.get("choices"),
                help=f"{f.metadata['help']} (default: {f.default})",
            )


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    return config_from_kwargs(**{f.name: getattr(args, f.name) for f in fields(ServerConfig)})
