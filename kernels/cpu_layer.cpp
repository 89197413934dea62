// One llama decoder layer over quantized weights in one call, for decode rows and verify
// spans on the CPU: input norm (with the residual add), qkv, rotary + KV store, paged
// attention, o, post-attention norm, gate/up, SiLU·mul, down.
//
// Each piece is the op the layer runs one by one from Python (rms_norm / add_rms_norm,
// quant_linear, rotary_store_kv, paged_attention_short, silu_and_mul; called here through
// the dispatcher), in the same order on the same tensors, so the result is bitwise the
// same. What goes is the Python around them: on a small model's decode step the module
// calls, views and op dispatch of a layer cost more than its arithmetic and do not shrink
// with threads. Registered (TORCH_LIBRARY_FRAGMENT) beside cpu_ops.cpp's ops.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <tuple>

namespace {

template <typename Sig>
c10::TypedOperatorHandle<Sig> find_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

using OptTensor = c10::optional<at::Tensor>;

at::Tensor linear(const at::Tensor& x, at::TensorList w, size_t at, at::IntArrayRef meta, size_t m) {
  static auto op = find_op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                      int64_t, int64_t, const OptTensor&, int64_t)>("specserve_cpu::quant_linear");
  return op.call(x, w[at], w[at + 1], w[at + 2], meta[m], meta[m + 1], c10::nullopt, meta[11]);
}

// weights: input norm, post-attention norm, then (packed, scales, mins) of qkv, o, gate_up,
// down. meta: heads, kv heads, head dim, then (bits, group) of qkv, o, gate_up, down, then
// quant_linear's dequant_rows.
// residual: none for the first layer. Returns the next layer's (hidden, residual), not yet added.
std::tuple<at::Tensor, at::Tensor> quant_decoder_layer(
    const at::Tensor& hidden, const OptTensor& residual, at::TensorList w, at::IntArrayRef meta, double eps,
    double scale, const at::Tensor& cos, const at::Tensor& sin, at::Tensor k_cache, at::Tensor v_cache,
    const at::Tensor& slot_mapping, const at::Tensor& block_tables, const at::Tensor& cu_query_lens,
    const at::Tensor& seq_lens, int64_t max_span, const OptTensor& tree_masks) {
  static auto norm = find_op<at::Tensor(const at::Tensor&, const at::Tensor&, double)>("specserve_cpu::rms_norm");
  static auto add_norm = find_op<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                                    const at::Tensor&, double)>("specserve_cpu::add_rms_norm");
  static auto rotary = find_op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                          at::Tensor, at::Tensor, const at::Tensor&)>("specserve_cpu::rotary_store_kv");
  static auto attend = find_op<void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                    const at::Tensor&, const at::Tensor&, double, int64_t, double, int64_t, at::Tensor,
                                    const OptTensor&)>(
      "specserve_cpu::paged_attention_short");
  static auto silu = find_op<at::Tensor(const at::Tensor&)>("specserve_cpu::silu_and_mul");
  TORCH_CHECK(w.size() == 14 && meta.size() == 12, "quant_decoder_layer: 14 weights and 12 meta values");
  const int64_t heads = meta[0], kv_heads = meta[1], head_dim = meta[2];
  at::Tensor h, res;
  if (residual.has_value()) {
    std::tie(h, res) = add_norm.call(hidden, *residual, w[0], eps);
  } else {
    h = norm.call(hidden, w[0], eps);
    res = hidden;
  }
  const at::Tensor qkv = linear(h, w, 2, meta, 3).view({-1, heads + 2 * kv_heads, head_dim});
  const at::Tensor q = rotary.call(qkv.narrow(1, 0, heads + kv_heads), qkv.narrow(1, heads + kv_heads, kv_heads),
                                   cos, sin, k_cache, v_cache, slot_mapping);
  at::Tensor out = at::empty_like(q);
  attend.call(q, k_cache, v_cache, block_tables, cu_query_lens, seq_lens, scale, 0, 0.0, max_span, out, tree_masks);
  const at::Tensor o = linear(out.reshape({-1, heads * head_dim}), w, 5, meta, 5);
  std::tie(h, res) = add_norm.call(o, res, w[1], eps);
  return {linear(silu.call(linear(h, w, 8, meta, 7)), w, 11, meta, 9), res};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specserve_cpu, m) {
  m.def("quant_decoder_layer(Tensor hidden, Tensor? residual, Tensor[] weights, int[] meta, float eps, "
        "float scale, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping, "
        "Tensor block_tables, Tensor cu_query_lens, Tensor seq_lens, int max_span, Tensor? tree_masks=None) -> "
        "(Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(specserve_cpu, CPU, m) {
  m.impl("quant_decoder_layer", quant_decoder_layer);
}
