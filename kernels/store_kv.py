"""KV store (Triton): write the step's K and V into the paged cache at ``slot_mapping``.

Same semantics as ``reference.store_kv``: row t of key/value goes to slot
``slot_mapping[t]`` (block ``slot // block_size``, offset ``slot % block_size``); rows whose
slot is -1 (padding, e.g. for CUDA graphs) are skipped. One program per token copies all
its KV heads; slot offsets are int64, so caches past 2**31 elements are addressed right.
A float8 cache (``--kv-cache-dtype fp8``) takes each value over its layer's scale,
saturated to ±448 and rounded to nearest, as torch's division and cast do.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.kernels import pdl
from specserve.kernels.fp8 import to_e4m3


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, k_scale, v_scale,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, KV_FP8: tl.constexpr, PDL: tl.constexpr = 0,
):
    """One token: key/value ``[num_kv_heads, head_dim]`` -> its cache slot."""
    pdl.wait(PDL)
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # padding row
        return
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < NUM_KV_HEADS) & (d < HEAD_DIM)
    block, offset = slot // BLOCK_SIZE, slot % BLOCK_SIZE
    key = tl.load(key_ptr + token * stride_kt + h * stride_kh + d, mask=mask)
    value = tl.load(value_ptr + token * stride_vt + h * stride_vh + d, mask=mask)
    k_dst = k_cache_ptr + block * stride_kcb + offset * stride_kcs + h * stride_kch + d
    v_dst = v_cache_ptr + block * stride_vcb + offset * stride_vcs + h * stride_vch + d
    if KV_FP8:
        tl.store(k_dst, to_e4m3(tl.math.div_rn(key.to(tl.float32), k_scale)), mask=mask)
        tl.store(v_dst, to_e4m3(tl.math.div_rn(value.to(tl.float32), v_scale)), mask=mask)
    else:
        tl.store(k_dst, key.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_dst, value.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, slot_mapping: torch.Tensor, k_scale: float = 1.0,
             v_scale: float = 1.0) -> None:
    """Write ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` into ``k_cache`` /
    ``v_cache`` ``[num_blocks, block_size, num_kv_heads, head_dim]`` at ``slot_mapping``
    ``[num_tokens]`` (int64; -1 rows are skipped). Casts to the cache's dtype (float8: over
    ``k_scale`` / ``v_scale``, saturating)."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    if value.shape != key.shape or k_cache.shape[2:] != key.shape[1:] or v_cache.shape != k_cache.shape:
        raise ValueError(f"key {tuple(key.shape)}, value {tuple(value.shape)} and caches "
                         f"{tuple(k_cache.shape)} / {tuple(v_cache.shape)} do not match")
    key = key if key.stride(-1) == 1 else key.contiguous()
    value = value if value.stride(-1) == 1 else value.contiguous()
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("the KV cache's head_dim must be contiguous")
    _store_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        KV_FP8=k_cache.dtype == torch.float8_e4m3fn, num_warps=4 if num_kv_heads * head_dim >= 1024 else 1,
        **pdl.launch(key.device))
