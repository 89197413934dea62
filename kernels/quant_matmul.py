"""Triton GEMMs over quantized weights for CUDA: ``y = x · Wᵀ`` with W kept as stored.

* ``fp8_linear``: W in float8 (e4m3) with fp32 scales over blocks of ``(BN, BK)`` weights
  (a block-wise ``weight_scale_inv`` of 128 × 128, or one per row: BK ≥ K). The
  activations come either in the model's dtype (W8A16) or in float8 with fp32 scales per
  row and group of ``AK`` inputs (W8A8: per token, AK ≥ K, or per token and 128-group as
  DeepSeek-V3 and Qwen3 FP8 checkpoints run), or in the model's dtype to be rounded to
  float8 so first (``quantize``, by ``quantize_rows``). Each K tile lies inside one scale
  block, so a tile's dot product is scaled once: ``acc += (a · b) · sa · sw``.
* ``int4_linear``: W in 4 bits, eight inputs per int32 in chunks of 128 inputs (``pack_int4``:
  input 128t + 16j + c in nibble j of the chunk's word c), with a scale and an integer
  zero point per row and group of ``G`` inputs (AWQ's and GPTQ's asymmetric form;
  symmetric GPTQ is zero 8). The tile is dequantised in fp32, ``(q − z) · s``, exact,
  rounded to the activations' dtype (what a dequantised copy of the weights would hold)
  and multiplied there.

A single row (a decode step's, outside ``invariant``) of W8A16 or 4-bit goes through
``_fp8_row_kernel`` or ``_int4_row_kernel`` instead: products on the CUDA cores in fp32,
the weights never rounded. Float8 inputs at a decode or verify step's few rows go through
``_fp8_left_kernel``: the same products with the weights as the left operand.

Tiles along N and K depend on the weight's shape and the GPU. At a decode step's few rows
one column tile per program leaves most SMs idle, or each with too few bytes in flight, so
K is split among programs (``plan``): each writes its fp32 partial sums, which are added in
a fixed order, bias last, and rounded, by the last of the tile's programs to finish
(``_finish``, 4-bit weights, with the layer's tile counters) or by a second launch
(``_sum_splits``). With ``invariant`` K is never split and the row tile is fixed, so a
row's result is the same alone or in any batch (``--deterministic``).

On Hopper the launches use programmatic dependent launch (``kernels/pdl.py``) where the
kind's tiles allow it, and W8A8 GEMMs prefetch their first weights before their wait.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from specserve.kernels import pdl
from specserve.kernels.fp8 import round_e4m3

@triton.jit
def _store(total, offs, cols, mask, bias_ptr, out_ptr, HAS_BIAS: tl.constexpr):
    """``total`` (+ the bias) into ``out`` at ``offs``, rounded to its dtype."""
    if HAS_BIAS:
        total += tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, total.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _finish(acc, offs, cols, mask, bias_ptr, out_ptr, part_ptr, count_ptr, MN,
            HAS_BIAS: tl.constexpr, SPLIT_SUM: tl.constexpr):
    """A program's fp32 sums ``acc`` for the outputs at ``offs`` of ``out`` ``[M, N]`` (row
    · stride + column; ``cols`` their columns, ``mask`` the valid ones). K whole
    (``SPLIT_SUM`` 0): + the bias, rounded to out's dtype. K split: the partial sums go to
    ``part`` ``[split, M, N]`` (fp32) at this program's split, to be added in the order of
    the splits, bias last: by a second launch (``_sum_splits``, SPLIT_SUM 1), or (SPLIT_SUM
    2) by the last of the output tile's programs to finish, which the tile's counter names.
    Each program counts itself once its partial sums are stored (release); the last reads
    them all from L2 after its count (acquire), and sets the counter back to 0 for the next
    launch. The sums are the same either way, and the same on every run."""
    if SPLIT_SUM == 0:
        _store(acc, offs, cols, mask, bias_ptr, out_ptr, HAS_BIAS)
    else:
        tl.store(part_ptr + tl.program_id(2).to(tl.int64) * MN + offs, acc, mask=mask)
        if SPLIT_SUM == 2:
            counter = count_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
            tl.debug_barrier()  # every thread's stores come before the count
            if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == tl.num_programs(2) - 1:
                split = part_ptr + offs
                total = tl.load(split, mask=mask, other=0.0, cache_modifier=".cg")
                for _ in range(1, tl.num_programs(2)):
                    split += MN
                    total += tl.load(split, mask=mask, other=0.0, cache_modifier=".cg")
                _store(total, offs, cols, mask, bias_ptr, out_ptr, HAS_BIAS)
                tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")


@triton.jit
def _fp8_lines(w_ptr, rn, N, K, k_start, K_SPLIT, stride_wn, INPUTS: tl.constexpr):
    """What a float8 GEMM's program prefetches before its PDL wait, in its columns' rows of
    the weights ``[N, K]`` (a byte each): from the line its share of K starts in, as many
    lines as its first INPUTS inputs take (``Tiles.prefetch`` K tiles), none past its
    share's last byte."""
    return pdl.row_lines(w_ptr, rn, stride_wn, k_start, N - 1, tl.minimum(K, k_start + K_SPLIT) - 1,
                         (INPUTS + 127) // 128)


@triton.jit
def _int4_lines(w_ptr, rn, N, K, k_start, K_SPLIT, stride_wn, INPUTS: tl.constexpr):
    """``_fp8_lines`` for packed 4-bit weights (``stride_wn`` int32 words a row, two
    inputs a byte): the lines of its first INPUTS inputs (one line for a K tile's 64 bytes)."""
    return pdl.row_lines(w_ptr, rn, 4 * stride_wn, k_start // 2, N - 1, (tl.minimum(K, k_start + K_SPLIT) - 1) // 2,
                         (INPUTS // 2 + 127) // 128)


@triton.jit(do_not_specialize=["M"])
def _fp8_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, bias_ptr, out_ptr, part_ptr, count_ptr, M, N, K, K_SPLIT,
                stride_xm, stride_xsm, stride_wn, stride_wsn, stride_om, stride_os,
                AK, BN, BK,
                A_FP8: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT_SUM: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
                PDL: tl.constexpr = 0, PREFETCH: tl.constexpr = 0):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_valid = rm < M
    n_valid = rn < N
    k_start = tl.program_id(2) * K_SPLIT
    if PREFETCH:  # (the weights: no kernel of the step writes them)
        pdl.prefetch_l2(_fp8_lines(w_ptr, rn, N, K, k_start, K_SPLIT, stride_wn, PREFETCH * BLOCK_K))
    pdl.wait(PDL)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_start, tl.minimum(k_start + K_SPLIT, K), BLOCK_K):
        k_valid = (k0 + rk) < K
        a = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_xm + (k0 + rk)[None, :],
                    mask=m_valid[:, None] & k_valid[None, :], other=0.0)      # [BLOCK_M, BLOCK_K]
        b = tl.load(w_ptr + rn[None, :].to(tl.int64) * stride_wn + (k0 + rk)[:, None],
                    mask=n_valid[None, :] & k_valid[:, None], other=0.0)      # [BLOCK_K, BLOCK_N]
        ws = tl.load(ws_ptr + (rn // BN).to(tl.int64) * stride_wsn + k0 // BK, mask=n_valid, other=0.0)
        if UPCAST:  # the interpreter has no float8 or bf16 products; fp32 holds them exactly
            part = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        elif A_FP8:
            part = tl.dot(a, b)
        elif IEEE:
            part = tl.dot(a, b.to(tl.float32), input_precision="ieee")
        else:  # float8 values are exact in bf16 and fp16
            part = tl.dot(a, b.to(a.dtype))
        if A_FP8:
            xs = tl.load(xs_ptr + rm.to(tl.int64) * stride_xsm + k0 // AK, mask=m_valid, other=0.0)
            part = part * xs[:, None]
        acc += part * ws[None, :]
    _finish(acc, rm[:, None].to(tl.int64) * stride_om + rn[None, :], rn[None, :], m_valid[:, None] & n_valid[None, :],
            bias_ptr, out_ptr, part_ptr, count_ptr, stride_os, HAS_BIAS, SPLIT_SUM)


@triton.jit(do_not_specialize=["M"])
def _fp8_left_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, bias_ptr, out_ptr, part_ptr, count_ptr, M, N, K, K_SPLIT,
                     stride_xm, stride_xsm, stride_wn, stride_wsn, stride_om, stride_os,
                     AK, BN, BK,
                     HAS_BIAS: tl.constexpr, SPLIT_SUM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
                     PDL: tl.constexpr = 0, PREFETCH: tl.constexpr = 0):
    """W8A8 at a decode or verify step's few rows: ``_fp8_kernel``'s sums, the weights on
    the product's left (outᵀ = W · xᵀ, a ``[BLOCK_N, BLOCK_M]`` tile). With x on the left
    a product has the rows' 16 as its M, which Hopper runs as mma.sync with the weights
    staged through shared memory; with W there M is the column tile, the shape of a wgmma
    (vLLM's CUTLASS FP8 GEMM swaps its operands at small M for the same reason; measured in
    ``benchmarks/results/quant_gpu/swap_ab_2026-12-05``). Its inputs come rounded to float8
    (``quantize_rows``): rounding each K tile here instead, in every program, puts a
    reduction and a division per input inside the streaming loop, and measured far slower
    (``benchmarks/results/quant_gpu/fused_rounding_2026-12-05``)."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_valid = rm < M
    n_valid = rn < N
    k_start = tl.program_id(2) * K_SPLIT
    if PREFETCH:  # (the weights: no kernel of the step writes them)
        pdl.prefetch_l2(_fp8_lines(w_ptr, rn, N, K, k_start, K_SPLIT, stride_wn, PREFETCH * BLOCK_K))
    pdl.wait(PDL)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(k_start, tl.minimum(k_start + K_SPLIT, K), BLOCK_K):
        k_valid = (k0 + rk) < K
        w = tl.load(w_ptr + rn[:, None].to(tl.int64) * stride_wn + (k0 + rk)[None, :],
                    mask=n_valid[:, None] & k_valid[None, :], other=0.0)      # [BLOCK_N, BLOCK_K]
        xt = tl.load(x_ptr + rm[None, :].to(tl.int64) * stride_xm + (k0 + rk)[:, None],
                     mask=m_valid[None, :] & k_valid[:, None], other=0.0)     # [BLOCK_K, BLOCK_M]
        xs = tl.load(xs_ptr + rm.to(tl.int64) * stride_xsm + k0 // AK, mask=m_valid, other=0.0)
        if UPCAST:  # (the interpreter: fp32 holds float8 products exactly)
            part = tl.dot(w.to(tl.float32), xt.to(tl.float32), input_precision="ieee")
        else:
            part = tl.dot(w, xt)
        ws = tl.load(ws_ptr + (rn // BN).to(tl.int64) * stride_wsn + k0 // BK, mask=n_valid, other=0.0)
        acc += part * ws[:, None] * xs[None, :]
    _finish(acc, rm[None, :].to(tl.int64) * stride_om + rn[:, None], rn[:, None], m_valid[None, :] & n_valid[:, None],
            bias_ptr, out_ptr, part_ptr, count_ptr, stride_os, HAS_BIAS, SPLIT_SUM)


@triton.jit(do_not_specialize=["M"])
def _fp8_row_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, bias_ptr, out_ptr, part_ptr, count_ptr, M, N, K, K_SPLIT,
                    stride_xm, stride_xsm, stride_wn, stride_wsn, stride_om, stride_os,
                    AK, BN, BK,
                    HAS_BIAS: tl.constexpr, SPLIT_SUM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
                    PDL: tl.constexpr = 0, PREFETCH: tl.constexpr = 0):
    """One row of W8A16 without tensor cores (``_int4_row_kernel``'s reasons): each program
    widens its ``[BLOCK_N, BLOCK_K]`` float8 weights to fp32, multiplies them by the row and
    sums along K, a K tile at a time, scaled by the weights' block. (Float8 inputs go to the
    tensor cores as they are, in ``_fp8_left_kernel``, which measured faster.)"""
    row = tl.program_id(0).to(tl.int64)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    n_valid = rn < N
    k_start = tl.program_id(2) * K_SPLIT
    if PREFETCH:  # (the weights: no kernel of the step writes them)
        pdl.prefetch_l2(_fp8_lines(w_ptr, rn, N, K, k_start, K_SPLIT, stride_wn, PREFETCH * BLOCK_K))
    pdl.wait(PDL)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(k_start, tl.minimum(k_start + K_SPLIT, K), BLOCK_K):
        k_valid = (k0 + rk) < K
        a = tl.load(x_ptr + row * stride_xm + k0 + rk, mask=k_valid, other=0.0).to(tl.float32)
        b = tl.load(w_ptr + rn[:, None].to(tl.int64) * stride_wn + (k0 + rk)[None, :],
                    mask=n_valid[:, None] & k_valid[None, :], other=0.0).to(tl.float32)  # [BLOCK_N, BLOCK_K]
        ws = tl.load(ws_ptr + (rn // BN).to(tl.int64) * stride_wsn + k0 // BK, mask=n_valid, other=0.0)
        acc += tl.sum(b * a[None, :], axis=1) * ws
    _finish(acc, row * stride_om + rn, rn, n_valid, bias_ptr, out_ptr, part_ptr, count_ptr, stride_os, HAS_BIAS,
            SPLIT_SUM)


@triton.jit(do_not_specialize=["M"])
def _int4_kernel(x_ptr, w_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, part_ptr, count_ptr, M, N, K, K_SPLIT,
                 stride_xm, stride_wn, stride_sn, stride_om, stride_os, GROUP,
                 HAS_BIAS: tl.constexpr, SPLIT_SUM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, TILE_IN_GROUP: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
                 PDL: tl.constexpr = 0, PREFETCH: tl.constexpr = 0):
    """A K tile is one chunk of 128 inputs, 16 words a row (``INT4_CHUNK``): nibble j of
    word c holds input 16j + c, so each nibble is its own product with 16 contiguous
    inputs and the tile is never reshuffled. 16 inputs share one scale group (groups are
    multiples of 16); with TILE_IN_GROUP the whole tile does."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rc = tl.arange(0, 16)
    m_valid = rm < M
    n_valid = rn < N
    k_start = tl.program_id(2) * K_SPLIT
    if PREFETCH:  # (the weights: no kernel of the step writes them)
        pdl.prefetch_l2(_int4_lines(w_ptr, rn, N, K, k_start, K_SPLIT, stride_wn, PREFETCH * BLOCK_K))
    pdl.wait(PDL)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_start, tl.minimum(k_start + K_SPLIT, K), BLOCK_K):
        words = tl.load(w_ptr + rn[None, :].to(tl.int64) * stride_wn + (k0 // 8 + rc)[:, None],
                        mask=n_valid[None, :], other=0)                      # [16, BLOCK_N]; K padded
        if TILE_IN_GROUP:
            group = rn.to(tl.int64) * stride_sn + k0 // GROUP
            s = tl.load(s_ptr + group, mask=n_valid, other=0.0).to(tl.float32)
            z = tl.load(z_ptr + group, mask=n_valid, other=0).to(tl.float32)
        if BLOCK_M <= 16:  # a decode or verify step's row tile (FEW_ROWS): nibbles by lop3 (``_nibble``)
            bits = _nibble_bits(words, not UPCAST)
        for j in tl.static_range(8):
            kj = k0 + 16 * j
            if not TILE_IN_GROUP:
                group = rn.to(tl.int64) * stride_sn + kj // GROUP
                g_valid = n_valid & ((kj + tl.zeros_like(rn)) < K)
                s = tl.load(s_ptr + group, mask=g_valid, other=0.0).to(tl.float32)
                z = tl.load(z_ptr + group, mask=g_valid, other=0).to(tl.float32)
            a = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_xm + (kj + rc)[None, :],
                        mask=m_valid[:, None] & ((kj + rc) < K)[None, :], other=0.0)  # [BLOCK_M, 16]
            if BLOCK_M <= 16:  # (q − z) · s as (q − z) · 2^p times s · 2^-p, the same bits
                q, scale = _nibble(bits, j, z[None, :])
                b = (q * (s * scale)[None, :]).to(a.dtype)
            else:  # a 64-row tile (prefill) has no registers to spare for eight nibbles held at once
                b = ((((words >> (4 * j)) & 0xF).to(tl.float32) - z[None, :]) * s[None, :]).to(a.dtype)
            if UPCAST:  # the interpreter cannot multiply bf16
                acc += tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
            elif IEEE:
                acc += tl.dot(a, b, input_precision="ieee")
            else:
                acc += tl.dot(a, b)
    _finish(acc, rm[:, None].to(tl.int64) * stride_om + rn[None, :], rn[None, :], m_valid[:, None] & n_valid[None, :],
            bias_ptr, out_ptr, part_ptr, count_ptr, stride_os, HAS_BIAS, SPLIT_SUM)


# The eight nibbles of each packed word w, each masked in place into the mantissa of 2^23:
# one lop3 a nibble (2^23 held in a register; nibbles 5–7 from w >> 12), so nibble j reads
# as the float 2^23 + q · 2^s, exactly, with s = 4j, or 4j − 12 for nibbles 5–7; 2^23
# subtracted, that is q · 2^s. With its input (or scale) taken times 2^-s, every product is
# the same bits as shift, mask and int-to-float would give (for values above 2^-110, whose
# scaled copies stay normal), at a third of the integer-pipe instructions, the pipe that
# bounds these kernels (results/quant_gpu/int4_k_lanes_2026-12-05/). The mask and the
# constant are one lop3 only in PTX: written in Triton, two immediates make ptxas emit two.
_NIBBLE_BITS = tl.constexpr("""{
.reg .b32 m, h;
mov.b32 m, 0x4B000000;
shr.u32 h, $8, 12;
lop3.b32 $0, $8, 0x0000000F, m, 0xEA;
lop3.b32 $1, $8, 0x000000F0, m, 0xEA;
lop3.b32 $2, $8, 0x00000F00, m, 0xEA;
lop3.b32 $3, $8, 0x0000F000, m, 0xEA;
lop3.b32 $4, $8, 0x000F0000, m, 0xEA;
lop3.b32 $5, h, 0x00000F00, m, 0xEA;
lop3.b32 $6, h, 0x0000F000, m, 0xEA;
lop3.b32 $7, h, 0x000F0000, m, 0xEA;
}""")


@triton.jit
def _nibble_bits(words, PTX: tl.constexpr):
    """``_NIBBLE_BITS`` of each word: eight int32 tensors shaped as ``words``. Without
    ``PTX`` (the interpreter, which runs none) the same bits by Triton's own operations."""
    if PTX:
        return tl.inline_asm_elementwise(_NIBBLE_BITS, "=r,=r,=r,=r,=r,=r,=r,=r,r", [words],
                                         dtype=(tl.int32,) * 8, is_pure=True, pack=1)
    else:
        h = words >> 12
        return ((words & 0xF) | 0x4B000000, (words & 0xF0) | 0x4B000000, (words & 0xF00) | 0x4B000000,
                (words & 0xF000) | 0x4B000000, (words & 0xF0000) | 0x4B000000, (h & 0xF00) | 0x4B000000,
                (h & 0xF000) | 0x4B000000, (h & 0xF0000) | 0x4B000000)


@triton.jit
def _nibble(bits, j: tl.constexpr, offset):
    """Nibble j of ``_nibble_bits`` less ``offset`` (a zero point, or 0), as fp32, and the
    power of two its input or scale is to be taken times: ``((q − offset) · 2^p, 2^-p)``,
    both exact (one subtraction: the float reads 2^23 + q · 2^p)."""
    if j <= 4:
        power = 16.0 ** j
    else:
        power = 16.0 ** (j - 3)
    return bits[j].to(tl.float32, bitcast=True) - (8388608.0 + offset * power), 1.0 / power


@triton.jit
def _chunk_products(bits, x_row, k0, K):
    """One packed chunk's products at one row from its words' ``_nibble_bits``: ``tile``
    ``[BLOCK_N, 16]`` = Σ_j q_j · x over the chunk's eight nibbles, for each column and word
    (nibble j of word c is input k0 + 16j + c), and ``x_sum`` ``[16]`` = Σ_j x, both in fp32,
    summed in order of j: the bits of shift, mask and convert."""
    rc = tl.arange(0, 16)
    tile = tl.zeros(bits[0].shape, dtype=tl.float32)
    x_sum = tl.zeros([16], dtype=tl.float32)
    for j in tl.static_range(8):
        a = tl.load(x_row + k0 + 16 * j + rc, mask=(k0 + 16 * j + rc) < K, other=0.0).to(tl.float32)
        q, scale = _nibble(bits, j, 0.0)
        tile += q * (a * scale)[None, :]
        x_sum += a
    return tile, x_sum


@triton.jit(do_not_specialize=["M"])
def _int4_row_kernel(x_ptr, w_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, part_ptr, count_ptr, M, N, K, K_SPLIT,
                     stride_xm, stride_wn, stride_sn, stride_om, stride_os, GROUP,
                     HAS_BIAS: tl.constexpr, SPLIT_SUM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, TILE_IN_GROUP: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
                     PDL: tl.constexpr = 0, PREFETCH: tl.constexpr = 0):
    """One row (a decode step's) without tensor cores: a product of 1 × 16 × N pads the
    tensor cores' 16 rows and routes the weights through shared memory for each nibble;
    here each program multiplies its ``[BLOCK_N, 16]`` words nibble by nibble in fp32 and
    sums along K once a chunk. ``q − z`` is applied as ``Σ q·x − z · Σ x`` per group, and
    the group's scale multiplies the sum (per nibble where groups are shorter than a chunk)."""
    row = tl.program_id(0).to(tl.int64)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rc = tl.arange(0, 16)
    n_valid = rn < N
    k_start = tl.program_id(2) * K_SPLIT
    if PREFETCH:  # (the weights: no kernel of the step writes them)
        pdl.prefetch_l2(_int4_lines(w_ptr, rn, N, K, k_start, K_SPLIT, stride_wn, PREFETCH * BLOCK_K))
    pdl.wait(PDL)
    x_row = x_ptr + row * stride_xm
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(k_start, tl.minimum(k_start + K_SPLIT, K), BLOCK_K):
        words = tl.load(w_ptr + rn[:, None].to(tl.int64) * stride_wn + (k0 // 8 + rc)[None, :],
                        mask=n_valid[:, None], other=0)                      # [BLOCK_N, 16]; K padded
        bits = _nibble_bits(words, not UPCAST)
        if TILE_IN_GROUP:
            group = rn.to(tl.int64) * stride_sn + k0 // GROUP
            s = tl.load(s_ptr + group, mask=n_valid, other=0.0).to(tl.float32)
            z = tl.load(z_ptr + group, mask=n_valid, other=0).to(tl.float32)
            tile, x_sum = _chunk_products(bits, x_row, k0, K)
            acc += (tl.sum(tile, axis=1) - z * tl.sum(x_sum, axis=0)) * s
        else:
            for j in tl.static_range(8):
                kj = k0 + 16 * j
                a = tl.load(x_row + kj + rc, mask=(kj + rc) < K, other=0.0).to(tl.float32)
                q, scale = _nibble(bits, j, 0.0)
                group = rn.to(tl.int64) * stride_sn + kj // GROUP
                g_valid = n_valid & ((kj + tl.zeros_like(rn)) < K)
                s = tl.load(s_ptr + group, mask=g_valid, other=0.0).to(tl.float32)
                z = tl.load(z_ptr + group, mask=g_valid, other=0).to(tl.float32)
                acc += (tl.sum(q * (a * scale)[None, :], axis=1) - z * tl.sum(a, axis=0)) * s
    _finish(acc, row * stride_om + rn, rn, n_valid, bias_ptr, out_ptr, part_ptr, count_ptr, stride_os, HAS_BIAS,
            SPLIT_SUM)


@triton.jit
def _sum_splits(part_ptr, bias_ptr, out_ptr, MN, N, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr,
                BLOCK: tl.constexpr, PDL: tl.constexpr = 0):
    """``out`` = the SPLIT partial sums ``[SPLIT, M, N]``, added in order, + the bias."""
    pdl.wait(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    valid = offs < MN
    acc = tl.load(part_ptr + offs, mask=valid, other=0.0)
    for i in tl.static_range(1, SPLIT):
        acc += tl.load(part_ptr + i * MN + offs, mask=valid, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs % N, mask=valid, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=valid)


@triton.jit
def _quantize_kernel(x_ptr, q_ptr, s_ptr, K, stride_xm, stride_qm, stride_sm, GROUP, x_static,
                     STATIC: tl.constexpr, BLOCK: tl.constexpr, ONE_PASS: tl.constexpr, PDL: tl.constexpr = 0):
    """Row ``program_id(0)``'s group ``program_id(1)`` of GROUP inputs to float8: scaled so
    its largest magnitude is 448 (or by ``x_static``), the scale stored beside. With
    ``ONE_PASS`` the group (BLOCK ≥ GROUP) is read once and held in registers; else in
    BLOCK-wide steps, twice."""
    pdl.wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    start = tl.program_id(1) * GROUP
    stop = tl.minimum(start + GROUP, K)
    r = tl.arange(0, BLOCK)
    if ONE_PASS:
        inside = (start + r) < stop
        v = tl.load(x_ptr + row * stride_xm + start + r, mask=inside, other=0.0).to(tl.float32)
        if STATIC:
            scale = x_static
        else:
            scale = tl.maximum(tl.math.div_rn(tl.max(tl.abs(v), axis=0), 448.0), 1e-12)
            tl.store(s_ptr + row * stride_sm + tl.program_id(1), scale)
        q = round_e4m3(tl.clamp(tl.math.div_rn(v, scale), -448.0, 448.0))
        tl.store(q_ptr + row * stride_qm + start + r, q.to(q_ptr.dtype.element_ty), mask=inside)
        return
    if STATIC:
        scale = x_static
    else:
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for k0 in range(start, stop, BLOCK):
            v = tl.load(x_ptr + row * stride_xm + k0 + r, mask=(k0 + r) < stop, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(v))
        scale = tl.maximum(tl.math.div_rn(tl.max(amax, axis=0), 448.0), 1e-12)
        tl.store(s_ptr + row * stride_sm + tl.program_id(1), scale)
    for k0 in range(start, stop, BLOCK):
        v = tl.load(x_ptr + row * stride_xm + k0 + r, mask=(k0 + r) < stop, other=0.0).to(tl.float32)
        q = round_e4m3(tl.clamp(tl.math.div_rn(v, scale), -448.0, 448.0))
        tl.store(q_ptr + row * stride_qm + k0 + r, q.to(q_ptr.dtype.element_ty), mask=(k0 + r) < stop)


ONE_PASS_MAX = 16384  # the widest group the quantizer holds in registers (``quantize_rows``)


def quantize_rows(x2: torch.Tensor, group: int, static: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``x2`` ``[M, K]`` to float8 in one launch: per row and group of ``group`` inputs
    (``group`` ≥ K: per row) scaled to a largest magnitude of 448, with the fp32 scales
    ``[M, ⌈K / group⌉]``; or with the one ``static`` scale (returned ``[1, 1]``). The
    same values as torch's division, clamp and float8 cast (on an H200 a −0 came out +0).
    A group of up to ``ONE_PASS_MAX`` inputs (a decode step's row of 4,096 or 14,336) is
    read once by one program of up to 16 warps; with a 1,024-wide loop its two passes' loads
    came one after another, a few µs a row. The kernel steps along a row one input at a
    time: a row that is not contiguous is copied first."""
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m, k = x2.shape
    group = min(group, k)
    groups = triton.cdiv(k, group)
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x2.device)
    scales = torch.empty(m, groups, dtype=torch.float32, device=x2.device) if static is None else \
        torch.full((1, 1), static, dtype=torch.float32, device=x2.device)
    if m:
        one_pass = group <= ONE_PASS_MAX
        block = triton.next_power_of_2(group) if one_pass else 1024
        _quantize_kernel[(m, groups)](x2, q, scales, k, x2.stride(0), q.stride(0), scales.stride(0), group,
                                      1.0 if static is None else float(static), STATIC=static is not None,
                                      BLOCK=block, ONE_PASS=one_pass, num_warps=min(16, max(4, block // 512)),
                                      **pdl.launch(x2.device))
    return q, scales


class Tiles(NamedTuple):
    """One launch's shape: tile sizes, the number of programs along K, warps and stages,
    and with K split, whether the tile's last program adds the partial sums (``_finish``)
    or a second launch does."""
    block_m: int
    block_n: int
    block_k: int
    split: int
    num_warps: int
    num_stages: int
    sum_in_launch: bool = False
    pdl: bool = True        # launched with PDL where the GPU has it (``kernels/pdl.py``)
    prefetch: int = 0       # ... and its first this many K tiles of weights asked of L2 before its wait


FEW_ROWS = 16  # up to this many rows (decode and verify steps): one narrow row tile, K split
INT4_CHUNK = 128  # inputs per packed K tile of a 4-bit weight

class FewRowTiles(NamedTuple):
    """A kind of weight's tiles for few rows (``plan``)."""
    block_n: int       # column tile
    deepest_k: int     # deepest K tile
    stages: int        # pipeline stages
    per_sm: int        # programs per SM at most
    most_split: int    # K split at most
    fewest_k: int      # K tiles a program at least
    num_warps: int
    sum_in_launch: bool = False  # K split: partial sums added by the tile's last program
    pdl: bool = True             # launched with programmatic dependent launch (``kernels/pdl.py``)
    prefetch: int = 0            # with PDL: the first this many K tiles of weights asked of L2 first


# Per kind of weight, from sweeps on an H200 (benchmarks/quant_gpu.py --sections tiles; the
# rows' kernels and W8A8's in benchmarks/results/quant_gpu/: int4_one_row/, fp8_one_row/,
# swap_ab_2026-12-05/). Each program streams its columns' weights; float8 inputs go straight
# to the tensor cores and want wide tiles, bf16 inputs convert the weights first and want
# narrow ones; 4-bit tiles want many programs, and one row's most of all. Summing the K
# splits in the launch saved 3.6 % of a 4-bit decode step and 2 % of a verify step on an
# H100, and nothing measurable for FP8 (a per-channel W8A8 step took 2 % longer):
# one_launch_split_2026-12-05/. With PDL (pdl_2026-12-06/) every kind's decode step was
# shorter; the weight prefetch helped W8A8 per channel (blocks, the same kind, level) and
# cost 4-bit, so W8A8 alone prefetches, two K tiles (sixteen made the step 3-7 % longer,
# four and eight were level: prefetch_depth_2026-12-06/); W8A16's verify step was slower
# with PDL, so its few-row GEMM launches without it.
FEW_ROW_TILES = {"w8a8": FewRowTiles(64, 256, 4, 2, 16, 2, 4, prefetch=2),
                 "w8a16": FewRowTiles(32, 128, 4, 4, 16, 4, 4, pdl=False),
                 "w4a16": FewRowTiles(64, INT4_CHUNK, 2, 14, 8, 4, 4, sum_in_launch=True),
                 "w4a16_row": FewRowTiles(128, INT4_CHUNK, 3, 14, 16, 2, 4, sum_in_launch=True),
                 "w8a16_row": FewRowTiles(64, 128, 3, 14, 16, 2, 4)}
MANY_ROW_TILES = FewRowTiles(128, 256, 4, 2, 1, 4, 4)  # (no K split)


@functools.cache
def plan(few: bool, kind: str, n: int, k: int, step: int, device: torch.device) -> Tiles:
    """The tiles for a weight ``[n, k]`` of ``kind`` (``FEW_ROW_TILES``' keys) whose scales
    change every ``step`` inputs, from the shape and the GPU only, and whether the rows are
    ``few`` (a row tile of 16, K may split) or not (a row tile of 64, K whole). K tiles are
    as deep as the scale step allows (a tile never spans two scale groups) and the shared
    memory holds; 4-bit tiles are one packed chunk.

    Few rows read each weight once for at most 16 rows: the step takes the weight's bytes
    over the bandwidth if enough programs stream it, so K splits (each split keeping the
    kind's fewest K tiles) until the programs reach the kind's count per SM. Many rows:
    column tiles narrow until the single row tile has about two programs per SM. Where K
    splits, the kind says whether the tile's last program adds the partial sums."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        sms = props.multi_processor_count
        smem = getattr(props, "shared_memory_per_block_optin", 0) or 48 * 1024
    else:  # the interpreter
        sms, smem = 4, 1 << 30
    bytes_per_weight = 0.5 if kind.startswith("w4a16") else 1
    block_n, deepest, stages, per_sm, most, fewest, warps, sum_in_launch, use_pdl, prefetch = \
        FEW_ROW_TILES[kind] if few else MANY_ROW_TILES
    if not few:
        while block_n > 16 and triton.cdiv(n, block_n) < 2 * sms:
            block_n //= 2
    block_m = FEW_ROWS if few else 64
    block_k = deepest
    while block_k > 16 and (step % block_k or (block_m * 2 + block_n * bytes_per_weight) * block_k * stages > smem - 8192):
        block_k //= 2
    if kind.startswith("w4a16"):
        block_k = INT4_CHUNK
    split = 1
    while (split < most and triton.cdiv(n, block_n) * split * 2 <= per_sm * sms
           and triton.cdiv(k, block_k * split * 2) >= fewest):
        split *= 2
    return Tiles(block_m, block_n, block_k, split, warps, stages, sum_in_launch and split > 1, use_pdl, prefetch)


def _k_step(k: int, *groups: int) -> int:
    """The K tile's bound: the finest scale group shorter than K (a tile must not span
    two), or 256 where every scale covers all of K."""
    inner = [g for g in groups if g < k]
    step = min(inner, default=256)
    if step % 16 or any(g % step for g in inner):
        raise ValueError(f"scale groups of {', '.join(map(str, groups))} inputs along K={k}: "
                         "the groups shorter than K must be multiples of 16 that nest")
    return step




def prefetch_tiles(tiles: Tiles, launch: dict) -> int:
    """The K tiles of weights a GEMM launched with ``launch``'s arguments asks of L2 before
    its PDL wait (``pdl.prefetch``): its tiles' own, or ``pdl.FORCED_PREFETCH`` where the A/B
    switch forces a kind that asks none; 0 for none. A power of two: the lines of a row
    are (``pdl.row_lines``)."""
    if tiles.prefetch & (tiles.prefetch - 1):
        raise ValueError(f"a GEMM prefetches a power of two of K tiles, not {tiles.prefetch}")
    return (tiles.prefetch or pdl.FORCED_PREFETCH) if pdl.prefetch(launch, tiles.prefetch > 0) else 0


def _launch(kernel, kind, x, n, k, step, out_dtype, args, constants, bias, invariant: bool, tiles,
            counters: torch.Tensor | None = None):
    """``kernel`` over ``x`` ``[..., K]`` into ``[..., N]``. ``args(x2, out, part, counters,
    k_split, stride_om, stride_os)`` lists the kernel's arguments and ``constants(tiles)``
    its own constexprs; with K split, ``part`` holds the fp32 partial sums ``[split, M, N]``
    that ``_finish`` adds, bias included, in the launch where the tiles say so and
    ``counters`` (int32 zeros, one per output tile at least) are given, else in a second
    launch (``_sum_splits``). ``tiles`` overrides ``plan`` (for sweeps)."""
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    out = torch.empty(m, n, dtype=out_dtype, device=x.device)
    if m:
        t = tiles or plan(m <= FEW_ROWS and not invariant, kind, n, k, step, x.device)
        k_split = triton.cdiv(triton.cdiv(k, t.split), t.block_k) * t.block_k
        split = triton.cdiv(k, k_split)
        grid = (triton.cdiv(m, t.block_m), triton.cdiv(n, t.block_n), split)
        part = out if split == 1 else torch.empty(split, m, n, dtype=torch.float32, device=x.device)
        if not (split > 1 and t.sum_in_launch and counters is not None and counters.numel() >= grid[0] * grid[1]):
            counters = None
        launch = pdl.launch(x.device, t.pdl)
        kernel[grid](x2, *args(x2, out, part, out if counters is None else counters, k_split, n, m * n),
                     HAS_BIAS=bias is not None, SPLIT_SUM=0 if split == 1 else 1 if counters is None else 2,
                     BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, UPCAST=x.device.type != "cuda",
                     IEEE=x.dtype == torch.float32, num_warps=t.num_warps, num_stages=t.num_stages,
                     PREFETCH=prefetch_tiles(t, launch), **launch, **constants(t))
        if split > 1 and counters is None:
            _sum_splits[(triton.cdiv(m * n, 1024),)](part, part if bias is None else bias, out, m * n, n,
                                                     SPLIT=split, HAS_BIAS=bias is not None, BLOCK=1024, **launch)
    return out.view(*x.shape[:-1], n)


def fp8_linear(x: torch.Tensor, x_scale: torch.Tensor | None, act_group: int, weight: torch.Tensor,
               weight_scale: torch.Tensor, block: tuple[int, int], bias: torch.Tensor | None,
               out_dtype: torch.dtype, invariant: bool = False, tiles: Tiles | None = None,
               quantize: bool = False, counters: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` ``[..., K]`` (float8 with ``x_scale`` ``[rows, K / act_group]``, or the model's
    dtype with ``x_scale`` None) · ``weight`` ``[N, K]`` float8, scaled by ``weight_scale``
    ``[N / block[0], K / block[1]]`` (ceil). Scale groups of K must be whole K tiles.
    ``quantize``: x in the model's dtype is first rounded to float8 per row and group of
    ``act_group`` inputs (W8A8 with dynamic scales, ``quantize_rows``). ``counters``: as
    ``int4_linear``'s (the kind's tiles say whether K splits use them)."""
    if quantize and x_scale is not None:
        raise ValueError("fp8_linear: inputs already in float8 (x_scale given) cannot be quantized again")
    n, k = weight.shape
    bn, bk = block
    shape = x.shape
    scaled = x_scale is not None or quantize  # float8 inputs, with scales per row and group
    step = _k_step(k, bk, act_group if scaled else k)
    # Unless a row must not depend on its batch: one row of W8A16 (a decode step) runs without
    # tensor cores, and a decode or verify step's few rows of W8A8 with the weights on the left.
    few = x.numel() <= FEW_ROWS * k and not invariant
    if quantize:
        x, x_scale = quantize_rows(x.reshape(-1, k), act_group)
    xs = x_scale if x_scale is not None else weight_scale

    def args(x2, out, part, counters, k_split, stride_om, stride_os):
        return (xs, weight, weight_scale, bias if bias is not None else weight_scale, out, part, counters,
                x2.shape[0], n, k, k_split, x2.stride(0), xs.stride(0), weight.stride(0), weight_scale.stride(0),
                stride_om, stride_os, act_group, bn, bk)

    if not scaled:
        one_row = few and x.numel() == k
        kernel, kind, constants = (_fp8_row_kernel, "w8a16_row", {}) if one_row else (_fp8_kernel, "w8a16", {"A_FP8": False})
    elif few:
        kernel, kind, constants = _fp8_left_kernel, "w8a8", {}
    else:
        kernel, kind, constants = _fp8_kernel, "w8a8", {"A_FP8": True}
    out = _launch(kernel, kind, x, n, k, step, out_dtype, args, lambda t: constants, bias, invariant, tiles,
                  counters)
    return out.view(*shape[:-1], n)


def int4_linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int,
                bias: torch.Tensor | None, invariant: bool = False, tiles: Tiles | None = None,
                counters: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` ``[..., K]`` · W ``[N, K]``ᵀ with W = (q − zeros) · scales per group of
    ``group`` inputs: ``packed`` int32 ``[N, 16 · ⌈K / 128⌉]`` (``pack_int4``), ``scales``
    ``[N, K / group]`` (any float dtype), ``zeros`` uint8 ``[N, K / group]``. ``counters``
    (``tile_counters``, the layer's own): K splits are added in the launch; without them,
    by a second launch. Each call sets them back to zeros, but two calls must not use the
    same counters at once (two streams): each layer holds its own."""
    n, k = packed.shape[0], x.shape[-1]
    if packed.shape[1] != triton.cdiv(k, INT4_CHUNK) * INT4_CHUNK // 8:
        raise ValueError(f"int4 weight of {packed.shape[1] * 8} packed inputs for activations of {k}")
    if tiles is not None and tiles.block_k != INT4_CHUNK:
        raise ValueError(f"4-bit K tiles are the packed chunks of {INT4_CHUNK} inputs")
    _k_step(k, group)

    def args(x2, out, part, counters, k_split, stride_om, stride_os):
        return (packed, scales, zeros, bias if bias is not None else scales, out, part, counters, x2.shape[0], n, k, k_split,
                x2.stride(0), packed.stride(0), scales.stride(0), stride_om, stride_os, group)

    # One row (a decode step) runs without tensor cores, unless a row must not depend on its batch.
    one_row = x.numel() == k and not invariant
    return _launch(_int4_row_kernel if one_row else _int4_kernel, "w4a16_row" if one_row else "w4a16", x, n, k,
                   INT4_CHUNK, x.dtype, args,
                   lambda t: {"TILE_IN_GROUP": group % INT4_CHUNK == 0 or group >= k}, bias, invariant, tiles,
                   counters)


def tile_counters(n: int, device: torch.device) -> torch.Tensor:
    """Zeros for ``_finish``'s counters: one per output tile of a weight of ``n`` columns at
    a decode or verify step's few rows (one row tile; column tiles of 16 or more)."""
    return torch.zeros(triton.cdiv(n, 16), dtype=torch.int32, device=device)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """uint8 ``[N, K]`` (0…15) -> int32 ``[N, 16 · ⌈K / 128⌉]``: K padded with zeros to whole
    chunks of 128 inputs, input 128t + 16j + c in nibble j of word 16t + c."""
    n, k = q.shape
    chunks = triton.cdiv(k, INT4_CHUNK)
    q = torch.nn.functional.pad(q.to(torch.int64), (0, chunks * INT4_CHUNK - k))
    nibbles = q.view(n, chunks, 8, 16).transpose(2, 3)                      # [n, chunk, word c, nibble j]
    words = (nibbles << torch.arange(0, 32, 4, device=q.device)).sum(-1).reshape(n, chunks * 16)
    return (words - (words >= 2**31) * 2**32).to(torch.int32)  # as int32's two's complement
