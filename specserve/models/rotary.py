"""Rotary position embedding (rotate-half layout) for any static rope type transformers knows.

Partial rotary (``partial_rotary_factor`` < 1, Phi-4-mini) rotates only the first
``rotary_dim`` dimensions of each head, rotate-half within them. The kernels rotate whole
heads, so q/k rows are reordered per head once at load (``rotary_order``): the rotated
dimensions' halves land in the head's halves, and the other dimensions get angle 0 and
scaling 1, which leaves them as they are. q·k is the same under one reordering of both.

LongRoPE (Phi-3 128k, Phi-3.5, Phi-4-mini) has two sets of frequencies: transformers
rotates every position of a sequence with the short factors while the sequence is at most
``original_max_position_embeddings`` long and with the long factors once it is longer
(its Phi-3 ``generate`` recomputes the cache at that point). Here a request is in one mode
for all its cached positions (``Scheduler`` decides it, and recomputes a request that
grows past the length); the runner feeds a long-mode request's positions shifted by
``Rotary.long_offset``, and the tables hold the long frequencies there.

Two forms of the same tables: the torch path computes cos/sin of the step's positions
each step (``Rotary.forward`` + ``apply_rotary``, the CPU path); the fused Triton path
reads a cos/sin cache over every position, built once when the model is
(``reference.rotary_cos_sin_cache``; the kernel is ``kernels/fused_rotary.py``).
"""
from __future__ import annotations

import copy

import torch
from torch import nn
from specserve.errors import ModelLoadError
from specserve.kernels import reference


class Rotary(nn.Module):
    """``inv_freq`` ``[head_dim / 2]`` and the rope type's attention ``scaling`` (per
    frequency) of one model; with ``max_positions`` also its ``cos_sin_cache``
    ``[max_positions, head_dim]`` fp32. With LongRoPE, positions from ``long_offset`` on
    are a long-mode request's (position + ``long_offset``): the long frequencies'
    ``inv_freq_long``, and cache rows ``max_positions`` on."""

    def __init__(self, config, max_positions: int | None = None) -> None:
        super().__init__()
        self.config = config
        self.max_positions = max_positions
        self.long_offset = config.max_position_embeddings if long_rope_start(config) is not None else 0
        if self.long_offset and max_positions not in (None, self.long_offset):
            raise ValueError("a LongRoPE table covers max_position_embeddings positions per mode")
        self.reset_tables()

    def reset_tables(self, device: torch.device | str | None = None) -> None:
        """(Re)compute the tables, on ``device`` when given: a model built on the meta
        device (then ``to_empty``) has garbage in them until this runs."""
        tables = [rope_parameters(self.config)]
        if self.long_offset:
            tables.append(rope_parameters(self.config, long=True))
        cache = None
        if self.max_positions is not None:
            cache = torch.cat([reference.rotary_cos_sin_cache(inv_freq, scaling, self.max_positions)
                               for inv_freq, scaling in tables])
        if device is not None:
            tables = [(inv_freq.to(device), scaling.to(device)) for inv_freq, scaling in tables]
            cache = None if cache is None else cache.to(device)
        (inv_freq, scaling), (inv_freq_long, scaling_long) = tables[0], tables[-1]
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("scaling", scaling, persistent=False)
        self.register_buffer("inv_freq_long", inv_freq_long if self.long_offset else None, persistent=False)
        self.register_buffer("scaling_long", scaling_long if self.long_offset else None, persistent=False)
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos ``[num_tokens, 1, head_dim]`` and a signed sin ``[num_tokens, 1, 2, head_dim/2]``
        (−sin on the first half), shaped for ``apply_rotary``; computed once per step."""
        inv_freq, scaling = self.inv_freq, self.scaling
        if self.long_offset:  # a long-mode request's positions come shifted by long_offset
            long = (positions >= self.long_offset)[:, None]
            positions = positions - self.long_offset * long[:, 0]
            inv_freq = torch.where(long, self.inv_freq_long, inv_freq)
            scaling = torch.where(long, self.scaling_long, scaling)
        freqs = positions[:, None].float() * inv_freq
        cos, sin = freqs.cos() * scaling, freqs.sin() * scaling
        cos = torch.cat((cos, cos), dim=-1)[:, None, :]
        sin = torch.stack((-sin, sin), dim=1)[:, None]
        return cos.to(dtype), sin.to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary on x ``[num_tokens, heads, head_dim]``:
    x·cos + (−x₂, x₁)·sin, with the sign folded into ``sin`` and the half swap a flip."""
    halves = x.unflatten(-1, (2, -1))
    return x * cos + (halves.flip(-2) * sin).flatten(-2)


def _rope_params(config) -> dict:
    params = dict(getattr(config, "rope_parameters", None) or {})
    if not params:  # transformers < 5: rope_theta + rope_scaling
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def position_limit(config) -> tuple[int | None, str]:
    """(the most positions this model runs, why): ``max_position_embeddings``."""
    return getattr(config, "max_position_embeddings", None), "max_position_embeddings"


def long_rope_start(config) -> int | None:
    """LongRoPE's ``original_max_position_embeddings``: a sequence longer than this is
    rotated with the long factors, every position of it; None for other ropes (or a
    LongRoPE model that never runs past it)."""
    params = _rope_params(config)
    if params["rope_type"] != "longrope":
        return None
    limit = getattr(config, "max_position_embeddings", None)
    original = params.get("original_max_position_embeddings") or getattr(
        config, "original_max_position_embeddings", None) or limit
    return original if limit is not None and original < limit else None


def rope_parameters(config, long: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(inv_freq, attention scaling), both ``[head_dim / 2]`` fp32; LongRoPE's short
    factors, or with ``long`` its long ones. Under partial rotary the frequencies past the
    rotated ones are 0 with scaling 1 (see the module docstring)."""
    params = _rope_params(config)
    rope_type = params["rope_type"]
    if rope_type == "default":
        dim = rotary_dim(config)
        exponent = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
        inv_freq, scaling = 1.0 / (params["rope_theta"] ** exponent), 1.0
    elif rope_type == "dynamic":
        raise ModelLoadError(f"rope type {rope_type!r} (length-dependent) is not supported")
    else:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # lazy: transformers, only to build

        if rope_type not in ROPE_INIT_FUNCTIONS:
            raise ModelLoadError(f"unknown rope type {rope_type!r}")
        # transformers picks LongRoPE's long factors for a sequence longer than the original length
        long_len = {"seq_len": long_rope_start(config) + 1} if long else {}
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", **long_len)
    half = head_dim_of(config) // 2
    if inv_freq.numel() != rotary_dim(config) // 2:
        raise ModelLoadError(f"rope type {rope_type!r} gave {inv_freq.numel()} frequencies for a rotary "
                             f"dimension of {rotary_dim(config)}")
    padding, device = half - inv_freq.numel(), inv_freq.device
    return (torch.cat((inv_freq.float(), torch.zeros(padding, device=device))),
            torch.cat((torch.full((inv_freq.numel(),), float(scaling), device=device),
                       torch.ones(padding, device=device))))


def rotary_dim(config) -> int:
    """How many dimensions of each head are rotated (all but under partial rotary)."""
    factor = getattr(config, "partial_rotary_factor", None) or 1.0
    dim = int(head_dim_of(config) * factor)
    if not 0 < factor <= 1 or dim % 2:
        raise ModelLoadError(f"partial_rotary_factor {factor} gives {dim} rotary dimensions of "
                             f"{head_dim_of(config)}; an even number is needed")
    return dim


def rotary_order(config) -> list[int] | None:
    """Under partial rotary, the per-head reordering of q/k dimensions (new index ->
    stored index) that puts rotated dimension pairs (j, j + r/2) at (j, j + D/2) and the
    unrotated ones between; None when every dimension is rotated."""
    dim, rot = head_dim_of(config), rotary_dim(config)
    if rot == dim:
        return None
    rot_half, rest = rot // 2, (dim - rot) // 2
    passing = list(range(rot, dim))
    return [*range(rot_half), *passing[:rest], *range(rot_half, rot), *passing[rest:]]


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _typed_rope(config, layer_type: str):
    """``config`` with the rope of one layer type (a shallow copy), or None if its rope
    is not given per layer type."""
    params = getattr(config, "rope_parameters", None) or {}
    if layer_type not in params or not isinstance(params[layer_type], dict):
        return None
    view = copy.copy(config)
    view.rope_parameters = dict(params[layer_type])
    return view


def global_rope_config(config):
    """The config whose rope the full-attention layers use: ``config`` itself, or its
    ``full_attention`` rope where the rope is given per layer type (Gemma 3)."""
    return _typed_rope(config, "full_attention") or config


def local_rope_config(config):
    """The config of the sliding-window layers' own rope (Gemma 3's local base), or None."""
    return _typed_rope(config, "sliding_attention")
