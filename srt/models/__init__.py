"""Model implementations and weight loading.

Entry points: ``default_model.resolve_model_path`` (user path or None -> Hugging Face folder,
converting GGUF files once), ``model_config.ModelConfig.from_pretrained``,
``loader.load_model`` / ``loader.load_tokenizer``, and ``registry.get_model_class``.
Every model class follows ``llama.LlamaForCausalLM``'s contract: ``forward(input_ids,
positions, fb)``, ``compute_logits(hidden)``, ``load_weights(named_tensors)``; its constructor
takes an optional ``tp`` group (``srt.distributed.TPGroup``) and builds only this rank's slices
from the tensor-parallel layers of ``tp_layers``. Checkpoint names map onto parameters in
``weight_map`` (one place for every family and format); Mixture-of-Experts families build on
``moe_decoder`` and the layers of ``moe``.
"""
