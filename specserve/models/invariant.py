"""Batch-invariant linear layers, for the deterministic mode (``EngineConfig.deterministic``).

A token's logits must not depend on what else shares its step — how many requests, whether
its row is a decode row, a verify row or part of a prefill chunk, the draft length k.
Library GEMMs choose their algorithm (GEMV or GEMM, split-K, tile sizes) by the number of
rows, so in bf16 a verify pass of 1 + k tokens rounds differently from a 1-token decode.
``InvariantLinear`` sums each output element in one fixed order for every M: on a CPU with
the C++ kernel (``kernels/cpu_gemm.cpp``, weights packed once), on CUDA with a Triton
matmul whose tiles depend only on the weight's shape (``kernels/matmul.py``).
"""
from __future__ import annotations

import torch
from torch import nn

from specserve.kernels import cpu_ops
from specserve.models.packed_linear import replace_linears
from specserve.models.quantized import QuantLinear


class InvariantLinear(nn.Module):
    """Drop-in for an ``nn.Linear`` whose rows do not see each other's numerics."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.on_cpu = weight.device.type == "cpu"
        if self.on_cpu:
            self.register_buffer("packed_weight", cpu_ops.pack_linear_weight(weight))
        else:
            # lazy: triton, only on a GPU (or under the Triton interpreter in tests)
            from specserve.kernels import matmul

            self._matmul = matmul
            self.register_buffer("weight", weight.contiguous())
        bias = None if linear.bias is None else linear.bias.detach()
        if bias is not None and self.on_cpu:
            bias = bias.float()  # the C++ kernel adds it in fp32 before rounding once
        self.register_buffer("bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.on_cpu:
            return cpu_ops.linear_invariant(x, self.packed_weight, self.bias, self.out_features)
        return self._matmul.linear(x, self.weight, self.bias)


def make_batch_invariant(model: nn.Module) -> int:
    """Replace every ``nn.Linear`` of ``model`` by an InvariantLinear; returns how many.
    Modules that keep their own views of linear weights (MoE's stacked experts for the
    grouped GEMMs) are told through ``linears_replaced()``. Quantized CPU layers keep their
    integer kernel for any number of rows (``QuantLinear.dequant_rows``)."""
    for module in model.modules():
        if isinstance(module, QuantLinear):
            module.dequant_rows = 0
    return replace_linears(model, InvariantLinear)
