"""A batch-invariant matmul for CUDA (Triton): ``y = x · Wᵀ (+ b)`` where each output
element is summed over K in one fixed order whatever the number of rows.

cuBLAS picks its algorithm by shape — split-K for a few rows, other tiles for many — so a
token's result depends on how many tokens share its step. Here the tile sizes depend only
on the weight's shape (and the GPU), never on M: a row's output is made by the same
program, tile by tile over K, alone, in a verify span, in a prefill chunk or in a CUDA
graph padded to a larger batch. K is split (into fixed chunks, summed in chunk order) only
as the weight's shape says, never by the rows.
``M`` is not specialised by Triton (``do_not_specialize``), so M = 1 and M = 16 run the
same compiled kernel.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["M"])
def _matmul_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, M, N, K, K_CHUNK, stride_xm, stride_wn, stride_om,
                   stride_os, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, SPLIT: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """One (row tile, column tile, K chunk). ``SPLIT``: write the chunk's fp32 partial sum
    at ``out_ptr + split * stride_os`` for ``_sum_splits_kernel``; else the finished tile."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    split = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_valid = rm < M
    n_valid = rn < N
    k_end = tl.minimum((split + 1) * K_CHUNK, K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(split * K_CHUNK, k_end, BLOCK_K):
        k_valid = (k0 + rk) < k_end
        a = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_xm + (k0 + rk)[None, :],
                    mask=m_valid[:, None] & k_valid[None, :], other=0.0)      # [BLOCK_M, BLOCK_K]
        b = tl.load(w_ptr + rn[None, :].to(tl.int64) * stride_wn + (k0 + rk)[:, None],
                    mask=n_valid[None, :] & k_valid[:, None], other=0.0)      # [BLOCK_K, BLOCK_N]
        if UPCAST:  # the interpreter cannot multiply bf16
            acc += tl.dot(a.to(tl.float32), b.to(tl.float32))
        elif IEEE:
            acc += tl.dot(a, b, input_precision="ieee")
        else:
            acc += tl.dot(a, b)
    out = out_ptr + split.to(tl.int64) * stride_os + rm[:, None].to(tl.int64) * stride_om + rn[None, :]
    mask = m_valid[:, None] & n_valid[None, :]
    if SPLIT:
        tl.store(out, acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn, mask=n_valid, other=0.0).to(tl.float32)[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M"])
def _sum_splits_kernel(part_ptr, bias_ptr, out_ptr, M, N, num_splits, stride_ps, stride_pm, stride_om,
                       HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr):
    """One row's column tile: the K chunks' partial sums added in chunk order (+ bias)."""
    row = tl.program_id(0).to(tl.int64)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_valid = rn < N
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for split in range(num_splits):
        acc += tl.load(part_ptr + split * stride_ps + row * stride_pm + rn, mask=n_valid, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=n_valid, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_om + rn, acc.to(out_ptr.dtype.element_ty), mask=n_valid)


@functools.cache
def tiles(n: int, k: int, device: torch.device) -> tuple[int, int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, K chunk) for a weight ``[n, k]``
    on ``device``: from the weight's shape and the GPU only, never from the rows. Column
    tiles narrow until a decode step's single row tile has about one program per SM;
    narrow tiles read deeper K tiles, so each program keeps enough bytes in flight, as far
    as the GPU's shared memory allows. Where the columns still give fewer than
    ``_PROGRAMS_PER_SM`` programs per SM, K is cut into fixed chunks (a K split set by the
    weight's shape, so every M sums the same chunks in the same order)."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        sms = props.multi_processor_count
        smem = getattr(props, "shared_memory_per_block_optin", 0) or 48 * 1024
    else:  # the interpreter: small tiles, any memory
        sms, smem = 4, 1 << 30
    block_m, block_n, stages = 64, 128, 3
    while block_n > 16 and triton.cdiv(n, block_n) < sms:
        block_n //= 2
    block_k = 256 if block_n <= 32 else 64
    while block_k > 32 and (block_m + block_n) * block_k * 2 * stages > smem - 4096:
        block_k //= 2
    splits = max(1, min(triton.cdiv(_PROGRAMS_PER_SM * sms, triton.cdiv(n, block_n)), k // _MIN_K_CHUNK))
    k_chunk = triton.cdiv(triton.cdiv(k, splits), block_k) * block_k
    return block_m, block_n, block_k, 4, stages, k_chunk


_PROGRAMS_PER_SM = 4
_MIN_K_CHUNK = 1024


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` ``[..., K]`` · ``weight`` ``[N, K]``ᵀ (+ ``bias`` ``[N]``), in ``x``'s dtype."""
    n, k = weight.shape
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m:
        block_m, block_n, block_k, num_warps, num_stages, k_chunk = tiles(n, k, weight.device)
        splits = triton.cdiv(k, k_chunk)
        part = torch.empty(splits, m, n, dtype=torch.float32, device=x.device) if splits > 1 else out
        interpreted = x.device.type != "cuda"
        has_bias = bias is not None
        bias = bias if has_bias else weight  # unread
        _matmul_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, block_n), splits)](
            x2, weight, bias, part, m, n, k, k_chunk, x2.stride(0), weight.stride(0), part.stride(-2),
            part.stride(0) if splits > 1 else 0, HAS_BIAS=has_bias, BLOCK_M=block_m, BLOCK_N=block_n,
            BLOCK_K=block_k, SPLIT=splits > 1, UPCAST=interpreted and x.dtype == torch.bfloat16,
            IEEE=x.dtype == torch.float32, num_warps=num_warps, num_stages=num_stages)
        if splits > 1:
            _sum_splits_kernel[(m, triton.cdiv(n, 1024))](
                part, bias, out, m, n, splits, part.stride(0), part.stride(1), out.stride(0),
                HAS_BIAS=has_bias, BLOCK_N=1024, num_warps=4)
    return out.view(*x.shape[:-1], n)
