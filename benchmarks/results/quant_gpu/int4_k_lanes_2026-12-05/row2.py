"""The shipped one-row 4-bit kernel's tiling (``[BLOCK_N columns, 16 words]`` a chunk, K
split among programs) with (a) each chunk's products kept per column and word, scaled by
the chunk's group scale and summed across the 16 words once at the end instead of once a
chunk (``DEFER``), and (b) cheaper nibbles (``NIB``): 0 shift, mask and int-to-float; 1 the
nibble masked in place into the mantissa of 2^23 and 2^23 subtracted (q · 16^j exactly, the
input scaled by 16^-j; one shift a word for the upper three); 2 the nibble shifted into
bits 19–22 of 1.0 (1 + q/16; Σx subtracted once). µs per projection as in ``sweep.py``, and
the SASS instruction mix of each variant as this machine's Triton compiles it.

    python benchmarks/results/quant_gpu/int4_k_lanes_2026-12-05/row2.py [out.json]

On a CPU (``TRITON_INTERPRET=1``) NIB 3 (inline PTX) cannot run; it checks the others.
"""
import copy
import json
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sweep import CUDA, SCHEMES, call, layer_bytes, projections_8b, qm, quantized_layer


@triton.jit
def _nib(words, hi, j: tl.constexpr, NIB: tl.constexpr):
    """Nibble j of each word as fp32 (see the module's docstring for NIB); ``hi`` is
    ``words >> 12`` (used by NIB 1 for nibbles 5–7)."""
    if NIB == 1:
        if j <= 4:
            bits = (words & (0xF << (4 * j))) | 0x4B000000
        else:
            bits = (hi & (0xF << (4 * (j - 3)))) | 0x4B000000
        return bits.to(tl.float32, bitcast=True) - 8388608.0
    elif NIB == 2:
        if j <= 4:
            bits = words << (19 - 4 * j)
        else:
            bits = words >> (4 * j - 19)
        return ((bits & 0x00780000) | 0x3F800000).to(tl.float32, bitcast=True)
    else:
        return ((words >> (4 * j)) & 0xF).to(tl.float32)


# Σ_j nibble_j(w) · a_j for one word w and eight fp32 inputs (the a_j pre-scaled by 16^-(j)
# for j ≤ 4 and 16^-(j-3) above, as NIB 1): each nibble masked in place into 2^23's
# mantissa (one lop3, 2^23 held in a register), 2^23 subtracted, then an fma.
_DOT8 = tl.constexpr("""{
.reg .b32 m, h, t;
mov.b32 m, 0x4B000000;
shr.u32 h, $1, 12;
lop3.b32 t, $1, 0x0000000F, m, 0xEA; sub.f32 t, t, 0f4B000000; mul.f32 $0, t, $2;
lop3.b32 t, $1, 0x000000F0, m, 0xEA; sub.f32 t, t, 0f4B000000; fma.rn.f32 $0, t, $3, $0;
lop3.b32 t, $1, 0x00000F00, m, 0xEA; sub.f32 t, t, 0f4B000000; fma.rn.f32 $0, t, $4, $0;
lop3.b32 t, $1, 0x0000F000, m, 0xEA; sub.f32 t, t, 0f4B000000; fma.rn.f32 $0, t, $5, $0;
lop3.b32 t, $1, 0x000F0000, m, 0xEA; sub.f32 t, t, 0f4B000000; fma.rn.f32 $0, t, $6, $0;
lop3.b32 t, h, 0x00000F00, m, 0xEA; sub.f32 t, t, 0f4B000000; fma.rn.f32 $0, t, $7, $0;
lop3.b32 t, h, 0x0000F000, m, 0xEA; sub.f32 t, t, 0f4B000000; fma.rn.f32 $0, t, $8, $0;
lop3.b32 t, h, 0x000F0000, m, 0xEA; sub.f32 t, t, 0f4B000000; fma.rn.f32 $0, t, $9, $0;
}""")


@triton.jit(do_not_specialize=["M"])
def _row2(x_ptr, w_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, part_ptr, count_ptr, M, N, K, K_SPLIT,
          stride_xm, stride_wn, stride_sn, stride_om, stride_os, GROUP,
          HAS_BIAS: tl.constexpr, SPLIT_SUM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
          BLOCK_K: tl.constexpr, TILE_IN_GROUP: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
          NIB: tl.constexpr = 0, DEFER: tl.constexpr = True):
    row = tl.program_id(0).to(tl.int64)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rc = tl.arange(0, 16)
    n_valid = rn < N
    k_start = tl.program_id(2) * K_SPLIT
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    total = tl.zeros([BLOCK_N, 16], dtype=tl.float32)
    for k0 in range(k_start, tl.minimum(k_start + K_SPLIT, K), BLOCK_K):
        words = tl.load(w_ptr + rn[:, None].to(tl.int64) * stride_wn + (k0 // 8 + rc)[None, :],
                        mask=n_valid[:, None], other=0)                      # [BLOCK_N, 16]; K padded
        hi = words >> 12
        group = rn.to(tl.int64) * stride_sn + k0 // GROUP
        s = tl.load(s_ptr + group, mask=n_valid, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + group, mask=n_valid, other=0).to(tl.float32)
        tile = tl.zeros([BLOCK_N, 16], dtype=tl.float32)
        x_sum = tl.zeros([16], dtype=tl.float32)
        if NIB == 3:
            xr = x_ptr + row * stride_xm + k0 + rc
            a0 = tl.load(xr, mask=(k0 + rc) < K, other=0.0).to(tl.float32)
            a1 = tl.load(xr + 16, mask=(k0 + 16 + rc) < K, other=0.0).to(tl.float32)
            a2 = tl.load(xr + 32, mask=(k0 + 32 + rc) < K, other=0.0).to(tl.float32)
            a3 = tl.load(xr + 48, mask=(k0 + 48 + rc) < K, other=0.0).to(tl.float32)
            a4 = tl.load(xr + 64, mask=(k0 + 64 + rc) < K, other=0.0).to(tl.float32)
            a5 = tl.load(xr + 80, mask=(k0 + 80 + rc) < K, other=0.0).to(tl.float32)
            a6 = tl.load(xr + 96, mask=(k0 + 96 + rc) < K, other=0.0).to(tl.float32)
            a7 = tl.load(xr + 112, mask=(k0 + 112 + rc) < K, other=0.0).to(tl.float32)
            x_sum = a0 + a1 + a2 + a3 + a4 + a5 + a6 + a7
            tile = tl.inline_asm_elementwise(
                _DOT8, "=r,r,r,r,r,r,r,r,r,r",
                [words, tl.broadcast_to(a0[None, :].to(tl.int32, bitcast=True), (BLOCK_N, 16)),
                 tl.broadcast_to((a1 * 0.0625)[None, :].to(tl.int32, bitcast=True), (BLOCK_N, 16)),
                 tl.broadcast_to((a2 * 0.00390625)[None, :].to(tl.int32, bitcast=True), (BLOCK_N, 16)),
                 tl.broadcast_to((a3 * 0.000244140625)[None, :].to(tl.int32, bitcast=True), (BLOCK_N, 16)),
                 tl.broadcast_to((a4 * 0.0000152587890625)[None, :].to(tl.int32, bitcast=True), (BLOCK_N, 16)),
                 tl.broadcast_to((a5 * 0.00390625)[None, :].to(tl.int32, bitcast=True), (BLOCK_N, 16)),
                 tl.broadcast_to((a6 * 0.000244140625)[None, :].to(tl.int32, bitcast=True), (BLOCK_N, 16)),
                 tl.broadcast_to((a7 * 0.0000152587890625)[None, :].to(tl.int32, bitcast=True), (BLOCK_N, 16))],
                dtype=tl.int32, is_pure=True, pack=1).to(tl.float32, bitcast=True)
        for j in tl.static_range(8 if NIB != 3 else 0):
            kj = k0 + 16 * j
            a = tl.load(x_ptr + row * stride_xm + kj + rc, mask=(kj + rc) < K, other=0.0).to(tl.float32)
            if NIB == 1:
                if j <= 4:
                    aq = a * (0.0625 ** j)
                else:
                    aq = a * (0.0625 ** (j - 3))
            else:
                aq = a
            tile += _nib(words, hi, j, NIB) * aq[None, :]
            x_sum += a
        if NIB == 2:
            tile = tile * 16.0
            xs = tl.sum(x_sum, axis=0) * 16.0 + z * tl.sum(x_sum, axis=0)
        else:
            xs = z * tl.sum(x_sum, axis=0)
        if DEFER:
            total += tile * s[:, None]
            acc -= xs * s
        else:
            acc += (tl.sum(tile, axis=1) - xs) * s
    if DEFER:
        acc += tl.sum(total, axis=1)
    qm._finish(acc, row * stride_om + rn, rn, n_valid, bias_ptr, out_ptr, part_ptr, count_ptr, stride_os, HAS_BIAS,
               SPLIT_SUM)


def sass_mix(kernel, consts, tiles):
    """SASS opcode counts of ``kernel`` compiled for this GPU (or sm_90) by this Triton."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    constants = dict(HAS_BIAS=False, SPLIT_SUM=2 if tiles.split > 1 else 0, BLOCK_M=1, BLOCK_N=tiles.block_n,
                     BLOCK_K=128, TILE_IN_GROUP=True, UPCAST=False, IEEE=False, **consts)
    pointers = {"x_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*bf16", "z_ptr": "*u8", "bias_ptr": "*bf16",
                "out_ptr": "*bf16", "part_ptr": "*fp32", "count_ptr": "*i32"}
    signature = {name: "constexpr" if name in constants else pointers.get(name, "i32") for name in kernel.arg_names}
    constexprs = {(kernel.arg_names.index(name),): value for name, value in constants.items()}
    c = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": tiles.num_warps,
                                                                      "num_stages": tiles.num_stages})
    tool = Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(c.asm["cubin"])
    sass = subprocess.run([str(tool), "-sass", f.name], capture_output=True, text=True, check=True).stdout
    os.unlink(f.name)
    ops = Counter(o.split(".")[0] for o in re.findall(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P[T\d]\s+)?([A-Z][A-Z0-9_.]*)", sass))
    return {"total": sum(ops.values()), **dict(ops.most_common(12))}


def variants(planned):
    """The first run (``row2_1.json``) timed NIB 0–2 with and without DEFER at the planned
    tiles and at four others; the second, these."""
    out = {"shipped": (qm._int4_row_kernel, planned, {}),
           "row2 nib1": (_row2, planned, {"NIB": 1, "DEFER": False}),
           "row2 nib3": (_row2, planned, {"NIB": 3, "DEFER": False})}
    for bn, split, warps in ((64, 16, 4), (128, 8, 4), (128, 16, 8), (128, 16, 2), (64, 16, 2), (256, 16, 4),
                             (256, 8, 4), (256, 16, 8), (512, 16, 8), (512, 8, 8)):
        out[f"row2 nib3 n{bn} s{split} w{warps}"] = (
            _row2, qm.Tiles(1, bn, 128, split, warps, planned.num_stages, True), {"NIB": 3, "DEFER": False})
    return out


def main() -> None:
    device = torch.device("cuda" if CUDA else "cpu")
    from specserve.models.checkpoint_quant import Int4Linear, quantize_int4
    rows = []
    shapes = projections_8b(device) if CUDA else [("small", 96, 640, None, None)]
    mixes = {}
    for name, n, k, linear, g in shapes:
        if CUDA:
            layer = quantized_layer(linear, SCHEMES["int4 W4A16 g128"])
            copies = min(15, -(-256_000_000 // layer_bytes(layer)) - 1)
            layers = [layer] + [copy.deepcopy(layer) for _ in range(copies)]
            source = linear.weight.detach()
        else:
            g = torch.Generator().manual_seed(0)
            source = torch.randn(n, k, generator=g) * 0.02
            layer = Int4Linear(quantize_int4(source, 128), None)
            layers = [layer]
        x = torch.randn(1, k, device=device, generator=g).to(torch.bfloat16 if CUDA else torch.float32)
        want = x.double() @ quantize_int4(source, 128).dequantize().to(device).double().T
        planned = qm.plan(True, "w4a16_row", n, k, 128, device)
        for label, (kernel, tiles, consts) in variants(planned).items():
            try:
                got = call(layer, x, kernel, tiles, consts).double()
                err = ((got - want).norm() / want.norm()).item()
                us = float("nan")
                if CUDA:
                    from deterministic import graph_us
                    us = graph_us(lambda k=kernel, t=tiles, c=consts, ls=layers, x=x: [call(each, x, k, t, c) for each in ls],
                                  20, device, calls=1) / len(layers)
                    if label not in mixes and name == "gate_up":
                        mixes[label] = sass_mix(kernel, consts, tiles)
            except Exception as e:  # noqa: BLE001  (a variant that fails to compile is reported, not fatal)
                print(name, label, "FAILED", repr(e)[:300], flush=True)
                continue
            row = {"gemm": name, "variant": label, "tiles": tiles._asdict(), "us": round(us, 2),
                   "rel_err_fp64": float(f"{err:.3g}")}
            rows.append(row)
            print(json.dumps(row), flush=True)
        if CUDA:
            layers, layer, linear = [], None, None
            torch.cuda.empty_cache()
    for label, mix in mixes.items():
        print("sass", label, json.dumps(mix), flush=True)
    if len(sys.argv) > 1:
        Path(sys.argv[1]).write_text(json.dumps({"rows": rows, "sass": mixes}, indent=1))


if __name__ == "__main__":
    main()
