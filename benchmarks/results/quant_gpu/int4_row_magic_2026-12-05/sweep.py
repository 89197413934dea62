"""4-bit weights at one row: the shipped ``_int4_row_kernel`` against variants that
(a) read each nibble as the float 1 + q/16 by a shift and a mask (no int-to-float
conversion, no subtraction: Σ (1 + q/16)·x = Σx + Σ q·x / 16) and (b) load two chunks of
128 inputs before computing either. µs per projection (Llama-3.1-8B, groups of 128),
CUDA-graph replay over weight copies larger than L2.

    python benchmarks/results/quant_gpu/int4_row_magic_2026-12-05/sweep.py [out.json]
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
def _chunk(words, x_ptr, row, kc, K, s_ptr, z_ptr, rn, n_valid, stride_sn, GROUP, MAGIC: tl.constexpr):
    """One chunk's contribution Σ (q − z)·x · s for each column (groups of 128)."""
    rc = tl.arange(0, 16)
    tile = tl.zeros(words.shape, dtype=tl.float32)
    x_sum = tl.zeros([16], dtype=tl.float32)
    for j in tl.static_range(8):
        a = tl.load(x_ptr + kc + 16 * j + rc, mask=(kc + 16 * j + rc) < K, other=0.0).to(tl.float32)
        if MAGIC:  # nibble j to bits 19..22 of the float 1.0: 1 + q/16, exactly
            if 4 * j <= 19:
                bits = words << (19 - 4 * j)
            else:
                bits = words >> (4 * j - 19)
            f = ((bits & 0x00780000) | 0x3F800000).to(tl.float32, bitcast=True)
        else:
            f = ((words >> (4 * j)) & 0xF).to(tl.float32)
        tile += f * a[None, :]
        x_sum += a
    group = rn.to(tl.int64) * stride_sn + kc // GROUP
    s = tl.load(s_ptr + group, mask=n_valid, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + group, mask=n_valid, other=0).to(tl.float32)
    xs = tl.sum(x_sum, axis=0)
    if MAGIC:
        return (16.0 * tl.sum(tile, axis=1) - (16.0 + z) * xs) * s
    else:
        return (tl.sum(tile, axis=1) - z * xs) * s


@triton.jit(do_not_specialize=["M"])
def _row_variant(x_ptr, w_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, part_ptr, count_ptr, M, N, K, K_SPLIT,
                 stride_xm, stride_wn, stride_sn, stride_om, stride_os, GROUP,
                 HAS_BIAS: tl.constexpr, SPLIT_SUM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, TILE_IN_GROUP: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
                 MAGIC: tl.constexpr, TWO: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rc = tl.arange(0, 16)
    n_valid = rn < N
    k_start = tl.program_id(2) * K_SPLIT
    k_stop = tl.minimum(k_start + K_SPLIT, K)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    xr = x_ptr + row * stride_xm
    wr = w_ptr + rn[:, None].to(tl.int64) * stride_wn
    if TWO:
        for k0 in range(k_start, k_stop, 256):
            w0 = tl.load(wr + (k0 // 8 + rc)[None, :], mask=n_valid[:, None], other=0)
            second = k0 + 128 < k_stop
            w1 = tl.load(wr + ((k0 + 128) // 8 + rc)[None, :],
                         mask=n_valid[:, None] & ((k0 + 128 + 0 * rc) < k_stop)[None, :], other=0)
            acc += _chunk(w0, xr, row, k0, K, s_ptr, z_ptr, rn, n_valid, stride_sn, GROUP, MAGIC)
            if second:
                acc += _chunk(w1, xr, row, k0 + 128, K, s_ptr, z_ptr, rn, n_valid, stride_sn, GROUP, MAGIC)
    else:
        for k0 in range(k_start, k_stop, 128):
            w0 = tl.load(wr + (k0 // 8 + rc)[None, :], mask=n_valid[:, None], other=0)
            acc += _chunk(w0, xr, row, k0, K, s_ptr, z_ptr, rn, n_valid, stride_sn, GROUP, MAGIC)
    qm._finish(acc, row * stride_om + rn, rn, n_valid, bias_ptr, out_ptr, part_ptr, count_ptr, stride_os, HAS_BIAS,
               SPLIT_SUM)


def call(layer, x, kernel, tiles, consts):
    n, k = layer.packed.shape[0], x.shape[-1]

    def args(x2, out, part, counters, k_split, stride_om, stride_os):
        return (layer.packed, layer.scales, layer.zeros, layer.scales, out, part, counters, x2.shape[0], n, k,
                k_split, x2.stride(0), layer.packed.stride(0), layer.scales.stride(0), stride_om, stride_os,
                layer.group)
    return qm._launch(kernel, "w4a16_row", x, n, k, 128, x.dtype, args,
                      lambda t: {"TILE_IN_GROUP": True, **consts}, None, False, tiles)


def main() -> None:
    device = torch.device("cuda" if CUDA else "cpu")
    rows = []
    for name, n, k, linear, g in projections_8b(device) if CUDA else [("small", 96, 512, None, None)]:
        if CUDA:
            layer = quantized_layer(linear, SCHEMES["int4 W4A16 g128"])
            copies = min(15, -(-256_000_000 // layer_bytes(layer)) - 1)
            layers = [layer] + [copy.deepcopy(layer) for _ in range(copies)]
        else:
            from specserve.models.checkpoint_quant import Int4Linear, quantize_int4
            g = torch.Generator().manual_seed(0)
            layer = Int4Linear(quantize_int4(torch.randn(n, k, generator=g) * 0.02, 128), None)
            layers = [layer]
        x = torch.randn(1, k, device=device, generator=g).to(torch.bfloat16 if CUDA else torch.float32)
        from specserve.models.checkpoint_quant import quantize_int4
        source = linear.weight.detach() if CUDA else torch.randn(n, k, generator=torch.Generator().manual_seed(0)) * 0.02
        want = x.double() @ quantize_int4(source, 128).dequantize().double().T
        planned = qm.plan(True, "w4a16_row", n, k, 128, device)
        variants = {"shipped": (qm._int4_row_kernel, planned, {})}
        for magic in (False, True):
            for two in (False, True):
                for bn, split in ((planned.block_n, planned.split), (64, 16), (128, 8), (256, 16)):
                    t = qm.Tiles(1, bn, 128, split, 4, planned.num_stages)
                    variants[f"{'magic' if magic else 'cvt'}{' two' if two else ''} n{bn} s{split}"] = (
                        _row_variant, t, {"MAGIC": magic, "TWO": two})
        base = call(layer, x, *variants["shipped"]).float()
        for label, (kernel, tiles, consts) in variants.items():
            try:
                got = call(layer, x, kernel, tiles, consts).float()
                err = ((got - base).norm() / base.norm()).item()
                if CUDA:
                    from deterministic import graph_us
                    us = graph_us(lambda k=kernel, t=tiles, c=consts, ls=layers, x=x: [call(each, x, k, t, c) for each in ls], 20, device,
                                  calls=1) / len(layers)
                else:
                    us = float("nan")
            except Exception as e:  # noqa: BLE001  (a variant that fails to compile is reported, not fatal)
                print(name, label, "FAILED", repr(e)[:300], flush=True)
                continue
            row = {"gemm": name, "variant": label, "tiles": tiles._asdict(), "us": round(us, 2),
                   "rel_diff_vs_shipped": float(f"{err:.3g}")}
            row["rel_err_fp64"] = float(f"{((got.double() - want).norm() / want.norm()).item():.3g}")
            rows.append(row)
            print(json.dumps(row), flush=True)
        if CUDA:
            layers, layer, linear = [], None, None
            torch.cuda.empty_cache()
    if len(sys.argv) > 1:
        Path(sys.argv[1]).write_text(json.dumps(rows, indent=1))


main()
