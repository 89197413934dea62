"""Llama-family decoder over a flattened ragged batch (``[num_tokens]``, no padding).

One implementation covers Llama 2/3, SmolLM2, Mistral (sliding window), Qwen2 (qkv bias)
and Qwen3 (per-head q/k RMSNorm); ``ArchSpec`` records how they differ. Q/K/V and
gate/up projections are merged at load time so each is one matmul.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from specserve.attention import AttentionBackend
from specserve.batch import ForwardBatch


@dataclass(frozen=True)
class ArchSpec:
    qkv_bias: bool | None = None   # None: follow config.attention_bias
    o_bias: bool | None = None
    qk_norm: bool = False


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # As transformers does: normalise in fp32, cast back, then scale.
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(x.dtype)


class Rotary(nn.Module):
    """Rotary embedding (rotate-half layout) for any static rope type transformers knows."""

    def __init__(self, config) -> None:
        super().__init__()
        inv_freq, self.scaling = rope_parameters(config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos ``[num_tokens, 1, head_dim]`` and a signed sin ``[num_tokens, 1, 2, head_dim/2]``
        (−sin on the first half), shaped for ``apply_rotary``; computed once per step."""
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        cos, sin = freqs.cos() * self.scaling, freqs.sin() * self.scaling
        cos = torch.cat((cos, cos), dim=-1)[:, None, :]
        sin = torch.stack((-sin, sin), dim=1)[:, None]
        return cos.to(dtype), sin.to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary on x ``[num_tokens, heads, head_dim]``:
    x·cos + (−x₂, x₁)·sin, with the sign folded into ``sin`` and the half swap a flip."""
    halves = x.unflatten(-1, (2, -1))
    return x * cos + (halves.flip(-2) * sin).flatten(-2)


def rope_parameters(config) -> tuple[torch.Tensor, float]:
    from specserve.errors import ModelLoadError

    params = dict(getattr(config, "rope_parameters", None) or {})
    if not params:  # transformers < 5: rope_theta + rope_scaling
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        dim = head_dim_of(config)
        exponent = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
        return 1.0 / (params["rope_theta"] ** exponent), 1.0
    if rope_type in ("dynamic", "longrope"):
        raise ModelLoadError(f"rope type {rope_type!r} (length-dependent) is not supported")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ModelLoadError(f"unknown rope type {rope_type!r}")
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
    return inv_freq.float(), float(scaling)


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class Attention(nn.Module):
    def __init__(self, config, spec: ArchSpec, layer_idx: int, backend: AttentionBackend) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = head_dim_of(config)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        bias = bool(getattr(config, "attention_bias", False))
        qkv_bias = bias if spec.qkv_bias is None else spec.qkv_bias
        o_bias = bias if spec.o_bias is None else spec.o_bias
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=o_bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if spec.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if spec.qk_norm else None
        self.scale = self.head_dim ** -0.5
        self.sliding_window = _sliding_window(config, layer_idx)
        self.backend = backend

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], batch: ForwardBatch) -> torch.Tensor:
        qkv = self.qkv_proj(hidden).view(-1, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        qk, v = qkv[:, :self.num_heads + self.num_kv_heads], qkv[:, self.num_heads + self.num_kv_heads:]
        if self.q_norm is not None:
            qk = torch.cat((self.q_norm(qk[:, :self.num_heads]), self.k_norm(qk[:, self.num_heads:])), dim=1)
        qk = apply_rotary(qk, cos, sin)  # q and k rotated together
        q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
        k_cache, v_cache = kv_cache
        self.backend.store_kv(k, v, k_cache, v_cache, batch)
        out = self.backend.attend(q, k_cache, v_cache, batch, self.scale, self.sliding_window)
        return self.o_proj(out.reshape(-1, self.q_size))


def _sliding_window(config, layer_idx: int) -> int | None:
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if window and layer_types is not None and layer_types[layer_idx] != "sliding_attention":
        return None
    return window or None


class MLP(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        bias = bool(getattr(config, "mlp_bias", False))
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=bias)
        if config.hidden_act not in ("silu", "swish"):
            from specserve.errors import ModelLoadError
            raise ModelLoadError(f"activation {config.hidden_act!r} is not supported (silu only)")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config, spec: ArchSpec, layer_idx: int, backend: AttentionBackend) -> None:
        super().__init__()
        self.self_attn = Attention(config, spec, layer_idx, backend)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden, cos, sin, kv_cache, batch):
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), cos, sin, kv_cache, batch)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class LlamaModel(nn.Module):
    def __init__(self, config, spec: ArchSpec, backend: AttentionBackend) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, spec, i, backend) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = Rotary(config)


class LlamaForCausalLM(nn.Module):
    """``forward`` returns final hidden states ``[num_tokens, hidden]``;
    ``compute_logits`` maps the rows that need them to ``[num_rows, vocab]``."""

    def __init__(self, config, spec: ArchSpec, backend: AttentionBackend) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, spec, backend)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))

    def tie_weights(self) -> None:
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], batch: ForwardBatch,
                num_layers: int | None = None) -> torch.Tensor:
        """``num_layers`` stops after the first layers (the layer-skip draft), then norms."""
        hidden = self.model.embed_tokens(input_ids)
        cos, sin = self.model.rotary(positions, hidden.dtype)
        for layer, kv_cache in zip(self.model.layers[:num_layers], kv_caches):
            hidden = layer(hidden, cos, sin, kv_cache, batch)
        return self.model.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    # Checkpoint name -> (our parameter, shard index) for the merged projections.
    STACKED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
               "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def shard_range(self, param_name: str, shard: int) -> tuple[int, int]:
        """Row range of shard ``shard`` inside merged parameter ``param_name``."""
        if ".qkv_proj." in param_name:
            attn = self.model.layers[0].self_attn
            sizes = [attn.q_size, attn.kv_size, attn.kv_size]
        else:
            sizes = [self.config.intermediate_size] * 2
        start = sum(sizes[:shard])
        return start, start + sizes[shard]
