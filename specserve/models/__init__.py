"""Supported architectures: the ``architectures`` entry of a checkpoint's config -> spec."""
from __future__ import annotations

from specserve.models.llama import ArchSpec, LlamaForCausalLM

ARCHITECTURES: dict[str, ArchSpec] = {
    "LlamaForCausalLM": ArchSpec(),
    "MistralForCausalLM": ArchSpec(),
    "Qwen2ForCausalLM": ArchSpec(qkv_bias=True, o_bias=False),
    # MiMo: Qwen2 with multi-token-prediction layers beside it (a draft: ``models/eagle.py``).
    "MiMoForCausalLM": ArchSpec(qkv_bias=True, o_bias=False, mtp_prefix="model.mtp_layers."),
    "Qwen3ForCausalLM": ArchSpec(qk_norm=True),
    "Phi3ForCausalLM": ArchSpec(),  # q/k/v and gate/up stored merged; longrope
    "MixtralForCausalLM": ArchSpec(moe=True),
    "Qwen2MoeForCausalLM": ArchSpec(qkv_bias=True, o_bias=False, moe=True),
    "Qwen3MoeForCausalLM": ArchSpec(qk_norm=True, moe=True),
    "GemmaForCausalLM": ArchSpec(gemma=True),
    "Gemma2ForCausalLM": ArchSpec(gemma=True, sandwich=True),  # + attention and final logit soft-capping
    "Gemma3ForCausalLM": ArchSpec(qk_norm=True, gemma=True, sandwich=True),  # Gemma 3 text (1B, or a text checkpoint)
}

__all__ = ["ARCHITECTURES", "ArchSpec", "LlamaForCausalLM"]
