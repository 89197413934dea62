// The decoder layer's glue on the CPU, one op each: RMSNorm (with the residual add fused
// in), SiLU·mul, rotary + KV store, and paged attention for decode rows and verify spans.
// A decode step of a small model on a CPU spends as much time dispatching the ~25 tiny
// torch ops per layer these replace as in their arithmetic; here each is one call. The
// glue follows the torch references in reference.py / rotary.py rounding for rounding:
// every intermediate the reference rounds to the model's dtype is rounded here too
// (``round_to<T>``), so bf16 results match it. Attention sums in fp32 throughout (the
// reference's SDPA rounds its probabilities to bf16), so it agrees within bf16 rounding.
//
// Built at first use by torch.utils.cpp_extension (cpu_ops.py); registered as
// torch.ops.specserve_cpu.*.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <memory>
#include <type_traits>
#include <tuple>
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

void check_rows(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.device().is_cpu(), "specserve_cpu ops run on CPU tensors");
  TORCH_CHECK(x.dim() >= 1 && x.stride(-1) == 1, "the last dimension must be contiguous");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(-1) && weight.is_contiguous(),
              "weight must be [hidden] and match x's last dimension");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "weight and x must share a dtype");
}

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

template <typename T, bool Gemma>
void rms_norm_rows(const at::Tensor& x, const at::Tensor& weight, at::Tensor& out, double eps) {
  const int64_t hidden = x.size(-1), rows = x.numel() / hidden;
  const T* xp = x.data_ptr<T>();
  const T* wp = weight.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, kParallelGrain / hidden + 1, [&](int64_t begin, int64_t end) {
    std::vector<float> row(hidden);
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t i = 0; i < hidden; ++i) row[i] = static_cast<float>(xp[r * hidden + i]);
      normalize_row<T, Gemma>(row.data(), wp, op + r * hidden, hidden, eps);
    }
  });
}

template <typename T, bool Gemma>
void add_rms_norm_rows(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight,
                       at::Tensor& out, at::Tensor& sum_out, double eps) {
  const int64_t hidden = x.size(-1), rows = x.numel() / hidden;
  const T* xp = x.data_ptr<T>();
  const T* rp = residual.data_ptr<T>();
  const T* wp = weight.data_ptr<T>();
  T* op = out.data_ptr<T>();
  T* sp = sum_out.data_ptr<T>();
  at::parallel_for(0, rows, kParallelGrain / hidden + 1, [&](int64_t begin, int64_t end) {
    std::vector<float> row(hidden);
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t i = 0; i < hidden; ++i) {
        // The sum is rounded to the model's dtype before it is normalised (as the reference).
        const T s = static_cast<T>(static_cast<float>(xp[r * hidden + i]) +
                                   static_cast<float>(rp[r * hidden + i]));
        sp[r * hidden + i] = s;
        row[i] = static_cast<float>(s);
      }
      normalize_row<T, Gemma>(row.data(), wp, op + r * hidden, hidden, eps);
    }
  });
}

template <bool Gemma>
at::Tensor norm_op(const at::Tensor& x_in, const at::Tensor& weight, double eps) {
  check_rows(x_in, weight);
  const at::Tensor x = x_in.contiguous();
  at::Tensor out = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm",
                                  [&] { rms_norm_rows<scalar_t, Gemma>(x, weight, out, eps); });
  return out;
}

template <bool Gemma>
std::tuple<at::Tensor, at::Tensor> add_norm_op(const at::Tensor& x_in, const at::Tensor& residual_in,
                                               const at::Tensor& weight, double eps) {
  check_rows(x_in, weight);
  TORCH_CHECK(x_in.sizes() == residual_in.sizes() && x_in.scalar_type() == residual_in.scalar_type(),
              "x and residual must have the same shape and dtype");
  const at::Tensor x = x_in.contiguous(), residual = residual_in.contiguous();
  at::Tensor out = at::empty_like(x), sum = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm",
                                  [&] { add_rms_norm_rows<scalar_t, Gemma>(x, residual, weight, out, sum, eps); });
  return {out, sum};
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

// act(gate) · up of the merged projection [rows, 2 · inter]: the activation rounded to
// the dtype, then the product (as F.silu(gate) * up). ``GeluTanh``: GeGLU's
// 0.5 g (1 + tanh(√(2/π) (g + 0.044715 g³))) (F.gelu(approximate="tanh")) for silu.
template <bool GeluTanh>
at::Tensor act_and_mul(const at::Tensor& gate_up_in) {
  TORCH_CHECK(gate_up_in.device().is_cpu() && gate_up_in.dim() == 2 && gate_up_in.size(1) % 2 == 0,
              "gate_up must be a [rows, 2 * intermediate] CPU tensor");
  const at::Tensor gate_up = gate_up_in.contiguous();
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2;
  at::Tensor out = at::empty({rows, inter}, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(), "silu_and_mul", [&] {
    const scalar_t* in = gate_up.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    // Split over elements, not rows (each is computed alone, so the split changes no bit):
    // a decode step's one row of scalar tanh is worth the threads; of vectorised SiLU, not.
    at::parallel_for(0, rows * inter, GeluTanh ? kActGrain : kParallelGrain, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin / inter; r * inter < end; ++r) {
        const int64_t i0 = std::max(begin - r * inter, int64_t(0)), i1 = std::min(end - r * inter, inter);
        const scalar_t* g = in + r * 2 * inter;
        const scalar_t* u = g + inter;
        scalar_t* o = op + r * inter;
        if constexpr (GeluTanh) {
          for (int64_t i = i0; i < i1; ++i) {
            const float gv = static_cast<float>(g[i]);
            const float act = 0.5f * gv * (1.f + std::tanh(0.7978845608028654f * (gv + 0.044715f * gv * gv * gv)));
            o[i] = static_cast<scalar_t>(round_to<scalar_t>(act) * static_cast<float>(u[i]));
          }
        } else if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {  // by bits, so the loop vectorises
          const uint16_t* gb = reinterpret_cast<const uint16_t*>(g);
          const uint16_t* ub = reinterpret_cast<const uint16_t*>(u);
          uint16_t* ob = reinterpret_cast<uint16_t*>(o);
          _Pragma("omp simd")  // (a #pragma cannot stand inside AT_DISPATCH's argument)
          for (int64_t i = i0; i < i1; ++i) {
            const float gv = bf16_to_float(gb[i]);
            const float act = bf16_to_float(float_to_bf16(gv / (1.f + exp_silu(-gv))));
            ob[i] = float_to_bf16(act * bf16_to_float(ub[i]));
          }
        } else {
          _Pragma("omp simd")
          for (int64_t i = i0; i < i1; ++i) {
            const float gv = static_cast<float>(g[i]);
            const float act = gv / (1.f + exp_silu(-gv));
            o[i] = static_cast<scalar_t>(round_to<scalar_t>(act) * static_cast<float>(u[i]));
          }
        }
      }
    });
  });
  return out;
}

// Rotate-half rotary of q and k, then k and v stored in the paged cache.
//   qk     [tokens, q_heads + kv_heads, head_dim]   (rows may be strided: a slice of qkv)
//   value  [tokens, kv_heads, head_dim]             (likewise)
//   cos    [tokens, head_dim]  cos of each angle, both halves
//   sin    [tokens, head_dim]  −sin on the first half, +sin on the second
//   caches [blocks, block_size, kv_heads, head_dim]; slot s at block s / block_size,
//   offset s % block_size; rows with slot −1 are not stored.
// out[i] = round(round(x[i]·cos[i]) + round(x[i ± half]·sin[i])), as the reference's
// x·cos + flip(halves)·sin in the model's dtype. Returns the rotated q, contiguous.
at::Tensor rotary_store_kv(const at::Tensor& qk, const at::Tensor& value, const at::Tensor& cos_in,
                           const at::Tensor& sin_in, at::Tensor k_cache, at::Tensor v_cache,
                           const at::Tensor& slot_mapping_in) {
  TORCH_CHECK(qk.dim() == 3 && value.dim() == 3 && qk.stride(2) == 1 && value.stride(2) == 1 &&
                  qk.stride(1) == qk.size(2) && value.stride(1) == value.size(2),
              "qk and value must be [tokens, heads, head_dim] with contiguous heads");
  const int64_t tokens = qk.size(0), head_dim = qk.size(2), kv_heads = value.size(1);
  const int64_t q_heads = qk.size(1) - kv_heads, half = head_dim / 2;
  TORCH_CHECK(q_heads > 0 && head_dim % 2 == 0 && value.size(0) == tokens && value.size(2) == head_dim,
              "qk / value shapes do not match");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 4 &&
                  k_cache.size(2) == kv_heads && k_cache.size(3) == head_dim &&
                  k_cache.sizes() == v_cache.sizes(),
              "caches must be contiguous [blocks, block_size, kv_heads, head_dim]");
  TORCH_CHECK(k_cache.scalar_type() == qk.scalar_type() && v_cache.scalar_type() == qk.scalar_type() &&
                  value.scalar_type() == qk.scalar_type(),
              "qk, value and the caches must share a dtype");
  const at::Tensor cos = cos_in.to(qk.scalar_type()).contiguous().view({-1, head_dim});
  const at::Tensor sin = sin_in.to(qk.scalar_type()).contiguous().view({-1, head_dim});
  TORCH_CHECK(cos.size(0) == tokens && sin.size(0) == tokens, "one cos / sin row per token");
  const at::Tensor slots = slot_mapping_in.to(at::kLong).contiguous();
  TORCH_CHECK(slots.numel() == tokens, "one slot per token");
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t slot = slots.data_ptr<int64_t>()[t];
    TORCH_CHECK(slot < num_slots, "slot ", slot, " is outside the cache of ", num_slots, " slots");
  }
  at::Tensor q_out = at::empty({tokens, q_heads, head_dim}, qk.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qk.scalar_type(), "rotary_store_kv", [&] {
    using T = scalar_t;
    const T* qkp = qk.data_ptr<T>();
    const T* vp = value.data_ptr<T>();
    const T* cp = cos.data_ptr<T>();
    const T* snp = sin.data_ptr<T>();
    const int64_t* sp = slots.data_ptr<int64_t>();
    T* qo = q_out.data_ptr<T>();
    T* kc = k_cache.data_ptr<T>();
    T* vc = v_cache.data_ptr<T>();
    const int64_t qk_row = qk.stride(0), v_row = value.stride(0), kv_width = kv_heads * head_dim;
    auto rotate = [&](const T* x, const T* c, const T* s, T* out) {
      for (int64_t i = 0; i < head_dim; ++i) {
        const float partner = static_cast<float>(x[i < half ? i + half : i - half]);
        const float a = round_to<T>(static_cast<float>(x[i]) * static_cast<float>(c[i]));
        const float b = round_to<T>(partner * static_cast<float>(s[i]));
        out[i] = static_cast<T>(a + b);
      }
    };
    at::parallel_for(0, tokens, kParallelGrain / (qk.size(1) * head_dim) + 1, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const T* c = cp + t * head_dim;
        const T* s = snp + t * head_dim;
        for (int64_t h = 0; h < q_heads; ++h)
          rotate(qkp + t * qk_row + h * head_dim, c, s, qo + (t * q_heads + h) * head_dim);
        const int64_t slot = sp[t];
        if (slot < 0) continue;
        for (int64_t h = 0; h < kv_heads; ++h)
          rotate(qkp + t * qk_row + (q_heads + h) * head_dim, c, s, kc + slot * kv_width + h * head_dim);
        std::copy(vp + t * v_row, vp + t * v_row + kv_width, vc + slot * kv_width);
      }
    });
  });
  return q_out;
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

// Every task's attention: a task (a span and KV head) per thread, its chunks in turn; or,
// where there are fewer tasks than threads to keep busy and their partials are small (a
// few decode rows or verify spans), every (task, chunk) on its own, the last chunk of a
// task to finish folding them. Both give the same bits (see kKeyChunk).
template <typename T>
void attend_tasks(const std::vector<SpanTask>& tasks, const T* query, const CacheView<T>& cache, int64_t num_heads,
                  int64_t kv_heads, float scale, int64_t window, T* out) {
  const int64_t head_dim = cache.head_dim, n = static_cast<int64_t>(tasks.size());
  std::vector<SpanView> views;
  std::vector<int64_t> first_item(n + 1, 0), first_partial(n + 1, 0);  // per task: its items, its partials' floats
  for (int64_t t = 0; t < n; ++t) {
    views.emplace_back(tasks[t], num_heads, kv_heads, window);
    first_item[t + 1] = first_item[t] + views[t].chunks;
    first_partial[t + 1] = first_partial[t] + views[t].chunks * views[t].nq * (head_dim + 2);
  }
  auto queries = [&](int64_t t, std::vector<float>& qt) {
    (views[t].pack == kNarrowPack ? pack_queries<T, kNarrowPack> : pack_queries<T, kPack>)(
        tasks[t], views[t], query, num_heads, head_dim, scale, qt);
  };
  auto chunk = [&](int64_t t, int64_t c, const std::vector<float>& qt, float* part, std::vector<float>& rows,
                   std::vector<float>& scores) {  // part: the chunk's m [nq], l [nq], o [nq, head_dim]
    const SpanView& s = views[t];
    (s.pack == kNarrowPack ? attend_chunk<T, kNarrowPack> : attend_chunk<T, kPack>)(
        tasks[t], s, cache, c, qt.data(), part, part + s.nq, part + 2 * s.nq, rows, scores);
  };
  auto fold_all = [&](int64_t t, float* state, const float* part) {  // state: running M, L, O
    const int64_t nq = views[t].nq;
    for (int64_t v = 0; v < nq; ++v)
      fold(state[v], state[nq + v], state + 2 * nq + v * head_dim, part[v], part[nq + v],
           part + 2 * nq + v * head_dim, head_dim);
  };
  constexpr int64_t kMaxPartials = int64_t(1) << 20;  // floats held for split tasks at most (4 MiB)
  if (n >= 2 * at::get_num_threads() || first_partial[n] > kMaxPartials || first_item[n] == n) {
    at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> qt, rows, scores, state, part;
      for (int64_t t = begin; t < end; ++t) {
        const SpanView& s = views[t];
        queries(t, qt);
        state.assign(s.nq * (head_dim + 2), 0.f);
        part.resize(s.nq * (head_dim + 2));
        for (int64_t c = 0; c < s.chunks; ++c) {
          chunk(t, c, qt, part.data(), rows, scores);
          fold_all(t, state.data(), part.data());
        }
        write_out(tasks[t], s, state.data() + s.nq, state.data() + 2 * s.nq, num_heads, head_dim, out);
      }
    });
    return;
  }
  std::vector<float> partials(first_partial[n]);
  std::unique_ptr<std::atomic<int64_t>[]> left(new std::atomic<int64_t>[n]);  // chunks yet to run, per task
  for (int64_t t = 0; t < n; ++t) left[t].store(views[t].chunks, std::memory_order_relaxed);
  at::parallel_for(0, first_item[n], 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qt, rows, scores, state;
    int64_t queried = -1;  // the task whose queries qt holds
    for (int64_t item = begin; item < end; ++item) {
      const int64_t t = std::upper_bound(first_item.begin(), first_item.end(), item) - first_item.begin() - 1;
      const SpanView& s = views[t];
      const int64_t part_size = s.nq * (head_dim + 2);
      if (queried != t) {
        queries(t, qt);
        queried = t;
      }
      chunk(t, item - first_item[t], qt, partials.data() + first_partial[t] + (item - first_item[t]) * part_size,
            rows, scores);
      if (left[t].fetch_sub(1, std::memory_order_acq_rel) != 1) continue;
      state.assign(part_size, 0.f);  // the task's last chunk to finish: fold them all, in order
      for (int64_t c = 0; c < s.chunks; ++c) fold_all(t, state.data(), partials.data() + first_partial[t] + c * part_size);
      write_out(tasks[t], s, state.data() + s.nq, state.data() + 2 * s.nq, num_heads, head_dim, out);
    }
  });
}

// Causal attention over the paged cache for every request whose query span is at most
// ``max_span`` rows, written into ``out`` (the other requests' rows are left as they are).
// Same semantics as reference.paged_attention: request r's rows cu_query_lens[r] ..
// cu_query_lens[r+1] are the last of its seq_lens[r] cached positions; ``window`` > 0
// keeps only the last ``window`` positions; ``softcap`` > 0 soft-caps the scores.
void paged_attention_short(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables_in, const at::Tensor& cu_query_lens_in,
                           const at::Tensor& seq_lens_in, double scale, int64_t window, double softcap,
                           int64_t max_span, at::Tensor out, const c10::optional<at::Tensor>& tree_masks_in) {
  TORCH_CHECK(query.is_contiguous() && out.is_contiguous() && out.sizes() == query.sizes() &&
                  query.dim() == 3, "query and out must be contiguous [tokens, heads, head_dim]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 4 &&
                  k_cache.sizes() == v_cache.sizes() && k_cache.size(3) == query.size(2) &&
                  query.size(1) % k_cache.size(2) == 0,
              "caches must be contiguous [blocks, block_size, kv_heads, head_dim]");
  TORCH_CHECK(k_cache.scalar_type() == query.scalar_type() && out.scalar_type() == query.scalar_type(),
              "query, caches and out must share a dtype");
  const at::Tensor tables = block_tables_in.to(at::kInt).contiguous();
  const at::Tensor cu = cu_query_lens_in.to(at::kInt).contiguous();  // no copy for the batch's own
  const at::Tensor lens = seq_lens_in.to(at::kInt).contiguous();
  const int64_t num_reqs = lens.numel(), num_heads = query.size(1), block_size = k_cache.size(1);
  const int64_t kv_heads = k_cache.size(2);
  TORCH_CHECK(cu.numel() == num_reqs + 1 && tables.size(0) >= num_reqs, "one table and span per request");
  const int32_t* cup = cu.data_ptr<int32_t>();
  const int32_t* lp = lens.data_ptr<int32_t>();
  at::Tensor tree_masks;
  if (tree_masks_in.has_value()) {
    tree_masks = tree_masks_in->to(at::kLong).contiguous();
    TORCH_CHECK(tree_masks.dim() == 1 && tree_masks.numel() >= query.size(0), "one tree mask per query row");
  }
  const int64_t* tmp = tree_masks.defined() ? tree_masks.data_ptr<int64_t>() : nullptr;
  std::vector<SpanTask> tasks;
  for (int64_t r = 0; r < num_reqs; ++r) {
    const int64_t q_len = cup[r + 1] - cup[r];
    if (q_len == 0 || q_len > max_span) continue;
    TORCH_CHECK(q_len <= lp[r] && (lp[r] + block_size - 1) / block_size <= tables.size(1) &&
                    cup[r + 1] <= query.size(0),
                "request ", r, ": its span, length and block table do not fit");
    for (int64_t h = 0; h < kv_heads; ++h) tasks.push_back({cup[r], q_len, lp[r], r, h});
  }
  const int64_t num_blocks = k_cache.size(0);
  for (const SpanTask& task : tasks) {  // every block a span reads must be in the cache
    if (task.kv_head != 0) continue;
    const int32_t* table = tables.data_ptr<int32_t>() + task.table_row * tables.size(1);
    for (int64_t b = 0; b < (task.seq_len + block_size - 1) / block_size; ++b)
      TORCH_CHECK(table[b] >= 0 && table[b] < num_blocks, "block ", table[b], " is outside the cache");
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_attention_short", [&] {
    const CacheView<scalar_t> cache{k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(), tables.data_ptr<int32_t>(),
                                    tables.size(1), block_size, kv_heads * query.size(2), query.size(2),
                                    static_cast<float>(softcap), tmp};
    attend_tasks<scalar_t>(tasks, query.data_ptr<scalar_t>(), cache, num_heads, kv_heads, static_cast<float>(scale), window,
        out.data_ptr<scalar_t>());
  });
}

// ------------------------------------------------------------------------------ greedy rows
// Each row of logits [rows, vocab]: its argmax as torch.argmax gives it (the first largest
// value; the first NaN where there is one), and with ``confidence`` its top probability,
// 1 / Σ exp(x - max) (NaN for a row with a NaN). torch's argmax over a vocabulary runs
// element by element, and a draft pass also took a logsumexp; here each pass vectorises.
template <typename T>
inline float logit_at(const T* row, int64_t i) { return static_cast<float>(row[i]); }
template <>
inline float logit_at<at::BFloat16>(const at::BFloat16* row, int64_t i) {
  return bf16_to_float(reinterpret_cast<const uint16_t*>(row)[i]);
}

#if defined(SPECSERVE_AVX512)
// 16 logits from i on (fewer at the end: the rest -inf), as float32.
inline __m512 logits16(const float* row, int64_t i, int64_t vocab) {
  const __mmask16 valid = vocab - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (vocab - i)) - 1);
  return _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), valid, row + i);
}
inline __m512 logits16(const at::BFloat16* row, int64_t i, int64_t vocab) {
  const __mmask16 valid = vocab - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (vocab - i)) - 1);
  const __m256i bits = _mm256_maskz_loadu_epi16(valid, reinterpret_cast<const uint16_t*>(row) + i);
  const __m512 wide = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
  return _mm512_mask_blend_ps(valid, _mm512_set1_ps(-INFINITY), wide);
}
#endif

// The row's largest logit (NaNs left out) and whether it holds a NaN; then the index of
// the first element equal to it (the first NaN where there is one).
template <typename T>
void argmax_row(const T* row, int64_t vocab, float& m, bool& nan, int64_t& index) {
#if defined(SPECSERVE_AVX512)
  __m512 top = _mm512_set1_ps(-INFINITY);
  __mmask16 unordered = 0;
  for (int64_t i = 0; i < vocab; i += 16) {
    const __m512 v = logits16(row, i, vocab);
    unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    top = _mm512_max_ps(v, top);  // (a NaN in v gives top: left out)
  }
  m = _mm512_reduce_max_ps(top);
  nan = unordered != 0;
  for (int64_t i = 0; i < vocab; i += 16) {
    const __m512 v = logits16(row, i, vocab);
    const __mmask16 hit = nan ? _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) : _mm512_cmp_ps_mask(v, _mm512_set1_ps(m), _CMP_EQ_OQ);
    if (hit) {
      index = i + __builtin_ctz(static_cast<unsigned>(hit));
      return;
    }
  }
  index = 0;
#else
  m = -INFINITY;
  nan = false;
  for (int64_t i = 0; i < vocab; ++i) {
    const float v = logit_at(row, i);
    nan = nan || v != v;
    m = v > m ? v : m;
  }
  for (index = 0; index < vocab; ++index) {
    const float v = logit_at(row, index);
    if (nan ? v != v : v == m) return;
  }
  index = 0;
#endif
}

template <typename T>
void greedy_row(const T* row, int64_t vocab, bool confidence, int64_t* index, float* top) {
  float m;
  bool nan;
  argmax_row(row, vocab, m, nan, *index);
  if (!confidence) return;
  if (nan || m == -INFINITY) {
    *top = NAN;
    return;
  }
  float total = 0.f;
#pragma omp simd reduction(+ : total)
  for (int64_t i = 0; i < vocab; ++i) total += exp_approx(logit_at(row, i) - m);
  *top = 1.f / total;
}

std::tuple<at::Tensor, at::Tensor> greedy_rows(const at::Tensor& logits_in, bool confidence) {
  TORCH_CHECK(logits_in.device().is_cpu() && logits_in.dim() == 2 && logits_in.size(1) > 0,
              "logits must be a [rows, vocab] CPU tensor");
  TORCH_CHECK(logits_in.scalar_type() == at::kFloat || logits_in.scalar_type() == at::kBFloat16,
              "logits must be float32 or bfloat16");
  const at::Tensor logits = logits_in.contiguous();
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  at::Tensor index = at::empty({rows}, logits.options().dtype(at::kLong));
  at::Tensor top = at::empty({confidence ? rows : 0}, logits.options().dtype(at::kFloat));
  int64_t* ip = index.data_ptr<int64_t>();
  float* tp = confidence ? top.data_ptr<float>() : nullptr;
  at::parallel_for(0, rows, kParallelGrain / vocab + 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      if (logits.scalar_type() == at::kFloat)
        greedy_row(logits.data_ptr<float>() + r * vocab, vocab, confidence, ip + r, tp ? tp + r : nullptr);
      else
        greedy_row(logits.data_ptr<at::BFloat16>() + r * vocab, vocab, confidence, ip + r, tp ? tp + r : nullptr);
    }
  });
  return {index, top};
}

}  // namespace

TORCH_LIBRARY(specserve_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
  m.def("gemma_rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("gemma_add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("gelu_tanh_and_mul(Tensor gate_up) -> Tensor");
  m.def("rotary_store_kv(Tensor qk, Tensor value, Tensor cos, Tensor sin, Tensor(a!) k_cache, "
        "Tensor(b!) v_cache, Tensor slot_mapping) -> Tensor");
  m.def("greedy_rows(Tensor logits, bool confidence) -> (Tensor, Tensor)");
  m.def("paged_attention_short(Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor cu_query_lens, Tensor seq_lens, float scale, int window, float softcap, int max_span, Tensor(a!) out, "
        "Tensor? tree_masks=None) -> ()");
}

TORCH_LIBRARY_IMPL(specserve_cpu, CPU, m) {
  m.impl("rms_norm", norm_op<false>);
  m.impl("add_rms_norm", add_norm_op<false>);
  m.impl("silu_and_mul", act_and_mul<false>);
  m.impl("gemma_rms_norm", norm_op<true>);
  m.impl("gemma_add_rms_norm", add_norm_op<true>);
  m.impl("gelu_tanh_and_mul", act_and_mul<true>);
  m.impl("rotary_store_kv", rotary_store_kv);
  m.impl("paged_attention_short", paged_attention_short);
  m.impl("greedy_rows", greedy_rows);
}
