"""Programmatic dependent launch (``kernels/pdl.py``): a kernel launched with it may start
while the kernel before it still runs, so it must not read or write global memory before
its ``griddepcontrol.wait`` (a prefetch aside, and the paged attention's reads of the batch's
layout, which the kernel before it never writes). Checked in the PTX of every kernel
that takes ``PDL``, compiled for Hopper without a GPU; and where PDL is never used."""
from __future__ import annotations

import math

import pytest
import torch
import triton
import triton.language as tl
from sm90_compile import compiles_for_sm90
from specserve.kernels import paged_attention, pdl, quant_matmul

CUDA = torch.cuda.is_available()


def test_pdl_is_never_used_off_a_gpu_or_when_turned_off(monkeypatch):
    assert pdl.launch(torch.device("cpu")) == {"PDL": 0}
    assert not pdl.prefetch(pdl.launch(torch.device("cpu")), True)
    assert pdl.prefetch({"PDL": 1, "launch_pdl": True}, True)
    assert not pdl.prefetch({"PDL": 1, "launch_pdl": True}, False)
    monkeypatch.setattr(pdl, "ENABLED", False)
    assert pdl.launch(torch.device("cuda", 0)) == {"PDL": 0}  # (no GPU asked: off first)
    assert pdl.launch(torch.device("cpu"), allowed=False) == {"PDL": 0}


def test_a_gemm_prefetches_its_tiles_depth_or_the_forced_one(monkeypatch):
    """A launch with PDL prefetches as many K tiles as its tiles ask; the A/B switch forces
    ``FORCED_PREFETCH`` on a kind that asks none, or none at all; without PDL, none; a
    depth that is not a power of two is refused."""
    tiles = quant_matmul.Tiles(16, 64, 256, 4, 4, 4, prefetch=4)
    on, off = {"PDL": 1, "launch_pdl": True}, pdl.launch(torch.device("cpu"))
    assert quant_matmul.prefetch_tiles(tiles, on) == 4 and quant_matmul.prefetch_tiles(tiles, off) == 0
    assert quant_matmul.prefetch_tiles(tiles._replace(prefetch=0), on) == 0
    monkeypatch.setattr(pdl, "GEMM_PREFETCH", True)
    assert quant_matmul.prefetch_tiles(tiles._replace(prefetch=0), on) == pdl.FORCED_PREFETCH == 2
    monkeypatch.setattr(pdl, "GEMM_PREFETCH", False)
    assert quant_matmul.prefetch_tiles(tiles, on) == 0
    with pytest.raises(ValueError, match="power of two"):
        quant_matmul.prefetch_tiles(tiles._replace(prefetch=3), on)


def test_pdl_needs_hopper_and_cuda_not_rocm(monkeypatch):
    """The launch option goes to NVIDIA GPUs of compute capability 9 on (Hopper) only: an
    older GPU has no ``griddepcontrol``, and a ROCm GPU answers as "cuda" with versions of
    its own (an MI300 says 9.4)."""
    for hip, capability, expected in ((None, (9, 0), True), (None, (10, 0), True), (None, (8, 9), False),
                                      ("6.2", (9, 4), False)):
        monkeypatch.setattr(torch.version, "hip", hip)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index, c=capability: c)
        pdl._supported.cache_clear()
        assert pdl._supported(0) is expected, (hip, capability)
    pdl._supported.cache_clear()


@triton.jit
def _lines_kernel(w_ptr, out_ptr, N, K, K_SPLIT, stride_wn, INT4: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, TILES: tl.constexpr, LINES: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_start = tl.program_id(1) * K_SPLIT
    if INT4:
        lines = quant_matmul._int4_lines(w_ptr, rn, N, K, k_start, K_SPLIT, stride_wn, TILES * BLOCK_K)
    else:
        lines = quant_matmul._fp8_lines(w_ptr, rn, N, K, k_start, K_SPLIT, stride_wn, TILES * BLOCK_K)
    program = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
    offs = tl.arange(0, BLOCK_N)[:, None] * LINES + tl.arange(0, LINES)[None, :]
    tl.store(out_ptr + program * BLOCK_N * LINES + offs, lines - w_ptr.to(tl.int64))


@pytest.mark.parametrize("int4, tiles", [(False, 2), (False, 8), (True, 1), (True, 4)])
@pytest.mark.parametrize("n, k, block_n, block_k, split", [
    (100, 4096, 64, 256, 4),   # ragged N
    (64, 576, 32, 64, 3),      # K not a multiple of 128 or of the split
    (33, 200, 32, 32, 2),      # a tile shorter than a line
])
def test_gemm_prefetches_stay_inside_the_weight_and_the_programs_share_of_k(int4, tiles, n, k, block_n, block_k,
                                                                            split):
    """Every address a GEMM's program prefetches, asked for its first ``tiles`` K tiles,
    lies in its weight, in one of its own columns' rows (the last row for columns past N),
    between the first and the last byte of its share of K; and they are, from the line its
    share starts in, as many lines as those tiles' bytes take, as far as the share goes (a
    row that starts mid-line has its tiles' last bytes left out)."""
    device = torch.device("cuda" if CUDA else "cpu")
    block_k = 128 if int4 else block_k
    k_pad = triton.cdiv(k, 128) * 128 if int4 else k
    row_bytes = k_pad // 2 if int4 else k
    w = torch.zeros(n, row_bytes, dtype=torch.uint8, device=device)
    stride = row_bytes // 4 if int4 else row_bytes  # (int32 words a row, for 4-bit)
    k_split = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    grid = (triton.cdiv(n, block_n), triton.cdiv(k, k_split))
    wanted = tiles * block_k // 2 if int4 else tiles * block_k  # (bytes)
    lines = (wanted + 127) // 128
    out = torch.full((grid[0] * grid[1] * block_n * lines,), -1, dtype=torch.int64, device=device)
    _lines_kernel[grid](w, out, n, k, k_split, stride, INT4=int4, BLOCK_N=block_n, BLOCK_K=block_k, TILES=tiles,
                        LINES=lines)
    out = out.view(grid[0], grid[1], block_n, lines).cpu()
    for pn in range(grid[0]):
        for pk in range(grid[1]):
            first, end = pk * k_split, min(k, (pk + 1) * k_split)  # the program's inputs
            lo, hi = (first // 2, (end - 1) // 2) if int4 else (first, end - 1)
            for c in range(block_n):
                row = min(pn * block_n + c, n - 1)
                for offset in out[pn, pk, c].tolist():
                    assert 0 <= offset < w.numel()
                    assert offset // row_bytes == row and lo <= offset % row_bytes <= hi, (pn, pk, c, offset)
                # The lines of that many bytes, from the line the share's first byte is in
                # (a row that starts mid-line gets fewer of its bytes: its lines are as many).
                first_line = (row * row_bytes + lo) // 128
                asked = set(range(first_line, min(first_line + lines, (row * row_bytes + hi) // 128 + 1)))
                assert asked == {offset // 128 for offset in out[pn, pk, c].tolist()}, (pn, pk, c)


@triton.jit
def _kv_lines_kernel(cache_ptr, table_ptr, out_ptr, start, end, kv_head, stride_b, stride_s, stride_h,
                     HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, KEYS: tl.constexpr,
                     LINES: tl.constexpr):
    lines = paged_attention._kv_lines(cache_ptr, table_ptr, start, end, kv_head, stride_b, stride_s, stride_h,
                                      HEAD_DIM, BLOCK_D, BLOCK_SIZE, KEYS)
    offs = tl.arange(0, KEYS)[:, None] * LINES + tl.arange(0, LINES)[None, :]
    tl.store(out_ptr + offs, lines - cache_ptr.to(tl.int64))  # (the cache starts on a line)


@pytest.mark.parametrize("dtype, head_dim", [(torch.bfloat16, 128), (torch.float8_e4m3fn, 64), (torch.float32, 80),
                                             (torch.bfloat16, 32), (torch.float8_e4m3fn, 96), (torch.bfloat16, 80)])
@pytest.mark.parametrize("start, end", [(0, 128), (64, 100), (130, 131), (5, 700)])
def test_attention_prefetches_the_lines_of_its_own_heads_rows_at_its_keys(dtype, head_dim, start, end):
    """The paged attention prefetches, for each of the first 128 keys of its range (keys
    past the range's end repeat the last), exactly the 128-byte lines its KV head's row lies
    in, found through the block table, rows that cross a line's edge included (a float8
    row of 96 bytes takes two lines where it starts 64 or 96 bytes into one)."""
    device = torch.device("cuda" if CUDA else "cpu")
    num_blocks, block_size, kv_heads, keys = 64, 16, 3, 128
    shape = (num_blocks, block_size, kv_heads, head_dim)
    nbytes = math.prod(shape) * dtype.itemsize
    buffer = torch.zeros(nbytes + 128, dtype=torch.uint8, device=device)
    skip = -buffer.data_ptr() % 128  # the cache starting on a line, as a GPU allocation does
    cache = buffer[skip:skip + nbytes].view(dtype).view(shape)
    table = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0)).to(torch.int32).to(device)
    size, row_bytes = cache.element_size(), head_dim * cache.element_size()
    block_d = triton.next_power_of_2(head_dim)
    lines = triton.cdiv(block_d * size, 128) * (1 if row_bytes % 128 == 0 else 2)
    out = torch.full((keys, lines), -1, dtype=torch.int64, device=device)
    _kv_lines_kernel[(1,)](cache, table, out, start, end, 2, *cache.stride()[:3], HEAD_DIM=head_dim,
                           BLOCK_D=block_d, BLOCK_SIZE=block_size, KEYS=keys, LINES=lines)
    table, out = table.cpu(), out.cpu()
    straddling = 0  # rows in one line more than their bytes fill
    for i in range(keys):
        pos = min(start + i, end - 1)
        row = size * (int(table[pos // block_size]) * cache.stride(0) + pos % block_size * cache.stride(1)
                      + 2 * cache.stride(2))
        straddling += (row + row_bytes - 1) // 128 - row // 128 >= triton.cdiv(row_bytes, 128)
        got = out[i].tolist()
        assert all(a % 128 == 0 for a in got), (i, got)
        assert {a // 128 for a in got} == set(range(row // 128, (row + row_bytes - 1) // 128 + 1)), (i, got, row)
    assert straddling or row_bytes != 96 or end - start < 4  # (96-byte rows cross lines: the case is met)


COMPILE_WITH_PDL = r"""
import re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from specserve.kernels import (fused_act, fused_norm, fused_rotary, paged_attention as pa, quant_matmul as qm,
                               store_kv as skv)

# Global memory touched: loads, stores, atomics and async copies (not ld.param, not prefetch).
TOUCH = re.compile(r"^\s*(@!?%\w+\s+)?(ld|st|atom|red|cp\.async)(\.[\w:]+)*?\.global", re.M)

checked = set()

# What the paged attention may load before its wait: int32 scalars (the batch's layout), not
# its queries (fp16 here), tree masks (int64), keys or values.
LAYOUT_LOAD = re.compile(r"^\s*(@!?%\w+\s+)?ld\.global(\.nc)?\.b32 \{ %r\d+ \}", re.M)

def check(fn, pointers, constants, num_warps=4, num_stages=2, prefetch=False, reads_layout=False):
    checked.add(fn)
    constants = dict(constants, PDL=1, **({"PREFETCH": prefetch} if "PREFETCH" in fn.arg_names else {}))
    prefetch = bool(prefetch)  # (the GEMMs': K tiles; the attention's: whether)
    constants.update({p.name: p.default for p in fn.params  # (constexprs left at their defaults)
                      if p.is_constexpr and p.has_default and p.name not in constants})
    signature = {name: "constexpr" if name in constants else pointers.get(name, "i32") for name in fn.arg_names}
    constexprs = {(fn.arg_names.index(name),): value for name, value in constants.items()}
    ptx = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                         target=GPUTarget("cuda", 90, 32),
                         options=dict(num_warps=num_warps, num_stages=num_stages)).asm["ptx"]
    wait = ptx.find("griddepcontrol.wait")
    assert wait >= 0 and "griddepcontrol.launch_dependents" in ptx, fn
    early = [ptx[m.start():ptx.find("\n", m.start())] for m in TOUCH.finditer(ptx[:wait])]
    if reads_layout:
        assert early and all(LAYOUT_LOAD.match(line) for line in early), (fn, early)
    else:
        assert not early, (fn, early)
    assert TOUCH.search(ptx[wait:]), fn  # (the pattern finds what the kernel does touch)
    assert ("prefetch.global.L2" in ptx[:wait]) == prefetch, fn

tiles = dict(HAS_BIAS=False, SPLIT_SUM=2, BLOCK_M=16, BLOCK_K=128, UPCAST=False, IEEE=False)
split = dict(part_ptr="*fp32", count_ptr="*i32")
fp8 = dict(split, xs_ptr="*fp32", w_ptr="*fp8e4nv", ws_ptr="*fp32", bias_ptr="*bf16", out_ptr="*bf16")
int4 = dict(split, x_ptr="*bf16", w_ptr="*i32", s_ptr="*bf16", z_ptr="*u8", bias_ptr="*bf16", out_ptr="*bf16")
for prefetch in (0, 2, 8):  # (K tiles)
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
check(fused_act._round_row_parts_kernel, dict(out_ptr="*fp8e4nv", scales_ptr="*fp32", values_ptr="*bf16",
      parts_ptr="*fp32"), dict(BLOCK=1024, PARTS=16))
check(fused_rotary._rotary_kernel, dict(q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", positions_ptr="*i64",
      cos_sin_ptr="*fp32", k_cache_ptr="*bf16", v_cache_ptr="*bf16", slot_mapping_ptr="*i64", k_scale="fp32",
      v_scale="fp32"), dict(NUM_HEADS=32, NUM_KV_HEADS=8, HALF=64, BLOCK_H=32, BLOCK_KV=8, BLOCK_HALF=64,
      BLOCK_SIZE=16, STORE_KV=True, KV_FP8=False))
check(skv._store_kv_kernel, dict(key_ptr="*bf16", value_ptr="*bf16", k_cache_ptr="*bf16", v_cache_ptr="*bf16",
      slot_mapping_ptr="*i64", k_scale="fp32", v_scale="fp32"),
      dict(NUM_KV_HEADS=8, HEAD_DIM=128, BLOCK_SIZE=16, BLOCK_H=8, BLOCK_D=128, KV_FP8=False))
for prefetch in (False, True):
    for split_kv in (False, True):
        check(pa._paged_attention_kernel, dict(out_ptr="*fp16", q_ptr="*fp16", k_cache_ptr="*fp16",
              v_cache_ptr="*fp16", part_out_ptr="*fp32", part_lse_ptr="*fp32", block_tables_ptr="*i32",
              cu_query_lens_ptr="*i32", seq_lens_ptr="*i32", tree_masks_ptr="*i64", qk_scale="fp32",
              v_scale="fp32"),
              dict(GROUP=4, HEAD_DIM=128, BLOCK_D=128, BLOCK_SIZE=16, BLOCK_Q=1, BLOCK_M=16, BLOCK_N=64,
                   SPLIT_KV=split_kv, USE_WINDOW=False, SOFTCAP=False, UPCAST_DOT=False, IEEE_DOT=False,
                   FP16_DOT=False, TREE=True), prefetch=prefetch, reads_layout=True)
check(pa._reduce_splits_kernel, dict(out_ptr="*bf16", part_out_ptr="*fp32", part_lse_ptr="*fp32",
      cu_query_lens_ptr="*i32"), dict(HEAD_DIM=128, BLOCK_D=128, BLOCK_S=32))
# Every kernel that takes PDL (and so may be launched with it) is among those checked.
import importlib, pkgutil, specserve.kernels as package
takes_pdl = {fn for info in pkgutil.iter_modules(package.__path__)
             for fn in vars(importlib.import_module("specserve.kernels." + info.name)).values()
             if isinstance(fn, triton.runtime.jit.JITFunction) and "PDL" in fn.arg_names and fn.__name__ != "wait"}
assert takes_pdl == checked, sorted(f.__name__ for f in takes_pdl ^ checked)
print("compiled")
"""


def test_pdl_kernels_touch_no_global_memory_before_their_wait():
    """(Compiled offline on any machine: the GPU tests run the kernels, not this check.)"""
    compiles_for_sm90(COMPILE_WITH_PDL)
