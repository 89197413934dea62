// Batch-invariant linear layers on the CPU: y = x · Wᵀ (+ b) where each output element is
// one fixed chain of fused multiply-adds over K, in K order, whatever the number of rows.
//
// oneDNN (and MKL) choose their algorithm by the shape: a single row takes a GEMV path
// that sums K in a different order from the blocked GEMM of 2+ rows, and tail rows of a
// row block take yet another. A token's logits then depend on how many tokens share its
// step, so a verify pass of 1 + k tokens rounds differently from a 1-token decode, and
// speculative greedy decoding in bf16 drifts from plain greedy decoding. Here the row and
// column tiling only decides which accumulators live in registers together; every output
// element's accumulator sees the same operations in the same order for every M, so a row's
// result is bitwise the same alone, in a batch, in a verify span or in a prefill chunk.
//
// Weights are packed once at load: 16 output columns per block ("lanes"), so one vector
// holds one K step of 16 columns and a row's K value is broadcast against it.
//  - bf16: [N/16][K/2][16][2], a K pair per lane, consumed by AVX512-BF16's vdpbf16ps
//    (acc += x₀w₀ + x₁w₁ per lane); without that instruction, the same pairs in fp32 FMAs.
//  - fp32: [N/16][K][16], one FMA per K step and lane.
// Registered (TORCH_LIBRARY_FRAGMENT) beside cpu_ops.cpp's ops as torch.ops.specserve_cpu.*.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>

#include <cmath>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kLanes = 16;  // output columns per packed block
// Rows × column blocks whose accumulators share registers: 4 × 4 for a few rows; 8 × 3
// from 8 rows on, where each weight vector loaded then serves twice the rows (fewer L2
// reads a multiply). Any tiling gives the same bits: it only groups the accumulators.
constexpr int64_t kRows = 4, kBlocks = 4, kRowsMany = 8, kBlocksMany = 3;

typedef float v16f __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));

inline v16f bf16_lo(v16u pair) {  // the first bf16 of each lane's pair, widened
  v16u bits = pair << 16;
  v16f out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

inline v16f bf16_hi(v16u pair) {  // the second
  v16u bits = pair & 0xFFFF0000u;
  v16f out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// acc + x · w per lane, rounded once. Always a fused multiply-add, written out: left to
// the compiler, ``acc + x * w`` is contracted into one in some instantiations and not in
// others (GCC 13 did so between tile sizes), and rows would round differently by tile.
inline v16f fma16(float x, v16f w, v16f acc) {
#if defined(__AVX512F__)
  __m512 a, b;
  std::memcpy(&a, &w, sizeof(a));
  std::memcpy(&b, &acc, sizeof(b));
  const __m512 r = _mm512_fmadd_ps(_mm512_set1_ps(x), a, b);
  v16f out;
  std::memcpy(&out, &r, sizeof(out));
  return out;
#else
  v16f out;
  for (int l = 0; l < kLanes; ++l) out[l] = std::fma(x, w[l], acc[l]);
  return out;
#endif
}

inline uint16_t bf16_round(float v) {  // round to nearest even, as at::BFloat16 does
  return c10::BFloat16(v).x;
}

// Rows [0, R) × column blocks [0, B) of one tile, bf16 weights. ``x`` rows of K bf16,
// ``w`` the tile's first block (blocks ``block_stride`` uint32 apart), out fp32 [R][B][16].
template <int R, int B>
inline void tile_bf16(const uint16_t* x, int64_t x_stride, const uint32_t* w, int64_t block_stride,
                      int64_t pairs, float* out) {
#if defined(__AVX512BF16__)
  __m512 acc[R][B];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < B; ++b) acc[r][b] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh wv[B];
    for (int b = 0; b < B; ++b)
      wv[b] = (__m512bh)_mm512_loadu_si512(w + b * block_stride + p * kLanes);
    for (int r = 0; r < R; ++r) {
      uint32_t pair;
      std::memcpy(&pair, x + r * x_stride + 2 * p, sizeof(pair));
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
      for (int b = 0; b < B; ++b) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], xv, wv[b]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < B; ++b) _mm512_storeu_ps(out + (r * B + b) * kLanes, acc[r][b]);
#else
  v16f acc[R][B] = {};
  for (int64_t p = 0; p < pairs; ++p) {
    v16f lo[B], hi[B];
    for (int b = 0; b < B; ++b) {
      v16u wv;
      std::memcpy(&wv, w + b * block_stride + p * kLanes, sizeof(wv));
      lo[b] = bf16_lo(wv);
      hi[b] = bf16_hi(wv);
    }
    for (int r = 0; r < R; ++r) {
      uint32_t bits0 = static_cast<uint32_t>(x[r * x_stride + 2 * p]) << 16;
      uint32_t bits1 = static_cast<uint32_t>(x[r * x_stride + 2 * p + 1]) << 16;
      float x0, x1;
      std::memcpy(&x0, &bits0, 4);
      std::memcpy(&x1, &bits1, 4);
      for (int b = 0; b < B; ++b) acc[r][b] = fma16(x1, hi[b], fma16(x0, lo[b], acc[r][b]));
    }
  }
  std::memcpy(out, acc, sizeof(acc));
#endif
}

// The same for fp32 weights [N/16][K][16]: acc = fma(x_k, w_k, acc) in K order.
template <int R, int B>
inline void tile_f32(const float* x, int64_t x_stride, const float* w, int64_t block_stride,
                     int64_t k_steps, float* out) {
  v16f acc[R][B] = {};
  for (int64_t k = 0; k < k_steps; ++k) {
    v16f wv[B];
    for (int b = 0; b < B; ++b) std::memcpy(&wv[b], w + b * block_stride + k * kLanes, sizeof(v16f));
    for (int r = 0; r < R; ++r) {
      const float xk = x[r * x_stride + k];
      for (int b = 0; b < B; ++b) acc[r][b] = fma16(xk, wv[b], acc[r][b]);
    }
  }
  std::memcpy(out, acc, sizeof(acc));
}

// Runs TILE<R, B>(args...) for the tile's real size (R <= 8, B <= 4), so every size has
// its accumulators in registers.
#define SPECSERVE_TILE_ROW(R, TILE, ...)                 \
  case R * 8 + 1: TILE<R, 1>(__VA_ARGS__); break;       \
  case R * 8 + 2: TILE<R, 2>(__VA_ARGS__); break;       \
  case R * 8 + 3: TILE<R, 3>(__VA_ARGS__); break;       \
  case R * 8 + 4: TILE<R, 4>(__VA_ARGS__); break;
#define SPECSERVE_DISPATCH_TILE(rows, blocks, TILE, ...)                                      \
  switch ((rows) * 8 + (blocks)) {                                                            \
    SPECSERVE_TILE_ROW(1, TILE, __VA_ARGS__) SPECSERVE_TILE_ROW(2, TILE, __VA_ARGS__)         \
    SPECSERVE_TILE_ROW(3, TILE, __VA_ARGS__) SPECSERVE_TILE_ROW(4, TILE, __VA_ARGS__)         \
    SPECSERVE_TILE_ROW(5, TILE, __VA_ARGS__) SPECSERVE_TILE_ROW(6, TILE, __VA_ARGS__)         \
    SPECSERVE_TILE_ROW(7, TILE, __VA_ARGS__) SPECSERVE_TILE_ROW(8, TILE, __VA_ARGS__)         \
    default: TORCH_CHECK(false, "tile size out of range");                                    \
  }

// Pack ``weight`` [N, K] (bf16 or fp32) into the blocked layout described above.
at::Tensor pack_linear_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.device().is_cpu(), "weight must be a 2-D CPU tensor [out, in]");
  const at::Tensor w = weight.contiguous();
  const int64_t n = w.size(0), k = w.size(1), blocks = (n + kLanes - 1) / kLanes;
  if (w.scalar_type() == at::kBFloat16) {
    TORCH_CHECK(k % 2 == 0, "a bf16 weight needs an even number of input features, got ", k);
    at::Tensor packed = at::zeros({blocks, k / 2, kLanes * 2}, w.options());
    const uint16_t* src = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
    uint16_t* dst = reinterpret_cast<uint16_t*>(packed.data_ptr<at::BFloat16>());
    for (int64_t col = 0; col < n; ++col)
      for (int64_t p = 0; p < k / 2; ++p)
        for (int64_t h = 0; h < 2; ++h)
          dst[((col / kLanes) * (k / 2) + p) * kLanes * 2 + (col % kLanes) * 2 + h] = src[col * k + 2 * p + h];
    return packed;
  }
  TORCH_CHECK(w.scalar_type() == at::kFloat, "weight must be bfloat16 or float32");
  at::Tensor packed = at::zeros({blocks, k, kLanes}, w.options());
  const float* src = w.data_ptr<float>();
  float* dst = packed.data_ptr<float>();
  for (int64_t col = 0; col < n; ++col)
    for (int64_t j = 0; j < k; ++j) dst[((col / kLanes) * k + j) * kLanes + col % kLanes] = src[col * k + j];
  return packed;
}

// y [M, N] = x [M, K] · Wᵀ + bias, W packed by pack_linear_weight; ``out_features`` = N;
// ``bias`` (optional) fp32, added before the one rounding to x's dtype.
at::Tensor linear_invariant(const at::Tensor& x_in, const at::Tensor& packed,
                            const c10::optional<at::Tensor>& bias_in, int64_t out_features) {
  TORCH_CHECK(x_in.device().is_cpu() && packed.device().is_cpu(), "linear_invariant runs on CPU tensors");
  TORCH_CHECK(x_in.scalar_type() == packed.scalar_type(), "x and the packed weight must share a dtype");
  const bool bf16 = packed.scalar_type() == at::kBFloat16;
  const int64_t k = bf16 ? packed.size(1) * 2 : packed.size(1);
  TORCH_CHECK(x_in.size(-1) == k, "x has ", x_in.size(-1), " features, the weight ", k);
  const int64_t blocks = packed.size(0);
  TORCH_CHECK(out_features > (blocks - 1) * kLanes && out_features <= blocks * kLanes,
              "out_features does not match the packed weight");
  const at::Tensor x = x_in.reshape({-1, k}).contiguous();
  const int64_t m = x.size(0);
  std::vector<int64_t> shape(x_in.sizes().begin(), x_in.sizes().end());
  shape.back() = out_features;
  at::Tensor out = at::empty({m, out_features}, x.options());
  const float* bias = nullptr;  // kept in fp32 by the layer, so no step converts it
  if (bias_in.has_value() && bias_in->defined()) {
    TORCH_CHECK(bias_in->scalar_type() == at::kFloat && bias_in->is_contiguous() &&
                    bias_in->numel() == out_features,
                "bias must be a contiguous float32 tensor of out_features elements");
    bias = bias_in->data_ptr<float>();
  }
  if (m == 0) return out.view(shape);
  const int64_t tile_rows = m >= kRowsMany ? kRowsMany : kRows;
  const int64_t group_blocks = m >= kRowsMany ? kBlocksMany : kBlocks;
  const int64_t groups = (blocks + group_blocks - 1) / group_blocks;
  // Threads split the columns only: every output element is made by one thread, whole.
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    float tile[kRowsMany * kBlocks * kLanes];
    for (int64_t g = begin; g < end; ++g) {
      const int64_t b0 = g * group_blocks, nb = std::min(group_blocks, blocks - b0);
      for (int64_t r0 = 0; r0 < m; r0 += tile_rows) {
        const int64_t nr = std::min(tile_rows, m - r0);
        if (bf16) {
          const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()) + r0 * k;
          const uint32_t* wp = reinterpret_cast<const uint32_t*>(packed.data_ptr<at::BFloat16>()) +
                               b0 * (k / 2) * kLanes;
          SPECSERVE_DISPATCH_TILE(nr, nb, tile_bf16, xp, k, wp, (k / 2) * kLanes, k / 2, tile)
        } else {
          const float* xp = x.data_ptr<float>() + r0 * k;
          const float* wp = packed.data_ptr<float>() + b0 * k * kLanes;
          SPECSERVE_DISPATCH_TILE(nr, nb, tile_f32, xp, k, wp, k * kLanes, k, tile)
        }
        // tile is [nr][nb][16]; add the bias and round once.
        for (int64_t r = 0; r < nr; ++r)
          for (int64_t b = 0; b < nb; ++b) {
            const int64_t col0 = (b0 + b) * kLanes, width = std::min(kLanes, out_features - col0);
            const float* acc = tile + (r * nb + b) * kLanes;
            if (bf16) {
              uint16_t* dst = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()) + (r0 + r) * out_features + col0;
              for (int64_t l = 0; l < width; ++l) dst[l] = bf16_round(bias ? acc[l] + bias[col0 + l] : acc[l]);
            } else {
              float* dst = out.data_ptr<float>() + (r0 + r) * out_features + col0;
              for (int64_t l = 0; l < width; ++l) dst[l] = bias ? acc[l] + bias[col0 + l] : acc[l];
            }
          }
      }
    }
  });
  return out.view(shape);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specserve_cpu, m) {
  m.def("pack_linear_weight(Tensor weight) -> Tensor");
  m.def("linear_invariant(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(specserve_cpu, CPU, m) {
  m.impl("pack_linear_weight", pack_linear_weight);
  m.impl("linear_invariant", linear_invariant);
}
