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
//
// ``quant_decoder_layers`` runs a run of such layers over a step of few rows (batch-1 decode,
// a verify span) in one call and one parallel region: the threads stay together from the
// first layer to the last, meeting at a barrier between pieces, where one call a piece
// forked and joined the thread pool about five times a layer and allocated each piece's
// output; at 8 threads those fixed costs were most of a small model's layer. The pieces
// run the code of the ops above (cpu_glue.h, cpu_quant.h) on the same rows, so the result
// is bitwise the same; only who computes which rows and columns changes.
#include "cpu_glue.h"
#include "cpu_quant.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <omp.h>
#include <torch/library.h>

#include <chrono>
#include <limits>
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


// Most rows a run of layers takes in one parallel region: each thread normalises and
// quantizes every row of a piece's input itself, which costs less than a barrier while the
// rows are few. More rows (prefill chunks, large batches) go layer by layer.
constexpr int64_t kRegionRows = 16;

// Where a region's time goes, for benchmarks (``region_times``): thread 0's clock between
// the region's steps, summed over layers and calls (of every model in the process) while
// timing is on (off: one branch each). A piece's time is thread 0's own share of it; waiting
// for the others at the barriers counts apart. At each of a layer's barriers, every
// thread's arrival time too: how far the last arrived after the first (the pieces'
// imbalance), and how long the release took after the last arrival (the barrier's own cost).
enum Phase { kInputNorm, kQuantize, kQkv, kRotary, kAttention, kO, kPostNorm, kGateUp, kSiluMul, kDown, kBarriers,
             kPhases };
enum Point { kAfterQkv, kAfterAttention, kAfterO, kAfterGateUp, kAfterDown, kPoints };  // a layer's barriers
std::atomic<bool> timing{false};
double phase_us[kPhases + 1 + 2 * kPoints];  // the phases, the layers run, then (spread, release) per barrier

// Returns the microseconds each phase took since the last call, the layers run, and per
// barrier the arrivals' spread and the release's latency; turns the timing on or off.
std::vector<double> region_times(bool enable) {
  std::vector<double> out(std::begin(phase_us), std::end(phase_us));
  std::fill(std::begin(phase_us), std::end(phase_us), 0.0);
  timing.store(enable);
  return out;
}

struct alignas(64) Arrival {  // a thread's, at one barrier (a cache line each)
  std::chrono::steady_clock::time_point at;
};

// A piece's items go to the threads as they take them (``take``, ``take_guided``), a few at
// a time: a thread that runs slower, or is interrupted, takes fewer, where equal shares
// made every other thread wait for it at the barrier. Which thread computes an item does
// not change it.
enum Piece { kQkvHeads, kAttentionItems, kOColumns, kGateUpColumns, kDownColumns, kPieces };
struct alignas(64) Counter {  // the next item of one piece of one layer (a cache line each)
  std::atomic<int64_t> next{0};
};

struct PhaseClock {
  bool on;
  std::chrono::steady_clock::time_point last;
  explicit PhaseClock(bool on_)
      : on(on_), last(on_ ? std::chrono::steady_clock::now() : std::chrono::steady_clock::time_point{}) {}
  void done(Phase phase) {  // the time since the last call, to ``phase``
    if (!on) return;
    const auto now = std::chrono::steady_clock::now();
    phase_us[phase] += std::chrono::duration<double, std::micro>(now - last).count();
    last = now;
  }
  // After barrier ``point`` (the threads' ``arrivals`` there): its spread and release, to
  // their sums; the time this takes counts nowhere.
  void barrier_done(Point point, const Arrival* arrivals, int64_t team) {
    if (!on) return;
    done(kBarriers);
    auto first = arrivals[0].at, final = arrivals[0].at;
    for (int64_t t = 1; t < team; ++t) {
      first = std::min(first, arrivals[t].at);
      final = std::max(final, arrivals[t].at);
    }
    phase_us[kPhases + 1 + 2 * point] += std::chrono::duration<double, std::micro>(final - first).count();
    phase_us[kPhases + 2 + 2 * point] += std::chrono::duration<double, std::micro>(last - final).count();
    last = std::chrono::steady_clock::now();
  }
};

// One layer's weights and cache, as the region reads them.
template <typename T>
struct LayerView {
  const T* input_norm;
  const T* post_norm;
  QuantWeight qkv, o, gate_up, down;
  double eps;
  float scale;
  T* k_cache;
  T* v_cache;
};

// The model's end after its last layer (``quant_model_logits``): the final norm of the rows
// whose logits are wanted (the residual added, as add_rms_norm does), then the LM head over
// them, each logit rounded to the model's dtype as the head's output is, stored as float32.
// A head over part of the vocabulary (a draft's, ``ids``) also puts its logits in the full
// vocabulary's columns, every other column -inf.
template <typename T>
struct HeadRun {
  const T* norm;
  double eps;
  std::vector<int64_t> rows;  // of the step, in the order their logits go out
  QuantWeight weight;
  float* logits;  // [rows, weight.n]
  const int64_t* ids = nullptr;  // [weight.n]: the vocabulary's column of each head row
  int64_t vocab = 0;
  float* full = nullptr;  // [rows, vocab]
};

// A run of layers in one parallel region (``quant_decoder_layers``). ``tasks``: the step's
// attention, covering every row. ``head``: the model's end too, in the same region, or null.
template <typename T>
std::tuple<at::Tensor, at::Tensor> layers_in_region(const at::Tensor& hidden, const OptTensor& residual,
                                                    at::TensorList w, at::IntArrayRef meta, at::ArrayRef<double> eps,
                                                    at::ArrayRef<double> scale, const at::Tensor& cos_in,
                                                    const at::Tensor& sin_in, at::TensorList k_caches,
                                                    at::TensorList v_caches, const at::Tensor& slots,
                                                    const at::Tensor& tables, const at::Tensor& tree_masks,
                                                    std::vector<SpanTask> tasks, const HeadRun<T>* head) {
  const int64_t layers = static_cast<int64_t>(k_caches.size()), m = hidden.size(0), hidden_size = hidden.size(1);
  const int64_t heads = meta[0], kv_heads = meta[1], head_dim = meta[2], q_width = heads * head_dim;
  const auto dtype = hidden.scalar_type();
  std::vector<LayerView<T>> views;
  for (int64_t l = 0; l < layers; ++l) {
    const at::TensorList lw = w.slice(14 * l, 14);
    const at::IntArrayRef lm = meta.slice(12 * l, 12);
    TORCH_CHECK(lm[0] == heads && lm[1] == kv_heads && lm[2] == head_dim, "every layer must have the same heads");
    for (int i = 0; i < 2; ++i)
      TORCH_CHECK(lw[i].scalar_type() == dtype && lw[i].is_contiguous() && lw[i].numel() == hidden_size,
                  "norm weights must be contiguous [hidden] in the hidden states' dtype");
    const QuantWeight qkv = quant_weight(lw[2], lw[3], lw[4], lm[3], lm[4], hidden_size, nullptr);
    const QuantWeight o = quant_weight(lw[5], lw[6], lw[7], lm[5], lm[6], q_width, nullptr);
    const QuantWeight gate_up = quant_weight(lw[8], lw[9], lw[10], lm[7], lm[8], hidden_size, nullptr);
    TORCH_CHECK(qkv.n == (heads + 2 * kv_heads) * head_dim && o.n == hidden_size && gate_up.n % 2 == 0,
                "qkv, o and gate_up do not match the heads and the hidden size");
    const QuantWeight down = quant_weight(lw[11], lw[12], lw[13], lm[9], lm[10], gate_up.n / 2, nullptr);
    TORCH_CHECK(down.n == hidden_size && (l == 0 || gate_up.n == views[0].gate_up.n),
                "down does not match the hidden size, or the layers' intermediate sizes differ");
    const at::Tensor& kc = k_caches[l];
    const at::Tensor& vc = v_caches[l];
    TORCH_CHECK(kc.is_contiguous() && vc.is_contiguous() && kc.dim() == 4 && kc.sizes() == vc.sizes() &&
                    kc.sizes() == k_caches[0].sizes() && kc.size(2) == kv_heads && kc.size(3) == head_dim &&
                    kc.scalar_type() == dtype && vc.scalar_type() == dtype,
                "caches must be contiguous [blocks, block_size, kv_heads, head_dim] in the hidden states' dtype");
    views.push_back({lw[0].data_ptr<T>(), lw[1].data_ptr<T>(), qkv, o, gate_up, down, eps[l],
                     static_cast<float>(scale[l]), kc.data_ptr<T>(), vc.data_ptr<T>()});
  }
  const int64_t inter = views[0].gate_up.n / 2, qkv_width = views[0].qkv.n;
  const at::Tensor cos = cos_in.to(dtype).contiguous().view({-1, head_dim});
  const at::Tensor sin = sin_in.to(dtype).contiguous().view({-1, head_dim});
  TORCH_CHECK(cos.size(0) == m && sin.size(0) == m, "one cos / sin row per token");
  const int64_t num_slots = k_caches[0].size(0) * k_caches[0].size(1);
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < m; ++t)
    TORCH_CHECK(slot[t] < num_slots, "slot ", slot[t], " is outside the cache of ", num_slots, " slots");

  const at::TensorOptions options = hidden.options();
  at::Tensor res_a = at::empty({m, hidden_size}, options), res_b = at::empty({m, hidden_size}, options);
  at::Tensor qkv = at::empty({m, qkv_width}, options), q = at::empty({m, q_width}, options);
  at::Tensor attn = at::empty({m, q_width}, options), o = at::empty({m, hidden_size}, options);
  at::Tensor gate_up = at::empty({m, 2 * inter}, options), down = at::empty({m, hidden_size}, options);
  const T* x0 = hidden.data_ptr<T>();
  const T* r0 = residual.has_value() ? residual->data_ptr<T>() : nullptr;
  T *ra = res_a.data_ptr<T>(), *rb = res_b.data_ptr<T>(), *qkvp = qkv.data_ptr<T>(), *qp = q.data_ptr<T>();
  T *attnp = attn.data_ptr<T>(), *op = o.data_ptr<T>(), *gup = gate_up.data_ptr<T>(), *downp = down.data_ptr<T>();
  const T* cosp = cos.data_ptr<T>();
  const T* sinp = sin.data_ptr<T>();

  const int threads = at::get_num_threads();
  const AttentionPlan plan(std::move(tasks), heads, kv_heads, head_dim, 0, threads);
  const int64_t num_tasks = static_cast<int64_t>(plan.tasks.size());
  std::vector<float> partials(plan.partial_floats());
  std::unique_ptr<std::atomic<int64_t>[]> left(new std::atomic<int64_t>[std::max<int64_t>(1, layers * num_tasks)]);
  for (int64_t l = 0; l < layers; ++l)  // a count per layer: no thread resets one another may still read
    for (int64_t t = 0; t < num_tasks; ++t) left[l * num_tasks + t].store(plan.views[t].chunks, std::memory_order_relaxed);
  const int64_t* masks = tree_masks.defined() ? tree_masks.data_ptr<int64_t>() : nullptr;
  const int64_t table_width = tables.size(1), block_size = k_caches[0].size(1);
  const bool timed = timing.load(std::memory_order_relaxed);
  std::vector<Arrival> arrivals(timed ? kPoints * threads : 0);  // per barrier, per thread
  std::vector<Counter> counters(layers * kPieces);  // per layer and piece: none is reused
  Counter head_columns;

#pragma omp parallel num_threads(threads)
  {
    const int64_t tid = omp_get_thread_num(), team = omp_get_num_threads();
    // Items begin … end - 1 of n to ``work``, ``grain`` at a time, until none is left.
    auto take = [&](Counter& counter, int64_t n, int64_t grain, auto&& work) {
      for (int64_t i = counter.next.fetch_add(grain, std::memory_order_relaxed); i < n;
           i = counter.next.fetch_add(grain, std::memory_order_relaxed))
        work(i, std::min(i + grain, n));
    };
    // The same with takes that shrink as the items run out (guided): each takes a share of
    // what is left, at least ``least``, so the threads' last takes are short and they reach
    // the barrier close together, where equal takes of a quarter of a thread's share left
    // the others waiting up to one take's time.
    auto take_guided = [&](Counter& counter, int64_t n, int64_t least, auto&& work) {
      int64_t i = counter.next.load(std::memory_order_relaxed);
      while (i < n) {
        const int64_t grain = std::max(least, (n - i) / (2 * team));
        if (counter.next.compare_exchange_weak(i, i + grain, std::memory_order_relaxed)) {
          work(i, std::min(i + grain, n));
          i = counter.next.load(std::memory_order_relaxed);
        }
      }
    };
    // Each thread's own: a piece's input rows, normalised or activated, and quantized.
    std::vector<T> h(m * std::max(hidden_size, inter));
    std::vector<float> row(std::max(hidden_size, q_width));
    std::vector<int16_t> natural;
    QuantizedRows quantized;
    AttentionScratch scratch;
    auto quantize = [&](const T* x, int64_t rows, int64_t k, const QuantWeight& weight) {
      quantized.kp = weight.kp;
      quantized.group = weight.group;
      prepare_rows(rows, quantized);
      quantize_row_range(x, k, quantized, 0, rows, natural);
    };
    // A weight's columns, in whole tiles of 4, taken guided (takes down to 1/64 of a thread's share).
    auto columns = [&](Counter& counter, const QuantWeight& weight, T* out) {
      const int64_t tiles = (weight.n + 3) / 4;
      take_guided(counter, tiles, std::max<int64_t>(1, tiles / (64 * team)), [&](int64_t begin, int64_t end) {
        matmul_columns(quantized, m, weight, out, 4 * begin, std::min(4 * end, weight.n));
      });
    };
    PhaseClock clock(tid == 0 && timed);
    auto barrier = [&](Point point) {
      if (timed) arrivals[point * team + tid].at = std::chrono::steady_clock::now();
#pragma omp barrier
      clock.barrier_done(point, arrivals.data() + point * team, team);
    };
    if (head != nullptr && head->full != nullptr) {  // -inf in the full vocabulary: long before the head
      const int64_t total = static_cast<int64_t>(head->rows.size()) * head->vocab, share = (total + team - 1) / team;
      std::fill(head->full + std::min(total, tid * share), head->full + std::min(total, (tid + 1) * share),
                -std::numeric_limits<float>::infinity());
    }
    for (int64_t l = 0; l < layers; ++l) {
      const LayerView<T>& layer = views[l];
      Counter* piece = counters.data() + l * kPieces;
      // Input norm (with the residual add; thread 0 keeps the sum), qkv.
      const T* x = l == 0 ? x0 : downp;
      const T* res_in = l == 0 ? r0 : ra;
      for (int64_t r = 0; r < m; ++r) {
        T* hr = h.data() + r * hidden_size;
        if (res_in == nullptr)
          norm_row<T, false>(x + r * hidden_size, layer.input_norm, hr, hidden_size, layer.eps, row.data());
        else
          add_norm_row<T, false>(x + r * hidden_size, res_in + r * hidden_size, layer.input_norm, hr,
                                 tid == 0 ? rb + r * hidden_size : nullptr, hidden_size, layer.eps, row.data());
      }
      const T* attn_res = res_in == nullptr ? x0 : rb;  // the first layer without a residual: the input itself
      clock.done(kInputNorm);
      quantize(h.data(), m, hidden_size, layer.qkv);
      clock.done(kQuantize);
      // qkv by heads, each head then rotated (q, k) and stored (k, v) for every token.
      take(piece[kQkvHeads], heads + 2 * kv_heads, 1, [&](int64_t u, int64_t) {
        matmul_columns(quantized, m, layer.qkv, qkvp, u * head_dim, (u + 1) * head_dim);
        clock.done(kQkv);
        for (int64_t t = 0; t < m; ++t)
          rotary_head(qkvp + t * qkv_width + u * head_dim, u, cosp + t * head_dim, sinp + t * head_dim, heads,
                      kv_heads, head_dim, slot[t], qp + t * q_width, layer.k_cache, layer.v_cache);
        clock.done(kRotary);
      });
      barrier(kAfterQkv);
      // Attention, by the plan's items.
      const CacheView<T> cache{layer.k_cache, layer.v_cache, tables.data_ptr<int32_t>(), table_width, block_size,
                               kv_heads * head_dim, head_dim, 0.f, masks};
      const AttentionRun<T> run{plan, qp, cache, heads, layer.scale, attnp, partials.data(), left.get() + l * num_tasks};
      take(piece[kAttentionItems], plan.items(), 1,
           [&](int64_t begin, int64_t end) { run.items(begin, end, scratch); });
      clock.done(kAttention);
      barrier(kAfterAttention);
      // o.
      quantize(attnp, m, q_width, layer.o);
      clock.done(kQuantize);
      columns(piece[kOColumns], layer.o, op);
      clock.done(kO);
      barrier(kAfterO);
      // Post-attention norm with the residual add (thread 0 keeps the sum), gate_up.
      for (int64_t r = 0; r < m; ++r)
        add_norm_row<T, false>(op + r * hidden_size, attn_res + r * hidden_size, layer.post_norm,
                               h.data() + r * hidden_size, tid == 0 ? ra + r * hidden_size : nullptr, hidden_size,
                               layer.eps, row.data());
      clock.done(kPostNorm);
      quantize(h.data(), m, hidden_size, layer.gate_up);
      clock.done(kQuantize);
      columns(piece[kGateUpColumns], layer.gate_up, gup);
      clock.done(kGateUp);
      barrier(kAfterGateUp);
      // SiLU·mul, down.
      for (int64_t r = 0; r < m; ++r)
        silu_mul_range(gup + r * 2 * inter, gup + r * 2 * inter + inter, h.data() + r * inter, 0, inter);
      clock.done(kSiluMul);
      quantize(h.data(), m, inter, layer.down);
      clock.done(kQuantize);
      columns(piece[kDownColumns], layer.down, downp);
      clock.done(kDown);
      barrier(kAfterDown);
      if (clock.on) phase_us[kPhases] += 1;
    }
    if (head != nullptr) {  // the final norm (every thread its own copy, as a layer's input), the LM head
      const int64_t rows = static_cast<int64_t>(head->rows.size());
      for (int64_t i = 0; i < rows; ++i)
        add_norm_row<T, false>(downp + head->rows[i] * hidden_size, ra + head->rows[i] * hidden_size, head->norm,
                               h.data() + i * hidden_size, nullptr, hidden_size, head->eps, row.data());
      quantize(h.data(), rows, hidden_size, head->weight);
      const int64_t n = head->weight.n, tiles = (n + 3) / 4;
      take_guided(head_columns, tiles, std::max<int64_t>(1, tiles / (64 * team)), [&](int64_t begin, int64_t end) {
        const int64_t c0 = 4 * begin, c1 = std::min(4 * end, n);
        matmul_columns<float, T>(quantized, rows, head->weight, head->logits, c0, c1);
        if (head->full != nullptr)  // the same values at their vocabulary columns, while in cache
          for (int64_t r = 0; r < rows; ++r)
            for (int64_t c = c0; c < c1; ++c) head->full[r * head->vocab + head->ids[c]] = head->logits[r * n + c];
      });
    }
  }
  return {down, res_a};
}

// The model's end for ``quant_model_logits``: the final norm's weight and eps, the rows
// whose logits are wanted, and the LM head as quant_linear takes it.
struct HeadArgs {
  at::Tensor norm, rows, packed, scales, mins;
  OptTensor bias;
  double eps;
  int64_t bits, group, dequant_rows;
  OptTensor vocab_ids;  // a head over part of the vocabulary: each row's column in it
  int64_t vocab_size;
};

// The model's end through the ops, as Python runs it: the final norm of every row, the
// wanted rows, the LM head (quant_linear), float32 (in the full vocabulary's columns for a
// head over part of it).
at::Tensor head_logits(const at::Tensor& hidden, const at::Tensor& residual, const HeadArgs& head,
                       const at::Tensor& rows) {
  static auto add_norm = find_op<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                                    const at::Tensor&, double)>("specserve_cpu::add_rms_norm");
  const at::Tensor normed = std::get<0>(add_norm.call(hidden, residual, head.norm, head.eps));
  at::Tensor x = at::index_select(normed, 0, rows);
  static auto op = find_op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                      int64_t, int64_t, const OptTensor&, int64_t)>("specserve_cpu::quant_linear");
  const at::Tensor logits =
      op.call(x, head.packed, head.scales, head.mins, head.bits, head.group, head.bias, head.dequant_rows)
          .to(at::kFloat);
  if (!head.vocab_ids.has_value()) return logits;
  return at::full({logits.size(0), head.vocab_size}, -std::numeric_limits<float>::infinity(), logits.options())
      .index_copy_(1, *head.vocab_ids, logits);
}

// Layers 0 … L - 1 of ``weights`` (14 a layer, as quant_decoder_layer takes them) and
// ``meta`` (12 a layer), each with its eps, attention scale and caches: one parallel region
// where the step's rows are few and every span is the attention kernel's, else one call a
// layer. Returns the last layer's (hidden, residual), not yet added; with ``head``, also
// the logits of its rows (float32), else an undefined tensor.
std::tuple<at::Tensor, at::Tensor, at::Tensor> run_layers(
    const at::Tensor& hidden, const OptTensor& residual, at::TensorList w, at::IntArrayRef meta,
    at::ArrayRef<double> eps, at::ArrayRef<double> scale, const at::Tensor& cos, const at::Tensor& sin,
    at::TensorList k_caches, at::TensorList v_caches, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
    const at::Tensor& cu_query_lens, const at::Tensor& seq_lens, int64_t max_span, const OptTensor& tree_masks,
    const HeadArgs* head) {
  const int64_t layers = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(layers > 0 && static_cast<int64_t>(w.size()) == 14 * layers &&
                  static_cast<int64_t>(meta.size()) == 12 * layers && static_cast<int64_t>(eps.size()) == layers &&
                  static_cast<int64_t>(scale.size()) == layers && static_cast<int64_t>(v_caches.size()) == layers,
              "quant_decoder_layers: 14 weights, 12 meta values, an eps, a scale and two caches a layer");
  const int64_t m = hidden.dim() == 2 ? hidden.size(0) : 0;
  const auto dtype = hidden.scalar_type();
  at::Tensor head_rows;
  if (head != nullptr) {
    head_rows = head->rows.to(at::kLong).contiguous();
    const int64_t* r = head_rows.data_ptr<int64_t>();
    for (int64_t i = 0; i < head_rows.numel(); ++i)
      TORCH_CHECK(r[i] >= 0 && r[i] < m, "logits row ", r[i], " is outside the step's ", m, " rows");
    TORCH_CHECK(head->norm.scalar_type() == dtype && head->norm.is_contiguous() && head->norm.dim() == 1 &&
                    head->norm.size(0) == (m > 0 ? hidden.size(1) : 0),
                "the final norm's weight must be contiguous [hidden] in the hidden states' dtype");
    if (head->vocab_ids.has_value()) {
      const at::Tensor& ids = *head->vocab_ids;
      TORCH_CHECK(ids.scalar_type() == at::kLong && ids.is_contiguous() && ids.dim() == 1 &&
                      ids.numel() == head->packed.size(0),
                  "vocab_ids must be contiguous int64, one per row of the head");
      const int64_t* id = ids.data_ptr<int64_t>();
      for (int64_t i = 0; i < ids.numel(); ++i)
        TORCH_CHECK(id[i] >= 0 && id[i] < head->vocab_size, "vocab id ", id[i], " is outside the vocabulary of ",
                    head->vocab_size);
    }
  }
  bool region = m > 0 && m <= kRegionRows && hidden.is_contiguous() &&
                (dtype == at::kFloat || dtype == at::kBFloat16) &&
                (!residual.has_value() || (residual->is_contiguous() && residual->sizes() == hidden.sizes() &&
                                           residual->scalar_type() == dtype));
  for (int64_t l = 0; l < layers && region; ++l) {
    const int64_t dequant_rows = meta[12 * l + 11];  // from these rows on the layer-by-layer path takes a GEMM
    region = dequant_rows == 0 || m < dequant_rows;
  }
  const at::Tensor slots = slot_mapping.to(at::kLong).contiguous();
  const at::Tensor tables = block_tables.to(at::kInt).contiguous();
  const at::Tensor cu = cu_query_lens.to(at::kInt).contiguous();
  const at::Tensor lens = seq_lens.to(at::kInt).contiguous();
  at::Tensor masks;
  std::vector<SpanTask> tasks;
  if (region) {
    TORCH_CHECK(slots.numel() == m, "one slot per token");
    if (tree_masks.has_value()) {
      masks = tree_masks->to(at::kLong).contiguous();
      TORCH_CHECK(masks.dim() == 1 && masks.numel() >= m, "one tree mask per query row");
    }
    const at::Tensor& kc = k_caches[0];
    TORCH_CHECK(kc.dim() == 4, "caches must be [blocks, block_size, kv_heads, head_dim]");
    tasks = span_tasks(tables, cu, lens, m, kc.size(2), kc.size(1), kc.size(0), max_span);
    int64_t covered = 0;  // rows whose span the kernel takes: all of them, or layer by layer
    for (const SpanTask& task : tasks) covered += task.kv_head == 0 ? task.q_len : 0;
    region = covered == m;
  }
  // The head in the region where quant_linear would take the integer kernel for its rows
  // (and they fit the region's buffers).
  const bool head_in_region = region && head != nullptr && head_rows.numel() <= m &&
                              (head->dequant_rows == 0 || head_rows.numel() < head->dequant_rows);
  if (region) {
    at::Tensor logits, full;
    auto in_region = [&](auto* tag) {
      using T = std::remove_pointer_t<decltype(tag)>;
      HeadRun<T> run{};
      if (head_in_region) {
        const QuantWeight weight = quant_weight(head->packed, head->scales, head->mins, head->bits, head->group,
                                                hidden.size(1), head->bias.has_value() ? head->bias->data_ptr<float>()
                                                                                       : nullptr);
        logits = at::empty({head_rows.numel(), weight.n}, hidden.options().dtype(at::kFloat));
        const int64_t* r = head_rows.data_ptr<int64_t>();
        run = {head->norm.data_ptr<T>(), head->eps, std::vector<int64_t>(r, r + head_rows.numel()), weight,
               logits.data_ptr<float>()};
        if (head->vocab_ids.has_value()) {
          full = at::empty({head_rows.numel(), head->vocab_size}, logits.options());
          run.ids = head->vocab_ids->data_ptr<int64_t>();
          run.vocab = head->vocab_size;
          run.full = full.data_ptr<float>();
        }
      }
      auto [h, res] = layers_in_region<T>(hidden, residual, w, meta, eps, scale, cos, sin, k_caches, v_caches, slots,
                                          tables, masks, std::move(tasks), head_in_region ? &run : nullptr);
      return std::make_tuple(h, res);
    };
    auto [h, res] = dtype == at::kFloat ? in_region(static_cast<float*>(nullptr))
                                        : in_region(static_cast<at::BFloat16*>(nullptr));
    if (head_in_region || head == nullptr) return {h, res, full.defined() ? full : logits};
    return {h, res, head_logits(h, res, *head, head_rows)};
  }
  at::Tensor h = hidden;
  OptTensor res = residual;
  for (int64_t l = 0; l < layers; ++l) {
    auto [next, sum] = quant_decoder_layer(h, res, w.slice(14 * l, 14), meta.slice(12 * l, 12), eps[l], scale[l], cos,
                                           sin, k_caches[l], v_caches[l], slot_mapping, block_tables, cu_query_lens,
                                           seq_lens, max_span, tree_masks);
    h = next;
    res = sum;
  }
  return {h, *res, head == nullptr ? at::Tensor() : head_logits(h, *res, *head, head_rows)};
}

// The layers alone (``FusedCpuLayers.run``): the last layer's (hidden, residual).
std::tuple<at::Tensor, at::Tensor> quant_decoder_layers(
    const at::Tensor& hidden, const OptTensor& residual, at::TensorList w, at::IntArrayRef meta,
    at::ArrayRef<double> eps, at::ArrayRef<double> scale, const at::Tensor& cos, const at::Tensor& sin,
    at::TensorList k_caches, at::TensorList v_caches, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
    const at::Tensor& cu_query_lens, const at::Tensor& seq_lens, int64_t max_span, const OptTensor& tree_masks) {
  auto [h, res, logits] = run_layers(hidden, residual, w, meta, eps, scale, cos, sin, k_caches, v_caches, slot_mapping,
                                     block_tables, cu_query_lens, seq_lens, max_span, tree_masks, nullptr);
  return {h, res};
}

// A quantized llama's whole pass over a step, from token ids to the float32 logits of
// ``logits_rows``, in one call: the embedding rows, the rotary tables (rotary_tables), the
// layers (as quant_decoder_layers runs them; from the first, so no residual yet), the final
// norm and the LM head. The same ops on the same values as the pass from Python, so the
// same bits; on a small model's decode step the Python between the layers' call and the
// sampler cost as much as several layers, each op there running from a cache the weights
// had just swept. ``embed`` [vocab, hidden] in the model's dtype; ``rope`` and
// ``long_offset`` as rotary_tables takes them; ``head``: the final norm's weight, then the
// LM head's packed, scales, mins (and bias); ``head_meta``: its bits, group, dequant_rows;
// ``vocab_ids``: for a head over part of the vocabulary (a draft's), each of its rows'
// column in the ``vocab_size`` of the logits, every other -inf.
at::Tensor quant_model_logits(const at::Tensor& input_ids, const at::Tensor& embed, const at::Tensor& positions,
                              at::TensorList rope, int64_t long_offset, at::TensorList w, at::IntArrayRef meta,
                              at::ArrayRef<double> eps, at::ArrayRef<double> scale, at::TensorList k_caches,
                              at::TensorList v_caches, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                              const at::Tensor& cu_query_lens, const at::Tensor& seq_lens, int64_t max_span,
                              const OptTensor& tree_masks, at::TensorList head, at::IntArrayRef head_meta,
                              double norm_eps, const at::Tensor& logits_rows, const OptTensor& vocab_ids,
                              int64_t vocab_size) {
  static auto tables_op = find_op<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, at::TensorList, int64_t,
                                                                     at::ScalarType)>("specserve_cpu::rotary_tables");
  TORCH_CHECK((head.size() == 4 || head.size() == 5) && head_meta.size() == 3,
              "quant_model_logits: the final norm, the head's packed, scales, mins (and bias); bits, group, "
              "dequant_rows");
  TORCH_CHECK(embed.dim() == 2 && embed.is_contiguous(), "the embeddings must be contiguous [vocab, hidden]");
  const at::Tensor ids = input_ids.to(at::kLong).contiguous();
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t t = 0; t < ids.numel(); ++t)
    TORCH_CHECK(id[t] >= 0 && id[t] < embed.size(0), "token id ", id[t], " is outside the vocabulary of ",
                embed.size(0));
  const at::Tensor hidden = at::index_select(embed, 0, ids);
  auto [cos, sin] = tables_op.call(positions, rope, long_offset, embed.scalar_type());
  const HeadArgs args{head[0], logits_rows, head[1], head[2], head[3],
                      head.size() == 5 ? OptTensor(head[4]) : OptTensor(), norm_eps, head_meta[0], head_meta[1],
                      head_meta[2], vocab_ids, vocab_size};
  TORCH_CHECK(!args.bias.has_value() || (args.bias->scalar_type() == at::kFloat && args.bias->is_contiguous()),
              "the head's bias must be contiguous float32");
  return std::get<2>(run_layers(hidden, c10::nullopt, w, meta, eps, scale, cos, sin, k_caches, v_caches, slot_mapping,
                                block_tables, cu_query_lens, seq_lens, max_span, tree_masks, &args));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specserve_cpu, m) {
  m.def("quant_decoder_layer(Tensor hidden, Tensor? residual, Tensor[] weights, int[] meta, float eps, "
        "float scale, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping, "
        "Tensor block_tables, Tensor cu_query_lens, Tensor seq_lens, int max_span, Tensor? tree_masks=None) -> "
        "(Tensor, Tensor)");
  m.def("region_times(bool enable) -> float[]", region_times);
  m.def("quant_decoder_layers(Tensor hidden, Tensor? residual, Tensor[] weights, int[] meta, float[] eps, "
        "float[] scale, Tensor cos, Tensor sin, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, Tensor slot_mapping, "
        "Tensor block_tables, Tensor cu_query_lens, Tensor seq_lens, int max_span, Tensor? tree_masks=None) -> "
        "(Tensor, Tensor)");
  m.def("quant_model_logits(Tensor input_ids, Tensor embed, Tensor positions, Tensor[] rope, int long_offset, "
        "Tensor[] weights, int[] meta, float[] eps, float[] scale, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, "
        "Tensor slot_mapping, Tensor block_tables, Tensor cu_query_lens, Tensor seq_lens, int max_span, "
        "Tensor? tree_masks, Tensor[] head, int[] head_meta, float norm_eps, Tensor logits_rows, "
        "Tensor? vocab_ids=None, int vocab_size=0) -> Tensor");
}

TORCH_LIBRARY_IMPL(specserve_cpu, CPU, m) {
  m.impl("quant_decoder_layer", quant_decoder_layer);
  m.impl("quant_decoder_layers", quant_decoder_layers);
  m.impl("quant_model_logits", quant_model_logits);
}
