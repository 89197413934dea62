"""Grouped expert GEMMs for a mixture of experts (Triton): every routed (token, expert)
pair of a step in one launch per projection.

The pairs are sorted by expert and each expert's run padded to a multiple of ``BLOCK_M``
(``align``), so every program multiplies a block of rows that share one expert's
weights: it reads only the experts some token chose, each once per block. The sort and
the block table are made on the device, sized by a static bound (``pairs + experts ·
(BLOCK_M − 1)`` rows), with no host sync: a step CUDA graphs can capture. Blocks past the
used length find no expert and return at once.

``moe_forward`` is the SwiGLU expert MLP: gate/up for every pair into its padded row,
SiLU·mul, then down with each pair's routing weight, written at the pair's own row
(token · k + j) and summed over the token's k pairs.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.kernels.paged_attention import _dot

BLOCK_M = 16


@triton.jit
def _grouped_gemm_kernel(a_ptr, w_ptr, out_ptr, rows_ptr, block_expert_ptr, scale_ptr,
                         num_pairs, num_experts, top_k, N, K,
                         stride_a, stride_we, stride_wn, stride_out,
                         FIRST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, UPCAST_DOT: tl.constexpr, IEEE_DOT: tl.constexpr):
    """One block of BLOCK_M sorted rows (one expert) by BLOCK_N output columns.

    FIRST: A's rows are the tokens (pair // top_k), the output rows the padded positions;
    otherwise A's rows are the padded positions and each output row is the pair's own,
    scaled by its routing weight."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert >= num_experts:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(rows_ptr + offs_m).to(tl.int64)
    valid = pairs < num_pairs
    if FIRST:
        a_rows = pairs // top_k
        out_rows = offs_m.to(tl.int64)
    else:
        a_rows = offs_m.to(tl.int64)
        out_rows = pairs
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        a = tl.load(a_ptr + a_rows[:, None] * stride_a + ks[None, :],
                    mask=valid[:, None] & (ks[None, :] < K), other=0.0)
        w = tl.load(w_ptr + expert * stride_we + offs_n[None, :] * stride_wn + ks[:, None],
                    mask=(offs_n[None, :] < N) & (ks[:, None] < K), other=0.0)
        acc += _dot(a, w, UPCAST_DOT, IEEE_DOT)
    if not FIRST:
        acc *= tl.load(scale_ptr + pairs, mask=valid, other=0.0).to(tl.float32)[:, None]
    tl.store(out_ptr + out_rows[:, None] * stride_out + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=valid[:, None] & (offs_n[None, :] < N))


def align(experts: torch.Tensor, num_experts: int, block_m: int = BLOCK_M) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows ``[P]``: pair indices sorted by expert, each expert's run padded to a
    multiple of ``block_m`` with the sentinel ``pairs``; the expert of each block
    ``[P // block_m]``, ``num_experts`` past the used length), all on the device."""
    flat = experts.flatten()
    pairs = flat.numel()
    device = flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device).scatter_add_(
        0, flat, torch.ones_like(flat))  # (bincount would wait for the device)
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)
    sorted_experts = flat[order]
    first_of_expert = counts.cumsum(0) - counts
    dest = (ends - padded)[sorted_experts] + torch.arange(pairs, device=device) - first_of_expert[sorted_experts]
    size = -(-(pairs + num_experts * (block_m - 1)) // block_m) * block_m
    rows = torch.full((size,), pairs, dtype=torch.int64, device=device)
    rows[dest] = order
    block_starts = torch.arange(0, size, block_m, device=device)
    block_expert = torch.searchsorted(ends, block_starts, right=True)  # num_experts: unused block
    return rows, block_expert


def grouped_gemm(a: torch.Tensor, weights: torch.Tensor, rows: torch.Tensor, block_expert: torch.Tensor,
                 num_pairs: int, top_k: int, out: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """``out[row] = a[row'] @ weights[expert].T`` for each sorted row (see the kernel's
    FIRST: ``scale`` None); with ``scale``, the second form."""
    first = scale is None
    num_experts, n, k = weights.shape
    block_n = min(64, triton.next_power_of_2(n))
    block_k = min(64, max(16, triton.next_power_of_2(k)))
    grid = (block_expert.numel(), triton.cdiv(n, block_n))
    _grouped_gemm_kernel[grid](
        a, weights, out, rows, block_expert, scale if scale is not None else a,
        num_pairs, num_experts, top_k, n, k, a.stride(0), weights.stride(0), weights.stride(1), out.stride(0),
        FIRST=first, BLOCK_M=BLOCK_M, BLOCK_N=max(16, block_n), BLOCK_K=block_k,
        UPCAST_DOT=a.device.type == "cpu", IEEE_DOT=a.dtype == torch.float32)
    return out


def moe_forward(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                experts: torch.Tensor, silu_and_mul) -> torch.Tensor:
    """The routed SwiGLU experts of ``x`` ``[T, H]``: gate/up ``w13`` ``[E, 2I, H]``, down
    ``w2`` ``[E, H, I]``, each token's ``experts`` / routing ``weights`` ``[T, k]``."""
    tokens, top_k = experts.shape
    num_experts = w13.shape[0]
    x = x if x.stride(-1) == 1 else x.contiguous()
    rows, block_expert = align(experts, num_experts)
    pairs = tokens * top_k
    gate_up = torch.empty(rows.numel(), w13.shape[1], dtype=x.dtype, device=x.device)
    grouped_gemm(x, w13, rows, block_expert, pairs, top_k, gate_up)
    act = silu_and_mul(gate_up)
    out = torch.empty(pairs, w2.shape[1], dtype=x.dtype, device=x.device)
    grouped_gemm(act, w2, rows, block_expert, pairs, top_k, out, scale=weights.flatten().contiguous())
    return out.view(tokens, top_k, -1).sum(dim=1)
