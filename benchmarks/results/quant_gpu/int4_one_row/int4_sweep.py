"""4-bit GEMM variants at a decode step's few rows: the shipped kernel (V0) against one
product per 128-input chunk (V1) and a CUDA-core kernel for one row (V2)."""
import copy, json, sys, os
import torch, triton
import triton.language as tl
sys.path.insert(0, "benchmarks"); sys.path.insert(0, "tests")
from specserve.kernels import quant_matmul as qm
from specserve.models.checkpoint_quant import Int4Linear, quantize_int4

@triton.jit(do_not_specialize=["M"])
def _v1(x_ptr, w_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, M, N, K, K_SPLIT,
        stride_xm, stride_wn, stride_sn, stride_om, stride_os, GROUP,
        HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr, TILE_IN_GROUP: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    pid_m = tl.program_id(0); pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rc = tl.arange(0, 16); rk = tl.arange(0, 128); sh = 4 * tl.arange(0, 8)
    m_valid = rm < M; n_valid = rn < N
    k_start = tl.program_id(2) * K_SPLIT
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_start, tl.minimum(k_start + K_SPLIT, K), 128):
        words = tl.load(w_ptr + rn[None, :].to(tl.int64) * stride_wn + (k0 // 8 + rc)[:, None],
                        mask=n_valid[None, :], other=0)                      # [16, BLOCK_N]
        group = rn.to(tl.int64) * stride_sn + k0 // GROUP
        s = tl.load(s_ptr + group, mask=n_valid, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + group, mask=n_valid, other=0).to(tl.int32)
        q = (words[None, :, :] >> sh[:, None, None]) & 0xF                   # [8, 16, BLOCK_N]
        b = tl.reshape(q, (128, BLOCK_N)) - z[None, :]
        a = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_xm + (k0 + rk)[None, :],
                    mask=m_valid[:, None] & ((k0 + rk) < K)[None, :], other=0.0)   # [BLOCK_M, 128]
        if UPCAST:
            part = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            part = tl.dot(a, b.to(a.dtype))
        acc += part * s[None, :]
    qm._store(acc, bias_ptr, out_ptr + tl.program_id(2) * stride_os, rm, rn, m_valid, n_valid, stride_om, HAS_BIAS)


@triton.jit(do_not_specialize=["M"])
def _v2(x_ptr, w_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, M, N, K, K_SPLIT,
        stride_xm, stride_wn, stride_sn, stride_om, stride_os, GROUP,
        HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr, TILE_IN_GROUP: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """One row per program row (grid's first axis over rows), CUDA cores: [BLOCK_N, 16] words
    with K along the fast axis, each nibble a [BLOCK_N, 16] product summed along K."""
    row = tl.program_id(0)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rc = tl.arange(0, 16)
    n_valid = rn < N
    k_start = tl.program_id(2) * K_SPLIT
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(k_start, tl.minimum(k_start + K_SPLIT, K), 128):
        words = tl.load(w_ptr + rn[:, None].to(tl.int64) * stride_wn + (k0 // 8 + rc)[None, :],
                        mask=n_valid[:, None], other=0)                      # [BLOCK_N, 16]
        group = rn.to(tl.int64) * stride_sn + k0 // GROUP
        s = tl.load(s_ptr + group, mask=n_valid, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + group, mask=n_valid, other=0).to(tl.float32)
        tile = tl.zeros([BLOCK_N, 16], dtype=tl.float32)
        xsum = tl.zeros([16], dtype=tl.float32)
        for j in tl.static_range(8):
            a = tl.load(x_ptr + row.to(tl.int64) * stride_xm + k0 + 16 * j + rc, mask=(k0 + 16 * j + rc) < K,
                        other=0.0).to(tl.float32)
            tile += ((words >> (4 * j)) & 0xF).to(tl.float32) * a[None, :]
            xsum += a
        acc += (tl.sum(tile, axis=1) - z * tl.sum(xsum, axis=0)) * s
    out = out_ptr + tl.program_id(2) * stride_os + row.to(tl.int64) * stride_om + rn
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=n_valid)


@triton.jit(do_not_specialize=["M"])
def _v3(x_ptr, w_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, M, N, K, K_SPLIT,
        stride_xm, stride_wn, stride_sn, stride_om, stride_os, GROUP,
        HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr, TILE_IN_GROUP: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """CUDA cores, BLOCK_M rows a program, nibbles to floats by the 2^23 trick."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rc = tl.arange(0, 16)
    m_valid = rm < M
    n_valid = rn < N
    k_start = tl.program_id(2) * K_SPLIT
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_start, tl.minimum(k_start + K_SPLIT, K), 128):
        words = tl.load(w_ptr + rn[:, None].to(tl.int64) * stride_wn + (k0 // 8 + rc)[None, :],
                        mask=n_valid[:, None], other=0)                      # [BLOCK_N, 16]
        group = rn.to(tl.int64) * stride_sn + k0 // GROUP
        s = tl.load(s_ptr + group, mask=n_valid, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + group, mask=n_valid, other=0).to(tl.float32) + 8388608.0
        tile = tl.zeros([BLOCK_M, BLOCK_N, 16], dtype=tl.float32)
        for j in tl.static_range(8):
            a = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_xm + (k0 + 16 * j + rc)[None, :],
                        mask=m_valid[:, None] & ((k0 + 16 * j + rc) < K)[None, :], other=0.0).to(tl.float32)
            b = (((words >> (4 * j)) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - z[:, None]
            tile += a[:, None, :] * b[None, :, :]
        acc += tl.sum(tile, axis=2) * s[None, :]
    qm._store(acc, bias_ptr, out_ptr + tl.program_id(2) * stride_os, rm, rn, m_valid, n_valid, stride_om, HAS_BIAS)


@triton.jit(do_not_specialize=["M"])
def _v2m(x_ptr, w_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, M, N, K, K_SPLIT,
         stride_xm, stride_wn, stride_sn, stride_om, stride_os, GROUP,
         HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
         BLOCK_K: tl.constexpr, TILE_IN_GROUP: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    row = tl.program_id(0)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rc = tl.arange(0, 16)
    n_valid = rn < N
    k_start = tl.program_id(2) * K_SPLIT
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(k_start, tl.minimum(k_start + K_SPLIT, K), 128):
        words = tl.load(w_ptr + rn[:, None].to(tl.int64) * stride_wn + (k0 // 8 + rc)[None, :],
                        mask=n_valid[:, None], other=0)                      # [BLOCK_N, 16]
        group = rn.to(tl.int64) * stride_sn + k0 // GROUP
        s = tl.load(s_ptr + group, mask=n_valid, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + group, mask=n_valid, other=0).to(tl.float32) + 8388608.0
        tile = tl.zeros([BLOCK_N, 16], dtype=tl.float32)
        for j in tl.static_range(8):
            a = tl.load(x_ptr + row.to(tl.int64) * stride_xm + k0 + 16 * j + rc, mask=(k0 + 16 * j + rc) < K,
                        other=0.0).to(tl.float32)
            b = (((words >> (4 * j)) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - z[:, None]
            tile += b * a[None, :]
        acc += tl.sum(tile, axis=1) * s
    out = out_ptr + tl.program_id(2) * stride_os + row.to(tl.int64) * stride_om + rn
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=n_valid)


def call(kernel, layer, x, tiles):
    n, k = layer.packed.shape[0], x.shape[-1]

    def args(x2, part, k_split, stride_om, stride_os):
        return (layer.packed, layer.scales, layer.zeros, layer.scales, part, x2.shape[0], n, k, k_split,
                x2.stride(0), layer.packed.stride(0), layer.scales.stride(0), stride_om, stride_os, layer.group)
    return qm._launch(kernel, "w4a16", x, n, k, 128, x.dtype, args,
                      lambda t: {"TILE_IN_GROUP": True}, None, False, tiles)


def main():
    cpu = not torch.cuda.is_available()
    dev = torch.device("cpu" if cpu else "cuda")
    shapes = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
    if cpu:
        shapes = {"small": (96, 512)}
    rows = []
    for name, (n, k) in shapes.items():
        g = torch.Generator(device=dev).manual_seed(0)
        w = torch.randn(n, k, device=dev, generator=g) * 0.02
        layer = Int4Linear(quantize_int4(w, 128), None)
        size = layer.packed.numel() * 4 + layer.scales.numel() * layer.scales.element_size() + layer.zeros.numel()
        layers = [layer] + ([] if cpu else [copy.deepcopy(layer) for _ in range(min(15, -(-256_000_000 // size) - 1))])
        x = (torch.randn(16, k, device=dev, generator=g)).to(torch.float32 if cpu else torch.bfloat16)
        for m in (1,):
            xm = x[:m].clone()
            want = layer(xm).float()
            variants = {"v0 planned": (qm._int4_kernel, None)}
            for fam, kern in (("v2", _v2), ("v2m", _v2m)):
                for bn in (64, 128, 256):
                    for split in (4, 8, 16):
                        for stages, warps in ((2, 4), (3, 4), (2, 8), (3, 8)):
                            variants[f"{fam} n{bn} s{split} st{stages} w{warps}"] = (kern, qm.Tiles(1, bn, 128, split, warps, stages))
            if cpu:
                variants = {k2: v for k2, v in variants.items() if "st2 w4" in k2 and "n64 " in k2 and "s4 " in k2}
            best = {}
            for label, (kern, tiles) in variants.items():
                try:
                    got = call(kern, layer, xm, tiles).float()
                    err = ((got - want).norm() / want.norm()).item()
                    if cpu:
                        us = float("nan")
                    else:
                        from deterministic import graph_us
                        us = graph_us(lambda: [call(kern, each, xm, tiles) for each in layers], 10, dev, calls=1) / len(layers)
                except Exception as e:  # noqa
                    print(name, m, label, "FAILED", repr(e)[:200], flush=True)
                    continue
                r = {"gemm": name, "m": m, "variant": label, "us": round(us, 2), "rel_err": round(err, 5)}
                rows.append(r)
                fam = label.split()[0]
                if fam not in best or not us >= best[fam]["us"]:
                    best[fam] = r
            print(name, m, json.dumps(best), flush=True)
    if os.environ.get("OUT"):
        open(os.path.join(os.environ["OUT"], "int4_sweep.json"), "w").write(json.dumps(rows, indent=0))

main()
