"""Triton GEMMs over quantized weights for CUDA: ``y = x · Wᵀ`` with W kept as stored.

* ``fp8_linear``: W in float8 (e4m3) with fp32 scales over blocks of ``(BN, BK)`` weights
  (a block-wise ``weight_scale_inv`` of 128 × 128, or one per row: BK ≥ K). The
  activations come either in the model's dtype (W8A16) or in float8 with fp32 scales per
  row and group of ``AK`` inputs (W8A8: per token, AK ≥ K, or per token and 128-group as
  DeepSeek-V3 and Qwen3 FP8 checkpoints run). Each K tile lies inside one scale block, so
  a tile's dot product is scaled once: ``acc += (a · b) · sa · sw``.
* ``int4_linear``: W in 4 bits, eight inputs per int32 (input 8c + j in nibble j of word
  c), with a scale and an integer zero point per row and group of ``G`` inputs (AWQ's and
  GPTQ's asymmetric form; symmetric GPTQ is zero 8). The tile is dequantised in fp32,
  ``(q − z) · s``, exact, rounded to the activations' dtype (what a dequantised copy of
  the weights would hold) and multiplied there.

Tiles along N and K depend on the weight's shape and the GPU, never on the rows, and no
program splits K; with ``invariant`` the row tile is fixed too, so a row's result is the
same alone or in any batch (``--deterministic``).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

@triton.jit
def _store(acc, bias_ptr, out_ptr, rm, rn, m_valid, n_valid, stride_om, HAS_BIAS: tl.constexpr):
    """The tile ``acc`` (+ the bias) into ``out`` in its dtype."""
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=n_valid, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rm[:, None].to(tl.int64) * stride_om + rn[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_valid[:, None] & n_valid[None, :])


@triton.jit(do_not_specialize=["M"])
def _fp8_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, bias_ptr, out_ptr, M, N, K,
                stride_xm, stride_xsm, stride_wn, stride_wsn, stride_om,
                AK, BN, BK,
                A_FP8: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
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
    _store(acc, bias_ptr, out_ptr, rm, rn, m_valid, n_valid, stride_om, HAS_BIAS)


@triton.jit(do_not_specialize=["M"])
def _int4_kernel(x_ptr, w_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, M, N, K,
                 stride_xm, stride_wn, stride_sn, stride_om, GROUP,
                 HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_valid = rm < M
    n_valid = rn < N
    rw = tl.arange(0, BLOCK_K // 8)
    shift = (tl.arange(0, 8) * 4)[None, :, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_valid = (k0 + rk) < K
        a = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_xm + (k0 + rk)[None, :],
                    mask=m_valid[:, None] & k_valid[None, :], other=0.0)      # [BLOCK_M, BLOCK_K]
        words = tl.load(w_ptr + rn[None, :].to(tl.int64) * stride_wn + (k0 // 8 + rw)[:, None],
                        mask=n_valid[None, :] & ((k0 + 8 * rw) < K)[:, None], other=0)  # [BLOCK_K / 8, BLOCK_N]
        q = tl.reshape((words[:, None, :] >> shift) & 0xF, (BLOCK_K, BLOCK_N))  # input 8c + j: word c, nibble j
        group = rn.to(tl.int64) * stride_sn + k0 // GROUP
        s = tl.load(s_ptr + group, mask=n_valid, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + group, mask=n_valid, other=0).to(tl.int32)
        b = ((q - z[None, :]).to(tl.float32) * s[None, :]).to(a.dtype)
        if UPCAST:  # the interpreter cannot multiply bf16
            acc += tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        elif IEEE:
            acc += tl.dot(a, b, input_precision="ieee")
        else:
            acc += tl.dot(a, b)
    _store(acc, bias_ptr, out_ptr, rm, rn, m_valid, n_valid, stride_om, HAS_BIAS)


@triton.jit
def _round_e4m3(v):
    """fp32 ``v`` (|v| ≤ 448) rounded to the nearest float8 e4m3 value, ties to even, as
    fp32: torch's ``.to(float8_e4m3fn)``, written out in integer and float arithmetic so
    that the interpreter rounds as a GPU does. Normal values keep 3 mantissa bits; below
    2⁻⁶ the spacing is 2⁻⁹ (subnormals)."""
    bits = v.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000
    normal = bits.to(tl.float32, bitcast=True)
    magnitude = (tl.abs(v) + 24576.0) - 24576.0  # 1.5 · 2¹⁴: fp32's spacing there is 2⁻⁹
    subnormal = tl.where(v < 0, -magnitude, magnitude)  # (a negative value rounding to 0 gives −0)
    return tl.where(tl.abs(v) < 0.015625, subnormal, normal)


@triton.jit
def _quantize_kernel(x_ptr, q_ptr, s_ptr, K, stride_xm, stride_qm, stride_sm, GROUP, x_static,
                     STATIC: tl.constexpr, BLOCK: tl.constexpr):
    """Row ``program_id(0)``'s group ``program_id(1)`` of GROUP inputs to float8: scaled so
    its largest magnitude is 448 (or by ``x_static``), the scale stored beside."""
    row = tl.program_id(0).to(tl.int64)
    start = tl.program_id(1) * GROUP
    stop = tl.minimum(start + GROUP, K)
    r = tl.arange(0, BLOCK)
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
        q = _round_e4m3(tl.clamp(tl.math.div_rn(v, scale), -448.0, 448.0))
        tl.store(q_ptr + row * stride_qm + k0 + r, q.to(q_ptr.dtype.element_ty), mask=(k0 + r) < stop)


def quantize_rows(x2: torch.Tensor, group: int, static: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``x2`` ``[M, K]`` to float8 in one launch: per row and group of ``group`` inputs
    (``group`` ≥ K: per row) scaled to a largest magnitude of 448, with the fp32 scales
    ``[M, ⌈K / group⌉]``; or with the one ``static`` scale (returned ``[1, 1]``). The
    same values as torch's division, clamp and float8 cast (on an H200 a −0 came out +0)."""
    m, k = x2.shape
    group = min(group, k)
    groups = triton.cdiv(k, group)
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x2.device)
    scales = torch.empty(m, groups, dtype=torch.float32, device=x2.device) if static is None else \
        torch.full((1, 1), static, dtype=torch.float32, device=x2.device)
    if m:
        _quantize_kernel[(m, groups)](x2, q, scales, k, x2.stride(0), q.stride(0), scales.stride(0), group,
                                      1.0 if static is None else float(static), STATIC=static is not None,
                                      BLOCK=min(1024, triton.next_power_of_2(group)))
    return q, scales


@functools.cache
def tiles(n: int, k: int, step: int, bytes_per_weight: float, device: torch.device) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) for a weight ``[n, k]`` whose scales
    change every ``step`` inputs: from the shape and the GPU only. Column tiles narrow
    until a decode step's single row tile has about two programs per SM; K tiles are as
    deep as the scale step allows (a tile never spans two scale groups) and the shared
    memory holds."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        sms = props.multi_processor_count
        smem = getattr(props, "shared_memory_per_block_optin", 0) or 48 * 1024
    else:  # the interpreter
        sms, smem = 4, 1 << 30
    block_n, stages = 128, 4
    while block_n > 16 and triton.cdiv(n, block_n) < 2 * sms:
        block_n //= 2
    block_k = 256
    while block_k > 16 and (step % block_k or (16 * 2 + block_n * bytes_per_weight) * block_k * stages > smem - 8192):
        block_k //= 2
    return block_n, block_k, 4, stages


def _k_step(k: int, *groups: int) -> int:
    """The K tile's bound: the finest scale group shorter than K (a tile must not span
    two), or 256 where every scale covers all of K."""
    inner = [g for g in groups if g < k]
    step = min(inner, default=256)
    if step % 16 or any(g % step for g in inner):
        raise ValueError(f"scale groups of {', '.join(map(str, groups))} inputs along K={k}: "
                         "the groups shorter than K must be multiples of 16 that nest")
    return step


def _launch(kernel, x, n, k, step, bytes_per_weight, out_dtype, args, invariant: bool, **meta):
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    out = torch.empty(m, n, dtype=out_dtype, device=x.device)
    if m:
        block_n, block_k, num_warps, num_stages = tiles(n, k, step, bytes_per_weight, x.device)
        # Few rows: one narrow row tile. ``invariant``: one tile height whatever the rows,
        # so a row's products run through the same instructions alone or in a batch.
        block_m = 64 if invariant or m > 16 else 16
        grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
        kernel[grid](x2, *args(x2, out), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                     UPCAST=x.device.type != "cuda", IEEE=x.dtype == torch.float32, num_warps=num_warps, num_stages=num_stages, **meta)
    return out.view(*x.shape[:-1], n)


def fp8_linear(x: torch.Tensor, x_scale: torch.Tensor | None, act_group: int, weight: torch.Tensor,
               weight_scale: torch.Tensor, block: tuple[int, int], bias: torch.Tensor | None,
               out_dtype: torch.dtype, invariant: bool = False) -> torch.Tensor:
    """``x`` ``[..., K]`` (float8 with ``x_scale`` ``[rows, K / act_group]``, or the model's
    dtype with ``x_scale`` None) · ``weight`` ``[N, K]`` float8, scaled by ``weight_scale``
    ``[N / block[0], K / block[1]]`` (ceil). Scale groups of K must be whole K tiles."""
    n, k = weight.shape
    bn, bk = block
    step = _k_step(k, bk, act_group if x_scale is not None else k)

    def args(x2, out):
        xs = x_scale if x_scale is not None else weight_scale
        return (xs, weight, weight_scale, bias if bias is not None else weight_scale, out,
                x2.shape[0], n, k, x2.stride(0), xs.stride(0), weight.stride(0), weight_scale.stride(0),
                out.stride(0), act_group, bn, bk)

    return _launch(_fp8_kernel, x, n, k, step, 1, out_dtype, args, invariant,
                   A_FP8=x_scale is not None, HAS_BIAS=bias is not None)


def int4_linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int,
                bias: torch.Tensor | None, invariant: bool = False) -> torch.Tensor:
    """``x`` ``[..., K]`` · W ``[N, K]``ᵀ with W = (q − zeros) · scales per group of
    ``group`` inputs: ``packed`` int32 ``[N, K / 8]``, ``scales`` ``[N, K / group]`` (any
    float dtype), ``zeros`` uint8 ``[N, K / group]``."""
    n, k = packed.shape[0], x.shape[-1]
    if packed.shape[1] * 8 != k:
        raise ValueError(f"int4 weight of {packed.shape[1] * 8} inputs for activations of {k}")
    step = _k_step(k, group)

    def args(x2, out):
        return (packed, scales, zeros, bias if bias is not None else scales, out, x2.shape[0], n, k,
                x2.stride(0), packed.stride(0), scales.stride(0), out.stride(0), group)

    return _launch(_int4_kernel, x, n, k, step, 0.5, x.dtype, args, invariant, HAS_BIAS=bias is not None)
