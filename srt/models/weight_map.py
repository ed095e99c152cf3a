"""Checkpoint tensor names -> the model's parameters: the one place names are mapped.

Every architecture (and every weight format: a quantised checkpoint's ``weight_scale`` or
``qweight`` keeps the suffix after the projection's name) goes through :class:`WeightMap`:

* **stacked projections**: ``...self_attn.q_proj.<suffix>`` -> ``...self_attn.qkv_proj.<suffix>``
  with shard id ``"q"``; ``gate_proj``/``up_proj`` -> ``gate_up_proj`` shards 0 and 1;
* **experts**: ``...experts.<e>.gate_proj.<suffix>`` -> ``...experts.gate_up_proj.<suffix>``
  with shard id ``("gate", e)`` (``"up"`` likewise; ``down_proj`` -> ``experts.down_proj``,
  ``("down", e)``): every expert's tensor lands in one stacked parameter ``[experts, out, in]``;
* **renames** of a family's own names first (Mixtral's ``block_sparse_moe`` and ``w1/w2/w3``);
* **tied embeddings**: ``lm_head.weight`` is skipped when the config ties it (the model's
  ``load_weights`` decides, since a checkpoint may also leave it out).

A parameter's loader is its ``weight_loader(param, tensor[, shard_id])`` attribute; the shard
ids a parameter must receive before it counts as loaded are its ``shard_ids`` attribute when it
has one (expert stacks), else those of the stacked rule that produced its name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

ShardId = Any  # None, an index, a letter ("q") or (part, expert) for expert stacks

# (our parameter, checkpoint name, shard id): checkpoint tensors that go into merged parameters
STACKED_PARAMS: tuple[tuple[str, str, ShardId], ...] = (
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
)
# checkpoint projection of an expert -> (our stacked parameter, part)
EXPERT_PARTS = {
    "gate_proj": ("gate_up_proj", "gate"),
    "up_proj": ("gate_up_proj", "up"),
    "down_proj": ("down_proj", "down"),
}
_EXPERT_NAME = re.compile(
    r"(?P<prefix>.*\.experts)\.(?P<expert>\d+)\.(?P<part>\w+)\.(?P<suffix>.+)"
)
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass(frozen=True)
class WeightMap:
    """How one family's checkpoint names map onto its parameters (see the module docstring)."""

    renames: tuple[tuple[str, str], ...] = ()  # (checkpoint substring, ours), applied in order
    stacked: tuple[tuple[str, str, ShardId], ...] = STACKED_PARAMS
    ignored_suffixes: tuple[str, ...] = IGNORED_SUFFIXES

    def is_ignored(self, ckpt_name: str) -> bool:
        return ckpt_name.endswith(self.ignored_suffixes)

    def param_name(self, ckpt_name: str) -> tuple[str, ShardId]:
        """``(our parameter name, shard id)`` of a checkpoint tensor (shard id None: the
        whole parameter)."""
        name = ckpt_name
        for old, new in self.renames:
            name = name.replace(old, new)
        expert = _EXPERT_NAME.fullmatch(name)
        if expert and expert["part"] in EXPERT_PARTS:
            merged, part = EXPERT_PARTS[expert["part"]]
            return f"{expert['prefix']}.{merged}.{expert['suffix']}", (part, int(expert["expert"]))
        for merged, part, shard_id in self.stacked:
            if f".{part}." in name:
                return name.replace(f".{part}.", f".{merged}."), shard_id
        return name, None

    def expected_shards(self, name: str, param: Any) -> set:
        """The shard ids parameter ``name`` must receive (``{None}``: loaded whole)."""
        declared = getattr(param, "shard_ids", None)
        if declared is not None:
            return set(declared)
        shards = {shard for merged, _, shard in self.stacked if f".{merged}." in name}
        return shards or {None}

    def missing(self, params: dict[str, Any], loaded: dict[str, set]) -> list[str]:
        """Parameters some of whose shards were never loaded."""
        return [
            name
            for name, param in params.items()
            if not self.expected_shards(name, param) <= loaded.get(name, set())
        ]


LLAMA_WEIGHTS = WeightMap()
