"""RMSNorm with an optional fused residual add (Triton), one program per row (handing
float8: one per slice of a row).

Same semantics as ``reference.rms_norm`` / ``reference.add_rms_norm``, rounding where
they round: the residual sum is rounded to the input dtype before it is normalised, the
normalised row (fp32) is rounded to the input dtype before it is scaled by the weight, and
the product is rounded once. On a GPU that matches torch's own bf16/fp16 rounding, so the
two paths differ only by the fp32 reduction order inside the norm.

Fusing the add into the next norm is the usual decoder-layer pattern: a layer hands back
``(hidden, residual)`` un-added and the next norm reads both, which saves the add's launch
and one round trip of the hidden states through memory.

Where the norm's one consumer is a float8 layer that rounds its input at run time (W8A8
with dynamic scales), the norm can hand it the rounded rows instead (``fp8_group``): the
values it would have written, rounded to float8 per row and group by the layer's own
quantizer's arithmetic (``quant_matmul.quantize_rows``), in the same launch. The two
variants are compiled apart, so a GPU may sum a row's squares in another order in each
(fp32 at the 8B widths on an H100: a value at a float8 midpoint then rounds the other
way); under the interpreter they agree bit for bit. On a GPU's decode step this saves
the quantizer's launch and the row's trip through memory. The rounding, not the bytes,
is what costs there, so each program sums the whole row and rounds a slice of it
(``benchmarks/results/quant_gpu/handed_fp8_2026-12-06/``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.kernels import pdl
from specserve.kernels.fp8 import round_e4m3


@triton.jit
def _rms_norm_kernel(
    out_ptr, new_residual_ptr, x_ptr, residual_ptr, weight_ptr, eps,
    stride_x, stride_r, stride_o, stride_n, scales_ptr, stride_s,
    HIDDEN: tl.constexpr, BLOCK: tl.constexpr, ADD_RESIDUAL: tl.constexpr, GEMMA: tl.constexpr,
    FP8_GROUP: tl.constexpr = 0, SLICE: tl.constexpr = 0, PDL: tl.constexpr = 0,
):
    """One row: ``out = weight · norm(x [+ residual])``, and the sum to ``new_residual``.
    GEMMA: ``(1 + weight) · norm(x)`` in fp32, rounded once (Gemma's norm). FP8_GROUP
    (a power of two dividing SLICE, or ≥ HIDDEN: per row): ``out`` (float8) gets the
    row's ``program_id(1)``-th slice of SLICE columns as ``fp8_rows`` rounds it, each
    program reading the whole row for its sum (and per row, its largest magnitude), and
    its slice's values again, so that the rounding, the costly part, spreads over the row."""
    pdl.wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < HIDDEN
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if ADD_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x_ptr.dtype.element_ty)
        if not FP8_GROUP:
            tl.store(new_residual_ptr + row * stride_n + cols, x, mask=mask)
    x = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / HIDDEN + eps)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    if FP8_GROUP:
        start = tl.program_id(1) * SLICE
        part = start + tl.arange(0, SLICE)
        inside = part < HIDDEN
        xs = tl.load(x_ptr + row * stride_x + part, mask=inside, other=0.0)
        if ADD_RESIDUAL:
            rs = tl.load(residual_ptr + row * stride_r + part, mask=inside, other=0.0)
            xs = (xs.to(tl.float32) + rs.to(tl.float32)).to(x_ptr.dtype.element_ty)
            tl.store(new_residual_ptr + row * stride_n + part, xs, mask=inside)
        vs = _weighted(xs.to(tl.float32), rstd, tl.load(weight_ptr + part, mask=inside, other=0.0), GEMMA,
                       x_ptr.dtype.element_ty)
        if FP8_GROUP >= HIDDEN:
            amax = tl.max(tl.abs(_weighted(x, rstd, weight, GEMMA, x_ptr.dtype.element_ty).to(tl.float32)), axis=0)
            fp8_rows(out_ptr + row * stride_o, scales_ptr + row * stride_s, vs, start, HIDDEN, SLICE, SLICE, True,
                     amax)
        else:
            fp8_rows(out_ptr + row * stride_o, scales_ptr + row * stride_s, vs, start, HIDDEN, SLICE, FP8_GROUP,
                     False, 0.0)
    else:
        tl.store(out_ptr + row * stride_o + cols, _weighted(x, rstd, weight, GEMMA, out_ptr.dtype.element_ty),
                 mask=mask)


@triton.jit
def _weighted(x, rstd, weight, GEMMA: tl.constexpr, dtype: tl.constexpr):
    """``weight · x · rstd`` in ``dtype``: ``x · rstd`` rounded to it first, but for Gemma
    (``(1 + weight) · x · rstd`` in fp32, rounded once)."""
    weight = weight.to(tl.float32)
    if GEMMA:
        normed = x * rstd
        weight = weight + 1.0
    else:
        normed = (x * rstd).to(dtype).to(tl.float32)
    return (normed * weight).to(dtype)


@triton.jit
def fp8_rows(q_ptr, s_ptr, v, start, size, BLOCK: tl.constexpr, GROUP: tl.constexpr, ROW_AMAX: tl.constexpr,
             amax):
    """``v``, a row's ``BLOCK`` values from column ``start`` on (those from ``size`` on
    are padding, 0), to float8 at ``q_ptr`` + column, in groups of ``GROUP`` (a power of
    two dividing BLOCK and ``start``), each scaled so that its largest magnitude is 448,
    the scales at ``s_ptr`` + group: ``quant_matmul._quantize_kernel``'s values, bit for
    bit. ``ROW_AMAX``: ``v`` is a block of one group, the row, whose largest magnitude is
    ``amax`` (its scale stored by the row's first block)."""
    cols = start + tl.arange(0, BLOCK)
    if ROW_AMAX:
        scale = tl.maximum(tl.math.div_rn(amax, 448.0), 1e-12)
        q = round_e4m3(tl.clamp(tl.math.div_rn(v.to(tl.float32), scale), -448.0, 448.0))
        tl.store(q_ptr + cols, q.to(q_ptr.dtype.element_ty), mask=cols < size)
        first = tl.arange(0, 1)
        tl.store(s_ptr + first, scale + tl.zeros([1], dtype=tl.float32), mask=start + first == 0)
    else:
        v = tl.reshape(v.to(tl.float32), (BLOCK // GROUP, GROUP))
        scale = tl.maximum(tl.math.div_rn(tl.max(tl.abs(v), axis=1), 448.0), 1e-12)
        q = round_e4m3(tl.clamp(tl.math.div_rn(v, scale[:, None]), -448.0, 448.0))
        tl.store(q_ptr + cols, tl.reshape(q, (BLOCK,)).to(q_ptr.dtype.element_ty), mask=cols < size)
        groups = tl.arange(0, BLOCK // GROUP)
        tl.store(s_ptr + start // GROUP + groups, scale, mask=start + groups * GROUP < size)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, fp8_group: int = 0):
    """``weight · x / rms(x)`` over the last dim of x ``[..., hidden]``; a new tensor.
    ``fp8_group``: instead, those values rounded to float8 per row and group of that many
    inputs (≥ hidden: per row), and their scales ``[rows, ⌈hidden / group⌉]``
    (``quant_matmul.quantize_rows``' values; ``fp8_fusable``)."""
    out, _, scales = _launch(x, None, weight, eps, fp8_group=fp8_group)
    return (out, scales) if fp8_group else out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float, fp8_group: int = 0):
    """``(rms_norm(x + residual), x + residual)`` in one launch; x and residual
    ``[num_tokens, hidden]`` of one dtype. Both results are new tensors. ``fp8_group``:
    the first is ``rms_norm``'s (float8 values, scales)."""
    _check_residual(x, residual)
    out, new_residual, scales = _launch(x, residual, weight, eps, fp8_group=fp8_group)
    return ((out, scales) if fp8_group else out), new_residual


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, fp8_group: int = 0):
    """``reference.gemma_rms_norm``: ``(1 + weight) · x / rms(x)`` in fp32, rounded once."""
    out, _, scales = _launch(x, None, weight, eps, gemma=True, fp8_group=fp8_group)
    return (out, scales) if fp8_group else out


def gemma_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float, fp8_group: int = 0):
    """``(gemma_rms_norm(x + residual), x + residual)`` in one launch."""
    _check_residual(x, residual)
    out, new_residual, scales = _launch(x, residual, weight, eps, gemma=True, fp8_group=fp8_group)
    return ((out, scales) if fp8_group else out), new_residual


FP8_SLICE = 1024  # columns a program rounds to float8 (a group's, where larger)


def fp8_fusable(width: int, group: int) -> bool:
    """Whether a norm or activation can hand float8 rows of ``width`` in groups of
    ``group`` inputs: per row, or in groups of a power of two (``fp8_rows``)."""
    return group >= width or (group > 0 and group & (group - 1) == 0)


def fp8_block(width: int, group: int, cap: int | None = None) -> tuple[int, int]:
    """The columns a program holds of float8 rows of ``width`` in groups of ``group``
    (``fp8_fusable``), and the group as ``fp8_rows`` sees it: per row, the whole row in
    one block (its padding is 0, which moves no largest magnitude); else up to ``cap``
    columns (None: the whole row) and at least a group."""
    block = triton.next_power_of_2(width)
    if group >= width:
        return block, block
    return (block if cap is None else max(group, min(cap, block))), group


def _check_residual(x, residual) -> None:
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} does not match "
                         f"x {tuple(x.shape)} {x.dtype}")


def _launch(x, residual, weight, eps, gemma: bool = False, fp8_group: int = 0):
    hidden = x.shape[-1]
    if weight.shape != (hidden,):
        raise ValueError(f"weight {tuple(weight.shape)} does not match hidden size {hidden}")
    rows = _rows(x)
    scales = None
    block = triton.next_power_of_2(hidden)
    if fp8_group:
        if not fp8_fusable(hidden, fp8_group) or weight.dtype != x.dtype:
            raise ValueError(f"float8 rows of {hidden} inputs in groups of {fp8_group} ({x.dtype} input, "
                             f"{weight.dtype} weight): per row or in groups of a power of two, in one dtype")
        scales = torch.empty(rows.shape[0], triton.cdiv(hidden, min(fp8_group, hidden)), dtype=torch.float32,
                             device=x.device)
        block, fp8_group = fp8_block(hidden, fp8_group)
        out = torch.empty(rows.shape, dtype=torch.float8_e4m3fn, device=x.device)
    else:
        out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    new_residual = out if residual is None else torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if rows.shape[0] == 0:
        return out, new_residual, scales
    residual_rows = _rows(residual) if residual is not None else rows
    # Rounding to float8, a row's programs take a slice each (of whole groups).
    part = block if not fp8_group else min(block, max(FP8_SLICE, fp8_group if fp8_group < hidden else 0))
    _rms_norm_kernel[(rows.shape[0], triton.cdiv(hidden, part))](
        out, new_residual, rows, residual_rows, weight.contiguous(), eps,
        rows.stride(0), residual_rows.stride(0), hidden, hidden, out if scales is None else scales,
        0 if scales is None else scales.stride(0),
        HIDDEN=hidden, BLOCK=block, ADD_RESIDUAL=residual is not None, GEMMA=gemma, FP8_GROUP=fp8_group,
        SLICE=part, num_warps=min(max(block // 256, 1), 8), **pdl.launch(x.device))
    return out, new_residual, scales


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as ``[rows, hidden]`` with unit column stride (a view when it can be)."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()
