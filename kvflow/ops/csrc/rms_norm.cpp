// kvflow C++ CPU kernel: RMSNorm, one pass per row, float32 arithmetic rounded once; and the
// residual add before it fused into the same pass (vLLM's fused_add_rms_norm, out of place).
// Python side and documentation: kvflow/layers/norm.py.
// Built on first use by kvflow.ops.build (torch.utils.cpp_extension.load, -O3 -march=$KVFLOW_CPU_MARCH).

// torch/extension.h's tensor API and pybind11 casters without its C++ frontend (torch/all.h:
// nn, optim, data, serialization), which took a third of a small kernel's compile time
#include <torch/types.h>
#include <torch/csrc/Exceptions.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <cmath>
#include <tuple>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define RN_AVX2 1
#endif

namespace {

#if defined(RN_AVX2)
// Eight values as float32 (bfloat16: the upper half of a float32, exact) and back (bfloat16:
// round to nearest even, NaN to 0x7FC0: c10::BFloat16's conversion).
inline __m256 ld8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 ld8(const c10::BFloat16* p) {
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
inline __m256i bf16_bits(__m256 v) {  // 8 x int32, each a bfloat16's bits
  const __m256i u = _mm256_castps_si256(v);
  const __m256i bias = _mm256_add_epi32(_mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1)),
                                        _mm256_set1_epi32(0x7FFF));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, bias), 16);
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
}
inline void st8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void st8(c10::BFloat16* p, __m256 v) {
  const __m256i b = bf16_bits(v);
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(b, b), 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}
// v rounded to T and back (the value a stored T holds).
inline __m256 round8(__m256 v, float) { return v; }
inline __m256 round8(__m256 v, c10::BFloat16) { return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits(v), 16)); }
#endif

// One row: y = s * rsqrt(mean(s^2) + eps) * w with s = x (+ r, rounded to T and written to
// sum), float32 arithmetic, y rounded once. The sum of squares in 16 partial sums by index
// (lane j: the elements i = j mod 16; the same order whatever the row's address, so a row
// gives the same result in any batch), then added in a fixed order.
template <typename T, bool ADD>
inline void rms_row(const T* x, const T* r, const T* w, T* sum, T* y, int64_t n, float eps) {
  float part[16] = {};
  int64_t i = 0;
#if defined(RN_AVX2)
  __m256 p0 = _mm256_setzero_ps(), p1 = _mm256_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    __m256 a = ld8(x + i), b = ld8(x + i + 8);
    if constexpr (ADD) {
      a = round8(_mm256_add_ps(a, ld8(r + i)), T());
      b = round8(_mm256_add_ps(b, ld8(r + i + 8)), T());
      st8(sum + i, a);
      st8(sum + i + 8, b);
    }
    p0 = _mm256_fmadd_ps(a, a, p0);
    p1 = _mm256_fmadd_ps(b, b, p1);
  }
  _mm256_storeu_ps(part, p0);
  _mm256_storeu_ps(part + 8, p1);
#else
  for (; i + 16 <= n; i += 16)
    for (int j = 0; j < 16; ++j) {
      float v = static_cast<float>(x[i + j]);
      if constexpr (ADD) {
        sum[i + j] = static_cast<T>(v + static_cast<float>(r[i + j]));
        v = static_cast<float>(sum[i + j]);
      }
      part[j] = std::fma(v, v, part[j]);
    }
#endif
  for (int j = 0; i < n; ++i, ++j) {
    float v = static_cast<float>(x[i]);
    if constexpr (ADD) {
      sum[i] = static_cast<T>(v + static_cast<float>(r[i]));
      v = static_cast<float>(sum[i]);
    }
    part[j] = std::fma(v, v, part[j]);
  }
  float ss = 0.f;
  for (int j = 0; j < 16; ++j) ss += part[j];
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
  const T* s = ADD ? sum : x;  // the rounded sum, as written
  i = 0;
#if defined(RN_AVX2)
  const __m256 iv = _mm256_set1_ps(inv);
  for (; i + 8 <= n; i += 8) st8(y + i, _mm256_mul_ps(_mm256_mul_ps(ld8(s + i), iv), ld8(w + i)));
#endif
  // x * r * w in float32, rounded once (as PyTorch's fused CPU rms_norm)
  for (; i < n; ++i) y[i] = static_cast<T>(static_cast<float>(s[i]) * inv * static_cast<float>(w[i]));
}

template <typename T, bool ADD>
void rms_rows(const T* x, int64_t x_stride, const T* r, int64_t r_stride, const T* w, T* sum, T* y, int64_t rows,
              int64_t n, double eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t k = begin; k < end; ++k)
      rms_row<T, ADD>(x + k * x_stride, ADD ? r + k * r_stride : nullptr, w, ADD ? sum + k * n : nullptr, y + k * n, n,
                      static_cast<float>(eps));
  });
}

void check(const torch::Tensor& x, const torch::Tensor& weight) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "CPU tensors");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x: [rows, hidden] with contiguous rows");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous(), "weight: [hidden]");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "x and weight must share a dtype");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16, "float32 or bfloat16");
}

template <bool ADD>
void launch(const torch::Tensor& x, const torch::Tensor& r, const torch::Tensor& w, torch::Tensor& sum,
            torch::Tensor& y, double eps) {
  const int64_t rows = x.size(0), n = x.size(1);
  if (x.scalar_type() == torch::kFloat32) {
    rms_rows<float, ADD>(x.data_ptr<float>(), x.stride(0), ADD ? r.data_ptr<float>() : nullptr, ADD ? r.stride(0) : 0,
                         w.data_ptr<float>(), ADD ? sum.data_ptr<float>() : nullptr, y.data_ptr<float>(), rows, n, eps);
  } else {
    using B = c10::BFloat16;
    rms_rows<B, ADD>(x.data_ptr<B>(), x.stride(0), ADD ? r.data_ptr<B>() : nullptr, ADD ? r.stride(0) : 0,
                     w.data_ptr<B>(), ADD ? sum.data_ptr<B>() : nullptr, y.data_ptr<B>(), rows, n, eps);
  }
}

}  // namespace

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  check(x, weight);
  auto y = torch::empty({x.size(0), x.size(1)}, x.options());
  torch::Tensor none;
  launch<false>(x, none, weight, none, y, eps);
  return y;
}

// (x + residual, RMSNorm(x + residual)): the sum rounded to x's dtype (as x + residual is),
// then normed as rms_norm does; both [rows, hidden], new tensors.
std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight,
                                                      double eps) {
  check(x, weight);
  TORCH_CHECK(residual.device().is_cpu() && residual.dim() == 2 && residual.stride(1) == 1 &&
                  residual.size(0) == x.size(0) && residual.size(1) == x.size(1),
              "residual: [rows, hidden] with contiguous rows, x's shape");
  TORCH_CHECK(residual.scalar_type() == x.scalar_type(), "x and residual must share a dtype");
  auto sum = torch::empty({x.size(0), x.size(1)}, x.options());
  auto y = torch::empty({x.size(0), x.size(1)}, x.options());
  launch<true>(x, residual, weight, sum, y, eps);
  return {sum, y};
}

// Python bindings (the module name, TORCH_EXTENSION_NAME, is the build's name: see kvflow/ops/build.py).
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", torch::wrap_pybind_function_no_gil(rms_norm), "rms_norm");
  m.def("add_rms_norm", torch::wrap_pybind_function_no_gil(add_rms_norm), "add_rms_norm");
}
