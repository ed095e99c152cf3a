"""SGLang's ``Engine`` keywords this engine has no use for (accepted by name at their off
values only), and the scoring job of ``Engine.score``'s arguments."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from radixlm.srt.managers.front_door import FrontDoor
from radixlm.srt.managers.scoring import SCORE_SAMPLING_PARAMS, ScoreJob, plan_scores

__all__ = [
    "SCORE_OFF_OPTIONS",
    "SGLANG_GENERATE_DEFAULTS",
    "check_sglang_options",
    "plan_engine_scores",
    "score_generate_args",
]

# SGLang's Engine.generate keywords this engine has no use for: accepted at these defaults
# (callers pass them explicitly), a ValueError naming them otherwise. A trace header is
# observability only: any value is accepted.
SGLANG_GENERATE_DEFAULTS: dict[str, Any] = {
    **dict.fromkeys(
        (
            "image_data",
            "audio_data",
            "video_data",
            "mm_hashes",
            "mm_content_hashes",
            "lora_path",
            "custom_logit_processor",
            "bootstrap_host",
            "bootstrap_port",
            "bootstrap_room",
            "routed_dp_rank",
            "disagg_prefill_dp_rank",
            "kv_hints",
            "data_parallel_rank",
            "session_id",
        )
    ),
    "require_reasoning": False,
    "return_hidden_states": False,
    "return_routed_experts": False,
    "routed_experts_start_len": 0,
}
_ACCEPTED_ANY = ("external_trace_header",)
# SGLang's Engine.generate keywords this engine implements beyond its own signature
ENGINE_GENERATE_EXTRAS = ("priority",)
# SGLang's Engine.score keywords for what this engine does not do, with their off values
SCORE_OFF_OPTIONS: dict[str, Any] = {
    "embed_override_token_id": None,
    "query_embed_overrides": None,
    "item_embed_overrides": None,
    "stacked_query_item_embed_overrides": None,
    "return_pooled_hidden_states": False,
    "score_extraction_token_id": None,
}


def check_sglang_options(options: dict[str, Any]) -> None:
    for name, value in options.items():
        if name in _ACCEPTED_ANY or name in ENGINE_GENERATE_EXTRAS:
            continue
        if name not in SGLANG_GENERATE_DEFAULTS:
            raise TypeError(f"generate() got an unexpected keyword argument {name!r}")
        default = SGLANG_GENERATE_DEFAULTS[name]
        if not (value is default or (type(value) is type(default) and value == default)):
            raise ValueError(
                f"{name} is not supported by this engine (text-only models, no LoRA, no "
                f"disaggregation, no hidden-state output); leave it out or at {default!r}"
            )


def check_score_options(options: dict[str, Any]) -> None:
    for name, value in options.items():
        if name not in SCORE_OFF_OPTIONS:
            raise TypeError(f"score() got an unexpected keyword argument {name!r}")
        if value is not None and value is not SCORE_OFF_OPTIONS[name]:
            raise ValueError(f"{name} is not supported by this engine; leave it out")


def plan_engine_scores(
    args: Mapping[str, Any], door: FrontDoor, vocab_size: int
) -> tuple[ScoreJob, list[list[int]]]:
    """The checked scoring job of ``Engine.score``'s arguments and its prompts' token ids
    (managers/scoring.py); raises GenerateError."""
    keys = ("apply_softmax", "item_first", "temperature", "return_token_logprobs")
    job = plan_scores(
        args["query"],
        args["items"],
        args["label_token_ids"],
        vocab_size=vocab_size,
        max_token_chars=door.max_token_chars,
        **{k: args[k] for k in keys},
    )
    ids = [door.tokenize(p, True, "items") if job.is_text else p for p in job.prompts]
    job.check_size(ids)
    return job, ids


def score_generate_args(job: ScoreJob, ids: list[list[int]]) -> dict[str, Any]:
    """The prefill-only requests that score a job's items (managers/scoring.py)."""
    return dict(
        input_ids=ids,
        sampling_params=SCORE_SAMPLING_PARAMS,
        return_logprob=True,
        token_ids_logprob=job.labels,
    )
