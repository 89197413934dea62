"""A batch-invariant matmul for CUDA (Triton): ``y = x · Wᵀ (+ b)`` where each output
element is summed over K in one fixed order whatever the number of rows.

cuBLAS picks its algorithm by shape — split-K for a few rows, other tiles for many — so a
token's result depends on how many tokens share its step. Here the tile sizes depend only
on the weight's shape (and the GPU), never on M: a row's output is made by the same
program, tile by tile over K, alone, in a verify span, in a prefill chunk or in a CUDA
graph padded to a larger batch. No split-K: one program owns an output tile over all of K.
``M`` is not specialised by Triton (``do_not_specialize``), so M = 1 and M = 16 run the
same compiled kernel.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["M"])
def _matmul_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                   HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_valid = rm < M
    n_valid = rn < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_valid = (k0 + rk) < K
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
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=n_valid, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rm[:, None].to(tl.int64) * stride_om + rn[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_valid[:, None] & n_valid[None, :])


@functools.cache
def tiles(n: int, k: int, device: torch.device) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) for a weight ``[n, k]`` on
    ``device``: from the weight's shape and the GPU only, never from the rows. Column tiles
    narrow until a decode step's single row tile has about one program per SM; narrow
    tiles read deeper K tiles, so each program keeps enough bytes in flight (measured on an
    H200 at Llama-3.1-8B's shapes), as far as the GPU's shared memory allows."""
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
    return block_m, block_n, block_k, 4, stages


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` ``[..., K]`` · ``weight`` ``[N, K]``ᵀ (+ ``bias`` ``[N]``), in ``x``'s dtype."""
    n, k = weight.shape
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m:
        block_m, block_n, block_k, num_warps, num_stages = tiles(n, k, weight.device)
        interpreted = x.device.type != "cuda"
        _matmul_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, block_n))](
            x2, weight, bias if bias is not None else weight, out, m, n, k,
            x2.stride(0), weight.stride(0), out.stride(0),
            HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
            UPCAST=interpreted and x.dtype == torch.bfloat16, IEEE=x.dtype == torch.float32,
            num_warps=num_warps, num_stages=num_stages)
    return out.view(*x.shape[:-1], n)
