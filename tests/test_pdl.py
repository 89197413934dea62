"""Programmatic dependent launch (``kernels/pdl.py``): a kernel launched with it may start
while the kernel before it still runs, so it must not read or write global memory before
its ``griddepcontrol.wait`` (a weight prefetch aside). Checked in the PTX of every kernel
that takes ``PDL``, compiled for Hopper without a GPU; and where PDL is never used."""
from __future__ import annotations

import pytest
import torch
from sm90_compile import compiles_for_sm90
from specserve.kernels import pdl

CUDA = torch.cuda.is_available()


def test_pdl_is_never_used_off_a_gpu_or_when_turned_off(monkeypatch):
    assert pdl.launch(torch.device("cpu")) == {"PDL": 0}
    assert not pdl.prefetch(torch.device("cpu"), True)
    monkeypatch.setattr(pdl, "ENABLED", False)
    assert pdl.launch(torch.device("cuda", 0)) == {"PDL": 0}  # (no GPU asked: off first)
    assert pdl.launch(torch.device("cpu"), allowed=False) == {"PDL": 0}


COMPILE_WITH_PDL = r"""
import re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from specserve.kernels import (fused_act, fused_norm, fused_rotary, paged_attention as pa, quant_matmul as qm,
                               store_kv as skv)

# Global memory touched: loads, stores, atomics and async copies (not ld.param, not prefetch).
TOUCH = re.compile(r"^\s*(@!?%\w+\s+)?(ld|st|atom|red|cp\.async)(\.[\w:]+)*?\.global", re.M)

def check(fn, pointers, constants, num_warps=4, num_stages=2, prefetch=False):
    constants = dict(constants, PDL=1, **({"PREFETCH": prefetch} if "PREFETCH" in fn.arg_names else {}))
    constants.update({p.name: p.default for p in fn.params  # (constexprs left at their defaults)
                      if p.is_constexpr and p.has_default and p.name not in constants})
    signature = {name: "constexpr" if name in constants else pointers.get(name, "i32") for name in fn.arg_names}
    constexprs = {(fn.arg_names.index(name),): value for name, value in constants.items()}
    ptx = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                         target=GPUTarget("cuda", 90, 32),
                         options=dict(num_warps=num_warps, num_stages=num_stages)).asm["ptx"]
    wait = ptx.find("griddepcontrol.wait")
    assert wait >= 0 and "griddepcontrol.launch_dependents" in ptx, fn
    early = TOUCH.search(ptx[:wait])
    assert early is None, (fn, early and early.group(0))
    assert TOUCH.search(ptx[wait:]), fn  # (the pattern finds what the kernel does touch)
    assert ("prefetch.global.L2" in ptx[:wait]) == prefetch, fn

tiles = dict(HAS_BIAS=False, SPLIT_SUM=2, BLOCK_M=16, BLOCK_K=128, UPCAST=False, IEEE=False)
split = dict(part_ptr="*fp32", count_ptr="*i32")
fp8 = dict(split, xs_ptr="*fp32", w_ptr="*fp8e4nv", ws_ptr="*fp32", bias_ptr="*bf16", out_ptr="*bf16")
int4 = dict(split, x_ptr="*bf16", w_ptr="*i32", s_ptr="*bf16", z_ptr="*u8", bias_ptr="*bf16", out_ptr="*bf16")
for prefetch in (False, True):
    check(qm._fp8_left_kernel, dict(fp8, x_ptr="*fp8e4nv"), dict(tiles, BLOCK_N=64), num_stages=4, prefetch=prefetch)
    check(qm._fp8_kernel, dict(fp8, x_ptr="*bf16"), dict(tiles, BLOCK_N=128, A_FP8=False), prefetch=prefetch)
    check(qm._fp8_row_kernel, dict(fp8, x_ptr="*bf16"), dict(tiles, BLOCK_N=64), prefetch=prefetch)
    check(qm._fp8_kernel, dict(fp8, x_ptr="*fp8e4nv"), dict(tiles, BLOCK_N=32, BLOCK_K=32, A_FP8=True),
          prefetch=prefetch)  # (small scale blocks: a K tile shorter than a line)
    for kernel in (qm._int4_kernel, qm._int4_row_kernel):
        check(kernel, int4, dict(tiles, BLOCK_N=128, TILE_IN_GROUP=True), prefetch=prefetch)
check(qm._quantize_kernel, dict(x_ptr="*bf16", q_ptr="*fp8e4nv", s_ptr="*fp32", x_static="fp32"),
      dict(STATIC=False, BLOCK=128, ONE_PASS=True))
check(qm._sum_splits, dict(part_ptr="*fp32", bias_ptr="*bf16", out_ptr="*bf16"), dict(SPLIT=4, HAS_BIAS=True, BLOCK=1024))
norm = dict(out_ptr="*bf16", new_residual_ptr="*bf16", x_ptr="*bf16", residual_ptr="*bf16", weight_ptr="*bf16",
            eps="fp32", scales_ptr="*fp32")
check(fused_norm._rms_norm_kernel, norm, dict(HIDDEN=4096, BLOCK=4096, ADD_RESIDUAL=True, GEMMA=False))
check(fused_norm._rms_norm_kernel, dict(norm, out_ptr="*fp8e4nv"),
      dict(HIDDEN=4096, BLOCK=4096, ADD_RESIDUAL=True, GEMMA=False, FP8_GROUP=4096, SLICE=1024))
check(fused_act._silu_and_mul_kernel, dict(out_ptr="*bf16", gate_up_ptr="*bf16", scales_ptr="*fp32"),
      dict(BLOCK=1024, GELU_TANH=False))
check(fused_rotary._rotary_kernel, dict(q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", positions_ptr="*i64",
      cos_sin_ptr="*fp32", k_cache_ptr="*bf16", v_cache_ptr="*bf16", slot_mapping_ptr="*i64", k_scale="fp32",
      v_scale="fp32"), dict(NUM_HEADS=32, NUM_KV_HEADS=8, HALF=64, BLOCK_H=32, BLOCK_KV=8, BLOCK_HALF=64,
      BLOCK_SIZE=16, STORE_KV=True, KV_FP8=False))
check(skv._store_kv_kernel, dict(key_ptr="*bf16", value_ptr="*bf16", k_cache_ptr="*bf16", v_cache_ptr="*bf16",
      slot_mapping_ptr="*i64", k_scale="fp32", v_scale="fp32"),
      dict(NUM_KV_HEADS=8, HEAD_DIM=128, BLOCK_SIZE=16, BLOCK_H=8, BLOCK_D=128, KV_FP8=False))
check(pa._paged_attention_kernel, dict(out_ptr="*bf16", q_ptr="*bf16", k_cache_ptr="*bf16", v_cache_ptr="*bf16",
      part_out_ptr="*fp32", part_lse_ptr="*fp32", block_tables_ptr="*i32", cu_query_lens_ptr="*i32",
      seq_lens_ptr="*i32", tree_masks_ptr="*i64", qk_scale="fp32", v_scale="fp32"),
      dict(GROUP=4, HEAD_DIM=128, BLOCK_D=128, BLOCK_SIZE=16, BLOCK_Q=1, BLOCK_M=16, BLOCK_N=64, SPLIT_KV=True,
           USE_WINDOW=False, SOFTCAP=False, UPCAST_DOT=False, IEEE_DOT=False, FP16_DOT=False, TREE=False))
check(pa._reduce_splits_kernel, dict(out_ptr="*bf16", part_out_ptr="*fp32", part_lse_ptr="*fp32",
      cu_query_lens_ptr="*i32"), dict(HEAD_DIM=128, BLOCK_D=128, BLOCK_S=32))
print("compiled")
"""


@pytest.mark.skipif(CUDA, reason="compiled offline; a GPU runs the kernels in the other tests")
def test_pdl_kernels_touch_no_global_memory_before_their_wait():
    compiles_for_sm90(COMPILE_WITH_PDL)
