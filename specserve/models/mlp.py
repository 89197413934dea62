"""The gated feed-forward block (SwiGLU, or GeGLU for Gemma): a dense layer's MLP (its
tensor-parallel share) and each expert of a mixture of experts (models/moe.py)."""
from __future__ import annotations

import torch
from torch import nn

from specserve.distributed import TPGroup
from specserve.errors import ModelLoadError
from specserve.models.checkpoint_quant import Fp8Rows
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
        self.fp8_group = 0  # the activation's output rounded to float8 in groups of this many (``linears_replaced``)

    def linears_replaced(self) -> None:
        """Where the down projection now rounds its input to float8 at run time
        (``Fp8Linear.input_group``), the activation hands it its output so rounded
        (``Fp8Rows``), where the ops can: one launch less."""
        group = getattr(self.down_proj, "input_group", None)
        self.fp8_group = group if group and self.ops.fp8_act_fusable(self.intermediate_size, group) else 0

    def forward(self, x: torch.Tensor | Fp8Rows) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.fp8_group:
            act = Fp8Rows(*self.act_and_mul(gate_up, fp8_group=self.fp8_group), self.fp8_group, gate_up.dtype)
        else:
            act = self.act_and_mul(gate_up)
        return self.tp.all_reduce(self.down_proj(act))
