"""bf16 linears prepacked for oneDNN, the fast CPU path on AMX / AVX-512-BF16 machines.

Plain fp32 ``F.linear`` with a few rows is compute bound on a CPU, so 8 tokens cost
several times 1; prepacked bf16 projections cost about the time to read their weights,
for 1 token and for 8. Verifying k draft tokens then costs about what decoding one does,
which is what speculation on a CPU needs.
"""
from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn


@functools.cache
def bf16_packing_supported() -> bool:
    """True when this CPU runs oneDNN's bf16 GEMM natively (AMX or AVX-512 BF16)."""
    try:
        if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
            return False
        amx = getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()
        avx512_bf16 = getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)()
        if not (amx or avx512_bf16):
            return False
        # Smoke test: the op exists in this build and computes a linear.
        w, x = torch.randn(16, 32).bfloat16(), torch.randn(3, 32).bfloat16()
        packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
        got = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        return bool(torch.allclose(got.float(), (x.float() @ w.float().T), atol=0.1, rtol=0.02))
    except Exception:  # any missing piece: keep plain nn.Linear
        return False


class PackedLinear(nn.Module):
    """Drop-in for a bf16 ``nn.Linear`` on CPU with the weight in oneDNN's blocked layout."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach().to(torch.bfloat16).contiguous()
        self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(weight, None))
        bias = None if linear.bias is None else linear.bias.detach().to(torch.bfloat16)
        self.register_buffer("bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed_weight, self.bias,
                                                  "none", [], "")


def pack_linears(model: nn.Module) -> int:
    """Replace every ``nn.Linear`` of a bf16 CPU model by a PackedLinear; returns how many."""
    return replace_linears(model, PackedLinear)


def replace_linears(model: nn.Module, make: Callable[[nn.Linear], nn.Module]) -> int:
    """Replace every ``nn.Linear`` of ``model`` by ``make(linear)``; returns how many."""
    replaced = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, name, make(child))
                replaced += 1
    linears_replaced(model)
    return replaced


def linears_replaced(model: nn.Module) -> None:
    """Tell the modules that keep their own views of their linears' weights (MoE's experts
    stacked for the grouped GEMMs) that some linears became other layers."""
    for module in model.modules():
        if hasattr(module, "linears_replaced"):
            module.linears_replaced()
