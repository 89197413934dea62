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
#include "cpu_glue.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <tuple>

namespace {

void check_rows(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.device().is_cpu(), "specserve_cpu ops run on CPU tensors");
  TORCH_CHECK(x.dim() >= 1 && x.stride(-1) == 1, "the last dimension must be contiguous");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(-1) && weight.is_contiguous(),
              "weight must be [hidden] and match x's last dimension");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "weight and x must share a dtype");
}


template <typename T, bool Gemma>
void rms_norm_rows(const at::Tensor& x, const at::Tensor& weight, at::Tensor& out, double eps) {
  const int64_t hidden = x.size(-1), rows = x.numel() / hidden;
  const T* xp = x.data_ptr<T>();
  const T* wp = weight.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, kParallelGrain / hidden + 1, [&](int64_t begin, int64_t end) {
    std::vector<float> row(hidden);
    for (int64_t r = begin; r < end; ++r)
      norm_row<T, Gemma>(xp + r * hidden, wp, op + r * hidden, hidden, eps, row.data());
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
    for (int64_t r = begin; r < end; ++r)
      add_norm_row<T, Gemma>(xp + r * hidden, rp + r * hidden, wp, op + r * hidden, sp + r * hidden, hidden, eps,
                             row.data());
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
        } else {
          silu_mul_range(g, u, o, i0, i1);
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
  const int64_t q_heads = qk.size(1) - kv_heads;
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
    const int64_t qk_row = qk.stride(0), v_row = value.stride(0);
    at::parallel_for(0, tokens, kParallelGrain / (qk.size(1) * head_dim) + 1, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t)
        rotary_token(qkp + t * qk_row, vp + t * v_row, cp + t * head_dim, snp + t * head_dim, q_heads, kv_heads,
                     head_dim, sp[t], qo + t * q_heads * head_dim, kc, vc);
    });
  });
  return q_out;
}

// The rotary tables of a step's ``positions`` (``rotary_rows``): (cos [tokens, 1, head_dim],
// signed sin [tokens, 1, 2, head_dim / 2]) in ``dtype``, the shapes Rotary.forward gives.
// ``rope``: inv_freq and scaling [head_dim / 2] fp32, then the long ones where
// ``long_offset`` > 0.
std::tuple<at::Tensor, at::Tensor> rotary_tables(const at::Tensor& positions_in, at::TensorList rope,
                                                 int64_t long_offset, at::ScalarType dtype) {
  TORCH_CHECK(rope.size() == (long_offset > 0 ? 4u : 2u), "rotary_tables: inv_freq and scaling (and the long ones)");
  const int64_t half = rope[0].numel();
  for (const at::Tensor& t : rope)
    TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.dim() == 1 && t.numel() == half,
                "inv_freq and scaling must be contiguous float32 [head_dim / 2]");
  const at::Tensor positions = positions_in.to(at::kLong).contiguous();
  const int64_t m = positions.numel();
  const at::TensorOptions options = at::TensorOptions().dtype(dtype);
  at::Tensor cos = at::empty({m, 1, 2 * half}, options), sin = at::empty({m, 1, 2, half}, options);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "rotary_tables", [&] {
    const bool long_mode = long_offset > 0;
    rotary_rows(positions.data_ptr<int64_t>(), m, half, rope[0].data_ptr<float>(), rope[1].data_ptr<float>(),
                long_mode ? rope[2].data_ptr<float>() : nullptr, long_mode ? rope[3].data_ptr<float>() : nullptr,
                long_offset, cos.data_ptr<scalar_t>(), sin.data_ptr<scalar_t>());
  });
  return {cos, sin};
}

// Every task's attention, the items of its plan shared out over the threads.
template <typename T>
void attend_tasks(std::vector<SpanTask> tasks, const T* query, const CacheView<T>& cache, int64_t num_heads,
                  int64_t kv_heads, float scale, int64_t window, T* out) {
  const AttentionPlan plan(std::move(tasks), num_heads, kv_heads, cache.head_dim, window, at::get_num_threads());
  std::vector<float> partials(plan.partial_floats());
  std::unique_ptr<std::atomic<int64_t>[]> left(new std::atomic<int64_t>[plan.tasks.size()]);
  for (size_t t = 0; t < plan.tasks.size(); ++t) left[t].store(plan.views[t].chunks, std::memory_order_relaxed);
  const AttentionRun<T> run{plan, query, cache, num_heads, scale, out, partials.data(), left.get()};
  at::parallel_for(0, plan.items(), 1, [&](int64_t begin, int64_t end) {
    AttentionScratch scratch;
    run.items(begin, end, scratch);
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
  const int64_t num_heads = query.size(1), kv_heads = k_cache.size(2);
  at::Tensor tree_masks;
  if (tree_masks_in.has_value()) {
    tree_masks = tree_masks_in->to(at::kLong).contiguous();
    TORCH_CHECK(tree_masks.dim() == 1 && tree_masks.numel() >= query.size(0), "one tree mask per query row");
  }
  const int64_t* tmp = tree_masks.defined() ? tree_masks.data_ptr<int64_t>() : nullptr;
  std::vector<SpanTask> tasks = span_tasks(tables, cu, lens, query.size(0), kv_heads, k_cache.size(1), k_cache.size(0),
                                           max_span);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_attention_short", [&] {
    const CacheView<scalar_t> cache{k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(), tables.data_ptr<int32_t>(),
                                    tables.size(1), k_cache.size(1), kv_heads * query.size(2), query.size(2),
                                    static_cast<float>(softcap), tmp};
    attend_tasks<scalar_t>(std::move(tasks), query.data_ptr<scalar_t>(), cache, num_heads, kv_heads, static_cast<float>(scale), window,
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
  m.def("rotary_tables(Tensor positions, Tensor[] rope, int long_offset, ScalarType dtype) -> (Tensor, Tensor)");
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
  m.impl("rotary_tables", rotary_tables);
}
