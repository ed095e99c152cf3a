"""Model implementations and weight loading.

Entry points: ``default_model.resolve_model_path`` (user path or None -> Hugging Face folder,
converting GGUF files once), ``model_config.ModelConfig.from_pretrained``,
``loader.load_model`` / ``tokenizer.load_tokenizer``, and ``registry.get_model_class``.
Every model class follows ``llama.LlamaForCausalLM``'s contract: ``forward(input_ids,
positions, fb)``, ``compute_logits(hidden)``, ``load_weights(named_tensors)``; its constructor
takes an optional ``tp`` group (``srt.distributed.TPGroup``) and builds only this rank's slices
from the tensor-parallel layers of ``tp_layers``. Checkpoint tensors reach parameters through
one seam, ``LlamaForCausalLM.weight_targets(name, tensor)``: ``(parameter, shard id, tensor)``
pieces, named by the family's ``weight_map`` (q/k/v and gate/up merged, experts stacked, a
family's renames; one place for every family and format); Phi-3 splits its fused tensors there.
Mixture-of-Experts families build on ``moe_decoder`` and the layers of ``moe``.
"""
