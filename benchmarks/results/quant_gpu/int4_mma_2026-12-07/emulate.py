"""The tensor-core kernel's arithmetic (``int4_mma.cu``), emulated on the CPU in numpy: each
lane's fragments as the kernel builds them (byte permute and lop3 on the packed words, x
fragments of rows g and g + 8), each mma as the 16 x 16 x 8 product of the fragments laid
out as PTX's m16n8k16 layouts say, the per-group correction and the warps' sum; against
the dequantised fp32 product. Checks the index arithmetic, not the hardware.

    python benchmarks/results/quant_gpu/int4_mma_2026-12-07/emulate.py
"""
import numpy as np
import torch
from specserve.kernels.quant_matmul import pack_int4

from specserve.models.checkpoint_quant import quantize_int4

torch.manual_seed(0)
N, K, M, NT, WARPS = 16, 384, 11, 1, 2
w = torch.randn(N, K) * 0.02
qw = quantize_int4(w, 128)
packed = pack_int4(qw.q).numpy().view(np.uint32)
s = qw.scale.float().numpy(); z = qw.zero.numpy().astype(np.float32)
x = torch.randn(16, K).bfloat16()
xbits = x.view(torch.int16).numpy().view(np.uint16)
def bf(b): return np.array([b], dtype=np.uint32).__lshift__(16).view(np.float32)[0]
def prmt(a, b, sel):
    by = [(a >> (8*i)) & 0xFF for i in range(4)] + [(b >> (8*i)) & 0xFF for i in range(4)]
    return sum(by[(sel >> (4*i)) & 0x7] << (8*i) for i in range(4))
def pair(a, b, J):
    byte = J >> 1
    sel = byte | (byte << 4) | ((4+byte) << 8) | ((4+byte) << 12)
    v = prmt(a >> 4, b >> 4, sel) if J & 1 else prmt(a, b, sel)
    return (v & 0x000F000F) | 0x43004300
def halves(r): return bf(r & 0xFFFF), bf(r >> 16)
out = np.zeros((M, N), np.float32)
chunks = K // 128
for blk in range(N // (8*NT)):
    n0 = blk * 8 * NT
    accs = {}
    for warp in range(WARPS):
        acc = np.zeros((32, NT, 4), np.float32)
        for ch in range(warp, chunks, WARPS):
            # build fragments per lane
            d = np.zeros((32, NT, 4)); sm = np.zeros((32, 4))
            for j in range(8):
                A = np.zeros((16, 16)); Bs = [np.zeros((16, 8)) for _ in range(NT)]; ONES = np.ones((16, 8))
                for lane in range(32):
                    g, t = lane >> 2, lane & 3
                    k = ch*128 + 16*j + 4*t
                    xl = [bf(xbits[g, k+i]) if g < M else 0.0 for i in range(4)]
                    xh = [bf(xbits[g+8, k+i]) if g+8 < M else 0.0 for i in range(4)]
                    # a0: row g, slots 2t,2t+1 ; a1: row g+8 slots 2t,2t+1; a2: row g slots 2t+8,2t+9; a3: row g+8
                    A[g, 2*t], A[g, 2*t+1] = xl[0], xl[1]
                    A[g+8, 2*t], A[g+8, 2*t+1] = xh[0], xh[1]
                    A[g, 2*t+8], A[g, 2*t+9] = xl[2], xl[3]
                    A[g+8, 2*t+8], A[g+8, 2*t+9] = xh[2], xh[3]
                    for i in range(NT):
                        col = n0 + 8*i + g
                        wd = [int(packed[col, ch*16 + 4*t + c]) for c in range(4)]
                        b0 = pair(wd[0], wd[1], j); b1 = pair(wd[2], wd[3], j)
                        Bs[i][2*t, g], Bs[i][2*t+1, g] = halves(b0)
                        Bs[i][2*t+8, g], Bs[i][2*t+9, g] = halves(b1)
                D_sum = A @ ONES
                Ds = [A @ B for B in Bs]
                for lane in range(32):
                    g, t = lane >> 2, lane & 3
                    sm[lane] += [D_sum[g, 2*t], D_sum[g, 2*t+1], D_sum[g+8, 2*t], D_sum[g+8, 2*t+1]]
                    for i in range(NT):
                        D = Ds[i]
                        d[lane, i] += [D[g, 2*t], D[g, 2*t+1], D[g+8, 2*t], D[g+8, 2*t+1]]
            for lane in range(32):
                g, t = lane >> 2, lane & 3
                for i in range(NT):
                    for c in range(2):
                        col = n0 + 8*i + 2*t + c
                        sc, off = s[col, ch], 128 + z[col, ch]
                        acc[lane, i, c] += sc * (d[lane, i, c] - off * sm[lane, c])
                        acc[lane, i, 2+c] += sc * (d[lane, i, 2+c] - off * sm[lane, 2+c])
        accs[warp] = acc
    tot = sum(accs.values())
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        for i in range(NT):
            for r in range(4):
                row = g + (8 if r >= 2 else 0); col = n0 + 8*i + 2*t + (r & 1)
                if row < M: out[row, col] = tot[lane, i, r]
deq = (qw.q.float() - qw.zero.float().repeat_interleave(128, 1)) * qw.scale.float().repeat_interleave(128, 1)
want = (x[:M].float() @ deq.T).numpy()
print("max abs err", np.abs(out - want).max(), "rel", np.linalg.norm(out - want) / np.linalg.norm(want))
