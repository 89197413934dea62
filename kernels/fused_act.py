"""SiLU·mul over the merged gate/up projection (Triton).

Same semantics as ``reference.silu_and_mul``: row t of ``gate_up`` ``[num_tokens,
2 · intermediate]`` holds the gate in its first half and up in its second; the result is
``silu(gate) · up`` ``[num_tokens, intermediate]``. As torch does for bf16/fp16, silu is
computed in fp32 and rounded before the product, which is rounded once. The grid is
(token, column block), so a decode step of one token still spreads over several programs.

``fp8_group`` hands the down projection its input rounded to float8 as its own quantizer
would (``fused_norm``'s reasons), bit for bit: in groups, each column block rounds its
own. Per row, the row's largest magnitude is needed before any value rounds. For a few
rows (``ROW_SPLIT_MOST``: decode and verify steps) two launches spread the row: the
activation's column blocks write their values and each block's largest magnitude, then
a rounding pass over the same blocks takes the row's largest of those; one program
computing and rounding a row of 14,336 alone is what cost there. For more rows, one
program holds each row, as the quantizer's does (each block finding the row's largest
magnitude itself, from the row's activations computed again, was slower:
``benchmarks/results/quant_gpu/handed_fp8_2026-12-06/``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.kernels import fused_norm, pdl
from specserve.kernels.fused_norm import fp8_block, fp8_rows

_BLOCK = 1024
FP8_ROW_MOST = 16384  # the widest row rounded to float8 per row (``quant_matmul.ONE_PASS_MAX``'s)
ROW_SPLIT_MOST = 16  # up to this many rows, float8 per row takes the two-launch form (0: never; timed at 1 and 5)


def fp8_fusable(width: int, group: int) -> bool:
    """Whether the activation can hand ``width`` outputs rounded to float8 in groups of
    ``group`` (``fused_norm.fp8_fusable``): per row, a row of up to ``FP8_ROW_MOST``
    (beyond ``ROW_SPLIT_MOST`` rows one program holds it in registers; wider rows were
    never timed)."""
    return fused_norm.fp8_fusable(width, group) and (group < width or width <= FP8_ROW_MOST)


@triton.jit
def _act_mul(row_ptr, cols, size, GELU_TANH: tl.constexpr):
    """``act(gate) · up`` at ``cols`` of a row (gate, then up from ``size`` on; 0 past
    ``size``) in the row's dtype: act in fp32, rounded before the product, which is
    rounded once."""
    mask = cols < size
    gate = tl.load(row_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(row_ptr + size + cols, mask=mask, other=0.0).to(tl.float32)
    if GELU_TANH:  # 0.5 x (1 + tanh(√(2/π) (x + 0.044715 x³))), tanh(u) = 2σ(2u) − 1
        inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        act = gate / (1.0 + tl.exp(-2.0 * inner))
    else:
        act = gate / (1.0 + tl.exp(-gate))
    act = act.to(row_ptr.dtype.element_ty).to(tl.float32)
    return (act * up).to(row_ptr.dtype.element_ty)


@triton.jit
def _silu_and_mul_kernel(out_ptr, gate_up_ptr, size, stride_in, stride_out, scales_ptr, stride_s,
                         BLOCK: tl.constexpr, GELU_TANH: tl.constexpr, FP8_GROUP: tl.constexpr = 0,
                         ROW_PARTS: tl.constexpr = False, PDL: tl.constexpr = 0):
    """One row, one block of ``BLOCK`` columns. GELU_TANH: ``gelu_tanh(gate)`` (GeGLU) for silu.
    FP8_GROUP: ``out`` (float8) gets the block as ``fused_norm.fp8_rows`` rounds it.
    ROW_PARTS: ``out`` gets the block's values, and ``scales`` (fp32) at the block's index
    their largest magnitude, for ``_round_row_parts_kernel``."""
    pdl.wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    start = tl.program_id(1) * BLOCK
    v = _act_mul(gate_up_ptr + row * stride_in, start + tl.arange(0, BLOCK), size, GELU_TANH)
    if FP8_GROUP:
        fp8_rows(out_ptr + row * stride_out, scales_ptr + row * stride_s, v, start, size, BLOCK, FP8_GROUP, False,
                 0.0)
    else:
        cols = start + tl.arange(0, BLOCK)
        tl.store(out_ptr + row * stride_out + cols, v, mask=cols < size)
        if ROW_PARTS:  # and the block's largest magnitude, beside the row's other blocks'
            tl.store(scales_ptr + row * stride_s + tl.program_id(1), tl.max(tl.abs(v.to(tl.float32)), axis=0))


@triton.jit
def _round_row_parts_kernel(out_ptr, scales_ptr, values_ptr, parts_ptr, size, stride_s, stride_v, stride_p,
                            BLOCK: tl.constexpr, PARTS: tl.constexpr, PDL: tl.constexpr = 0):
    """One row, one block of ``BLOCK`` columns of ``values`` (``ROW_PARTS``' output) to
    float8 in one group, the row, whose largest magnitude is the largest of its blocks'
    (``parts``, PARTS a power of two at least their count, which is ⌈size / BLOCK⌉):
    ``fused_norm.fp8_rows``' rounding, bit for bit as one program holding the row does."""
    pdl.wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    start = tl.program_id(1) * BLOCK
    p = tl.arange(0, PARTS)
    amax = tl.max(tl.load(parts_ptr + row * stride_p + p, mask=p < tl.cdiv(size, BLOCK), other=0.0), axis=0)
    cols = start + tl.arange(0, BLOCK)
    v = tl.load(values_ptr + row * stride_v + cols, mask=cols < size, other=0.0)
    fp8_rows(out_ptr + row * size, scales_ptr + row * stride_s, v, start, size, BLOCK, BLOCK, True, amax)


def silu_and_mul(gate_up: torch.Tensor, fp8_group: int = 0):
    """``silu(gate) · up`` of gate_up ``[..., 2 · intermediate]``; a new tensor
    ``[..., intermediate]``. ``fp8_group``: instead, those values rounded to float8 per
    row and group of that many inputs (≥ intermediate: per row) ``[rows, intermediate]``,
    and their scales ``[rows, ⌈intermediate / group⌉]`` (``quant_matmul.quantize_rows``'
    values; ``fused_norm.fp8_fusable``)."""
    return _act_and_mul(gate_up, gelu_tanh=False, fp8_group=fp8_group)


def gelu_tanh_and_mul(gate_up: torch.Tensor, fp8_group: int = 0):
    """``gelu_tanh(gate) · up`` (``reference.gelu_tanh_and_mul``: GeGLU); ``fp8_group``
    as ``silu_and_mul``'s."""
    return _act_and_mul(gate_up, gelu_tanh=True, fp8_group=fp8_group)


def _act_and_mul(gate_up: torch.Tensor, gelu_tanh: bool, fp8_group: int = 0):
    if gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up's last dim must be even, got {gate_up.shape[-1]}")
    size = gate_up.shape[-1] // 2
    rows = gate_up.reshape(-1, 2 * size)
    rows = rows if rows.stride(-1) == 1 else rows.contiguous()
    scales = None
    block = min(_BLOCK, triton.next_power_of_2(size))
    split_row = size > _BLOCK and fp8_group >= size and rows.shape[0] <= ROW_SPLIT_MOST
    if fp8_group:
        if not fp8_fusable(size, fp8_group):
            raise ValueError(f"float8 rows of {size} inputs in groups of {fp8_group}: per row (up to "
                             f"{FP8_ROW_MOST}) or in groups of a power of two")
        scales = torch.empty(rows.shape[0], triton.cdiv(size, min(fp8_group, size)), dtype=torch.float32,
                             device=gate_up.device)
        block, fp8_group = fp8_block(size, fp8_group, _BLOCK)
        out = torch.empty(rows.shape[0], size, dtype=torch.float8_e4m3fn, device=gate_up.device)
    else:
        out = torch.empty(*gate_up.shape[:-1], size, dtype=gate_up.dtype, device=gate_up.device)
    if not (rows.shape[0] and size):
        return out if scales is None else (out, scales)
    launch = pdl.launch(gate_up.device)
    if split_row:  # float8 per row, over the row's blocks
        parts = triton.cdiv(size, _BLOCK)
        values = torch.empty(rows.shape[0], size, dtype=gate_up.dtype, device=gate_up.device)
        maxima = torch.empty(rows.shape[0], parts, dtype=torch.float32, device=gate_up.device)
        _silu_and_mul_kernel[(rows.shape[0], parts)](
            values, rows, size, rows.stride(0), size, maxima, parts, BLOCK=_BLOCK, GELU_TANH=gelu_tanh,
            ROW_PARTS=True, num_warps=4, **launch)
        _round_row_parts_kernel[(rows.shape[0], parts)](
            out, scales, values, maxima, size, scales.stride(0), size, parts, BLOCK=_BLOCK,
            PARTS=triton.next_power_of_2(parts), num_warps=4, **launch)
        return out, scales
    _silu_and_mul_kernel[(rows.shape[0], triton.cdiv(size, block))](
        out, rows, size, rows.stride(0), size, out if scales is None else scales,
        0 if scales is None else scales.stride(0), BLOCK=block, GELU_TANH=gelu_tanh, FP8_GROUP=fp8_group,
        num_warps=min(16, max(4, block // 1024)) if block >= 512 else 1, **launch)
    return out if scales is None else (out, scales)
