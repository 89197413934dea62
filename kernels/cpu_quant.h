// Quantized-weight linear layers on the CPU: the weight form, the activations' quantization
// and the integer dot-product kernels, shared by quant_linear (cpu_quant.cpp) and the fused
// decoder layers (cpu_layer.cpp). Included once per source file: everything is internal.
//
// Linear layers over quantized weights on the CPU: y = x · Wᵀ with W kept in 4, 5, 6 or 8 bits,
// as GGUF files hold it (Q4_0 … Q8_0, the K-quants, IQ4_NL and IQ4_XS:
// specserve/models/quantized.py repacks each into the one form below, exactly).
//
// Weight form: every weight is w = scale · q + min, q an unsigned integer (4 bits: 0..15,
// 5 bits: 0..31, 6 bits: 0..63, or 8 bits: 0..255), with one fp32 scale and one fp32 min per group of G consecutive
// inputs (G = 16 or 32). Q4_0 is q · d − 8d, Q8_0 is (q + 128) · d − 128d, Q6_K's groups
// of 16 are (q + 32) · d·s − 32 · d·s: all exact in fp32. IQ4_NL and IQ4_XS index a table
// of 16 values t: their q is t[i] + 128, held as the 4-bit index i (the form ``kIq4``,
// bits = -4) and looked up in the kernel.
//
// Activations are quantized per row and per block of 32 inputs to int16 with one fp32
// scale: a = round(x / d), d = max|x| / 32767. A group's dot product is then an integer
// sum, two AVX-512 VNNI instructions per 64 weights and row (vpdpwssd: 2 signed 16-bit
// products per int32 lane), and
//   y = Σ_groups  scale · d · Σ q·a  +  min · d · Σ a.
// llama.cpp quantizes activations to int8 (d = max|x| / 127), which costs half the integer
// work but moves the default model's answers: on "What is the capital of France?" its Q4_1
// file answers "L'Étoile, la Cité, …" with int8 activations and "The capital of France is
// Paris." with 12 bits or more, as it does dequantised. 16 bits keep the file's model.
//
// Inputs are reordered inside blocks so that each int32 lane sums one group only: a block
// is 16 groups (512 inputs at G = 32, 256 at G = 16; the last blocks of a row may be
// 8, 4 or 2 groups, see ``blocks``), and lane l of each of its 64-input chunks holds 4
// inputs of group l (of group l / L when the block has 16 / L groups). The integer sums then
// run across the whole block in the lanes, and the scales apply once per block: one
// multiply and two FMAs per 16 groups, where the integer work is two vpdpwssd per 64 weights.
//
// Layout, per output row n, inputs padded with zeros to Kp (a multiple of 64), in block order:
//  - 4 bits: Kp/2 bytes; each pair of 64-input chunks in 64 bytes, byte j holding input j
//    of the first (low nibble) and of the second (high nibble); an odd last chunk in 32
//    bytes, byte j holding its inputs j and 32 + j.
//  - 8 bits: Kp bytes.
//  - 5 or 6 bits (AVX-512 VNNI builds): the 4-bit layout of the low four bits, then planes
//    of the higher ones: 8 bytes a chunk and bit (bits − 4 of them, chunk by chunk: chunk c's
//    at 8 · (bits − 4) · c), bit j of a plane (as a little-endian u64) bit 4 + p of the
//    chunk's input j in the order its 4-bit bytes give (the pair's byte j, the odd chunk's
//    j, 32 + j).
//  - IQ4 (AVX-512 VNNI builds): the 4-bit layout of the indices.
//  - scales, mins: [N, Kp/G] fp32 (or fp16, where every value is one exactly and G = 32), in
//    group order (not reordered). Or two-level (``Sub8``, AVX-512 VNNI builds, Kp a multiple
//    of 256): where every value is a float32 factor of its super-block of 256 inputs times
//    a small integer of its group (the K-quants' d · sc and dmin · m, IQ4_XS's d · (ls −
//    32)), a row is its groups' integers as int8, then its super-blocks' factors as
//    float32 (4 bytes each, unaligned): [N, Kp/G + 4 · Kp/256] bytes, where fp32 took 4
//    bytes a group. Q4_K then reads 4.75 bits a weight, not 6; Q6_K 6.625, not 8.
//    Where every min is one factor f times its group's scale
//    (Q4_0's −8, Q5_0's −16, Q8_0's and IQ4's −128, Q6_K's −32, Q3_K's −4), ``mins`` is f
//    alone, a 0-dim float32, and no min is read: the kernels take min = f · scale in
//    float32 (pack() keeps f only where that product is each stored min exactly), as they
//    take min · 1 from a per-group ``mins``.
// Every output element is summed in one fixed order (block by block, then the 16 lanes),
// with rows and columns tiled only to share loads: a row's result does not depend on how
// many rows share the call, so the layer is batch-invariant as it stands.
//
// Many rows (a prefill chunk; ``dequant_rows`` or more): the integer dot products cost as
// much per row at any M, while a library GEMM reuses each weight over many rows. There the
// weight is unpacked in its own block order to x's dtype (scale · q + min, exact in fp32,
// rounded once to bf16 for bf16 activations), x's columns are put in the same order, and
// ATen's GEMM multiplies them; on a CPU with AMX, for bf16 activations, 64 weight rows at a
// time are unpacked into tiles that stay in cache and multiplied on the tile unit instead
// (cpu_quant.cpp: amx_linear). A row's result then depends on M crossing the threshold:
// the deterministic mode passes 0 (never).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

// The kernel's path, by what the build targets (kernels/cpu_ops.py's flags).
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define QUANT_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define QUANT_AVX2 1
#endif

namespace {


constexpr int64_t kChunk = 64;    // inputs per weight vector
constexpr int64_t kABlock = 32;   // inputs per activation scale
constexpr int64_t kLaneIn = 4;    // inputs per int32 lane (two int16 pairs)
constexpr int64_t kTileRows = 4;  // rows sharing one unpacked weight vector
// The forms beside 4 and 8 bits (``bits`` of a call): 5 and 6 bits, and 4-bit indices into
// the IQ4 table. They need byte masks or shuffles that only the AVX-512 VNNI path has; other
// builds run their q as 8 bits (``weight_forms``).
constexpr int64_t kIq4 = -4;
constexpr bool nibble_form(int64_t bits) { return bits == 5 || bits == 6 || bits == kIq4; }
#if defined(QUANT_AVX512)
constexpr bool kNibbleForms = true;
#else
constexpr bool kNibbleForms = false;
#endif
// IQ4_NL's and IQ4_XS's values (ggml's kvalues_iq4nl) + 128: q of index i.
constexpr uint8_t kIq4Table[16] = {1, 24, 45, 63, 79, 93, 106, 118, 129, 141, 153, 166, 181, 197, 217, 241};

// Bits a weight takes in ``packed``.
constexpr int64_t stored_bits(int64_t bits) { return bits == kIq4 ? 4 : bits; }

// The blocks of a row of kp inputs, in chunks: as many 16-group blocks as fit, then
// blocks of half, a quarter, ... of that (the layout's order; models/quantized.py: blocks).
std::vector<int64_t> blocks(int64_t kp, int64_t group) {
  const int64_t full = 16 * group / kChunk;  // chunks in a 16-group block
  std::vector<int64_t> out;
  int64_t left = kp / kChunk;
  for (; left >= full; left -= full) out.push_back(full);
  for (int64_t size = full / 2; size >= 1; size /= 2)
    if (left >= size) {
      out.push_back(size);
      left -= size;
    }
  return out;
}

// Where a chunk's input 4l + t (int32 lane l's t-th) sits among the chunk's 64 quantized
// activations. AVX-512 VNNI and the portable loop: two halves of 16 pairs, pair l of the
// first half holding inputs 4l, 4l + 1, of the second 4l + 2, 4l + 3 (lane l of a vpdpwssd
// sums one pair). AVX2: four vectors of 16, the even then the odd inputs of 0-31, then of
// 32-63 (the weights' even and odd inputs of a half, as its dot_tile widens them).
#if defined(QUANT_AVX2)
constexpr int64_t slot(int64_t l, int64_t t) { return 32 * (l / 8) + 16 * (t % 2) + 2 * (l % 8) + t / 2; }
#else
constexpr int64_t slot(int64_t l, int64_t t) { return 32 * (t / 2) + 2 * l + t % 2; }
#endif

// Activations of one call, quantized: a [M, Kp] int16 in block order, each 64-input chunk's
// inputs at their ``slot``; per weight group (G inputs), d of the group's 32-input block and
// d · Σ a over the group, [M, Kp / G].
struct QuantizedRows {
  std::vector<int16_t> a;
  std::vector<float> group_scale, group_sum;
  std::vector<int64_t> blocks;
  int64_t kp = 0, group = 32;
  int64_t blocks_kp = -1, blocks_group = -1;  // what ``blocks`` was made for (``prepare_rows``)
};

template <typename T>
float as_float(T v) { return static_cast<float>(v); }

// A weight's scales (and per-group mins) are float32, or float16 where every one of them is
// exactly a float16 (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL), which reads fewer bytes per step.
inline float scalar(float v) { return v; }
inline float scalar(at::Half v) { return static_cast<float>(v); }

// A two-level scale's (or min's) per-group integer (the form above); its super-block's
// factor sits after the row's integers.
struct Sub8 {
  int8_t v;
};
template <typename S>
constexpr bool kTwoLevel = std::is_same_v<S, Sub8>;
constexpr int64_t kSuperBlock = 256;  // inputs a two-level factor covers

// Entries of S a row of scales (or mins) takes: one a group, and for two-level ones 4 bytes
// a super-block after them.
template <typename S>
constexpr int64_t scale_row(int64_t groups, int64_t group) {
  if constexpr (kTwoLevel<S>) return groups + 4 * (groups * group / kSuperBlock);
  else return groups;
}

#if defined(QUANT_AVX512)
// 16 activations from p on, as float32.
inline __m512 load_floats16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load_floats16(const at::BFloat16* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
#endif

// ``out`` sized for m rows of kp inputs (its kp and group set), its rows still to quantize
// (``quantize_row_range`` writes every value of ``a``; the groups past k keep scale and sum 0).
// A thread's scratch is prepared a few times a layer: its blocks are made again only for
// another kp or group.
inline void prepare_rows(int64_t m, QuantizedRows& out) {
  const int64_t groups = out.kp / out.group;
  out.a.resize(m * out.kp);
  out.group_scale.assign(m * groups, 0.f);
  out.group_sum.assign(m * groups, 0.f);
  if (out.blocks_kp != out.kp || out.blocks_group != out.group) {
    out.blocks = blocks(out.kp, out.group);
    out.blocks_kp = out.kp;
    out.blocks_group = out.group;
  }
}

#if defined(QUANT_AVX512)
// Chunk j of a whole block (16 groups of g inputs, a group a lane: L = 1 below) into block
// order, from the block's natural order at ``src``: lane l's inputs 4j … 4j + 3 of group l,
// each at its ``slot``, which puts input pair p (4j + 2p, + 1) of lane l in the chunk's
// int32 16p + l; so each half of the chunk is one gather of the lanes' pairs.
inline void whole_block_chunk(const int16_t* src, int64_t g, int64_t j, int16_t* chunk) {
  static_assert(slot(5, 2) == 32 + 2 * 5 && slot(5, 3) == 32 + 2 * 5 + 1, "the AVX-512 slots");
  const __m512i lanes = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                           _mm512_set1_epi32(static_cast<int32_t>(2 * g)));  // bytes
  for (int64_t p = 0; p < 2; ++p)
    _mm512_storeu_si512(chunk + 32 * p, _mm512_i32gather_epi32(lanes, src + kLaneIn * j + 2 * p, 1));
}
#endif

// Rows begin … end - 1 of x [m, k] quantized into ``out`` (prepared), ``natural`` a scratch
// row of kp values.
template <typename T>
void quantize_row_range(const T* x, int64_t k, QuantizedRows& out, int64_t begin, int64_t end,
                        std::vector<int16_t>& natural) {
  const int64_t kp = out.kp, g = out.group, groups = kp / g;
  natural.assign(kp, 0);
  float block[kABlock];
  for (int64_t r = begin; r < end; ++r) {
    for (int64_t b0 = 0; b0 < k; b0 += kABlock) {
      const int64_t width = std::min(kABlock, k - b0);
#if defined(QUANT_AVX512)
      if (width == kABlock) {  // the same values 16 lanes at a time (max, the rounding and the sums are exact)
        __m512 v[2];
        for (int h = 0; h < 2; ++h) v[h] = load_floats16(x + r * k + b0 + 16 * h);
        const float top = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v[0]), _mm512_abs_ps(v[1])));
        const float d = top / 32767.f, id = d != 0.f ? 1.f / d : 0.f;
        __m512i q[2];
        for (int h = 0; h < 2; ++h) {
          q[h] = _mm512_cvtps_epi32(_mm512_mul_ps(v[h], _mm512_set1_ps(id)));  // to nearest, ties to even
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(natural.data() + b0 + 16 * h), _mm512_cvtepi32_epi16(q[h]));
        }
        for (int64_t g0 = 0; g0 < kABlock; g0 += g) {
          const int32_t sum = g == kABlock ? _mm512_reduce_add_epi32(_mm512_add_epi32(q[0], q[1]))
                                           : _mm512_reduce_add_epi32(q[g0 / 16]);
          out.group_scale[r * groups + (b0 + g0) / g] = d;
          out.group_sum[r * groups + (b0 + g0) / g] = d * static_cast<float>(sum);
        }
        continue;
      }
#endif
      float amax = 0.f;
      for (int64_t i = 0; i < kABlock; ++i) {
        block[i] = i < width ? as_float(x[r * k + b0 + i]) : 0.f;
        amax = std::max(amax, std::fabs(block[i]));
      }
      const float d = amax / 32767.f, id = d != 0.f ? 1.f / d : 0.f;
      int16_t* a = natural.data() + b0;
      for (int64_t i = 0; i < kABlock; ++i)
        a[i] = static_cast<int16_t>(std::nearbyint(block[i] * id));  // ties to even, as torch.round
      for (int64_t g0 = 0; g0 < kABlock; g0 += g) {  // a weight group lies inside one block
        int32_t sum = 0;
        for (int64_t i = 0; i < g; ++i) sum += a[g0 + i];
        out.group_scale[r * groups + (b0 + g0) / g] = d;
        out.group_sum[r * groups + (b0 + g0) / g] = d * static_cast<float>(sum);
      }
    }
    // Into block order: chunk j, lane l of a block of 16 / L groups holds inputs
    // (j · L + l % L) · 4 … + 3 of its group l / L, each at its slot.
    int16_t* dst = out.a.data() + r * kp;
    int64_t k0 = 0;
    for (const int64_t size : out.blocks) {
      const int64_t per_lane = g / (kLaneIn * size);  // L
#if defined(QUANT_AVX512)
      if (per_lane == 1) {  // a whole block
        for (int64_t j = 0; j < size; ++j) whole_block_chunk(natural.data() + k0, g, j, dst + k0 + j * kChunk);
        k0 += size * kChunk;
        continue;
      }
#endif
      for (int64_t j = 0; j < size; ++j)
        for (int64_t l = 0; l < 16; ++l) {
          const int16_t* src = natural.data() + k0 + (l / per_lane) * g + (j * per_lane + l % per_lane) * kLaneIn;
          int16_t* chunk = dst + k0 + j * kChunk;
          for (int64_t t = 0; t < kLaneIn; ++t) chunk[slot(l, t)] = src[t];
        }
      k0 += size * kChunk;
    }
  }
}

template <typename T>
void quantize_rows(const T* x, int64_t m, int64_t k, QuantizedRows& out) {
  prepare_rows(m, out);
  at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
    std::vector<int16_t> natural;
    quantize_row_range(x, k, out, begin, end, natural);
  });
}

#if defined(QUANT_AVX512)
// The bits above the fourth of chunk c of a 5- or 6-bit row whose planes start at
// ``planes``, as 16 and 32 in the bytes they belong to (in the chunk's order: as
// weight_chunk and a pair's masks give them).
template <int Bits>
inline __m512i high_bits(const uint8_t* planes, int64_t c) {
  uint64_t bits[Bits - 4];
  std::memcpy(bits, planes + 8 * (Bits - 4) * c, sizeof(bits));
  const __m512i fifth = _mm512_maskz_mov_epi8(_cvtu64_mask64(bits[0]), _mm512_set1_epi8(16));
  if constexpr (Bits == 5) return fifth;
  else return _mm512_or_si512(fifth, _mm512_maskz_mov_epi8(_cvtu64_mask64(bits[1]), _mm512_set1_epi8(32)));
}

// kIq4Table in each 128-bit lane: vpshufb's table, a nibble its index.
inline __m512i iq4_table() {
  return _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kIq4Table)));
}

// Weight vector (64 inputs, as unsigned bytes) of chunk c of the row at w, outside chunk
// pairs: any 8-bit chunk, or a 4-bit row's odd last chunk (32 bytes, inputs j and 32 + j).
template <int Bits>
inline __m512i weight_chunk(const uint8_t* w, int64_t c) {
  if constexpr (Bits == 8) {
    return _mm512_loadu_si512(w + c * kChunk);
  } else {
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + c * (kChunk / 2)));
    const __m256i lo = _mm256_and_si256(packed, low4), hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low4);
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
  }
}

// Per lane, the value of its group: the block's `count` groups from p, each over 16 / count lanes.
// 16 scales or mins (the first ``count``, the rest 0) as float32.
inline __m512 load16(const float* p, int64_t count) {
  return count == 16 ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps(__mmask16((1u << count) - 1), p);
}
inline __m512 load16(const at::Half* p, int64_t count) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(__mmask16((1u << count) - 1), p));
}

// Groups g0 … g0 + count − 1 of a row of scales or mins as float32, lane l holding group
// g0 + l (0 from lane ``count`` on); ``groups`` and ``group``: the row's (two-level rows
// read their factors after their integers). A two-level value is factor · integer, the
// float32 product the fp32 form holds.
template <typename S>
inline __m512 group_values(const S* row, int64_t g0, int64_t count, int64_t /*groups*/, int64_t /*group*/) {
  return load16(row + g0, count);
}
inline __m512 group_values(const Sub8* row, int64_t g0, int64_t count, int64_t groups, int64_t group) {
  const __mmask16 valid = __mmask16((1u << count) - 1);
  const __m512 sub = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(valid, row + g0)));
  const uint8_t* factors = reinterpret_cast<const uint8_t*>(row) + groups;
  const int64_t per = kSuperBlock / group, first = g0 / per;  // (a block never starts inside a super-block's groups)
  float f[2];
  std::memcpy(f, factors + 4 * first, count > per ? 8 : 4);
  __m512 factor = _mm512_set1_ps(f[0]);
  if (count > per) factor = _mm512_mask_blend_ps(__mmask16(0xFFFFu << per), factor, _mm512_set1_ps(f[1]));
  return _mm512_maskz_mul_ps(valid, sub, factor);  // (lanes past the block 0 whatever the factor)
}

// Lane l takes the value of group l / (16 / count) (a block of ``count`` groups over 16 lanes).
inline __m512 spread(__m512 v, int64_t count) {
  if (count == 16) return v;
  // a shift, counts being powers of two
  const __m512i lanes = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const int shift = __builtin_ctzll(static_cast<uint64_t>(16 / count));
  return _mm512_permutexvar_ps(_mm512_srli_epi32(lanes, static_cast<unsigned>(shift)), v);
}

template <typename S>
inline __m512 per_lane(const S* p, int64_t count) {
  return spread(load16(p, count), count);
}

// A block's per-lane scales or mins from a row of them (``group_values`` spread).
template <typename S>
inline __m512 lane_values(const S* row, int64_t g0, int64_t count, int64_t groups, int64_t group) {
  return spread(group_values(row, g0, count, groups, group), count);
}

// Cols weight rows × Rows activation rows, one accumulator each.
template <int Rows, int Cols, int Bits, int G, typename S>
inline void dot_tile(const uint8_t* w, int64_t row_bytes, const S* ws, const S* wm, float mf, const QuantizedRows& q,
                     int64_t r0, float* out /* [Rows][Cols] */) {
  const int64_t kp = q.kp, groups = kp / G, stride = scale_row<S>(groups, G);
  const __m512 min_factor = _mm512_set1_ps(mf);
  __m512 acc[Cols][Rows];
  for (int n = 0; n < Cols; ++n)
    for (int r = 0; r < Rows; ++r) acc[n][r] = _mm512_setzero_ps();
  const int16_t* a = q.a.data() + r0 * kp;
  // Bytes 4l, 4l + 1 (first) and 4l + 2, 4l + 3 (second) of each dword as int16 pairs.
  const __m512i first = _mm512_set4_epi32(int(0x800D800Cu), int(0x80098008u), int(0x80058004u), int(0x80018000u));
  const __m512i second = _mm512_add_epi8(first, _mm512_set1_epi32(0x0002'0002));
  const __m512i table = iq4_table();  // (IQ4 only)
  // acc += w · a over one 64-input chunk: the weight bytes widened to int16 pairs.
  auto madd = [&](__m512i dot, __m512i wv, const int16_t* ac) __attribute__((always_inline)) {
    dot = _mm512_dpwssd_epi32(dot, _mm512_shuffle_epi8(wv, first), _mm512_loadu_si512(ac));
    return _mm512_dpwssd_epi32(dot, _mm512_shuffle_epi8(wv, second), _mm512_loadu_si512(ac + 32));
  };
  int64_t c = 0, g0 = 0;
  for (const int64_t size : q.blocks) {
    const int64_t count = size * kChunk / G;  // groups in this block
    __m512i dots[Cols][Rows];
    for (int n = 0; n < Cols; ++n)
      for (int r = 0; r < Rows; ++r) dots[n][r] = _mm512_setzero_si512();
    // 4 bits, 5 or 6 (the low four as 4 bits, the others from the row's planes, kp / 2
    // bytes on) or IQ4 (4-bit indices, looked up).
    constexpr bool kPlanes = Bits == 5 || Bits == 6;
    constexpr int kNibbles = kPlanes ? 4 : stored_bits(Bits);
    if (kNibbles == 4 && size > 1) {  // chunk pairs: one load, two masks (blocks of 2+ chunks hold whole pairs)
      const __m512i low4 = _mm512_set1_epi8(0x0F);
      for (int64_t j = 0; j < size; j += 2, c += 2)
        for (int n = 0; n < Cols; ++n) {
          const __m512i packed = _mm512_loadu_si512(w + n * row_bytes + c * (kChunk / 2));
          __m512i lo = _mm512_and_si512(packed, low4);
          __m512i hi = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low4);
          if constexpr (kPlanes) {
            lo = _mm512_or_si512(lo, high_bits<Bits>(w + n * row_bytes + kp / 2, c));
            hi = _mm512_or_si512(hi, high_bits<Bits>(w + n * row_bytes + kp / 2, c + 1));
          } else if constexpr (Bits == kIq4) {
            lo = _mm512_shuffle_epi8(table, lo);
            hi = _mm512_shuffle_epi8(table, hi);
          }
          for (int r = 0; r < Rows; ++r) {
            dots[n][r] = madd(dots[n][r], lo, a + r * kp + c * kChunk);
            dots[n][r] = madd(dots[n][r], hi, a + r * kp + (c + 1) * kChunk);
          }
        }
    } else {  // 8 bits, or a 4-, 5- or 6-bit block of one chunk: the row's odd last chunk
      for (int64_t j = 0; j < size; ++j, ++c)
        for (int n = 0; n < Cols; ++n) {
          __m512i wv = weight_chunk<kNibbles>(w + n * row_bytes, c);
          if constexpr (kPlanes) wv = _mm512_or_si512(wv, high_bits<Bits>(w + n * row_bytes + kp / 2, c));
          if constexpr (Bits == kIq4) wv = _mm512_shuffle_epi8(table, wv);
          for (int r = 0; r < Rows; ++r) dots[n][r] = madd(dots[n][r], wv, a + r * kp + c * kChunk);
        }
    }
    const __mmask16 valid = __mmask16((1u << count) - 1);
    __m512 wscale[Cols], wmin[Cols];  // the columns' per-lane scales and per-group mins
    for (int n = 0; n < Cols; ++n) {
      wscale[n] = lane_values(ws + n * stride, g0, count, groups, G);
      wmin[n] = _mm512_mul_ps(group_values(wm + n * stride, g0, count, groups, G), min_factor);
    }
    for (int r = 0; r < Rows; ++r) {
      const __m512 d = per_lane(q.group_scale.data() + (r0 + r) * groups + g0, count);
      const __m512 sums = _mm512_maskz_loadu_ps(valid, q.group_sum.data() + (r0 + r) * groups + g0);
      for (int n = 0; n < Cols; ++n) {
        const __m512 scale = _mm512_mul_ps(wscale[n], d);
        acc[n][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots[n][r]), scale, acc[n][r]);
        // the min term, once per group: Σ min · d·Σa
        acc[n][r] = _mm512_fmadd_ps(wmin[n], sums, acc[n][r]);
      }
    }
    g0 += count;
  }
  for (int r = 0; r < Rows; ++r)
    for (int n = 0; n < Cols; ++n) out[r * Cols + n] = _mm512_reduce_add_ps(acc[n][r]);
}

constexpr int kVectorRegisters = 32;
#elif defined(QUANT_AVX2)
// AVX2: the same integer sums with vpmaddwd, each 16-lane accumulator as two 8-lane halves
// (lanes 0-7 from the chunk's inputs 0-31, lanes 8-15 from 32-63). A machine without AVX-512
// VNNI (most desktop CPUs, AVX-512 ones before Cascade Lake) runs this rather than the
// portable loop. The weights are widened to int16 by masks and shifts of 16-bit words,
// never by byte shuffles (which the shuffle ports would serialize): a word of a half holds
// its inputs 2i and 2i + 1, so the even inputs (e) and the odd ones (o) of each half come
// out as two vectors, and the activations are laid out to match (``slot``).

// A chunk's weights as int16, the madd operands: e[v] holds half v's even inputs 32v + 2i,
// o[v] its odd inputs 32v + 2i + 1 (i = 0..15).
struct ChunkWeights {
  __m256i e[2], o[2];
};

inline __m256i load256(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }

// Chunk c + `second` of the pair of chunks c, c + 1 of a row at w (c even, both in the
// row's chunk pairs), from the pair's words (loaded once for both: ``pair_words``). 8 bits: a
// chunk's 64 bytes in order. 4 bits: the pair's 64 bytes, byte j holding input j of c (low
// nibble) and of c + 1 (high): word i of half v has c's 32v + 2i, c + 1's 32v + 2i, c's
// 32v + 2i + 1, c + 1's 32v + 2i + 1 in its four nibbles.
template <int Bits>
inline void pair_words(const uint8_t* w, int64_t c, __m256i words[4]) {
  if constexpr (Bits == 8) {
    for (int i = 0; i < 4; ++i) words[i] = load256(w + c * kChunk + 32 * i);
  } else {
    words[0] = load256(w + c * (kChunk / 2));
    words[1] = load256(w + c * (kChunk / 2) + 32);
  }
}

template <int Bits, int Second>
inline ChunkWeights pair_chunk(const __m256i words[4]) {
  ChunkWeights x;
  if constexpr (Bits == 8) {
    const __m256i byte = _mm256_set1_epi16(0x00FF);
    for (int v = 0; v < 2; ++v) {
      x.e[v] = _mm256_and_si256(words[2 * Second + v], byte);
      x.o[v] = _mm256_srli_epi16(words[2 * Second + v], 8);
    }
  } else {
    const __m256i nibble = _mm256_set1_epi16(0x000F);
    for (int v = 0; v < 2; ++v) {
      x.e[v] = _mm256_and_si256(_mm256_srli_epi16(words[v], 4 * Second), nibble);
      x.o[v] = Second ? _mm256_srli_epi16(words[v], 12) : _mm256_and_si256(_mm256_srli_epi16(words[v], 8), nibble);
    }
  }
  return x;
}

// A lone chunk c: any 8-bit chunk, or a 4-bit row's odd last chunk (32 bytes, byte j holding
// inputs j and 32 + j: word i has inputs 2i, 32 + 2i, 2i + 1, 32 + 2i + 1 in its nibbles).
template <int Bits>
inline void lone_chunk(const uint8_t* w, int64_t c, ChunkWeights& x) {
  if constexpr (Bits == 8) {
    const __m256i byte = _mm256_set1_epi16(0x00FF);
    for (int v = 0; v < 2; ++v) {
      const __m256i words = load256(w + c * kChunk + 32 * v);
      x.e[v] = _mm256_and_si256(words, byte);
      x.o[v] = _mm256_srli_epi16(words, 8);
    }
  } else {
    const __m256i nibble = _mm256_set1_epi16(0x000F);
    const __m256i words = load256(w + c * (kChunk / 2));
    x.e[0] = _mm256_and_si256(words, nibble);
    x.e[1] = _mm256_and_si256(_mm256_srli_epi16(words, 4), nibble);
    x.o[0] = _mm256_and_si256(_mm256_srli_epi16(words, 8), nibble);
    x.o[1] = _mm256_srli_epi16(words, 12);
  }
}

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline __m256 load4(const float* p) { return _mm256_castps128_ps256(_mm_loadu_ps(p)); }  // upper lanes unused
inline __m256 load4(const at::Half* p) {
  return _mm256_castps128_ps256(_mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline float one(float v) { return v; }
inline float one(at::Half v) { return _cvtsh_ss(v.x); }

// 16 per-lane values of a block of `count` groups (16, 8, 4 or 2) as two halves: lane l
// takes its group's entry l / (16 / count) of p, or with `once` entry l for l < count and 0
// after (the min term, once per group). Never reads past p's count entries.
template <typename S>
inline void lanes16(const S* p, int64_t count, bool once, __m256& lo, __m256& hi) {
  if (count == 16) {
    lo = load8(p);
    hi = load8(p + 8);
    return;
  }
  hi = _mm256_setzero_ps();
  if (count == 8) {
    const __m256 v = load8(p);
    if (once) {
      lo = v;
      return;
    }
    lo = _mm256_permutevar8x32_ps(v, _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3));
    hi = _mm256_permutevar8x32_ps(v, _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7));
  } else if (count == 4) {
    const __m256 v = load4(p);
    if (once) {
      lo = _mm256_blend_ps(_mm256_setzero_ps(), v, 0x0F);
      return;
    }
    lo = _mm256_permutevar8x32_ps(v, _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));
    hi = _mm256_permutevar8x32_ps(v, _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3));
  } else {  // 2
    if (once) {
      lo = _mm256_setr_ps(one(p[0]), one(p[1]), 0.f, 0.f, 0.f, 0.f, 0.f, 0.f);
      return;
    }
    lo = _mm256_set1_ps(one(p[0]));
    hi = _mm256_set1_ps(one(p[1]));
  }
}

template <int Rows, int Cols, int Bits, int G, typename S>
inline void dot_tile(const uint8_t* w, int64_t row_bytes, const S* ws, const S* wm, float mf, const QuantizedRows& q,
                     int64_t r0, float* out /* [Rows][Cols] */) {
  const int64_t kp = q.kp, groups = kp / G;
  const __m256 min_factor = _mm256_set1_ps(mf);
  // One accumulator per output: the two halves' lanes fold into one, l and l + 8.
  __m256 acc[Cols][Rows];
  for (int n = 0; n < Cols; ++n)
    for (int r = 0; r < Rows; ++r) acc[n][r] = _mm256_setzero_ps();
  const int16_t* a = q.a.data() + r0 * kp;
  int64_t c = 0, g0 = 0;
  for (const int64_t size : q.blocks) {
    const int64_t count = size * kChunk / G;  // groups in this block
    __m256i dots[Cols][Rows][2];
    for (int n = 0; n < Cols; ++n)
      for (int r = 0; r < Rows; ++r) dots[n][r][0] = dots[n][r][1] = _mm256_setzero_si256();
    auto madd = [&](const ChunkWeights& x, int n, int64_t chunk) __attribute__((always_inline)) {
      for (int r = 0; r < Rows; ++r) {
        const int16_t* ac = a + r * kp + chunk * kChunk;
        for (int v = 0; v < 2; ++v)
          dots[n][r][v] = _mm256_add_epi32(dots[n][r][v],
                                           _mm256_add_epi32(_mm256_madd_epi16(x.e[v], load256(ac + 32 * v)),
                                                            _mm256_madd_epi16(x.o[v], load256(ac + 32 * v + 16))));
      }
    };
    if (size == 1) {  // a block of one chunk: the row's last (blocks of 2+ chunks hold whole pairs)
      for (int n = 0; n < Cols; ++n) {
        ChunkWeights x;
        lone_chunk<Bits>(w + n * row_bytes, c, x);
        madd(x, n, c);
      }
      ++c;
    } else {
      for (int64_t j = 0; j < size; j += 2, c += 2)
        for (int n = 0; n < Cols; ++n) {
          __m256i words[4];
          pair_words<Bits>(w + n * row_bytes, c, words);
          madd(pair_chunk<Bits, 0>(words), n, c);
          madd(pair_chunk<Bits, 1>(words), n, c + 1);
        }
    }
    __m256 d[Rows][2], sums[Rows][2];
    for (int r = 0; r < Rows; ++r) {
      lanes16(q.group_scale.data() + (r0 + r) * groups + g0, count, false, d[r][0], d[r][1]);
      lanes16(q.group_sum.data() + (r0 + r) * groups + g0, count, true, sums[r][0], sums[r][1]);
    }
    for (int n = 0; n < Cols; ++n) {
      __m256 scale[2], mins[2];
      lanes16(ws + n * groups + g0, count, false, scale[0], scale[1]);
      lanes16(wm + n * groups + g0, count, true, mins[0], mins[1]);
      mins[0] = _mm256_mul_ps(mins[0], min_factor);
      mins[1] = _mm256_mul_ps(mins[1], min_factor);
      for (int r = 0; r < Rows; ++r)
        for (int h = 0; h < 2; ++h) {
          acc[n][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots[n][r][h]), _mm256_mul_ps(scale[h], d[r][h]), acc[n][r]);
          // the min term, once per group: Σ min · d·Σa
          acc[n][r] = _mm256_fmadd_ps(mins[h], sums[r][h], acc[n][r]);
        }
    }
    g0 += count;
  }
  for (int r = 0; r < Rows; ++r)
    for (int n = 0; n < Cols; ++n) {
      alignas(32) float v[8];
      _mm256_store_ps(v, acc[n][r]);
      out[r * Cols + n] = ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
    }
}

constexpr int kVectorRegisters = 16;
#else
// Portable: the same sums, lane by lane, in the same order as the vector path.
template <int Rows, int Cols, int Bits, int G, typename S>
inline void dot_tile(const uint8_t* w, int64_t row_bytes, const S* ws, const S* wm, float mf, const QuantizedRows& q,
                     int64_t r0, float* out) {
  const int64_t kp = q.kp, groups = kp / G, chunks = kp / kChunk;
  for (int n = 0; n < Cols; ++n) {
    const uint8_t* wn = w + n * row_bytes;
    for (int r = 0; r < Rows; ++r) {
      const int64_t row = r0 + r;
      const int16_t* a = q.a.data() + row * kp;
      float acc[16] = {};
      int64_t c = 0, g0 = 0;
      for (const int64_t size : q.blocks) {
        const int64_t count = size * kChunk / G, per = 16 / count;
        int32_t dots[16] = {};
        for (int64_t j = 0; j < size; ++j, ++c)
          for (int64_t i = 0; i < kChunk; ++i) {
            int32_t wq = wn[c * kChunk + i];
            if (Bits == 4 && (c & 1) == 0 && c + 1 == chunks) {  // an odd last chunk
              const uint8_t byte = wn[c * (kChunk / 2) + (i % 32)];
              wq = i < 32 ? (byte & 0x0F) : (byte >> 4);
            } else if (Bits == 4) {
              const uint8_t byte = wn[(c & ~int64_t(1)) * (kChunk / 2) + i];
              wq = (c & 1) ? (byte >> 4) : (byte & 0x0F);
            }
            const int64_t lane = i / kLaneIn, in_lane = i % kLaneIn;
            dots[lane] += wq * int32_t(a[c * kChunk + slot(lane, in_lane)]);
          }
        for (int64_t l = 0; l < 16; ++l) {
          const int64_t grp = g0 + l / per;
          acc[l] = std::fma(float(dots[l]), scalar(ws[n * groups + grp]) * q.group_scale[row * groups + grp], acc[l]);
          if (l < count)
            acc[l] = std::fma(scalar(wm[n * groups + g0 + l]) * mf, q.group_sum[row * groups + g0 + l], acc[l]);
        }
        g0 += count;
      }
      float s = 0.f;
      for (int l = 0; l < 16; ++l) s += acc[l];
      out[r * Cols + n] = s;
    }
  }
}

constexpr int kVectorRegisters = 32;  // (no vector registers: the AVX-512 tiles)
#endif

// Column tiles of dot_rows, by the accumulators the vector registers hold: on AVX-512, 4
// columns for 1 or 2 rows and 2 for 3 or 4 (measured best on a Xeon); on AVX2's 16, 4
// columns for 1 row, 2 for 2, 1 for more.
template <int Rows>
constexpr int tile_cols() {
  if constexpr (kVectorRegisters == 16) return Rows == 1 ? 2 : Rows == 2 ? 2 : 1;
  return Rows <= 2 ? 4 : 2;
}

// How far ahead of its column tile a thread asks for weights (into L2), in weight rows:
// columns of the output. Left to the hardware prefetchers, a decode step on few threads
// waited on DRAM: a tile reads kCols row streams at once, 64 bytes of each in turn.
constexpr int64_t kPrefetchCols = 16;

// Rows activation rows against `cols` weight rows, in column tiles of ``tile_cols``
// columns: out [Rows][cols]. With
// `prefetch`, each tile first asks for the weight rows kPrefetchCols ahead of it, of the
// `left` rows from w on (a span's first row tile: the others find them in cache).
template <int Rows, int Bits, int G, typename S>
void dot_rows(int64_t cols, const uint8_t* w, int64_t row_bytes, const S* ws, const S* wm, float mf,
              const QuantizedRows& q, int64_t r0, float* out, bool prefetch, int64_t left) {
  constexpr int kCols = tile_cols<Rows>();
  float tile[Rows * kCols];
  const int64_t stride = scale_row<S>(q.kp / G, G);
  for (int64_t n0 = 0; n0 < cols; n0 += kCols) {
    if (prefetch && n0 + kPrefetchCols + kCols <= left) {
      const uint8_t* ahead = w + (n0 + kPrefetchCols) * row_bytes;
      for (int64_t b = 0; b < kCols * row_bytes; b += 64) __builtin_prefetch(ahead + b, 0, 2);  // prefetcht1
    }
    const int64_t width = std::min<int64_t>(kCols, cols - n0);
    if (width == kCols) {
      dot_tile<Rows, kCols, Bits, G, S>(w + n0 * row_bytes, row_bytes, ws + n0 * stride, wm + n0 * stride, mf, q, r0,
                                        tile);
      for (int r = 0; r < Rows; ++r)
        for (int n = 0; n < kCols; ++n) out[r * cols + n0 + n] = tile[r * kCols + n];
    } else {
      for (int64_t n = n0; n < cols; ++n) {
        dot_tile<Rows, 1, Bits, G, S>(w + n * row_bytes, row_bytes, ws + n * stride, wm + n * stride, mf, q, r0, tile);
        for (int r = 0; r < Rows; ++r) out[r * cols + n] = tile[r];
      }
    }
  }
}
// Output columns a thread takes at once (a span): 16 leaves 8 threads less uneven work on
// a 576-column projection (36 spans) than 32 did (18), at no cost on 2.
constexpr int64_t kSpan = 16;

// A weight in the form above, as a call reads it: ``scales`` and ``mins`` float32, or
// float16 (``half``, groups of 32), or two-level (``two_level``: Sub8 rows), each min
// ``min_factor`` times its ``mins`` entry (1: the mins as they are; or ``mins`` is
// ``scales`` and the factor f); ``bias`` float32 or null.
struct QuantWeight {
  const uint8_t* packed;
  const void* scales;
  const void* mins;
  float min_factor;
  const float* bias;
  int64_t n, kp, row_bytes, bits, group;
  bool half, two_level;
  int64_t spans() const { return (n + kSpan - 1) / kSpan; }
};

// Whether this build takes two-level scales (``Sub8``): its AVX-512 VNNI kernels read them.
constexpr bool kTwoLevelScales = kNibbleForms;

// A weight's tensors checked for k inputs (``packed`` uint8 [N, Kp · stored_bits(bits) / 8], ``scales``
// and ``mins`` float32 or float16 [N, Kp / group] or two-level uint8 [N, scale_row], or ``mins`` a
// 0-dim float32 factor) and read as a QuantWeight.
inline QuantWeight quant_weight(const at::Tensor& packed, const at::Tensor& scales, const at::Tensor& mins, int64_t bits,
                                int64_t group, int64_t k, const float* bias) {
  TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == at::kByte && packed.dim() == 2 &&
                  packed.is_contiguous(),
              "packed must be a contiguous uint8 CPU tensor [N, bytes]");
  TORCH_CHECK(bits == 4 || bits == 8 || (nibble_form(bits) && kNibbleForms),
              "bits must be 4 or 8 (or 5, 6 or -4, IQ4, built for AVX-512 VNNI)");
  TORCH_CHECK(group == 16 || group == 32, "group must be 16 or 32");
  TORCH_CHECK(bits != kIq4 || group == 32, "IQ4 weights come in groups of 32");
  TORCH_CHECK(packed.size(1) * 8 % stored_bits(bits) == 0, "packed rows of ", packed.size(1),
              " bytes hold no whole ", stored_bits(bits), "-bit row");
  const int64_t n = packed.size(0), kp = packed.size(1) * 8 / stored_bits(bits);
  TORCH_CHECK(kp % kChunk == 0 && k <= kp && kp - k < kChunk, "x has ", k, " features, the weight ", kp, " (padded)");
  const bool half = scales.scalar_type() == at::kHalf, two_level = scales.scalar_type() == at::kByte;
  TORCH_CHECK(!half || group == 32, "float16 scales come with groups of 32");
  TORCH_CHECK(!two_level || (kTwoLevelScales && kp % kSuperBlock == 0),
              "two-level (uint8) scales need a build for AVX-512 VNNI and inputs in whole super-blocks of 256");
  const at::ScalarType dtype = half ? at::kHalf : two_level ? at::kByte : at::kFloat;
  const int64_t row = two_level ? scale_row<Sub8>(kp / group, group) : kp / group;
  const bool factor = mins.dim() == 0;
  TORCH_CHECK(!factor || (mins.scalar_type() == at::kFloat && mins.device().is_cpu()),
              "mins as one factor must be a 0-dim float32 CPU tensor");
  for (const at::Tensor* t : {&scales, &mins})
    TORCH_CHECK((factor && t == &mins) ||
                    (t->scalar_type() == dtype && t->is_contiguous() && t->dim() == 2 && t->size(0) == n &&
                     t->size(1) == row),
                "scales and mins must be contiguous [N, Kp / group], both float32 or both float16, or both "
                "two-level uint8 [N, Kp / group + 4 Kp / 256] (or mins one 0-dim float32 factor of the scales)");
  return {packed.data_ptr<uint8_t>(), scales.data_ptr(), factor ? scales.data_ptr() : mins.data_ptr(),
          factor ? *mins.const_data_ptr<float>() : 1.f, bias, n, kp, packed.size(1), bits, group, half,
          two_level};
}

// Output columns begin … end - 1 of y [m, n] = x · Wᵀ (+ bias), x quantized in q, a span
// at a time: each output element is made whole by one call (and summed in the same order
// in any tile), so threads may split the columns any way. Each element is rounded to R,
// then stored as T (a float32 output of a bfloat16 model's values: R = bfloat16, T = float).
template <int Bits, int G, typename S, typename T, typename R = T>
void matmul_columns(const QuantizedRows& q, int64_t m, const QuantWeight& wt, T* out, int64_t begin, int64_t end) {
  const int64_t n = wt.n, row_bytes = wt.row_bytes, stride = scale_row<S>(q.kp / G, G);
  const S* scales = static_cast<const S*>(wt.scales);
  const S* mins = static_cast<const S*>(wt.mins);
  const float* bias = wt.bias;
  float res[kTileRows * kSpan];
  for (int64_t c0 = begin; c0 < end; c0 += kSpan) {
    const int64_t cols = std::min(kSpan, end - c0);
    const uint8_t* w = wt.packed + c0 * row_bytes;
    const S* ws = scales + c0 * stride;
    const S* wm = mins + c0 * stride;
    for (int64_t r0 = 0; r0 < m; r0 += kTileRows) {
      const int64_t rows = std::min(kTileRows, m - r0);
      switch (rows) {
        case 1: dot_rows<1, Bits, G, S>(cols, w, row_bytes, ws, wm, wt.min_factor, q, r0, res, r0 == 0, n - c0); break;
        case 2: dot_rows<2, Bits, G, S>(cols, w, row_bytes, ws, wm, wt.min_factor, q, r0, res, r0 == 0, n - c0); break;
        case 3: dot_rows<3, Bits, G, S>(cols, w, row_bytes, ws, wm, wt.min_factor, q, r0, res, r0 == 0, n - c0); break;
        default: dot_rows<4, Bits, G, S>(cols, w, row_bytes, ws, wm, wt.min_factor, q, r0, res, r0 == 0, n - c0); break;
      }
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t j = 0; j < cols; ++j) {
          const float y = res[r * cols + j];
          out[(r0 + r) * n + c0 + j] = static_cast<T>(static_cast<R>(bias ? y + bias[c0 + j] : y));
        }
    }
  }
}

template <typename T, typename R = T>
void matmul_columns(const QuantizedRows& q, int64_t m, const QuantWeight& w, T* out, int64_t begin, int64_t end) {
#if defined(QUANT_AVX512)
  if (w.two_level) {  // (quant_weight takes them only where the build runs them: K-quants, IQ4_XS, their merges)
    const bool g32 = w.group == 32;
    if (w.bits == kIq4) matmul_columns<kIq4, 32, Sub8, T, R>(q, m, w, out, begin, end);  // (groups of 32)
    else if (w.bits == 4 && g32) matmul_columns<4, 32, Sub8, T, R>(q, m, w, out, begin, end);
    else if (w.bits == 4) matmul_columns<4, 16, Sub8, T, R>(q, m, w, out, begin, end);
    else if (w.bits == 5 && g32) matmul_columns<5, 32, Sub8, T, R>(q, m, w, out, begin, end);
    else if (w.bits == 5) matmul_columns<5, 16, Sub8, T, R>(q, m, w, out, begin, end);
    else if (w.bits == 6 && g32) matmul_columns<6, 32, Sub8, T, R>(q, m, w, out, begin, end);
    else if (w.bits == 6) matmul_columns<6, 16, Sub8, T, R>(q, m, w, out, begin, end);
    else if (g32) matmul_columns<8, 32, Sub8, T, R>(q, m, w, out, begin, end);
    else matmul_columns<8, 16, Sub8, T, R>(q, m, w, out, begin, end);
    return;
  }
#endif
  if (nibble_form(w.bits)) {  // (quant_weight takes them only where the build runs them)
#if defined(QUANT_AVX512)
    if (w.bits == kIq4 && w.half) matmul_columns<kIq4, 32, at::Half, T, R>(q, m, w, out, begin, end);
    else if (w.bits == kIq4) matmul_columns<kIq4, 32, float, T, R>(q, m, w, out, begin, end);  // (groups of 32)
    else if (w.bits == 6 && w.half) matmul_columns<6, 32, at::Half, T, R>(q, m, w, out, begin, end);
    else if (w.bits == 6 && w.group == 32) matmul_columns<6, 32, float, T, R>(q, m, w, out, begin, end);
    else if (w.bits == 6) matmul_columns<6, 16, float, T, R>(q, m, w, out, begin, end);
    else if (w.half) matmul_columns<5, 32, at::Half, T, R>(q, m, w, out, begin, end);
    else if (w.group == 32) matmul_columns<5, 32, float, T, R>(q, m, w, out, begin, end);
    else matmul_columns<5, 16, float, T, R>(q, m, w, out, begin, end);
#else
    TORCH_CHECK(false, "5-bit, 6-bit and IQ4 weights run on builds for AVX-512 VNNI only");
#endif
    return;
  }
  if (w.half) {  // groups of 32 (quant_weight checks it)
    if (w.bits == 4) matmul_columns<4, 32, at::Half, T, R>(q, m, w, out, begin, end);
    else matmul_columns<8, 32, at::Half, T, R>(q, m, w, out, begin, end);
  } else if (w.bits == 4 && w.group == 32) {
    matmul_columns<4, 32, float, T, R>(q, m, w, out, begin, end);
  } else if (w.bits == 4) {
    matmul_columns<4, 16, float, T, R>(q, m, w, out, begin, end);
  } else if (w.group == 32) {
    matmul_columns<8, 32, float, T, R>(q, m, w, out, begin, end);
  } else {
    matmul_columns<8, 16, float, T, R>(q, m, w, out, begin, end);
  }
}

// y [m, n] = x · Wᵀ (+ bias), the threads splitting the output columns only.
template <typename T>
void quant_matmul(const QuantizedRows& q, int64_t m, const QuantWeight& w, T* out) {
  at::parallel_for(0, w.spans(), 1, [&](int64_t begin, int64_t end) {
    matmul_columns(q, m, w, out, begin * kSpan, std::min(end * kSpan, w.n));
  });
}

}  // namespace
