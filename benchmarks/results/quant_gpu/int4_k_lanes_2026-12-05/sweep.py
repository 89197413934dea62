"""4-bit weights at one row: the shipped ``_int4_row_kernel`` (each program a
``[128 columns, 16 words]`` tile, K split 8–16 ways, partial sums added by the tile's last
program) against ``_lanes``, where a warp's lanes read consecutive words of the same
columns' rows: a program holds ``BLOCK_N`` columns' rows whole (``[BLOCK_N, CH, 16]``
words an iteration, ``CH`` chunks of 128 inputs), so each load is 512 contiguous bytes
of one row, K needs no split and no partial sums, and each column's sum is reduced across
lanes once at the end. µs per projection (Llama-3.1-8B, AWQ-style groups of 128), CUDA-graph
replay over weight copies larger than L2; on a CPU (``TRITON_INTERPRET=1``) it checks the
outputs only.

    python benchmarks/results/quant_gpu/int4_k_lanes_2026-12-05/sweep.py [out.json]
"""
import copy
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT), str(ROOT.parent / "tests")]
from quant_gpu import SCHEMES, layer_bytes, projections_8b, quantized_layer
from specserve.kernels import quant_matmul as qm

CUDA = torch.cuda.is_available()


@triton.jit
def _nibble(words, j: tl.constexpr, TRICK: tl.constexpr):
    """Nibble j of each word as fp32: q exactly (TRICK 0: shift, mask, convert), or
    q · 16^(j mod 4) exactly (TRICK 1: the nibble masked in place into the mantissa of 2^23,
    2^23 subtracted: no shift for nibbles 0–3, no int-to-float conversion)."""
    if TRICK:
        part = words if j < 4 else words >> 16
        bits = (part & (0xF << (4 * (j % 4)))) | 0x4B000000
        return bits.to(tl.float32, bitcast=True) - 8388608.0
    else:
        return ((words >> (4 * j)) & 0xF).to(tl.float32)


@triton.jit(do_not_specialize=["M"])
def _lanes(x_ptr, w_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, part_ptr, count_ptr, M, N, K, K_SPLIT,
           stride_xm, stride_wn, stride_sn, stride_om, stride_os, GROUP,
           HAS_BIAS: tl.constexpr, SPLIT_SUM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
           BLOCK_K: tl.constexpr, TILE_IN_GROUP: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
           PREFETCH: tl.constexpr = False, TRICK: tl.constexpr = False):
    CH: tl.constexpr = BLOCK_K // 128
    row = tl.program_id(0).to(tl.int64)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rh = tl.arange(0, CH)
    rc = tl.arange(0, 16)
    n_valid = rn < N
    chunks = tl.cdiv(K, 128)
    c_start = tl.program_id(2) * (K_SPLIT // 128)
    c_stop = tl.minimum(c_start + K_SPLIT // 128, chunks)
    wr = w_ptr + rn[:, None, None].to(tl.int64) * stride_wn + rc[None, None, :]
    sr = rn[:, None].to(tl.int64) * stride_sn
    xr = x_ptr + row * stride_xm
    acc = tl.zeros([BLOCK_N, CH], dtype=tl.float32)
    if PREFETCH:
        words = tl.load(wr + ((c_start + rh) * 16)[None, :, None],
                        mask=n_valid[:, None, None] & ((c_start + rh) < c_stop)[None, :, None], other=0)
    for c0 in range(c_start, c_stop, CH):
        ch = c0 + rh                                                      # [CH] chunk numbers
        c_valid = ch < c_stop
        if PREFETCH:  # the next chunks' words in flight while these are multiplied
            following = tl.load(wr + ((ch + CH) * 16)[None, :, None],
                                mask=n_valid[:, None, None] & ((ch + CH) < c_stop)[None, :, None], other=0)
        else:
            words = tl.load(wr + (ch * 16)[None, :, None], mask=n_valid[:, None, None] & c_valid[None, :, None],
                            other=0)                                      # [BLOCK_N, CH, 16]
        sv = n_valid[:, None] & c_valid[None, :]
        if TILE_IN_GROUP:
            dot = tl.zeros([BLOCK_N, CH, 16], dtype=tl.float32)
            x_sum = tl.zeros([CH, 16], dtype=tl.float32)
        for j in tl.static_range(8):
            kx = (ch * 128 + 16 * j)[:, None] + rc[None, :]               # [CH, 16] inputs of nibble j
            a = tl.load(xr + kx, mask=kx < K, other=0.0).to(tl.float32)
            q = _nibble(words, j, TRICK)
            aq = a * (0.0625 ** (j % 4)) if TRICK else a
            if TILE_IN_GROUP:
                dot += q * aq[None, :, :]
                x_sum += a
            else:
                group = sr + ((ch * 128 + 16 * j) // GROUP)[None, :]
                s = tl.load(s_ptr + group, mask=sv, other=0.0).to(tl.float32)
                z = tl.load(z_ptr + group, mask=sv, other=0).to(tl.float32)
                acc += (tl.sum(q * aq[None, :, :], axis=2) - z * tl.sum(a, axis=1)[None, :]) * s
        if TILE_IN_GROUP:
            group = sr + ((ch * 128) // GROUP)[None, :]
            s = tl.load(s_ptr + group, mask=sv, other=0.0).to(tl.float32)
            z = tl.load(z_ptr + group, mask=sv, other=0).to(tl.float32)
            acc += (tl.sum(dot, axis=2) - z * tl.sum(x_sum, axis=1)[None, :]) * s
        if PREFETCH:
            words = following
    qm._finish(tl.sum(acc, axis=1), row * stride_om + rn, rn, n_valid, bias_ptr, out_ptr, part_ptr, count_ptr,
               stride_os, HAS_BIAS, SPLIT_SUM)


def call(layer, x, kernel, tiles, consts=None):
    n, k = layer.packed.shape[0], x.shape[-1]

    def args(x2, out, part, counters, k_split, stride_om, stride_os):
        return (layer.packed, layer.scales, layer.zeros, layer.scales, out, part, counters, x2.shape[0], n, k,
                k_split, x2.stride(0), layer.packed.stride(0), layer.scales.stride(0), stride_om, stride_os,
                layer.group)
    return qm._launch(kernel, "w4a16_row", x, n, k, 128, x.dtype, args,
                      lambda t: {"TILE_IN_GROUP": layer.group % 128 == 0 or layer.group >= k, **(consts or {})}, None, False, tiles,
                      getattr(layer, "tile_counters", None))


def variants(planned):
    out = {"shipped": (qm._int4_row_kernel, planned, {})}
    for bn in (4, 8, 16):
        for ch in (4, 8):
            for warps in (2, 4):
                for prefetch in (False, True):
                    for trick in (False, True):
                        out[f"lanes n{bn} ch{ch} w{warps}{' pre' if prefetch else ''}{' trick' if trick else ''}"] = (
                            _lanes, qm.Tiles(1, bn, 128 * ch, 1, warps, 1), {"PREFETCH": prefetch, "TRICK": trick})
    return out


def main() -> None:
    device = torch.device("cuda" if CUDA else "cpu")
    from specserve.models.checkpoint_quant import Int4Linear, quantize_int4
    rows = []
    shapes = projections_8b(device) if CUDA else [("small", 96, 640, None, None)]
    for name, n, k, linear, g in shapes:
        if CUDA:
            layer = quantized_layer(linear, SCHEMES["int4 W4A16 g128"])
            copies = min(15, -(-256_000_000 // layer_bytes(layer)) - 1)
            layers = [layer] + [copy.deepcopy(layer) for _ in range(copies)]
            source = linear.weight.detach()
        else:
            g = torch.Generator().manual_seed(0)
            source = torch.randn(n, k, generator=g) * 0.02
        for group in ((128,) if CUDA else (128, 32, 640)):
            if not CUDA:
                layer = Int4Linear(quantize_int4(source, group), None)
                layers = [layer]
            x = torch.randn(1, k, device=device, generator=g).to(torch.bfloat16 if CUDA else torch.float32)
            want = x.double() @ quantize_int4(source, group).dequantize().to(device).double().T
            planned = qm.plan(True, "w4a16_row", n, k, 128, device)
            chosen = variants(planned) if CUDA else {
                "shipped": (qm._int4_row_kernel, planned, {}),
                **{f"lanes n4 ch2 pre{p} trick{t}": (_lanes, qm.Tiles(1, 4, 256, 1, 2, 1), {"PREFETCH": p, "TRICK": t})
                   for p in (False, True) for t in (False, True)},
                "lanes n8 ch4 split pre trick": (_lanes, qm.Tiles(1, 8, 512, 2, 4, 1),
                                                 {"PREFETCH": True, "TRICK": True})}
            for label, (kernel, tiles, consts) in chosen.items():
                try:
                    got = call(layer, x, kernel, tiles, consts).double()
                    err = ((got - want).norm() / want.norm()).item()
                    us = float("nan")
                    if CUDA:
                        from deterministic import graph_us
                        us = graph_us(lambda k=kernel, t=tiles, c=consts, ls=layers, x=x: [call(each, x, k, t, c) for each in ls],
                                      20, device, calls=1) / len(layers)
                except Exception as e:  # noqa: BLE001  (a variant that fails to compile is reported, not fatal)
                    print(name, label, "FAILED", repr(e)[:300], flush=True)
                    continue
                row = {"gemm": name, "group": group, "variant": label, "tiles": tiles._asdict(), "us": round(us, 2),
                       "rel_err_fp64": float(f"{err:.3g}")}
                rows.append(row)
                print(json.dumps(row), flush=True)
        if CUDA:
            layers, layer, linear = [], None, None
            torch.cuda.empty_cache()
    if len(sys.argv) > 1:
        Path(sys.argv[1]).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
