// W4A16 at 1 to 16 rows on the tensor cores: mma.sync m16n8k16 (bf16 in, fp32 sums), the
// weights in specserve's packed layout as they are (kernels/quant_matmul.pack_int4: input
// 128c + 16j + w of a column in nibble j of its word 16c + w), groups of 128 inputs.
//
// A dot product does not care in which order its inputs come, so each mma takes its 16
// inputs in the order the words hand them out: lane (g, t) of a warp holds words 4t..4t+3
// of a chunk of its column g; in the chunk's mma j its four weights are nibble j of those
// words, inputs 16j + 4t .. 16j + 4t + 3, and the same lane's x fragment is those four
// inputs of row g: one 8-byte load. A nibble becomes the bf16 128 + q by one byte permute
// for two weights and one lop3 with 0x4300 (128's bits); the products x · (128 + q) are
// exact in fp32, and per group out += s · (Σ x (128 + q) − (128 + z) Σ x), Σ x from one
// more mma against ones.
//
// NT: n8 tiles a warp (8·NT columns a block), WARPS: warps a block, each taking every
// WARPS-th chunk of the block's columns, summed through shared memory at the end. DEPTH:
// chunks a warp has loading ahead of the one it multiplies.
#ifndef NT
#define NT 2
#endif
#ifndef WARPS
#define WARPS 8
#endif
#ifndef DEPTH
#define DEPTH 1
#endif

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;

__device__ __forceinline__ void mma_bf16(float (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ u32 lop3_and_or(u32 a, u32 mask, u32 magic) {  // (a & mask) | magic
    u32 r;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;\n" : "=r"(r) : "r"(a), "r"(mask), "r"(magic));
    return r;
}

__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 sel) {
    u32 r;
    asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
    return r;
}

__device__ __forceinline__ float half_to_float(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;\n" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ u16 float_to_bf16(float f) {
    u16 h;
    asm("cvt.rn.bf16.f32 %0, %1;\n" : "=h"(h) : "f"(f));
    return h;
}

// Two weights as bf16 128 + q: nibble j of word a (low half) and of word b (high half).
// ``a_hi``/``b_hi``: the words shifted right by 4 (the odd nibbles' bytes).
template <int J>
__device__ __forceinline__ u32 pair(u32 a, u32 b, u32 a_hi, u32 b_hi, u32 mask, u32 magic) {
    constexpr u32 byte = J >> 1;
    constexpr u32 sel = byte | (byte << 4) | ((4 + byte) << 8) | ((4 + byte) << 12);
    u32 v = (J & 1) ? prmt(a_hi, b_hi, sel) : prmt(a, b, sel);
    return lop3_and_or(v, mask, magic);
}

extern "C" __global__ void __launch_bounds__(32 * WARPS)
int4_mma(const u16* __restrict__ x, const u32* __restrict__ w, const u16* __restrict__ s,
         const u8* __restrict__ z, u16* __restrict__ out, int M, int N, int chunks,
         int stride_x, int stride_w, int stride_s, int stride_z, int stride_o) {
    __shared__ float reduce[WARPS - 1][NT][4][32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int n0 = blockIdx.x * 8 * NT;
    const u32 mask = 0x000F000Fu, magic = 0x43004300u, ones = 0x3F803F80u;
    const bool row_lo = g < M, row_hi = g + 8 < M;
    const u16* x_lo = x + (long)g * stride_x + 4 * t;
    const u16* x_hi = x + (long)(g + 8) * stride_x + 4 * t;

    float acc[NT][4];
#pragma unroll
    for (int i = 0; i < NT; ++i)
#pragma unroll
        for (int r = 0; r < 4; ++r) acc[i][r] = 0.f;

    const uint4* wp[NT];
#pragma unroll
    for (int i = 0; i < NT; ++i)
        wp[i] = reinterpret_cast<const uint4*>(w + (long)(n0 + 8 * i + g) * stride_w + 4 * t);

    uint4 ahead[DEPTH][NT];
#pragma unroll
    for (int a = 0; a < DEPTH; ++a) {
        const int c = warp + a * WARPS;
        if (c < chunks) {
#pragma unroll
            for (int i = 0; i < NT; ++i) ahead[a][i] = __ldg(wp[i] + c * 4);
        }
    }
    for (int ch = warp; ch < chunks; ch += WARPS) {
        uint4 words[NT];
#pragma unroll
        for (int i = 0; i < NT; ++i) words[i] = ahead[0][i];
#pragma unroll
        for (int a = 0; a + 1 < DEPTH; ++a)
#pragma unroll
            for (int i = 0; i < NT; ++i) ahead[a][i] = ahead[a + 1][i];
        if (ch + DEPTH * WARPS < chunks) {
#pragma unroll
            for (int i = 0; i < NT; ++i) ahead[DEPTH - 1][i] = __ldg(wp[i] + (ch + DEPTH * WARPS) * 4);
        }
        float d[NT][4], sum[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int i = 0; i < NT; ++i)
#pragma unroll
            for (int r = 0; r < 4; ++r) d[i][r] = 0.f;
        u32 hi[NT][4];
#pragma unroll
        for (int i = 0; i < NT; ++i) {
            hi[i][0] = words[i].x >> 4; hi[i][1] = words[i].y >> 4;
            hi[i][2] = words[i].z >> 4; hi[i][3] = words[i].w >> 4;
        }
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const int k = ch * 128 + 16 * j;
            uint2 xl = make_uint2(0u, 0u), xh = make_uint2(0u, 0u);
            if (row_lo) xl = __ldg(reinterpret_cast<const uint2*>(x_lo + k));
            if (row_hi) xh = __ldg(reinterpret_cast<const uint2*>(x_hi + k));
            mma_bf16(sum, xl.x, xh.x, xl.y, xh.y, ones, ones);
#pragma unroll
            for (int i = 0; i < NT; ++i) {
                u32 b0, b1;
                switch (j) {  // (J must be a constant for the selector)
                    case 0: b0 = pair<0>(words[i].x, words[i].y, hi[i][0], hi[i][1], mask, magic);
                            b1 = pair<0>(words[i].z, words[i].w, hi[i][2], hi[i][3], mask, magic); break;
                    case 1: b0 = pair<1>(words[i].x, words[i].y, hi[i][0], hi[i][1], mask, magic);
                            b1 = pair<1>(words[i].z, words[i].w, hi[i][2], hi[i][3], mask, magic); break;
                    case 2: b0 = pair<2>(words[i].x, words[i].y, hi[i][0], hi[i][1], mask, magic);
                            b1 = pair<2>(words[i].z, words[i].w, hi[i][2], hi[i][3], mask, magic); break;
                    case 3: b0 = pair<3>(words[i].x, words[i].y, hi[i][0], hi[i][1], mask, magic);
                            b1 = pair<3>(words[i].z, words[i].w, hi[i][2], hi[i][3], mask, magic); break;
                    case 4: b0 = pair<4>(words[i].x, words[i].y, hi[i][0], hi[i][1], mask, magic);
                            b1 = pair<4>(words[i].z, words[i].w, hi[i][2], hi[i][3], mask, magic); break;
                    case 5: b0 = pair<5>(words[i].x, words[i].y, hi[i][0], hi[i][1], mask, magic);
                            b1 = pair<5>(words[i].z, words[i].w, hi[i][2], hi[i][3], mask, magic); break;
                    case 6: b0 = pair<6>(words[i].x, words[i].y, hi[i][0], hi[i][1], mask, magic);
                            b1 = pair<6>(words[i].z, words[i].w, hi[i][2], hi[i][3], mask, magic); break;
                    default: b0 = pair<7>(words[i].x, words[i].y, hi[i][0], hi[i][1], mask, magic);
                             b1 = pair<7>(words[i].z, words[i].w, hi[i][2], hi[i][3], mask, magic); break;
                }
                mma_bf16(d[i], xl.x, xh.x, xl.y, xh.y, b0, b1);
            }
        }
        // The chunk is one group: out += s · (Σ x (128 + q) − (128 + z) Σ x), per column of
        // the lane's sums (2t, 2t + 1 of each n8 tile).
#pragma unroll
        for (int i = 0; i < NT; ++i) {
#pragma unroll
            for (int c = 0; c < 2; ++c) {
                const long col = n0 + 8 * i + 2 * t + c;
                const float sc = half_to_float(__ldg(s + col * stride_s + ch));
                const float off = 128.f + (float)__ldg(z + col * stride_z + ch);
                acc[i][c] += sc * (d[i][c] - off * sum[c]);
                acc[i][2 + c] += sc * (d[i][2 + c] - off * sum[2 + c]);
            }
        }
    }
    if (warp > 0) {
#pragma unroll
        for (int i = 0; i < NT; ++i)
#pragma unroll
            for (int r = 0; r < 4; ++r) reduce[warp - 1][i][r][lane] = acc[i][r];
    }
    __syncthreads();
    if (warp == 0) {
#pragma unroll
        for (int i = 0; i < NT; ++i) {
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                float v = acc[i][r];
                for (int o = 0; o < WARPS - 1; ++o) v += reduce[o][i][r][lane];
                const int row = g + (r >= 2 ? 8 : 0);
                const int col = n0 + 8 * i + 2 * t + (r & 1);
                if (row < M) out[(long)row * stride_o + col] = float_to_bf16(v);
            }
        }
    }
}
