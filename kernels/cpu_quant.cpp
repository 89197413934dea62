// quant_linear: y = x · Wᵀ with W held in the quantized form of cpu_quant.h; from
// ``dequant_rows`` rows on W is unpacked for a library GEMM (see cpu_quant.h).
// Registered (TORCH_LIBRARY_FRAGMENT) beside cpu_ops.cpp's ops as torch.ops.specserve_cpu.*.
#include "cpu_quant.h"

#include <torch/library.h>

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

// W [N, Kp] in the packed layout's own block order (``block_positions``): scale · q + min,
// exact in fp32, rounded once to T (padding inputs weigh 0: their groups' scales and mins
// are 0). Each row is read once, in order, with no gathers: the caller puts x's columns in
// the same order, which leaves every product as it was.
template <typename S, typename T>
void unpack_weight(int64_t n, int64_t kp, int64_t group, int64_t bits, const uint8_t* packed, int64_t row_bytes,
                   const S* scales, const S* mins, T* out) {
  const std::vector<int64_t> sizes = blocks(kp, group);
  const int64_t groups = kp / group, chunks = kp / kChunk;
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
          lane_min[l] = scalar(mins[r * groups + g0 + l / per]);
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
}

// y [..., N] = x [..., K] · Wᵀ (+ bias), W in the form above: ``packed`` uint8 [N, Kp·bits/8],
// ``scales``/``mins`` fp32 or fp16 [N, Kp/group]; ``bias`` fp32 or none. y has x's dtype. From
// ``dequant_rows`` rows on (0: never), W is unpacked for a library GEMM (see the top).
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
    const int64_t groups = kp / group, row_bytes = packed.size(1);
    const int64_t slice = std::min(n, std::max<int64_t>(64, kUnpackBytes / (kp * x.element_size()) / 64 * 64));
    at::Tensor w = at::empty({slice, kp}, x.options());
    const at::Tensor b = bias ? bias_in->to(x.scalar_type()) : at::Tensor();
    at::Tensor out = slice < n ? at::empty({m, n}, x.options()) : at::Tensor();
    for (int64_t n0 = 0; n0 < n; n0 += slice) {
      const int64_t cols = std::min(slice, n - n0);
      auto unpack = [&](auto* sc, auto* mn) {
        const uint8_t* p = packed.data_ptr<uint8_t>() + n0 * row_bytes;
        if (x.scalar_type() == at::kFloat)
          unpack_weight(cols, kp, group, bits, p, row_bytes, sc + n0 * groups, mn + n0 * groups, w.data_ptr<float>());
        else
          unpack_weight(cols, kp, group, bits, p, row_bytes, sc + n0 * groups, mn + n0 * groups,
                        w.data_ptr<at::BFloat16>());
      };
      if (half)
        unpack(scales.data_ptr<at::Half>(), mins.data_ptr<at::Half>());
      else
        unpack(scales.data_ptr<float>(), mins.data_ptr<float>());
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

TORCH_LIBRARY_FRAGMENT(specserve_cpu, m) {
  m.def("quant_linear(Tensor x, Tensor packed, Tensor scales, Tensor mins, int bits, int group, "
        "Tensor? bias, int dequant_rows=0) -> Tensor");
}

TORCH_LIBRARY_IMPL(specserve_cpu, CPU, m) {
  m.impl("quant_linear", quant_linear);
}
