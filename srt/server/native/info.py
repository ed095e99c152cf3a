"""What routers and clients read about a server, in SGLang's shapes: model info, server info,
load (``/v1/loads`` and the older ``/get_load``) and tokenizer info.

The load figures come from the scheduler (``Scheduler.load_info``): it answers between two
steps without waiting for the step in flight, so a figure is at most one step old and a load
query never holds generation up; concurrent queries share one answer
(``TokenizerManager.load``). This server is one data-parallel rank (``dp_rank`` 0), however
many tensor-parallel ranks (``tp_size``) it runs: replicas are separate servers behind a router.
"""

from __future__ import annotations

import dataclasses
import time
from datetime import datetime, timezone
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response

from radixlm.srt.managers.model_info import model_info_of
from radixlm.srt.managers.tokenizer_manager import GenerateError, TokenizerManager
from radixlm.srt.messages import ServerInfoReq
from radixlm.srt.server.http.access import is_admin_caller, redact_paths
from radixlm.srt.server.http.deps import get_tm, json_response
from radixlm.srt.server.http.openapi import ERROR_RESPONSES

router = APIRouter(responses=ERROR_RESPONSES)

SECRET_CONFIG_FIELDS = ("api_key", "admin_api_key")
LOAD_SECTIONS = frozenset({"core", "memory", "spec", "lora", "disagg", "queues", "all"})
LOAD_FORMATS = ("json", "prometheus")
PROMETHEUS_PREFIX = "radixlm_"
DP_RANK = 0
LOAD_FIGURES = frozenset(
    {
        "timestamp",
        "num_running_reqs",
        "num_waiting_reqs",
        "num_grammar_queue_reqs",
        "num_retracted_reqs",
        "num_used_tokens",
        "num_available_tokens",
        "num_evictable_tokens",
        "num_pending_tokens",
        "max_total_num_tokens",
        "max_running_requests",
        "token_usage",
        "gen_throughput",
        "cache_hit_rate",
        "utilization",
    }
)  # what Scheduler.load_info answers


async def scheduler_load(tm: TokenizerManager) -> dict[str, Any]:
    """The scheduler's load figures; a 503 when its answer lacks some."""
    load = await tm.load()
    missing = sorted(LOAD_FIGURES - load.keys())
    if missing:
        raise GenerateError(f"the scheduler's load answer lacks {missing}", 503)
    return load


# ---------------------------------------------------------------------- model and server
def model_info(tm: TokenizerManager, served_model_name: str) -> dict[str, Any]:
    return model_info_of(tm.info, tm.cfg.tokenizer_path, served_model_name)


@router.get("/get_model_info")
@router.get("/model_info")
async def get_model_info(request: Request) -> Response:
    """SGLang's model info; local paths only for admin callers (others see the served name in
    ``model_path`` and ``tokenizer_path``: access.redact_paths)."""
    name = request.app.state.served_model_name
    return json_response(_for_caller(request, model_info(get_tm(request), name)))


def _for_caller(request: Request, answer: dict[str, Any]) -> dict[str, Any]:
    if is_admin_caller(request):
        return answer
    return redact_paths(answer, request.app.state.served_model_name)


@router.get("/get_server_info")
@router.get("/server_info")
async def get_server_info(request: Request) -> Response:
    """The resolved configuration (keys left out), the scheduler's ready report and its
    current state, and the figures a router reads (``dp_size``, ``max_total_num_tokens``...);
    local paths only for admin callers."""
    tm = get_tm(request)
    reply = await tm.control(ServerInfoReq())
    config = {k: v for k, v in dataclasses.asdict(tm.cfg).items() if k not in SECRET_CONFIG_FIELDS}
    return json_response(
        _for_caller(
            request,
            {
                **config,
                **tm.info,
                "served_model_name": request.app.state.served_model_name,
                "dp_size": 1,
                "tp_size": tm.cfg.tp_size,  # the ranks behind this one HTTP server
                "pp_size": 1,
                "max_total_num_tokens": tm.max_total_tokens,
                "max_req_input_len": min(tm.context_length, tm.max_total_tokens) - 1,
                "kv_pool": reply.data,
                "internal_states": [reply.data],
                "sessions": tm.sessions.info(),
                "num_inflight_requests": tm.num_request_states,
                "num_request_states": tm.num_request_states,
                "weight_version": reply.data.get("weight_version"),  # update_weights_from_disk's
                "weight_update_pending": tm.weight_update_pending,  # new requests wait meanwhile
                "num_paused_requests": tm.num_paused,
                "paused": tm.pause_reason,  # why requests wait now; None while they do not
                "version": request.app.version,
            },
        )
    )


# ---------------------------------------------------------------------- load
def rank_load(load: dict[str, Any], sections: set[str], paused: int = 0) -> dict[str, Any]:
    """One rank's entry of ``/v1/loads`` from the scheduler's figures."""
    used, pending = load["num_used_tokens"], load["num_pending_tokens"]
    out = {
        "dp_rank": DP_RANK,
        "timestamp": load["timestamp"],
        "num_running_reqs": load["num_running_reqs"],
        "num_waiting_reqs": load["num_waiting_reqs"],
        "num_total_reqs": load["num_running_reqs"] + load["num_waiting_reqs"],
        "num_used_tokens": used,
        "num_total_tokens": used + pending,  # in the KV pool, plus the waiting prompts
        "max_total_num_tokens": load["max_total_num_tokens"],
        "max_running_requests": load["max_running_requests"],
        "token_usage": load["token_usage"],
        "gen_throughput": load["gen_throughput"],
        "cache_hit_rate": load["cache_hit_rate"],
        "utilization": load["utilization"],
    }
    if sections & {"all", "queues"}:
        out["queues"] = {
            "waiting": load["num_waiting_reqs"] - load["num_grammar_queue_reqs"],
            "grammar": load["num_grammar_queue_reqs"],
            "paused": paused,  # held by /pause_generation or a weight update
            "retracted": load["num_retracted_reqs"],
        }
    return out


def aggregate(loads: list[dict[str, Any]]) -> dict[str, Any]:
    n = max(len(loads), 1)
    return {
        "total_running_reqs": sum(d["num_running_reqs"] for d in loads),
        "total_waiting_reqs": sum(d["num_waiting_reqs"] for d in loads),
        "total_reqs": sum(d["num_total_reqs"] for d in loads),
        "total_used_tokens": sum(d["num_used_tokens"] for d in loads),
        "total_tokens": sum(d["num_total_tokens"] for d in loads),
        "avg_token_usage": round(sum(d["token_usage"] for d in loads) / n, 4),
        "avg_throughput": round(sum(d["gen_throughput"] for d in loads) / n, 2),
        "avg_utilization": round(sum(d["utilization"] for d in loads) / n, 4),
    }


def parse_include(include: str | None) -> set[str]:
    sections = {s.strip() for s in include.split(",")} if include else {"all"}
    invalid = sections - LOAD_SECTIONS
    if invalid:
        raise GenerateError(
            f"Invalid include sections: {sorted(invalid)}. Valid options: {sorted(LOAD_SECTIONS)}",
            400,
            "include",
        )
    return sections


def prometheus_text(loads: list[dict[str, Any]]) -> str:
    lines = []
    for key in [k for k, v in (loads[0] if loads else {}).items() if k != "dp_rank"]:
        values = [(d["dp_rank"], d[key]) for d in loads if isinstance(d[key], (int, float))]
        if values:
            lines.append(f"# TYPE {PROMETHEUS_PREFIX}{key} gauge")
            lines += [f'{PROMETHEUS_PREFIX}{key}{{dp_rank="{r}"}} {v}' for r, v in values]
    return "\n".join(lines) + "\n"


@router.get("/v1/loads")
async def get_loads(
    request: Request, dp_rank: int | None = None, include: str | None = None, format: str = "json"
) -> Response:
    """Per-rank load (``include``: comma-separated sections, ``core`` and ``queues`` reported
    here; ``format``: ``json`` or ``prometheus``); a ``dp_rank`` this server is not gets none."""
    sections = parse_include(include)
    if format not in LOAD_FORMATS:
        raise GenerateError(f"format must be one of {list(LOAD_FORMATS)}, got {format!r}", 400)
    load = await scheduler_load(get_tm(request))
    tm = get_tm(request)
    loads = [rank_load(load, sections, tm.num_paused)] if dp_rank in (None, DP_RANK) else []
    if format == "prometheus":
        return PlainTextResponse(prometheus_text(loads), media_type="text/plain; version=0.0.4")
    return json_response(
        {
            "timestamp": datetime.now(timezone.utc).isoformat(),
            "version": request.app.version,
            "dp_rank_count": 1,
            "loads": loads,
            "aggregate": aggregate(loads),
        }
    )


@router.get("/get_load")
async def get_load(request: Request) -> Response:
    """The older per-rank shape: requests (running + waiting), waiting requests, tokens (in
    the KV pool plus the waiting prompts) and the waiting prompts' tokens."""
    load = await scheduler_load(get_tm(request))
    used, pending = load["num_used_tokens"], load["num_pending_tokens"]
    entry = {
        "dp_rank": DP_RANK,
        "num_reqs": load["num_running_reqs"] + load["num_waiting_reqs"],
        "num_waiting_reqs": load["num_waiting_reqs"],
        "num_tokens": used + pending,
        "num_pending_tokens": pending,
        "ts_tic": time.perf_counter(),
    }
    return json_response([entry])


# ---------------------------------------------------------------------- tokenizer
def tokenizer_info(tm: TokenizerManager) -> dict[str, Any]:
    tok = tm.tokenizer
    info: dict[str, Any] = {
        "tokenizer_class": type(tok).__name__,
        "vocab_size": len(tok),
        "model_max_length": tm.context_length,
        "chat_template": getattr(tok, "chat_template", None),
    }
    for name in ("bos", "eos", "pad", "unk"):
        info[f"{name}_token"] = getattr(tok, f"{name}_token", None)
        info[f"{name}_token_id"] = getattr(tok, f"{name}_token_id", None)
    return info


@router.get("/tokenizer_info")
async def get_tokenizer_info(request: Request) -> Response:
    """The tokenizer's class, size, special tokens and chat template (None without one)."""
    state = request.app.state
    if getattr(state, "tokenizer_info", None) is None:
        state.tokenizer_info = tokenizer_info(get_tm(request))
    return json_response(state.tokenizer_info)
