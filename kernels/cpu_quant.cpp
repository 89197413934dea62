// quant_linear: y = x · Wᵀ with W held in the quantized form of cpu_quant.h; from
// ``dequant_rows`` rows on W is unpacked onto AMX tiles or for a library GEMM (see cpu_quant.h).
// Registered (TORCH_LIBRARY_FRAGMENT) beside cpu_ops.cpp's ops as torch.ops.specserve_cpu.*.
#include "cpu_quant.h"

#include <torch/library.h>

#include <memory>

#if defined(__AMX_TILE__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {


// Most bytes of unpacked weight a prompt chunk's GEMM takes at once (``quant_linear``): a
// slice stays in the last-level cache between its unpacking and its GEMM.
constexpr int64_t kUnpackBytes = int64_t(4) << 20;

// Block order: the position of each natural input 0..kp-1 in a row of the packed layout
// (models/quantized.py: block_order, inverted).
std::vector<int64_t> block_positions(int64_t kp, int64_t group) {
  std::vector<int64_t> position(kp);
  int64_t k0 = 0;
  for (const int64_t size : blocks(kp, group)) {
    const int64_t per_lane = group / (kLaneIn * size);
    for (int64_t j = 0; j < size; ++j)
      for (int64_t l = 0; l < 16; ++l)
        for (int64_t t = 0; t < kLaneIn; ++t)
          position[k0 + (l / per_lane) * group + (j * per_lane + l % per_lane) * kLaneIn + t] =
              k0 + j * kChunk + kLaneIn * l + t;
    k0 += size * kChunk;
  }
  return position;
}

template <typename T>
inline T from_float(float v) { return static_cast<T>(v); }

#if defined(QUANT_AVX512)
// 32 weights q · scale + min (q: 16 + 16 as int32 lanes; scales and mins per lane) to
// ``out``: fp32, or rounded once to bf16 (to nearest even; weights are finite and, their
// scales and mins being float16s or products of them, never denormal).
template <typename T>
inline void store_weights(__m512i q0, __m512i q1, __m512 s0, __m512 m0, __m512 s1, __m512 m1, T* out) {
  const __m512 w0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q0), s0, m0);
  const __m512 w1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q1), s1, m1);
  if constexpr (std::is_same_v<T, float>) {
    _mm512_storeu_ps(out, w0);
    _mm512_storeu_ps(out + 16, w1);
  } else {
#if defined(__AVX512BF16__)
    _mm512_storeu_si512(out, (__m512i)_mm512_cvtne2ps_pbh(w1, w0));
#else
    const __m512i one = _mm512_set1_epi32(1), half = _mm512_set1_epi32(0x7FFF);
    for (int i = 0; i < 2; ++i) {
      const __m512i b = _mm512_castps_si512(i ? w1 : w0);
      const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(b, 16), one);
      const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(odd, half)), 16);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 16 * i), _mm512_cvtepi32_epi16(rounded));
    }
#endif
  }
}

// One row of W in the packed layout's block order (``block_positions``): scale · q + min,
// exact in fp32, rounded once to T; the row's 32-input halves of chunks go to ``out``,
// ``half_stride`` elements apart (32: the row as it is; AMX: one tile row each). Each
// block's per-lane scales and mins (``min_factor`` times ``mins``: QuantWeight) are spread
// once for all its chunks.
template <typename S, typename T>
inline void unpack_row(const uint8_t* row, const S* scales, const S* mins, float min_factor,
                       const std::vector<int64_t>& sizes, int64_t chunks, int64_t group, int64_t bits, T* out,
                       int64_t half_stride) {
  const __m512i nibble = _mm512_set1_epi32(0x0F);
  auto bytes16 = [](const uint8_t* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); };
  // q of 16 nibbles (int32 lanes) of chunk c's inputs from ``first`` on: 4 bits as they
  // are, 5 and 6 bits with their higher bits (from the row's planes, after its chunks'
  // nibbles) as 16 and 32 in their lanes, IQ4 looked up in its table.
  const uint8_t* plane = row + chunks * (kChunk / 2);
  const __m512i table = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kIq4Table)));
  auto q_of = [&](__m512i nibbles, int64_t chunk, int first) {
    if (bits == kIq4) return _mm512_permutexvar_epi32(nibbles, table);
    if (bits != 5 && bits != 6) return nibbles;
    for (int64_t p = 0; p < bits - 4; ++p) {
      uint16_t mask;
      std::memcpy(&mask, plane + 8 * ((bits - 4) * chunk + p) + first / 8, 2);
      nibbles = _mm512_mask_or_epi32(nibbles, __mmask16(mask), nibbles, _mm512_set1_epi32(16 << p));
    }
    return nibbles;
  };
  int64_t c = 0, g0 = 0;
  const int64_t groups = chunks * kChunk / group;
  for (const int64_t size : sizes) {
    const int64_t count = size * kChunk / group;  // groups in this block
    const __m512 ls = lane_values(scales, g0, count, groups, group);
    const __m512 lm = _mm512_mul_ps(lane_values(mins, g0, count, groups, group), _mm512_set1_ps(min_factor));
    __m512 sv[4], mv[4];  // a chunk's outputs 16h … 16h + 15 are lanes 4h … 4h + 3
    for (int h = 0; h < 4; ++h) {
      const __m512i lanes = _mm512_srli_epi32(_mm512_add_epi32(_mm512_set1_epi32(16 * h),
          _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0)), 2);
      sv[h] = _mm512_permutexvar_ps(lanes, ls);
      mv[h] = _mm512_permutexvar_ps(lanes, lm);
    }
    if (bits != 8 && size > 1) {  // chunk pairs: byte i holds input i of c (low nibble) and of c + 1 (high)
      for (int64_t j = 0; j < size; j += 2, c += 2) {
        const uint8_t* pair = row + c * (kChunk / 2);
        for (int h = 0; h < 2; ++h) {
          const __m512i d0 = bytes16(pair + 32 * h), d1 = bytes16(pair + 32 * h + 16);
          store_weights(q_of(_mm512_and_si512(d0, nibble), c, 32 * h),
                        q_of(_mm512_and_si512(d1, nibble), c, 32 * h + 16), sv[2 * h], mv[2 * h],
                        sv[2 * h + 1], mv[2 * h + 1], out + (2 * c + h) * half_stride);
          store_weights(q_of(_mm512_srli_epi32(d0, 4), c + 1, 32 * h),
                        q_of(_mm512_srli_epi32(d1, 4), c + 1, 32 * h + 16), sv[2 * h], mv[2 * h],
                        sv[2 * h + 1], mv[2 * h + 1], out + (2 * c + 2 + h) * half_stride);
        }
      }
    } else if (bits != 8) {  // the odd last chunk, its own block: byte i holds its inputs i and 32 + i
      const uint8_t* bytes = row + c * (kChunk / 2);
      const __m512i d0 = bytes16(bytes), d1 = bytes16(bytes + 16);
      store_weights(q_of(_mm512_and_si512(d0, nibble), c, 0),
                    q_of(_mm512_and_si512(d1, nibble), c, 16), sv[0], mv[0], sv[1], mv[1],
                    out + 2 * c * half_stride);
      store_weights(q_of(_mm512_srli_epi32(d0, 4), c, 32),
                    q_of(_mm512_srli_epi32(d1, 4), c, 48), sv[2], mv[2], sv[3], mv[3],
                    out + (2 * c + 1) * half_stride);
      ++c;
    } else {
      for (int64_t j = 0; j < size; ++j, ++c)
        for (int h = 0; h < 2; ++h)
          store_weights(bytes16(row + c * kChunk + 32 * h), bytes16(row + c * kChunk + 32 * h + 16), sv[2 * h],
                        mv[2 * h], sv[2 * h + 1], mv[2 * h + 1], out + (2 * c + h) * half_stride);
    }
    g0 += count;
  }
}
#endif

// W [N, Kp] in the packed layout's own block order (``block_positions``): scale · q + min,
// exact in fp32, rounded once to T (padding inputs weigh 0: their groups' scales and mins
// are 0). Each row is read once, in order, with no gathers: the caller puts x's columns in
// the same order, which leaves every product as it was.
template <typename S, typename T>
void unpack_weight(int64_t n, int64_t kp, int64_t group, int64_t bits, const uint8_t* packed, int64_t row_bytes,
                   const S* scales, const S* mins, float min_factor, T* out) {
  const std::vector<int64_t> sizes = blocks(kp, group);
  const int64_t groups = kp / group, chunks = kp / kChunk;
  TORCH_CHECK(!nibble_form(bits) || kNibbleForms,
              "5-bit, 6-bit and IQ4 weights run on builds for AVX-512 VNNI only");
#if defined(QUANT_AVX512)
  const int64_t stride = scale_row<S>(groups, group);
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      unpack_row(packed + r * row_bytes, scales + r * stride, mins + r * stride, min_factor, sizes, chunks, group,
                 bits, out + r * kp, 32);
  });
#else
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    alignas(32) uint8_t q[kChunk];
    float lane_scale[16], lane_min[16];
    for (int64_t r = begin; r < end; ++r) {
      const uint8_t* row = packed + r * row_bytes;
      T* o = out + r * kp;
      int64_t c = 0, g0 = 0;
      for (const int64_t size : sizes) {
        const int64_t per = 16 / (size * kChunk / group);  // lanes per group
        for (int l = 0; l < 16; ++l) {
          lane_scale[l] = scalar(scales[r * groups + g0 + l / per]);
          lane_min[l] = scalar(mins[r * groups + g0 + l / per]) * min_factor;
        }
        for (int64_t j = 0; j < size; ++j, ++c) {
          // the chunk's 64 q in its order (lane l: positions 4l … 4l + 3)
          if (bits == 8) {
            std::memcpy(q, row + c * kChunk, kChunk);
          } else if ((c & 1) == 0 && c + 1 == chunks) {  // the odd last chunk: byte i holds i and 32 + i
            for (int i = 0; i < 32; ++i) {
              q[i] = row[c * (kChunk / 2) + i] & 0x0F;
              q[32 + i] = row[c * (kChunk / 2) + i] >> 4;
            }
          } else {  // a pair: byte i holds input i of c (low nibble) and of c + 1 (high)
            const uint8_t* pair = row + (c & ~int64_t(1)) * (kChunk / 2);
            const int shift = (c & 1) ? 4 : 0;
            for (int i = 0; i < kChunk; ++i) q[i] = (pair[i] >> shift) & 0x0F;
          }
          T* oc = o + c * kChunk;
          int64_t p = 0;
#if defined(__AVX2__) && defined(__FMA__)
          for (; p < kChunk; p += 8) {  // lanes p / 4 and p / 4 + 1
            const __m256 sv = _mm256_set_m128(_mm_set1_ps(lane_scale[p / 4 + 1]), _mm_set1_ps(lane_scale[p / 4]));
            const __m256 mv = _mm256_set_m128(_mm_set1_ps(lane_min[p / 4 + 1]), _mm_set1_ps(lane_min[p / 4]));
            const __m256 qv = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + p))));
            const __m256 w = _mm256_fmadd_ps(qv, sv, mv);
            if constexpr (std::is_same_v<T, float>) {
              _mm256_storeu_ps(oc + p, w);
            } else {  // to bf16, rounding to nearest even (weights are finite)
              const __m256i b = _mm256_castps_si256(w);
              const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
              const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
              const __m256i halves = _mm256_permute4x64_epi64(_mm256_packus_epi32(rounded, rounded), 0x08);
              _mm_storeu_si128(reinterpret_cast<__m128i*>(oc + p), _mm256_castsi256_si128(halves));
            }
          }
#endif
          for (; p < kChunk; ++p) oc[p] = from_float<T>(std::fma(float(q[p]), lane_scale[p / 4], lane_min[p / 4]));
        }
        g0 += size * kChunk / group;
      }
    }
  });
#endif
}

#if defined(QUANT_AVX512) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define QUANT_AMX 1
// Many rows on a CPU with AMX: W unpacked 64 output rows at a time into tiles that stay in
// L1/L2, multiplied by x's rows on the tile unit (TDPBF16PS: a 16 x 16 fp32 accumulator
// tile += a 16 x 32 bf16 tile of weights by a 32 x 16 tile of x's rows, in 16 cycles),
// nothing written to memory but y. The products are the unpacked path's: bf16 weights
// (scale · q + min rounded once), bf16 inputs, fp32 sums; every output element is summed
// over K in one order (32-input steps, in the packed layout's order) whatever the number
// of rows, so a row's result does not depend on its batch.
//
// Roles: the weights are the A operand (16 rows of n, 32 inputs each: one unpacked
// 32-input half-chunk of a row is one tile row, no transposition), x the B operand
// (pairs of inputs of 16 rows of x per tile row, laid out once per call) and C holds
// y transposed (16 n x 16 rows of x).

// Whether this process may use the tile registers (Linux asks each process to request
// them once: arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)).
bool amx_ready() {
  static const bool ready = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ready;
}

// Tiles 0-3: C; 4, 5, 7: A (weights); 6, 7: B (x). All 16 rows of 64 bytes.
inline void amx_configure() {
  struct alignas(64) Config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
  } config{};
  config.palette = 1;
  for (int t = 0; t < 8; ++t) {
    config.colsb[t] = 64;
    config.rows[t] = 16;
  }
  _tile_loadconfig(&config);
}

constexpr int64_t kTileK = 32;      // inputs per tile step
constexpr int64_t kTileBlocks = 4;  // 16-row blocks of W a thread unpacks and multiplies at once
// A tiles lie [block][step] apart by this many elements: one tile (16 rows of 32) and a
// cache line. A row's consecutive steps are then stored 1,088 bytes apart, not a multiple
// of 4 KiB (stores 4 KiB apart stall the loads of the next weights that alias them).
constexpr int64_t kTileStride = 16 * kTileK + 32;

// y [m, n] (bf16) = x [m, k] (bf16) · Wᵀ (+ bias).
//
// A thread takes 64 rows of W at a time, unpacked into [16-row block][step][row][32 inputs]
// (one A tile per 16 rows and step), and multiplies them with four accumulator tiles side
// by side, so that each tile of x loaded serves four blocks of W. Up to 16 rows of x: the
// four 16-row blocks of W against x; more: two blocks of W against two blocks of x, pair
// by pair.
template <typename S>
at::Tensor amx_linear(const at::Tensor& x, const QuantWeight& wt) {
  const int64_t m = x.size(0), k = x.size(1), n = wt.n, kp = wt.kp, group = wt.group, bits = wt.bits;
  const int64_t steps = kp / kTileK, blocks_m = (m + 15) / 16, stride = scale_row<S>(kp / group, group);
  // x's columns in the packed order (zeros at the padding inputs), then as B tiles:
  // [block of 16 rows][step][pair j][row i] = inputs 2j, 2j + 1 of the step, of row i.
  const std::vector<int64_t> position = block_positions(kp, group);
  const at::Tensor index = at::tensor(at::ArrayRef<int64_t>(position.data(), k), at::kLong);
  const at::Tensor xb = at::zeros({m, kp}, x.options()).index_copy_(1, index, x);
  std::vector<uint32_t> xt(blocks_m * steps * 256, 0u);
  const uint32_t* pairs = reinterpret_cast<const uint32_t*>(xb.data_ptr<at::BFloat16>());
  for (int64_t r = 0; r < m; ++r)
    for (int64_t s = 0; s < steps; ++s)
      for (int64_t j = 0; j < 16; ++j) xt[((r / 16) * steps + s) * 256 + j * 16 + r % 16] = pairs[r * kp / 2 + s * 16 + j];
  at::Tensor out = at::empty({m, n}, x.options());
  at::BFloat16* y = out.data_ptr<at::BFloat16>();
  const S* scales = static_cast<const S*>(wt.scales);
  const S* mins = static_cast<const S*>(wt.mins);
  const std::vector<int64_t> sizes = blocks(kp, group);
  const int64_t chunks = kp / kChunk, span = 16 * kTileBlocks;
  const __m512i column = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                            _mm512_set1_epi32(16));
  at::parallel_for(0, (n + span - 1) / span, 1, [&](int64_t begin, int64_t end) {
    amx_configure();
    // [block][step][row][32], kept by the thread from call to call (uninitialised: every
    // element read is written first)
    thread_local std::unique_ptr<at::BFloat16[]> a;
    thread_local int64_t a_size = 0;
    if (a_size < kTileBlocks * steps * kTileStride) {
      a_size = kTileBlocks * steps * kTileStride;
      a.reset(new at::BFloat16[a_size]);
    }
    alignas(64) float c[16 * 16];
    auto tile_a = [&](int64_t s, int64_t block) { return a.get() + (block * steps + s) * kTileStride; };
    auto tile_b = [&](int64_t s, int64_t block) { return xt.data() + (block * steps + s) * 256; };
    // C (stored in c): 16 rows of W from n0 by 16 rows of x from r0, plus the bias, rounded once.
    auto store = [&](int64_t n0, int64_t r0) {
      if (n0 >= n || r0 >= m) return;
      const int64_t rows = std::min<int64_t>(16, n - n0), count = std::min<int64_t>(16, m - r0);
      const __mmask16 valid = __mmask16((1u << rows) - 1);
      const __m512 bias = wt.bias ? _mm512_maskz_loadu_ps(valid, wt.bias + n0) : _mm512_setzero_ps();
      for (int64_t i = 0; i < count; ++i)  // row i of x: column i of C
        _mm256_mask_storeu_epi16(y + (r0 + i) * n + n0, valid,
                                 (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(_mm512_i32gather_ps(column, c + i, 4), bias)));
    };
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n0 = span * b, rows = std::min<int64_t>(span, n - n0);
      const int64_t ahead = std::min<int64_t>(span, std::max<int64_t>(0, std::min(n, n0 + 2 * span) - n0 - span));
      for (int64_t r = 0; r < rows; ++r) {
        if (r < ahead) {  // the next rows into L2 while these unpack
          const uint8_t* next = wt.packed + (n0 + span + r) * wt.row_bytes;
          for (int64_t byte = 0; byte < wt.row_bytes; byte += 64) __builtin_prefetch(next + byte, 0, 2);
        }
        unpack_row(wt.packed + (n0 + r) * wt.row_bytes, scales + (n0 + r) * stride, mins + (n0 + r) * stride,
                   wt.min_factor, sizes, chunks, group, bits, tile_a(0, r / 16) + (r % 16) * kTileK, kTileStride);
      }
      for (int64_t r = rows; r < span; ++r)  // the last rows' missing rows weigh 0
        for (int64_t s = 0; s < steps; ++s) std::memset(tile_a(s, r / 16) + (r % 16) * kTileK, 0, kTileK * 2);
      if (blocks_m == 1) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t s = 0; s < steps; ++s) {
          _tile_loadd(6, tile_b(s, 0), 64);
          _tile_loadd(4, tile_a(s, 0), 64);
          _tile_dpbf16ps(0, 4, 6);
          _tile_loadd(5, tile_a(s, 1), 64);
          _tile_dpbf16ps(1, 5, 6);
          _tile_loadd(7, tile_a(s, 2), 64);
          _tile_dpbf16ps(2, 7, 6);
          _tile_loadd(4, tile_a(s, 3), 64);
          _tile_dpbf16ps(3, 4, 6);
        }
        _tile_stored(0, c, 64);
        store(n0, 0);
        _tile_stored(1, c, 64);
        store(n0 + 16, 0);
        _tile_stored(2, c, 64);
        store(n0 + 32, 0);
        _tile_stored(3, c, 64);
        store(n0 + 48, 0);
        continue;
      }
      for (int64_t bm = 0; bm < blocks_m; bm += 2)
        for (int64_t bn = 0; bn < kTileBlocks; bn += 2) {
          const int64_t bm1 = std::min(bm + 1, blocks_m - 1);  // (a lone last block twice: stored once)
          _tile_zero(0);
          _tile_zero(1);
          _tile_zero(2);
          _tile_zero(3);
          for (int64_t s = 0; s < steps; ++s) {
            _tile_loadd(6, tile_b(s, bm), 64);
            _tile_loadd(4, tile_a(s, bn), 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_loadd(7, tile_b(s, bm1), 64);
            _tile_dpbf16ps(1, 4, 7);
            _tile_loadd(5, tile_a(s, bn + 1), 64);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
          }
          _tile_stored(0, c, 64);
          store(n0 + 16 * bn, 16 * bm);
          _tile_stored(2, c, 64);
          store(n0 + 16 * (bn + 1), 16 * bm);
          if (bm1 != bm) {
            _tile_stored(1, c, 64);
            store(n0 + 16 * bn, 16 * bm1);
            _tile_stored(3, c, 64);
            store(n0 + 16 * (bn + 1), 16 * bm1);
          }
        }
    }
    _tile_release();
  });
  return out;
}
#endif

// y [..., N] = x [..., K] · Wᵀ (+ bias), W in the form above: ``packed`` uint8
// [N, Kp · stored_bits(bits) / 8], ``scales``/``mins`` fp32 or fp16 [N, Kp/group], or two-level
// uint8 rows (``Sub8``: AVX-512 VNNI builds) (``mins`` or a 0-dim fp32 factor of the scales);
// ``bias`` fp32 or none. y has x's dtype. From
// ``dequant_rows`` rows on (0: never), W is unpacked onto AMX tiles (bf16 x, where the build
// and the OS allow them) or for a library GEMM (see the top).
at::Tensor quant_linear(const at::Tensor& x_in, const at::Tensor& packed, const at::Tensor& scales,
                        const at::Tensor& mins, int64_t bits, int64_t group, const c10::optional<at::Tensor>& bias_in,
                        int64_t dequant_rows) {
  TORCH_CHECK(x_in.device().is_cpu(), "quant_linear runs on CPU tensors");
  const float* bias = nullptr;
  if (bias_in.has_value() && bias_in->defined()) {
    TORCH_CHECK(bias_in->scalar_type() == at::kFloat && bias_in->is_contiguous() && bias_in->numel() == packed.size(0),
                "bias must be a contiguous float32 tensor of N elements");
    bias = bias_in->data_ptr<float>();
  }
  const int64_t k = x_in.size(-1);
  const QuantWeight wt = quant_weight(packed, scales, mins, bits, group, k, bias);
  const int64_t n = wt.n, kp = wt.kp;
  const bool half = wt.half;
  TORCH_CHECK(x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16,
              "x must be float32 or bfloat16");
  const at::Tensor x = x_in.reshape({-1, k}).contiguous();
  const int64_t m = x.size(0);
  std::vector<int64_t> shape(x_in.sizes().begin(), x_in.sizes().end());
  shape.back() = n;
#if defined(QUANT_AMX)
  if (dequant_rows > 0 && m >= dequant_rows && x.scalar_type() == at::kBFloat16 && amx_ready()) {
    const at::Tensor y = half ? amx_linear<at::Half>(x, wt) : wt.two_level ? amx_linear<Sub8>(x, wt)
                                                                            : amx_linear<float>(x, wt);
    return y.view(shape);
  }
#endif
  if (dequant_rows > 0 && m >= dequant_rows) {
    // The weight unpacked in its block order, x's columns put in that order (zeros for the
    // padding inputs): the same products, one pass over the weight for ATen's GEMM. A large
    // weight (an LM head: 49,152 x 576) goes in slices of output columns of at most
    // kUnpackBytes, each unpacked into one reused buffer while the cache still holds it:
    // unpacked whole it was written to memory and read back, in a fresh allocation each
    // call, and 40 rows cost twice the integer kernel's.
    const std::vector<int64_t> position = block_positions(kp, group);
    const at::Tensor index = at::tensor(at::ArrayRef<int64_t>(position.data(), k), at::kLong);
    const at::Tensor xb = at::zeros({m, kp}, x.options()).index_copy_(1, index, x);
    const int64_t row_bytes = packed.size(1);
    const int64_t slice = std::min(n, std::max<int64_t>(64, kUnpackBytes / (kp * x.element_size()) / 64 * 64));
    at::Tensor w = at::empty({slice, kp}, x.options());
    const at::Tensor b = bias ? bias_in->to(x.scalar_type()) : at::Tensor();
    at::Tensor out = slice < n ? at::empty({m, n}, x.options()) : at::Tensor();
    for (int64_t n0 = 0; n0 < n; n0 += slice) {
      const int64_t cols = std::min(slice, n - n0);
      auto unpack = [&](auto* sc, auto* mn) {
        const uint8_t* p = packed.data_ptr<uint8_t>() + n0 * row_bytes;
        const int64_t stride = scale_row<std::remove_cv_t<std::remove_pointer_t<decltype(sc)>>>(kp / group, group);
        if (x.scalar_type() == at::kFloat)
          unpack_weight(cols, kp, group, bits, p, row_bytes, sc + n0 * stride, mn + n0 * stride, wt.min_factor,
                        w.data_ptr<float>());
        else
          unpack_weight(cols, kp, group, bits, p, row_bytes, sc + n0 * stride, mn + n0 * stride, wt.min_factor,
                        w.data_ptr<at::BFloat16>());
      };
      if (half)
        unpack(static_cast<const at::Half*>(wt.scales), static_cast<const at::Half*>(wt.mins));
#if defined(QUANT_AVX512)
      else if (wt.two_level)
        unpack(static_cast<const Sub8*>(wt.scales), static_cast<const Sub8*>(wt.mins));
#endif
      else
        unpack(static_cast<const float*>(wt.scales), static_cast<const float*>(wt.mins));
      const at::Tensor ws = w.narrow(0, 0, cols);
      const at::Tensor y = bias ? at::linear(xb, ws, b.narrow(0, n0, cols)) : at::linear(xb, ws);
      if (slice == n) return y.view(shape);
      out.narrow(1, n0, cols).copy_(y);
    }
    return out.view(shape);
  }
  at::Tensor out = at::empty({m, n}, x.options());
  if (m == 0) return out.view(shape);
  QuantizedRows q;
  q.kp = kp;
  q.group = group;
  if (x.scalar_type() == at::kFloat) {
    quantize_rows(x.data_ptr<float>(), m, k, q);
    quant_matmul(q, m, wt, out.data_ptr<float>());
  } else {
    quantize_rows(x.data_ptr<at::BFloat16>(), m, k, q);
    quant_matmul(q, m, wt, out.data_ptr<at::BFloat16>());
  }
  return out.view(shape);
}

}  // namespace

// Whether quant_linear multiplies many rows on AMX tiles here: built for them, and the
// process granted them.
bool amx_tiles() {
#if defined(QUANT_AMX)
  return amx_ready();
#else
  return false;
#endif
}

// Whether quant_linear and the fused layers take two-level (uint8) scales in this build.
bool two_level_scales() { return kTwoLevelScales; }

// The forms (``bits``) quant_linear and the fused layers take in this build.
std::vector<int64_t> weight_forms() {
  std::vector<int64_t> forms = {4, 8};
  if (kNibbleForms) forms.insert(forms.end(), {5, 6, kIq4});
  return forms;
}

TORCH_LIBRARY_FRAGMENT(specserve_cpu, m) {
  m.def("amx_tiles() -> bool", &amx_tiles);
  m.def("weight_forms() -> int[]", &weight_forms);
  m.def("two_level_scales() -> bool", &two_level_scales);
  m.def("quant_linear(Tensor x, Tensor packed, Tensor scales, Tensor mins, int bits, int group, "
        "Tensor? bias, int dequant_rows=0) -> Tensor");
}

TORCH_LIBRARY_IMPL(specserve_cpu, CPU, m) {
  m.impl("quant_linear", quant_linear);
}
