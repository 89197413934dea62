"""The gated feed-forward block (SwiGLU, or GeGLU for Gemma): a dense layer's MLP (its
tensor-parallel share) and each expert of a mixture of experts (models/moe.py)."""
from __future__ import annotations

import torch
from torch import nn

from specserve.distributed import TPGroup
from specserve.errors import ModelLoadError
from specserve.models.layer_ops import LayerOps


class MLP(nn.Module):
    """``down(act(gate(x)) · up(x))``, gate and up merged (act: silu, or gelu_tanh). ``intermediate_size``:
    this rank's rows (a dense layer's share; an expert's whole, experts being unsharded)."""

    def __init__(self, config, ops: LayerOps, intermediate_size: int, tp: TPGroup) -> None:
        super().__init__()
        self.ops = ops
        self.tp = tp
        bias = bool(getattr(config, "mlp_bias", False))
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * self.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(self.intermediate_size, config.hidden_size, bias=bias)
        act = getattr(config, "hidden_activation", None) or config.hidden_act
        if act in ("silu", "swish"):
            self.act_and_mul = ops.silu_and_mul
        elif act in ("gelu_pytorch_tanh", "gelu_tanh"):  # GeGLU (Gemma)
            self.act_and_mul = ops.gelu_tanh_and_mul
        else:
            raise ModelLoadError(f"activation {act!r} is not supported (silu, gelu_pytorch_tanh)")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.down_proj(self.act_and_mul(self.gate_up_proj(x))))
