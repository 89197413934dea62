"""The SwiGLU feed-forward block: a dense layer's MLP (its tensor-parallel share) and
each expert of a mixture of experts (models/moe.py)."""
from __future__ import annotations

import torch
from torch import nn

from specserve.distributed import TPGroup
from specserve.errors import ModelLoadError
from specserve.models.layer_ops import LayerOps


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) · up(x))``, gate and up merged. ``intermediate_size``:
    this rank's rows (a dense layer's share; an expert's whole, experts being unsharded)."""

    def __init__(self, config, ops: LayerOps, intermediate_size: int, tp: TPGroup) -> None:
        super().__init__()
        self.ops = ops
        self.tp = tp
        bias = bool(getattr(config, "mlp_bias", False))
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * self.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(self.intermediate_size, config.hidden_size, bias=bias)
        if config.hidden_act not in ("silu", "swish"):
            raise ModelLoadError(f"activation {config.hidden_act!r} is not supported (silu only)")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x))))
