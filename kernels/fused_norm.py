"""RMSNorm with an optional fused residual add (Triton), one program per row.

Same semantics as ``reference.rms_norm`` / ``reference.add_rms_norm``, rounding where
they round: the residual sum is rounded to the input dtype before it is normalised, the
normalised row (fp32) is rounded to the input dtype before it is scaled by the weight, and
the product is rounded once. On a GPU that matches torch's own bf16/fp16 rounding, so the
two paths differ only by the fp32 reduction order inside the norm.

Fusing the add into the next norm is the usual decoder-layer pattern: a layer hands back
``(hidden, residual)`` un-added and the next norm reads both, which saves the add's launch
and one round trip of the hidden states through memory.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    out_ptr, new_residual_ptr, x_ptr, residual_ptr, weight_ptr, eps,
    stride_x, stride_r, stride_o, stride_n,
    HIDDEN: tl.constexpr, BLOCK: tl.constexpr, ADD_RESIDUAL: tl.constexpr, GEMMA: tl.constexpr,
):
    """One row: ``out = weight · norm(x [+ residual])``, and the sum to ``new_residual``.
    GEMMA: ``(1 + weight) · norm(x)`` in fp32, rounded once (Gemma's norm)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < HIDDEN
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if ADD_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(new_residual_ptr + row * stride_n + cols, x, mask=mask)
    x = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / HIDDEN + eps)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if GEMMA:
        normed = x * rstd
        weight = weight + 1.0
    else:
        normed = (x * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (normed * weight).to(out_ptr.dtype.element_ty),
             mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight · x / rms(x)`` over the last dim of x ``[..., hidden]``; a new tensor."""
    return _launch(x, None, weight, eps)[0]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual), x + residual)`` in one launch; x and residual
    ``[num_tokens, hidden]`` of one dtype. Both results are new tensors."""
    _check_residual(x, residual)
    return _launch(x, residual, weight, eps)


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``reference.gemma_rms_norm``: ``(1 + weight) · x / rms(x)`` in fp32, rounded once."""
    return _launch(x, None, weight, eps, gemma=True)[0]


def gemma_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(gemma_rms_norm(x + residual), x + residual)`` in one launch."""
    _check_residual(x, residual)
    return _launch(x, residual, weight, eps, gemma=True)


def _check_residual(x, residual) -> None:
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} does not match "
                         f"x {tuple(x.shape)} {x.dtype}")


def _launch(x, residual, weight, eps, gemma: bool = False):
    hidden = x.shape[-1]
    if weight.shape != (hidden,):
        raise ValueError(f"weight {tuple(weight.shape)} does not match hidden size {hidden}")
    rows = _rows(x)
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    new_residual = out if residual is None else torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if rows.shape[0] == 0:
        return out, new_residual
    residual_rows = _rows(residual) if residual is not None else rows
    block = triton.next_power_of_2(hidden)
    _rms_norm_kernel[(rows.shape[0],)](
        out, new_residual, rows, residual_rows, weight.contiguous(), eps,
        rows.stride(0), residual_rows.stride(0), hidden, hidden,
        HIDDEN=hidden, BLOCK=block, ADD_RESIDUAL=residual is not None, GEMMA=gemma,
        num_warps=min(max(block // 256, 1), 8))
    return out, new_residual


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as ``[rows, hidden]`` with unit column stride (a view when it can be)."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()
