"""Quantized GEMMs at a decode or verify step's few rows with the weights as the product's
left operand ("swap AB": out^T = W · x^T), against the shipped kernels.

The shipped few-row kernels put x (1 to 16 rows, padded to 16) on the left and the weights
on the right: a 16-row product, which Hopper runs as mma.sync with the weights staged
through shared memory. With W on the left the product's M is the column tile (64 or 128),
its N the rows (16): the shape of a wgmma, whose left operand may come from registers,
where the 4-bit and float8 weights are widened. vLLM's CUTLASS FP8 GEMM swaps A and B for
small M for the same reason.

Prints one JSON line per (scheme, projection, rows): the planned kernel's µs and the best
swap variant's, and writes every timing to $OUT/swap_sweep.json. On a CPU (Triton's
interpreter) it checks the kernels' values on small shapes and times nothing.
"""
import copy
import json
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, "benchmarks")
sys.path.insert(0, "tests")
from specserve.kernels import quant_matmul as qm

from specserve.models.checkpoint_quant import (
    Fp8Linear,
    Int4Linear,
    quantize_fp8,
    quantize_int4,
)


@triton.jit(do_not_specialize=["M"])
def _fp8_swap(x_ptr, xs_ptr, w_ptr, ws_ptr, bias_ptr, out_ptr, M, N, K, K_SPLIT,
              stride_xm, stride_xsm, stride_wn, stride_wsn, stride_om, stride_os,
              AK, BN, BK,
              A_FP8: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_valid = rm < M
    n_valid = rn < N
    k_start = tl.program_id(2) * K_SPLIT
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(k_start, tl.minimum(k_start + K_SPLIT, K), BLOCK_K):
        k_valid = (k0 + rk) < K
        w = tl.load(w_ptr + rn[:, None].to(tl.int64) * stride_wn + (k0 + rk)[None, :],
                    mask=n_valid[:, None] & k_valid[None, :], other=0.0)      # [BLOCK_N, BLOCK_K]
        xt = tl.load(x_ptr + rm[None, :].to(tl.int64) * stride_xm + (k0 + rk)[:, None],
                     mask=m_valid[None, :] & k_valid[:, None], other=0.0)     # [BLOCK_K, BLOCK_M]
        ws = tl.load(ws_ptr + (rn // BN).to(tl.int64) * stride_wsn + k0 // BK, mask=n_valid, other=0.0)
        if UPCAST:
            part = tl.dot(w.to(tl.float32), xt.to(tl.float32), input_precision="ieee")
        elif A_FP8:
            part = tl.dot(w, xt)
        else:
            part = tl.dot(w.to(xt.dtype), xt)
        if A_FP8:
            xs = tl.load(xs_ptr + rm.to(tl.int64) * stride_xsm + k0 // AK, mask=m_valid, other=0.0)
            part = part * xs[None, :]
        acc += part * ws[:, None]
    out = out_ptr + tl.program_id(2) * stride_os + rm[None, :].to(tl.int64) * stride_om + rn[:, None]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=n_valid, other=0.0).to(tl.float32)[:, None]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_valid[None, :] & n_valid[:, None])


@triton.jit(do_not_specialize=["M"])
def _int4_swap(x_ptr, w_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, M, N, K, K_SPLIT,
               stride_xm, stride_wn, stride_sn, stride_om, stride_os, GROUP,
               HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, TILE_IN_GROUP: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
               DEQUANT: tl.constexpr):
    """DEQUANT: each nibble plane widened to (q - z) * s in x's dtype before its product (the
    shipped tiled kernel's values); else the product takes q as it is and the group's
    zero and scale apply to the chunk's sums (Σ q·x − z · Σ x) · s (the row kernel's)."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rc = tl.arange(0, 16)
    m_valid = rm < M
    n_valid = rn < N
    k_start = tl.program_id(2) * K_SPLIT
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(k_start, tl.minimum(k_start + K_SPLIT, K), BLOCK_K):
        words = tl.load(w_ptr + rn[:, None].to(tl.int64) * stride_wn + (k0 // 8 + rc)[None, :],
                        mask=n_valid[:, None], other=0)                      # [BLOCK_N, 16]
        group = rn.to(tl.int64) * stride_sn + k0 // GROUP
        s = tl.load(s_ptr + group, mask=n_valid, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + group, mask=n_valid, other=0).to(tl.float32)
        part = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        x_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
        for j in tl.static_range(8):
            kj = k0 + 16 * j
            xt = tl.load(x_ptr + rm[None, :].to(tl.int64) * stride_xm + (kj + rc)[:, None],
                         mask=m_valid[None, :] & ((kj + rc) < K)[:, None], other=0.0)  # [16, BLOCK_M]
            q = (words >> (4 * j)) & 0xF
            if DEQUANT:
                b = ((q.to(tl.float32) - z[:, None]) * s[:, None]).to(xt.dtype)
            else:
                b = q.to(xt.dtype)
                x_sum += tl.sum(xt.to(tl.float32), axis=0)
            if UPCAST:
                part += tl.dot(b.to(tl.float32), xt.to(tl.float32), input_precision="ieee")
            else:
                part += tl.dot(b, xt)
        if DEQUANT:
            acc += part
        else:
            acc += (part - z[:, None] * x_sum[None, :]) * s[:, None]
    out = out_ptr + tl.program_id(2) * stride_os + rm[None, :].to(tl.int64) * stride_om + rn[:, None]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=n_valid, other=0.0).to(tl.float32)[:, None]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_valid[None, :] & n_valid[:, None])


def fp8_call(layer: Fp8Linear, x: torch.Tensor, tiles):
    """The layer's own input handling, then the swap kernel with ``tiles``."""
    from specserve.models.checkpoint_quant import _quantize_rows

    n, k = layer.weight.shape
    if layer.activations == "token":
        xq, xs = _quantize_rows(x, k)
        act_group = k
    else:
        xq, xs, act_group = x, None, k
    step = qm._k_step(k, layer.block[1], act_group if xs is not None else k)
    xs_arg = xs.expand(xq.shape[0], -1) if xs is not None else layer.weight_scale

    def args(x2, part, k_split, stride_om, stride_os):
        return (xs_arg, layer.weight, layer.weight_scale, layer.weight_scale, part, x2.shape[0], n, k, k_split,
                x2.stride(0), xs_arg.stride(0), layer.weight.stride(0), layer.weight_scale.stride(0),
                stride_om, stride_os, act_group, *layer.block)
    return qm._launch(_fp8_swap, "w8a8", xq, n, k, step, x.dtype, args, lambda t: {"A_FP8": xs is not None},
                      None, False, tiles)


def int4_call(layer: Int4Linear, x: torch.Tensor, tiles, dequant: bool):
    n, k = layer.packed.shape[0], x.shape[-1]

    def args(x2, part, k_split, stride_om, stride_os):
        return (layer.packed, layer.scales, layer.zeros, layer.scales, part, x2.shape[0], n, k, k_split,
                x2.stride(0), layer.packed.stride(0), layer.scales.stride(0), stride_om, stride_os, layer.group)
    return qm._launch(_int4_swap, "w4a16", x, n, k, qm.INT4_CHUNK, x.dtype, args,
                      lambda t: {"TILE_IN_GROUP": True, "DEQUANT": dequant}, None, False, tiles)


SCHEMES = {"fp8 W8A8 per channel": ("fp8", "token"), "fp8 W8A16 per channel": ("fp8", None),
           "int4 W4A16 g128": ("int4", None)}


def make(scheme, w):
    kind, act = SCHEMES[scheme]
    if kind == "int4":
        return Int4Linear(quantize_int4(w, 128), None)
    return Fp8Linear(quantize_fp8(w), None, act, None, deterministic=False)


def variants(scheme, cpu: bool):
    """label -> fn(layer, x, tiles) and the tiles to sweep."""
    kind = SCHEMES[scheme][0]
    out = []
    if kind == "int4":
        fams = [("swap q", lambda l, x, t: int4_call(l, x, t, False)),
                ("swap dq", lambda l, x, t: int4_call(l, x, t, True))]
        ks, stage_set = (128,), (2, 3)
    else:
        fams = [("swap", fp8_call)]
        ks, stage_set = (128, 256), (3, 4)
    for fam, fn in fams:
        for bn in (64, 128):
            for bk in ks:
                for stages in stage_set:
                    for split in (1, 2, 4, 8, 16):
                        out.append((f"{fam} n{bn} k{bk} st{stages} s{split}", fn, (bn, bk, stages, split)))
    if cpu:
        out = [v for v in out if v[2][0] == 64 and v[2][2] == stage_set[0] and v[2][3] in (1, 2)]
    return out


def main():
    cpu = not torch.cuda.is_available()
    dev = torch.device("cpu" if cpu else "cuda")
    dtype = torch.float32 if cpu else torch.bfloat16
    shapes = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
    if cpu:
        shapes = {"small": (96, 512)}
    if not cpu:
        from deterministic import graph_us
    rows = []
    for scheme in SCHEMES:
        for name, (n, k) in shapes.items():
            g = torch.Generator(device=dev).manual_seed(0)
            w = (torch.randn(n, k, device=dev, generator=g) * 0.02).to(dtype)
            layer = make(scheme, w)
            size = sum(t.numel() * t.element_size() for t in layer.buffers())
            layers = [layer] + ([] if cpu else [copy.deepcopy(layer) for _ in range(min(15, -(-256_000_000 // size) - 1))])
            x = torch.randn(16, k, device=dev, generator=g).to(dtype)
            for m in (1, 5, 16):
                xm = x[:m].clone()
                want = layer(xm).float()
                planned = float("nan") if cpu else graph_us(lambda xm=xm, layers=layers: [each(xm) for each in layers], 10, dev, calls=1) / len(layers)
                best = None
                for label, fn, (bn, bk, stages, split) in variants(scheme, cpu):
                    tiles = qm.Tiles(16, bn, bk, split, 4, stages)
                    try:
                        got = fn(layer, xm, tiles).float()
                        err = ((got - want).norm() / want.norm()).item()
                        us = float("nan") if cpu else graph_us(
                            lambda fn=fn, xm=xm, tiles=tiles, layers=layers: [fn(each, xm, tiles) for each in layers],
                            10, dev, calls=1) / len(layers)
                    except Exception as e:  # noqa: BLE001 (a sweep: report and go on)
                        print(scheme, name, m, label, "FAILED", repr(e)[:300], flush=True)
                        continue
                    r = {"scheme": scheme, "gemm": name, "m": m, "variant": label, "us": round(us, 2),
                         "rel_err": round(err, 6)}
                    rows.append(r)
                    if err > 2e-2:
                        print("WRONG", json.dumps(r), flush=True)
                    if best is None or us < best["us"] or cpu:
                        best = r
                print(json.dumps({"scheme": scheme, "gemm": name, "m": m, "planned_us": round(planned, 2),
                                  "best": best}), flush=True)
                rows.append({"scheme": scheme, "gemm": name, "m": m, "variant": "planned", "us": round(planned, 2)})
            layers = layer = None
            if not cpu:
                torch.cuda.empty_cache()
            if os.environ.get("OUT"):  # after each projection: a run cut short keeps what it has
                with open(os.path.join(os.environ["OUT"], "swap_sweep.json"), "w") as f:
                    json.dump(rows, f, indent=0)


if __name__ == "__main__":
    main()
