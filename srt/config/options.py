"""The options a user sets: ``ServerConfig``, one frozen dataclass with help text (and the
allowed values) per field, and the constants its fields and help name."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

# SGLang's --schedule-policy values ("priority" is refused as SGLang's scheduler refuses it:
# --enable-priority-scheduling ranks the queue on top of any of these); "spf" is radixlm's
# earlier name of shortest-prefill-first
SCHEDULE_POLICIES = (
    "fcfs",
    "lpm",
    "dfs-weight",
    "lof",
    "random",
    "hrrn",
    "shortest-prefill-first",
    "spf",
    "routing-key",
)
ATTENTION_BACKENDS = ("auto", "torch", "cpu", "triton", "flashinfer")
GRAMMAR_BACKENDS = ("auto", "outlines", "llguidance", "none")
DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTIZATIONS = ("none", "int4", "fp8")
HICACHE_WRITE_POLICIES = ("write_through_selective", "write_through", "write_back")
HICACHE_PREFETCH_POLICIES = ("timeout", "best_effort", "wait_complete")
KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "fp8_e5m2")
KV_CACHE_SCALE_MODES = ("calibrate", "unit")  # else kv_cache_scales is a JSON file's path
# speculative decoding; SGLang's NGRAM and STANDALONE are accepted as ngram and draft
# (SPECULATIVE_ALIASES in build.py)
SPECULATIVE_ALGORITHMS = ("none", "ngram", "draft")
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
DISAGGREGATION_MODES = ("null", "prefill", "decode")
TRANSFER_BACKENDS = ("mooncake",)  # NIXL would be a second entry


def _opt(default: Any, help: str, choices: tuple[Any, ...] | None = None) -> Any:
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
    hicache_storage_backend: str | None = _opt(
        None,
        "SGLang's disk-tier flag: 'file' is the disk tier, in --hicache-storage-dir (else "
        "$SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR, else /tmp/hicache); other backends are refused",
    )
    hicache_storage_max_bytes: int = _opt(
        16 * 2**30, "size cap of the disk KV tier in bytes (least recently used pages go first)"
    )
    hicache_storage_prefetch_policy: str = _opt(
        "timeout",
        "how long admission waits for a prompt's pages read from the disk tier (SGLang's names): "
        "timeout: up to a share of what recomputing them would take (at least 50 ms); "
        "best_effort: no wait, the pages read by then; wait_complete: the request stays queued "
        "(later ones go ahead) until all are read, at most 10 s after it arrived",
        HICACHE_PREFETCH_POLICIES,
    )
    hicache_io_backend: str = _opt(
        "direct",
        "host-device KV copies (SGLang's flag): direct, one DMA a layer per run of host pages "
        "plus an on-device gather/scatter; SGLang's kernel is taken as direct, with a warning",
        ("direct", "kernel"),
    )
    hicache_mem_layout: str = _opt(
        "layer_first",
        "host KV pool layout (SGLang's flag): layer_first; SGLang's page_first layouts are "
        "taken as layer_first, with a warning",
        ("layer_first", "page_first", "page_first_direct", "page_first_kv_split"),
    )
    # scheduling
    max_running_requests: int = _opt(256, "most requests decoding at once")
    max_prefill_tokens: int = _opt(8192, "token budget of one prefill step")
    num_continuous_decode_steps: int = _opt(
        1,
        "decode steps the running requests get in a row before waiting prompts may be "
        "prefilled again (SGLang's flag; more: fewer prefill stalls in their output, later "
        "first tokens)",
    )
    chunked_prefill_size: int | None = _opt(
        None,
        "split prompts longer than this into chunks (-1: off; default: on, sized per device)",
    )
    enable_mixed_chunk: bool = _opt(
        False,
        "run prefill chunks together with the running decodes (default on a CPU, and on a GPU "
        "with the flashinfer attention backend)",
    )
    disable_mixed_chunk: bool = _opt(
        False,
        "run prefill chunks alone, without the running decodes (default on a GPU with the "
        "triton attention backend)",
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
    tpot_target_ms: float | None = _opt(
        None,
        "while requests decode, prefill only as much prompt per step as keeps their time per "
        "output token near this (the decode batch fills while prompts wait; default: prefill "
        "first, whatever fits)",
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
    default_priority_value: int | None = _opt(
        None,
        "with --enable-priority-scheduling: the priority of requests that set none (default: "
        "they rank below every given priority)",
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
    watchdog_timeout: float = _opt(
        300.0,
        "seconds one scheduler step may run (SGLang's flag): past it the server fails its "
        "requests with 503 and exits non-zero, for its supervisor to restart it; 0: off",
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
    dp_size: int = _opt(
        1,
        "data-parallel replicas (alias --data-parallel-size): 1 only; several servers behind "
        "sglang-router serve data parallelism",
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
        "log one record per finished request: rid, finish reason, token counts, latency, and "
        "what --log-requests-level adds",
    )
    log_requests_level: int = _opt(
        0,
        "what --log-requests records (SGLang's levels): 0 metadata; 1 also the sampling "
        "parameters that differ from their defaults; 2 also the prompt and output, cut to 2,048 "
        "characters each; 3 them whole (SGLang's default is 2: here no text unless asked)",
        (0, 1, 2, 3),
    )
    log_requests_format: str = _opt(
        "text", "--log-requests records as text lines or one JSON object a line", ("text", "json")
    )
    log_requests_target: tuple[str, ...] | None = _opt(
        None,
        "where --log-requests writes: stdout and/or folders (each gets requests.log appended "
        "to); default: the server's log",
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
    enable_cache_report: bool = _opt(
        False,
        "accepted (SGLang's flag): the OpenAI routes always report cached prompt tokens "
        "(usage.prompt_tokens_details.cached_tokens)",
    )
    skip_server_warmup: bool = _opt(
        False, "accepted (SGLang's flag): the server sends itself no warm-up request"
    )
    enable_p2p_check: bool = _opt(
        False, "accepted (SGLang's flag): NCCL itself checks GPU peer access between ranks"
    )
    # accepted, with a warning at start: a speed setting that has no counterpart here
    enable_torch_compile: bool = _opt(
        False,
        "accepted (SGLang's flag) with a warning: not used (the decode step is captured in CUDA "
        "graphs over Triton/FlashInfer kernels)",
    )
    trust_remote_code: bool = _opt(
        False,
        "accepted (SGLang's flag): no code is ever loaded from a checkpoint; the supported "
        "architectures are built in",
    )

    def replace(self, **changes: Any) -> ServerConfig:
        return dataclasses.replace(self, **changes)
