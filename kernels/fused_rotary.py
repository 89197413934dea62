"""Rotary embedding of q and k in place, optionally fused with the KV store (Triton).

Same semantics as ``reference.rotary_embedding`` / ``reference.rotary_store_kv``: the
rotate-half layout, ``(x₁·cos − x₂·sin, x₂·cos + x₁·sin)`` for the two halves of each head,
with cos and sin read from a cache ``[max_positions, head_dim]`` (cos | sin, fp32) built
once per model, so a step computes no angles. The math is fp32 and each result is rounded
once to the output's dtype.

One program per token rotates all its query heads and all its key heads. Fused with the
KV store it writes the rotated key and the value straight to the token's cache slot
(skipping slot -1, padding) instead of back to ``key``, which saves a launch per layer.
Positions are clamped to the cache: only padding rows of a CUDA-graph step can lie past
it (their outputs are thrown away), and a clamped read stays inside the cache.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.kernels import pdl
from specserve.kernels.fp8 import to_e4m3


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, v_ptr, positions_ptr, cos_sin_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    k_scale, v_scale, max_position, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_KV: tl.constexpr, BLOCK_HALF: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, STORE_KV: tl.constexpr, KV_FP8: tl.constexpr, PDL: tl.constexpr = 0,
):
    """One token: rotate its q heads in place; its k heads in place, or (STORE_KV) into
    the cache with its v heads."""
    pdl.wait(PDL)
    token = tl.program_id(0).to(tl.int64)
    pos = tl.minimum(tl.load(positions_ptr + token), max_position - 1)
    d = tl.arange(0, BLOCK_HALF)[None, :]
    cos = tl.load(cos_sin_ptr + pos * (2 * HALF) + d, mask=d < HALF, other=0.0)  # [1, BLOCK_HALF]
    sin = tl.load(cos_sin_ptr + pos * (2 * HALF) + HALF + d, mask=d < HALF, other=0.0)

    hq = tl.arange(0, BLOCK_H)[:, None]
    q_mask = (hq < NUM_HEADS) & (d < HALF)
    q = q_ptr + token * stride_qt + hq * stride_qh + d                        # first halves
    q1 = tl.load(q, mask=q_mask, other=0.0).to(tl.float32)
    q2 = tl.load(q + HALF, mask=q_mask, other=0.0).to(tl.float32)
    tl.store(q, (q1 * cos - q2 * sin).to(q_ptr.dtype.element_ty), mask=q_mask)
    tl.store(q + HALF, (q2 * cos + q1 * sin).to(q_ptr.dtype.element_ty), mask=q_mask)

    hk = tl.arange(0, BLOCK_KV)[:, None]
    k_mask = (hk < NUM_KV_HEADS) & (d < HALF)
    k = k_ptr + token * stride_kt + hk * stride_kh + d
    k1 = tl.load(k, mask=k_mask, other=0.0).to(tl.float32)
    k2 = tl.load(k + HALF, mask=k_mask, other=0.0).to(tl.float32)
    k1_out = k1 * cos - k2 * sin
    k2_out = k2 * cos + k1 * sin
    if STORE_KV:
        slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
        if slot >= 0:  # -1: a padding row, not stored
            block, offset = slot // BLOCK_SIZE, slot % BLOCK_SIZE
            k_dst = k_cache_ptr + block * stride_kcb + offset * stride_kcs + hk * stride_kch + d
            v = v_ptr + token * stride_vt + hk * stride_vh + d
            v_dst = v_cache_ptr + block * stride_vcb + offset * stride_vcs + hk * stride_vch + d
            v1, v2 = tl.load(v, mask=k_mask), tl.load(v + HALF, mask=k_mask)
            if KV_FP8:  # over the layer's scales; the rotated key rounded once, from fp32
                tl.store(k_dst, to_e4m3(tl.math.div_rn(k1_out, k_scale)), mask=k_mask)
                tl.store(k_dst + HALF, to_e4m3(tl.math.div_rn(k2_out, k_scale)), mask=k_mask)
                tl.store(v_dst, to_e4m3(tl.math.div_rn(v1.to(tl.float32), v_scale)), mask=k_mask)
                tl.store(v_dst + HALF, to_e4m3(tl.math.div_rn(v2.to(tl.float32), v_scale)), mask=k_mask)
            else:
                tl.store(k_dst, k1_out.to(k_cache_ptr.dtype.element_ty), mask=k_mask)
                tl.store(k_dst + HALF, k2_out.to(k_cache_ptr.dtype.element_ty), mask=k_mask)
                tl.store(v_dst, v1.to(v_cache_ptr.dtype.element_ty), mask=k_mask)
                tl.store(v_dst + HALF, v2.to(v_cache_ptr.dtype.element_ty), mask=k_mask)
    else:
        tl.store(k, k1_out.to(k_ptr.dtype.element_ty), mask=k_mask)
        tl.store(k + HALF, k2_out.to(k_ptr.dtype.element_ty), mask=k_mask)


def rotary_(query: torch.Tensor, key: torch.Tensor, positions: torch.Tensor,
            cos_sin_cache: torch.Tensor) -> None:
    """Rotate query ``[num_tokens, num_heads, head_dim]`` and key ``[num_tokens,
    num_kv_heads, head_dim]`` (views, e.g. of the merged qkv output) in place, at
    ``positions`` ``[num_tokens]`` int64, with cos/sin from ``cos_sin_cache``."""
    _launch(query, key, None, positions, cos_sin_cache, None, None, None)


def rotary_store_kv(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    positions: torch.Tensor, cos_sin_cache: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, slot_mapping: torch.Tensor, k_scale: float = 1.0,
                    v_scale: float = 1.0) -> torch.Tensor:
    """Rotate ``query`` in place (and return it); write the rotated key and the value
    ``[num_tokens, num_kv_heads, head_dim]`` into ``k_cache`` / ``v_cache`` ``[num_blocks,
    block_size, num_kv_heads, head_dim]`` at ``slot_mapping`` ``[num_tokens]`` (int64, -1
    rows skipped), cast to the cache's dtype (float8: over ``k_scale`` / ``v_scale``).
    ``key`` itself is left as it was."""
    if value.shape != key.shape or k_cache.shape[2:] != key.shape[1:] or v_cache.shape != k_cache.shape:
        raise ValueError(f"key {tuple(key.shape)}, value {tuple(value.shape)} and caches "
                         f"{tuple(k_cache.shape)} / {tuple(v_cache.shape)} do not match")
    if value.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("value and the KV cache need a contiguous head_dim")
    _launch(query, key, value, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return query


def _launch(query, key, value, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, k_scale=1.0, v_scale=1.0):
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    if (key.shape[0] != num_tokens or key.shape[2] != head_dim or head_dim % 2
            or cos_sin_cache.shape[1:] != (head_dim,)):
        raise ValueError(f"query {tuple(query.shape)}, key {tuple(key.shape)} and cos/sin cache "
                         f"{tuple(cos_sin_cache.shape)} do not match")
    if query.stride(-1) != 1 or key.stride(-1) != 1 or not cos_sin_cache.is_contiguous():
        raise ValueError("query, key and the cos/sin cache need a contiguous head_dim")
    if num_tokens == 0:
        return
    store = k_cache is not None
    if store:
        value_strides = value.stride()[:2]
        cache_strides = (*k_cache.stride()[:3], *v_cache.stride()[:3])
    else:  # the kernel reads none of these
        value, k_cache, v_cache, slot_mapping = key, key, key, positions
        value_strides, cache_strides = (0, 0), (0,) * 6
    block_h, block_kv = triton.next_power_of_2(num_heads), triton.next_power_of_2(num_kv_heads)
    block_half = triton.next_power_of_2(head_dim // 2)
    _rotary_kernel[(num_tokens,)](
        query, key, value, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, k_scale, v_scale,
        cos_sin_cache.shape[0], *query.stride()[:2], *key.stride()[:2], *value_strides,
        *cache_strides,
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HALF=head_dim // 2,
        BLOCK_H=block_h, BLOCK_KV=block_kv, BLOCK_HALF=block_half,
        BLOCK_SIZE=k_cache.shape[1] if store else 1, STORE_KV=store,
        KV_FP8=store and k_cache.dtype == torch.float8_e4m3fn,
        num_warps=max(1, min(4, block_h * block_half // 256)), **pdl.launch(query.device))
