"""SiLU·mul over the merged gate/up projection (Triton).

Same semantics as ``reference.silu_and_mul``: row t of ``gate_up`` ``[num_tokens,
2 · intermediate]`` holds the gate in its first half and up in its second; the result is
``silu(gate) · up`` ``[num_tokens, intermediate]``. As torch does for bf16/fp16, silu is
computed in fp32 and rounded before the product, which is rounded once. The grid is
(token, column block), so a decode step of one token still spreads over several programs.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(out_ptr, gate_up_ptr, size, stride_in, stride_out, BLOCK: tl.constexpr,
                         GELU_TANH: tl.constexpr):
    """One row, one block of ``BLOCK`` columns. GELU_TANH: ``gelu_tanh(gate)`` (GeGLU) for silu."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < size
    gate = tl.load(gate_up_ptr + row * stride_in + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * stride_in + size + cols, mask=mask, other=0.0).to(tl.float32)
    if GELU_TANH:  # 0.5 x (1 + tanh(√(2/π) (x + 0.044715 x³))), tanh(u) = 2σ(2u) − 1
        inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        act = gate / (1.0 + tl.exp(-2.0 * inner))
    else:
        act = gate / (1.0 + tl.exp(-gate))
    act = act.to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) · up`` of gate_up ``[..., 2 · intermediate]``; a new tensor
    ``[..., intermediate]``."""
    return _act_and_mul(gate_up, gelu_tanh=False)


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(gate) · up`` (``reference.gelu_tanh_and_mul``: GeGLU)."""
    return _act_and_mul(gate_up, gelu_tanh=True)


def _act_and_mul(gate_up: torch.Tensor, gelu_tanh: bool) -> torch.Tensor:
    if gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up's last dim must be even, got {gate_up.shape[-1]}")
    size = gate_up.shape[-1] // 2
    rows = gate_up.reshape(-1, 2 * size)
    rows = rows if rows.stride(-1) == 1 else rows.contiguous()
    out = torch.empty(*gate_up.shape[:-1], size, dtype=gate_up.dtype, device=gate_up.device)
    if rows.shape[0] == 0 or size == 0:
        return out
    block = min(_BLOCK, triton.next_power_of_2(size))
    _silu_and_mul_kernel[(rows.shape[0], triton.cdiv(size, block))](
        out, rows, size, rows.stride(0), size, BLOCK=block, GELU_TANH=gelu_tanh,
        num_warps=4 if block >= 512 else 1)
    return out
