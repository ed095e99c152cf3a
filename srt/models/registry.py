"""Model classes by the ``architectures`` name of a Hugging Face ``config.json``."""

from __future__ import annotations

from torch import nn

from radixlm.srt.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from radixlm.srt.models.gpt_oss import GptOssForCausalLM
from radixlm.srt.models.llama import LlamaForCausalLM
from radixlm.srt.models.mistral import MistralForCausalLM
from radixlm.srt.models.mixtral import MixtralForCausalLM
from radixlm.srt.models.olmoe import OlmoeForCausalLM
from radixlm.srt.models.phi3 import Phi3ForCausalLM
from radixlm.srt.models.qwen2 import Qwen2ForCausalLM
from radixlm.srt.models.qwen2_moe import Qwen2MoeForCausalLM
from radixlm.srt.models.qwen3 import Qwen3ForCausalLM
from radixlm.srt.models.qwen3_moe import Qwen3MoeForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    # Mixture-of-Experts (moe_decoder.py; gpt-oss: gpt_oss.py)
    "GptOssForCausalLM": GptOssForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "OlmoeForCausalLM": OlmoeForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
}


def supported_architectures() -> list[str]:
    return sorted(MODEL_REGISTRY)


def get_model_class(architecture: str) -> type[nn.Module]:
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        raise ValueError(
            f"model architecture {architecture!r} is not supported; supported architectures: "
            f"{', '.join(supported_architectures())}"
        ) from None
