// The decoder layer's glue on the CPU, row by row: RMSNorm, SiLU·mul, rotary, and paged
// attention's pieces; shared by the ops of cpu_ops.cpp and the fused decoder layers of
// cpu_layer.cpp, which run the same code on the same rows and so give the same bits.
// Included once per source file: everything is internal.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define SPECSERVE_AVX512 1
#endif

namespace {

template <typename T>
inline float round_to(float v) {
  return static_cast<float>(static_cast<T>(v));
}

// Rows below this many elements in all run on the calling thread: a decode step's few
// rows are done before a thread pool would wake.
constexpr int64_t kParallelGrain = 1 << 15;
// Elements of a scalar activation (a tanh each) per thread at least.
constexpr int64_t kActGrain = 512;

// out = round(weight · round(x / rms(x))), x already in fp32 (``row``); as transformers:
// normalise in fp32, cast back to the model's dtype, then scale. ``Gemma``: Gemma's norm,
// round((1 + weight) · x / rms(x)), all in fp32, rounded once.
template <typename T, bool Gemma>
inline void normalize_row(const float* row, const T* weight, T* out, int64_t hidden, double eps) {
  float sum = 0.f;
  for (int64_t i = 0; i < hidden; ++i) sum += row[i] * row[i];
  const float inv = 1.f / std::sqrt(sum / static_cast<float>(hidden) + static_cast<float>(eps));
  for (int64_t i = 0; i < hidden; ++i) {
    if constexpr (Gemma)
      out[i] = static_cast<T>(row[i] * inv * (1.f + static_cast<float>(weight[i])));
    else
      out[i] = static_cast<T>(static_cast<float>(weight[i]) * round_to<T>(row[i] * inv));
  }
}

// One row of RMSNorm over x (``row``: hidden floats of scratch).
template <typename T, bool Gemma>
inline void norm_row(const T* x, const T* weight, T* out, int64_t hidden, double eps, float* row) {
  for (int64_t i = 0; i < hidden; ++i) row[i] = static_cast<float>(x[i]);
  normalize_row<T, Gemma>(row, weight, out, hidden, eps);
}

// One row of RMSNorm over x + residual: the sum rounded to the model's dtype before it is
// normalised (as the reference), and written to ``sum_out`` unless that is null.
template <typename T, bool Gemma>
inline void add_norm_row(const T* x, const T* residual, const T* weight, T* out, T* sum_out, int64_t hidden,
                         double eps, float* row) {
  for (int64_t i = 0; i < hidden; ++i) {
    const T s = static_cast<T>(static_cast<float>(x[i]) + static_cast<float>(residual[i]));
    if (sum_out != nullptr) sum_out[i] = s;
    row[i] = static_cast<float>(s);
  }
  normalize_row<T, Gemma>(row, weight, out, hidden, eps);
}

// bfloat16 from and to float by bits, as c10::BFloat16 converts (round to nearest even,
// NaN to 0x7FC0), in a form the compiler vectorises.
inline float bf16_to_float(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}
inline uint16_t float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  const uint16_t rounded = static_cast<uint16_t>((u + ((u >> 16) & 1u) + 0x7FFFu) >> 16);
  return f != f ? static_cast<uint16_t>(0x7FC0) : rounded;
}

// Cephes' expf, in a form the compiler vectorises: x = n ln 2 + f (n rounded by adding
// and taking away 1.5 · 2^23), e^f by a degree-6 polynomial, ~1 ulp; 2^n is left to the
// callers, who set it by bits for their own ranges.
inline float exp_poly(float x, int& n) {
  const float nf = (x * 1.44269504088896341f + 12582912.f) - 12582912.f;
  n = static_cast<int>(nf);
  const float f = x - nf * 0.693359375f - nf * -2.12194440e-4f;
  const float z = f * f;
  return ((((((1.9875691500e-4f * f + 1.3981999507e-3f) * f + 8.3334519073e-3f) * f +
             4.1665795894e-2f) * f + 1.6666665459e-1f) * f + 5.0000001201e-1f) * z) + f + 1.f;
}

inline float pow2(int n) {  // 2^n for a normal float's exponent
  const int32_t bits = (n + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return scale;
}

// exp(x) for SiLU: +inf above ln(FLT_MAX), as expf gives; below -80 too small to change
// 1 + exp(x), which is all SiLU takes of it. 2^n as 2^(n-1) · 2, n reaching 128 just
// below the top.
inline float exp_silu(float x) {
  const bool over = x > 88.72283905206835f;
  int n;
  const float p = exp_poly(std::min(std::max(x, -80.f), 88.72283905206835f), n);
  return over ? INFINITY : p * pow2(n - 1) * 2.f;
}

// SiLU(gate) · up for elements i0 … i1 - 1 of one row of the merged projection: the
// activation rounded to the dtype, then the product (as F.silu(gate) * up). Each element
// is computed alone, so any split of a row gives the same bits.
template <typename T>
inline void silu_mul_range(const T* g, const T* u, T* o, int64_t i0, int64_t i1) {
  if constexpr (std::is_same_v<T, at::BFloat16>) {  // by bits, so the loop vectorises
    const uint16_t* gb = reinterpret_cast<const uint16_t*>(g);
    const uint16_t* ub = reinterpret_cast<const uint16_t*>(u);
    uint16_t* ob = reinterpret_cast<uint16_t*>(o);
#pragma omp simd
    for (int64_t i = i0; i < i1; ++i) {
      const float gv = bf16_to_float(gb[i]);
      const float act = bf16_to_float(float_to_bf16(gv / (1.f + exp_silu(-gv))));
      ob[i] = float_to_bf16(act * bf16_to_float(ub[i]));
    }
  } else {
#pragma omp simd
    for (int64_t i = i0; i < i1; ++i) {
      const float gv = static_cast<float>(g[i]);
      const float act = gv / (1.f + exp_silu(-gv));
      o[i] = static_cast<T>(round_to<T>(act) * static_cast<float>(u[i]));
    }
  }
}

// Rotate-half rotary of one head: out[i] = round(round(x[i]·cos[i]) + round(x[i ± half]·sin[i])),
// as the reference's x·cos + flip(halves)·sin in the model's dtype (``sin`` signed: −sin
// on the first half, +sin on the second).
template <typename T>
inline void rotate_half(const T* x, const T* c, const T* s, T* out, int64_t head_dim) {
  const int64_t half = head_dim / 2;
  for (int64_t i = 0; i < head_dim; ++i) {
    const float partner = static_cast<float>(x[i < half ? i + half : i - half]);
    const float a = round_to<T>(static_cast<float>(x[i]) * static_cast<float>(c[i]));
    const float b = round_to<T>(partner * static_cast<float>(s[i]));
    out[i] = static_cast<T>(a + b);
  }
}

// The rotary tables of ``m`` positions, as the torch path makes them (rotary.py,
// ``Rotary.forward``): angle = position · inv_freq in fp32, cos and sin times the rope's
// scaling, then rounded to T; ``cos`` [m, head_dim] both halves, ``sin`` [m, head_dim] −sin on
// the first half and +sin on the second. A position from ``long_offset`` on (LongRoPE's long
// mode; 0: none) is position − long_offset under the long frequencies. The cos / sin are
// the C library's, where torch's vectorised ones may differ in the last bit of a float:
// every CPU path takes its tables from here.
template <typename T>
inline void rotary_rows(const int64_t* positions, int64_t m, int64_t half, const float* inv_freq,
                        const float* scaling, const float* inv_freq_long, const float* scaling_long,
                        int64_t long_offset, T* cos_out, T* sin_out) {
  for (int64_t t = 0; t < m; ++t) {
    int64_t p = positions[t];
    const bool long_mode = long_offset > 0 && p >= long_offset;
    if (long_mode) p -= long_offset;
    const float* inv = long_mode ? inv_freq_long : inv_freq;
    const float* sc = long_mode ? scaling_long : scaling;
    T* c = cos_out + t * 2 * half;
    T* s = sin_out + t * 2 * half;
    for (int64_t i = 0; i < half; ++i) {
      const float angle = static_cast<float>(p) * inv[i];
      const float cv = std::cos(angle) * sc[i], sv = std::sin(angle) * sc[i];
      c[i] = c[half + i] = static_cast<T>(cv);
      s[i] = static_cast<T>(-sv);
      s[half + i] = static_cast<T>(sv);
    }
  }
}

// Head u of one token's q, k and v heads (q_heads, then kv_heads, then kv_heads), its
// values ``x``: a q head rotated into ``q_out``; a k head rotated into the caches' ``slot``,
// a v head copied there (slot < 0: not stored). Caches [slots, kv_heads · head_dim].
template <typename T>
inline void rotary_head(const T* x, int64_t u, const T* c, const T* s, int64_t q_heads, int64_t kv_heads,
                        int64_t head_dim, int64_t slot, T* q_out, T* k_cache, T* v_cache) {
  if (u < q_heads) return rotate_half(x, c, s, q_out + u * head_dim, head_dim);
  if (slot < 0) return;
  const int64_t kv_width = kv_heads * head_dim;
  if (u < q_heads + kv_heads) return rotate_half(x, c, s, k_cache + slot * kv_width + (u - q_heads) * head_dim, head_dim);
  std::copy(x, x + head_dim, v_cache + slot * kv_width + (u - q_heads - kv_heads) * head_dim);
}

// One token's rotary and KV store (``rotary_head`` for each head): ``qk`` its q and k heads,
// ``value`` its v heads.
template <typename T>
inline void rotary_token(const T* qk, const T* value, const T* c, const T* s, int64_t q_heads, int64_t kv_heads,
                         int64_t head_dim, int64_t slot, T* q_out, T* k_cache, T* v_cache) {
  for (int64_t u = 0; u < q_heads + 2 * kv_heads; ++u)
    rotary_head(u < q_heads + kv_heads ? qk + u * head_dim : value + (u - q_heads - kv_heads) * head_dim, u, c, s,
                q_heads, kv_heads, head_dim, slot, q_out, k_cache, v_cache);
}

// ------------------------------------------------------------------------------ attention
// exp for softmax (exp_poly; its arguments are at most 0, clamped at -87).
inline float exp_approx(float x) {
  int n;
  const float p = exp_poly(std::max(x, -87.f), n);
  return p * pow2(n);
}

// A row of the cache or the query in fp32 (bf16 by its bits, so the loop vectorises).
template <typename T>
inline void to_float(const T* src, float* dst, int64_t n) {
  for (int64_t d = 0; d < n; ++d) dst[d] = static_cast<float>(src[d]);
}

template <>
inline void to_float<at::BFloat16>(const at::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
#pragma omp simd
  for (int64_t d = 0; d < n; ++d) dst[d] = bf16_to_float(bits[d]);
}

struct SpanTask {
  int64_t row_start, q_len, seq_len, table_row, kv_head;
};

// A step's attention tasks: a (span, KV head) for each request whose span of query rows is
// at most ``max_span`` (the others are left to another kernel), each checked to fit its
// block table and the cache. tables [requests, width], cu [requests + 1], lens [requests]:
// contiguous int32.
inline std::vector<SpanTask> span_tasks(const at::Tensor& tables, const at::Tensor& cu, const at::Tensor& lens,
                                        int64_t rows, int64_t kv_heads, int64_t block_size, int64_t num_blocks,
                                        int64_t max_span) {
  const int64_t num_reqs = lens.numel();
  TORCH_CHECK(cu.numel() == num_reqs + 1 && tables.size(0) >= num_reqs, "one table and span per request");
  const int32_t* cup = cu.data_ptr<int32_t>();
  const int32_t* lp = lens.data_ptr<int32_t>();
  std::vector<SpanTask> tasks;
  for (int64_t r = 0; r < num_reqs; ++r) {
    const int64_t q_len = cup[r + 1] - cup[r];
    if (q_len == 0 || q_len > max_span) continue;
    TORCH_CHECK(q_len <= lp[r] && (lp[r] + block_size - 1) / block_size <= tables.size(1) && cup[r + 1] <= rows,
                "request ", r, ": its span, length and block table do not fit");
    const int32_t* table = tables.data_ptr<int32_t>() + r * tables.size(1);
    for (int64_t b = 0; b < (lp[r] + block_size - 1) / block_size; ++b)  // every block the span reads is in the cache
      TORCH_CHECK(table[b] >= 0 && table[b] < num_blocks, "block ", table[b], " is outside the cache");
    for (int64_t h = 0; h < kv_heads; ++h) tasks.push_back({cup[r], q_len, lp[r], r, h});
  }
  return tasks;
}

// Query vectors are scored 16 at a time ("a pack"), one per vector lane, so a key's dot
// products with all of them are head_dim fused multiply-adds with no sum across lanes. A
// span of at most kNarrowPack query vectors (a decode row of a model with up to 8 query
// heads per KV head) is scored in a pack of 8 instead, half the lanes to compute where
// most of 16 would be padding; each lane computes the same in either, so a row's
// attention is bitwise the same alone and in a longer span.
constexpr int64_t kPack = 16;
constexpr int64_t kNarrowPack = 8;
// Positions a tree row's visibility mask covers (reference.TREE_SPAN).
constexpr int64_t kTreeSpan = 64;
// Keys scored together: independent accumulators, so the adds do not wait on each other.
constexpr int64_t kKeys = 4;
// Value dimensions summed together (reads past a row's end stay inside the buffer's slack).
constexpr int64_t kValueChunk = 64;
// Keys are taken a chunk of this many positions at a time, counted from a span's first
// visible position. Each chunk gives every query vector a partial softmax (its max m, the
// sum l of exp(s - m), and the exp-weighted value sums o), and the chunks are folded in
// position order (``fold``). A chunk's partial depends on that chunk alone, so a short
// span's chunks can run on different threads and fold to the same bits as one thread
// taking them in turn: the result depends on neither the batch nor the thread count.
constexpr int64_t kKeyChunk = 64;
// A vector's partial softmax before any key: no key seen (l = 0; folding it changes nothing).
constexpr float kNoScore = -3.0e38f;

// Scores of one pack: st[j][l] = q_l · key_j for the span's keys (rows of ``keys``).
// Multiply-adds are written as std::fma here and below, so every key's score and every
// value sum rounds the same way in the blocked loop and its tail, whatever the compiler
// would contract: a row's attention is then the same in any span (the deterministic mode).
template <int64_t Pack>
inline void score_pack(const float* qt, const float* keys, int64_t span, int64_t head_dim, float* st) {
  int64_t j = 0;
  for (; j + kKeys <= span; j += kKeys) {
    float acc[kKeys][Pack] = {};
    for (int64_t d = 0; d < head_dim; ++d) {
      const float* qd = qt + d * Pack;
      for (int64_t t = 0; t < kKeys; ++t) {
        const float k = keys[(j + t) * head_dim + d];
#pragma omp simd
        for (int64_t l = 0; l < Pack; ++l) acc[t][l] = std::fma(k, qd[l], acc[t][l]);
      }
    }
    std::memcpy(st + j * Pack, acc, sizeof(acc));
  }
  for (; j < span; ++j) {
    float acc[Pack] = {};
    for (int64_t d = 0; d < head_dim; ++d) {
      const float k = keys[j * head_dim + d];
#pragma omp simd
      for (int64_t l = 0; l < Pack; ++l) acc[l] = std::fma(k, qt[d * Pack + l], acc[l]);
    }
    std::memcpy(st + j * Pack, acc, sizeof(acc));
  }
}

// Partial softmax of each lane over the keys it sees in st [len][Pack]: those in its range
// [lo_l, hi_l) whose score is not -inf (a tree row's hidden keys). st becomes exp(s - m_l)
// there and 0 elsewhere; m, l: each lane's max and sum (kNoScore and 0 where it sees none).
template <int64_t Pack>
inline void partial_softmax(float* st, int64_t len, const int32_t* lo, const int32_t* hi, float* m, float* l) {
  std::fill(m, m + Pack, kNoScore);
  std::fill(l, l + Pack, 0.f);
  for (int64_t j = 0; j < len; ++j) {
#pragma omp simd
    for (int64_t v = 0; v < Pack; ++v)
      m[v] = (j >= lo[v] && j < hi[v]) ? std::max(m[v], st[j * Pack + v]) : m[v];
  }
  for (int64_t j = 0; j < len; ++j) {
#pragma omp simd
    for (int64_t v = 0; v < Pack; ++v) {
      const float s = st[j * Pack + v];
      const float e = (j >= lo[v] && j < hi[v] && s > -INFINITY) ? exp_approx(s - m[v]) : 0.f;
      st[j * Pack + v] = e;
      l[v] += e;
    }
  }
}

// Where one span and KV head reads: query vector v = i · group + g is row i, head
// kv_head · group + g; row i sees positions [max(lo, first_pos + i - window + 1), first_pos + i].
// Its query vectors are scored in packs of kNarrowPack where they fit one, else of kPack.
struct SpanView {
  int64_t group, nq, pack, packs, first_pos, window, lo, span, chunks;
  SpanView(const SpanTask& task, int64_t num_heads, int64_t kv_heads, int64_t window_)
      : group(num_heads / kv_heads), nq(task.q_len * group), pack(nq <= kNarrowPack ? kNarrowPack : kPack),
        packs((nq + pack - 1) / pack),
        first_pos(task.seq_len - task.q_len), window(window_),
        lo(window_ > 0 ? std::max<int64_t>(0, first_pos - window_ + 1) : 0), span(task.seq_len - lo),
        chunks((span + kKeyChunk - 1) / kKeyChunk) {}
  int64_t row(int64_t v) const { return std::min(v, nq - 1) / group; }  // padding lanes copy the last row
  // Row i's visible positions as indices from lo: [first(i), last(i)).
  int64_t first(int64_t i) const { return window > 0 ? std::max<int64_t>(0, first_pos + i - window + 1 - lo) : 0; }
  int64_t last(int64_t i) const { return first_pos + i - lo + 1; }
};

// The task's query vectors, scaled, in packs: qt [packs, head_dim, Pack], lanes padded with 0.
template <typename T, int64_t Pack>
void pack_queries(const SpanTask& task, const SpanView& s, const T* query, int64_t num_heads, int64_t head_dim,
                  float scale, std::vector<float>& qt) {
  qt.assign(s.packs * head_dim * Pack, 0.f);
  std::vector<float> widened(head_dim);
  for (int64_t v = 0; v < s.nq; ++v) {
    const int64_t i = v / s.group, head = task.kv_head * s.group + v % s.group;
    to_float(query + ((task.row_start + i) * num_heads + head) * head_dim, widened.data(), head_dim);
    float* dst = qt.data() + (v / Pack) * head_dim * Pack + v % Pack;
    for (int64_t d = 0; d < head_dim; ++d) dst[d * Pack] = widened[d] * scale;
  }
}

// The paged cache as the spans read it.
template <typename T>
struct CacheView {
  const T* k_cache;
  const T* v_cache;
  const int32_t* tables;
  int64_t table_width, block_size, kv_width, head_dim;
  float softcap;              // > 0: each score s (already scaled) becomes softcap · tanh(s / softcap) (Gemma 2)
  const int64_t* tree_masks;  // null, or each row's visibility over its span's last kTreeSpan positions (0: causal)

  // The rows of positions pos … pos + count - 1 of ``cache`` (K or V) for one span and KV
  // head, widened into ``rows``, a block at a time (no division per position).
  void widen(const T* cache, const SpanTask& task, int64_t pos, int64_t count, float* rows) const {
    const int32_t* table = tables + task.table_row * table_width;
    for (const int64_t end = pos + count; pos < end;) {
      const int64_t block = pos / block_size, offset = pos - block * block_size;
      const int64_t n = std::min(block_size - offset, end - pos);
      const T* base = cache + (static_cast<int64_t>(table[block]) * block_size + offset) * kv_width +
                      task.kv_head * head_dim;
      for (int64_t r = 0; r < n; ++r) to_float(base + r * kv_width, rows + r * head_dim, head_dim);
      rows += n * head_dim;
      pos += n;
    }
  }
};

// Chunk c of one span and KV head: each query vector's partial softmax over the chunk's
// keys, into m [nq], l [nq] and o [nq, head_dim] (see kKeyChunk).
template <typename T, int64_t Pack>
void attend_chunk(const SpanTask& task, const SpanView& s, const CacheView<T>& cache, int64_t c, const float* qt,
                  float* m, float* l, float* o, std::vector<float>& rows, std::vector<float>& scores) {
  const int64_t head_dim = cache.head_dim, c0 = c * kKeyChunk, len = std::min(kKeyChunk, s.span - c0);
  rows.resize(len * head_dim + kValueChunk);  // widened keys, then values (+ slack for vector reads)
  scores.resize(s.packs * len * Pack);
  cache.widen(cache.k_cache, task, s.lo + c0, len, rows.data());
  for (int64_t p = 0; p < s.packs; ++p) {
    int32_t key_lo[Pack], key_hi[Pack];  // each lane's visible keys, as indices into the chunk
    bool any = false;
    for (int64_t v = 0; v < Pack; ++v) {
      const int64_t i = s.row(p * Pack + v);
      key_lo[v] = static_cast<int32_t>(std::clamp<int64_t>(s.first(i) - c0, 0, len));
      key_hi[v] = static_cast<int32_t>(std::clamp<int64_t>(s.last(i) - c0, 0, len));
      any |= key_lo[v] < key_hi[v];
    }
    float* st = scores.data() + p * len * Pack;
    if (!any) {  // rows that see none of the chunk (before it, or windowed past it)
      std::fill(st, st + len * Pack, 0.f);
    } else {
      score_pack<Pack>(qt + p * head_dim * Pack, rows.data(), len, head_dim, st);
      if (cache.softcap > 0.f) {
        const float cap = cache.softcap, inv_cap = 1.f / cap;
        for (int64_t j = 0; j < len * Pack; ++j) st[j] = cap * std::tanh(st[j] * inv_cap);
      }
      if (cache.tree_masks != nullptr) {  // keys a tree row may not see: -inf, left out of its softmax
        const int64_t tail = std::max(s.lo + c0, task.seq_len - kTreeSpan), end = s.lo + c0 + len;
        for (int64_t v = 0; v < Pack; ++v) {
          const uint64_t mask = static_cast<uint64_t>(cache.tree_masks[task.row_start + s.row(p * Pack + v)]);
          if (mask == 0) continue;
          for (int64_t pos = tail; pos < end; ++pos)
            if (((mask >> (task.seq_len - 1 - pos)) & 1u) == 0) st[(pos - s.lo - c0) * Pack + v] = -INFINITY;
        }
      }
    }
    float pm[Pack], pl[Pack];
    partial_softmax<Pack>(st, len, key_lo, key_hi, pm, pl);
    const int64_t lanes = std::min(Pack, s.nq - p * Pack);
    std::copy(pm, pm + lanes, m + p * Pack);
    std::copy(pl, pl + lanes, l + p * Pack);
  }
  cache.widen(cache.v_cache, task, s.lo + c0, len, rows.data());
  // Exp-weighted values: two query vectors and 64 dimensions at a time, so eight vector
  // accumulators stay in registers and their adds do not wait on one another.
  for (int64_t v0 = 0; v0 < s.nq; v0 += 2) {
    const int64_t v1 = std::min(v0 + 1, s.nq - 1);
    const float* p0 = scores.data() + (v0 / Pack) * len * Pack + v0 % Pack;  // stride Pack
    const float* p1 = scores.data() + (v1 / Pack) * len * Pack + v1 % Pack;
    const int64_t hi = std::clamp<int64_t>(s.last(v1 / s.group) - c0, 0, len);  // later keys weigh 0
    for (int64_t d0 = 0; d0 < head_dim; d0 += kValueChunk) {
      const int64_t width = std::min(kValueChunk, head_dim - d0);
      float sums[2][kValueChunk] = {};
      for (int64_t j = 0; j < hi; ++j) {
        const float a = p0[j * Pack], b = p1[j * Pack];
        const float* val = rows.data() + j * head_dim + d0;
#pragma omp simd
        for (int64_t d = 0; d < kValueChunk; ++d) {
          sums[0][d] = std::fma(a, val[d], sums[0][d]);
          sums[1][d] = std::fma(b, val[d], sums[1][d]);
        }
      }
      std::copy(sums[0], sums[0] + width, o + v0 * head_dim + d0);
      std::copy(sums[1], sums[1] + width, o + v1 * head_dim + d0);
    }
  }
}

// Folds one chunk's partial softmax (m, l, o) of a query vector into the running one (M, L, O),
// the chunks taken in position order; a running state with L = 0 has seen no key yet.
inline void fold(float& M, float& L, float* O, float m, float l, const float* o, int64_t head_dim) {
  if (l == 0.f) return;  // no key of this chunk is visible to the vector
  if (L == 0.f) {
    M = m;
    L = l;
    std::copy(o, o + head_dim, O);
    return;
  }
  const float top = std::max(M, m), a = exp_approx(M - top), b = exp_approx(m - top);
  L = std::fma(L, a, l * b);
#pragma omp simd
  for (int64_t d = 0; d < head_dim; ++d) O[d] = std::fma(O[d], a, o[d] * b);
  M = top;
}

// The folded softmax of each query vector, O / L, into ``out`` [tokens, heads, head_dim].
template <typename T>
void write_out(const SpanTask& task, const SpanView& s, const float* L, const float* O, int64_t num_heads,
               int64_t head_dim, T* out) {
  for (int64_t v = 0; v < s.nq; ++v) {
    const int64_t i = v / s.group, head = task.kv_head * s.group + v % s.group;
    T* dst = out + ((task.row_start + i) * num_heads + head) * head_dim;
    const float inv = L[v] > 0.f ? 1.f / L[v] : 0.f;
    for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<T>(O[v * head_dim + d] * inv);
  }
}


// One step's attention, shared out: the tasks (a span and KV head each) and the items
// threads take. A task per item, its chunks in turn; or, where there are fewer tasks than
// threads to keep busy and their partials are small (a few decode rows or verify spans),
// every (task, chunk) an item of its own, the last chunk of a task to finish folding them.
// Both give the same bits (see kKeyChunk). The plan depends on the step alone: every
// layer of the step runs it.
struct AttentionPlan {
  std::vector<SpanTask> tasks;
  std::vector<SpanView> views;
  std::vector<int64_t> first_item, first_partial;  // per task: its first item, its partials' first float
  int64_t head_dim = 0;
  bool by_chunk = false;

  AttentionPlan(std::vector<SpanTask> tasks_, int64_t num_heads, int64_t kv_heads, int64_t head_dim_, int64_t window,
                int64_t threads)
      : tasks(std::move(tasks_)), head_dim(head_dim_) {
    const int64_t n = static_cast<int64_t>(tasks.size());
    first_item.assign(n + 1, 0);
    first_partial.assign(n + 1, 0);
    for (int64_t t = 0; t < n; ++t) {
      views.emplace_back(tasks[t], num_heads, kv_heads, window);
      first_item[t + 1] = first_item[t] + views[t].chunks;
      first_partial[t + 1] = first_partial[t] + views[t].chunks * views[t].nq * (head_dim + 2);
    }
    constexpr int64_t kMaxPartials = int64_t(1) << 20;  // floats held for split tasks at most (4 MiB)
    by_chunk = !(n >= 2 * threads || first_partial[n] > kMaxPartials || first_item[n] == n);
  }
  int64_t items() const { return by_chunk ? first_item.back() : static_cast<int64_t>(tasks.size()); }
  int64_t partial_floats() const { return by_chunk ? first_partial.back() : 0; }
};

// What one thread reuses from item to item.
struct AttentionScratch {
  std::vector<float> qt, rows, scores, state, part;
};

// One layer's attention under a plan: its queries, cache and output; with a plan by chunk,
// the chunks' partials and a count per task of its chunks yet to run (set to each task's
// chunk count before its items run).
template <typename T>
struct AttentionRun {
  const AttentionPlan& plan;
  const T* query;
  const CacheView<T>& cache;
  int64_t num_heads;
  float scale;
  T* out;
  float* partials;
  std::atomic<int64_t>* left;

  void queries(int64_t t, std::vector<float>& qt) const {
    const SpanView& s = plan.views[t];
    (s.pack == kNarrowPack ? pack_queries<T, kNarrowPack> : pack_queries<T, kPack>)(
        plan.tasks[t], s, query, num_heads, plan.head_dim, scale, qt);
  }
  // part: the chunk's m [nq], l [nq], o [nq, head_dim]
  void chunk(int64_t t, int64_t c, const std::vector<float>& qt, float* part, AttentionScratch& x) const {
    const SpanView& s = plan.views[t];
    (s.pack == kNarrowPack ? attend_chunk<T, kNarrowPack> : attend_chunk<T, kPack>)(
        plan.tasks[t], s, cache, c, qt.data(), part, part + s.nq, part + 2 * s.nq, x.rows, x.scores);
  }
  void fold_all(int64_t t, float* state, const float* part) const {  // state: running M, L, O
    const int64_t nq = plan.views[t].nq, head_dim = plan.head_dim;
    for (int64_t v = 0; v < nq; ++v)
      fold(state[v], state[nq + v], state + 2 * nq + v * head_dim, part[v], part[nq + v],
           part + 2 * nq + v * head_dim, head_dim);
  }
  void finish(int64_t t, const float* state) const {
    const SpanView& s = plan.views[t];
    write_out(plan.tasks[t], s, state + s.nq, state + 2 * s.nq, num_heads, plan.head_dim, out);
  }

  // Items begin … end - 1, in order.
  void items(int64_t begin, int64_t end, AttentionScratch& x) const {
    const int64_t head_dim = plan.head_dim;
    if (!plan.by_chunk) {
      for (int64_t t = begin; t < end; ++t) {
        const SpanView& s = plan.views[t];
        queries(t, x.qt);
        x.state.assign(s.nq * (head_dim + 2), 0.f);
        x.part.resize(s.nq * (head_dim + 2));
        for (int64_t c = 0; c < s.chunks; ++c) {
          chunk(t, c, x.qt, x.part.data(), x);
          fold_all(t, x.state.data(), x.part.data());
        }
        finish(t, x.state.data());
      }
      return;
    }
    int64_t queried = -1;  // the task whose queries x.qt holds
    for (int64_t item = begin; item < end; ++item) {
      const int64_t t =
          std::upper_bound(plan.first_item.begin(), plan.first_item.end(), item) - plan.first_item.begin() - 1;
      const SpanView& s = plan.views[t];
      const int64_t part_size = s.nq * (head_dim + 2), c = item - plan.first_item[t];
      if (queried != t) {
        queries(t, x.qt);
        queried = t;
      }
      chunk(t, c, x.qt, partials + plan.first_partial[t] + c * part_size, x);
      if (left[t].fetch_sub(1, std::memory_order_acq_rel) != 1) continue;
      x.state.assign(part_size, 0.f);  // the task's last chunk to finish: fold them all, in order
      for (int64_t k = 0; k < s.chunks; ++k) fold_all(t, x.state.data(), partials + plan.first_partial[t] + k * part_size);
      finish(t, x.state.data());
    }
  }
};

}  // namespace
