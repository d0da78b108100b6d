// kvflow C++ CPU kernel: SiLU-and-mul (vLLM's silu_and_mul), the SwiGLU activation of a merged
// gate/up projection in one pass: y[t, i] = silu(x[t, i]) * x[t, I + i], float32 arithmetic,
// with PyTorch's roundings: silu(gate) rounded to x's dtype, then the product (bfloat16: the
// values of F.silu(gate) * up; rounding once instead moved 27% of the results by one step
// from them). Python side and documentation: kvflow/layers/activation.py.
// Built on first use by kvflow.ops.build (torch.utils.cpp_extension.load, -O3 -march=$KVFLOW_CPU_MARCH).
//
// silu(g) = g * sigmoid(g) (Elfwing et al. 2018), computed with t = e^-|g| in (0, 1] (never
// overflows): g / (1 + t) for g >= 0 (PyTorch's formula), g * t / (1 + t) for g < 0; so
// silu(g) -> g for g >> 0, -> -0 for g << 0, NaN stays NaN. e^x: Cephes expf (range reduction
// by ln 2 in two parts, degree-6 polynomial, 2^n by exponent bits / vscalefps), within 2 ulp;
// float32 results within 5 ulp of PyTorch's for |g| < 80 (vector passes: -0 below g = -87.3), bfloat16 ones equal
// to PyTorch's but where the two e^x round silu(g) differently (about one in a million).
//
// Measured (2026-12-05, this shared 2-core AMD EPYC with AVX-512; x = randn(4096, 3072), I = 1536;
// torch.set_num_threads(1), time.process_time over 50 calls, best of 3; a new [4096, 1536]
// output each call, whose page faults alone cost ~2.2 ms in float32):
//   -march=native (AVX-512):  bfloat16 4.92 ms vs F.silu(g) * u 8.94 ms; float32 4.97 vs 9.34 ms
//   x86-64-v3 (AVX2; ATen avx2): bfloat16 7.32 ms vs 10.70 ms;         float32 5.94 vs 11.13 ms
// In L2 (64 rows) the AVX-512 pass takes 0.33 ns a value in float32, 0.53 in bfloat16.

// torch/extension.h's tensor API and pybind11 casters without its C++ frontend (torch/all.h)
#include <torch/types.h>
#include <torch/csrc/Exceptions.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <algorithm>
#include <cmath>
#include <type_traits>
#if defined(__AVX512F__)
#include <immintrin.h>
#define ACT_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define ACT_AVX2 1
#endif
#include "vec_exp.h"  // exp_neg16, exp_neg8 (paged_attention.cpp's softmax uses the same)

namespace {

// Scalar (the portable loop and the vector passes' tails): the same formula with std::exp.
inline float silu1(float g) {
  const float t = std::exp(-std::fabs(g));
  const float num = g >= 0.f ? g : g * t;  // a NaN g: NaN either way
  return num / (1.f + t);
}

#if defined(ACT_AVX512)
inline __m512 silu16(__m512 g) {
  const __m512 sign = _mm512_set1_ps(-0.f);
  const __m512 t = exp_neg16(_mm512_or_ps(g, sign));  // e^-|g|
  const __mmask16 neg = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ);
  const __m512 num = _mm512_mask_mul_ps(g, neg, g, t);
  return _mm512_div_ps(num, _mm512_add_ps(_mm512_set1_ps(1.f), t));
}
inline __m512 ld16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 ld16(const c10::BFloat16* p) {  // bfloat16: the upper half of a float32, exact
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
inline void st16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
// 16 x int32, each a bfloat16's bits: round to nearest even, NaN -> 0x7FC0 (c10::BFloat16's conversion)
inline __m512i bf16_bits16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i bias = _mm512_add_epi32(_mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1)),
                                        _mm512_set1_epi32(0x7FFF));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
  return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
}
inline void st16(c10::BFloat16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bf16_bits16(v)));
}
// v rounded to T and back (the value a stored T holds; bfloat16: to nearest even by the same
// bias, in place; a NaN is not made 0x7FC0 here, its product with up is NaN and st16 stores that)
inline __m512 rnd16(__m512 v, float) { return v; }
inline __m512 rnd16(__m512 v, c10::BFloat16) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i bias = _mm512_add_epi32(_mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1)),
                                        _mm512_set1_epi32(0x7FFF));
  return _mm512_castsi512_ps(_mm512_and_si512(_mm512_add_epi32(u, bias), _mm512_set1_epi32(-65536)));
}
#elif defined(ACT_AVX2)
inline __m256 silu8(__m256 g) {
  const __m256 t = exp_neg8(_mm256_or_ps(g, _mm256_set1_ps(-0.f)));  // e^-|g|
  const __m256 neg = _mm256_cmp_ps(g, _mm256_setzero_ps(), _CMP_LT_OQ);
  const __m256 num = _mm256_blendv_ps(g, _mm256_mul_ps(g, t), neg);
  return _mm256_div_ps(num, _mm256_add_ps(_mm256_set1_ps(1.f), t));
}
inline __m256 ld8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 ld8(const c10::BFloat16* p) {  // bfloat16: the upper half of a float32, exact
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
inline void st8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
// 8 x int32, each a bfloat16's bits: round to nearest even, NaN -> 0x7FC0 (c10::BFloat16's conversion)
inline __m256i bf16_bits8(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i bias = _mm256_add_epi32(_mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1)),
                                        _mm256_set1_epi32(0x7FFF));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, bias), 16);
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
}
inline __m256 rnd8(__m256 v, float) { return v; }
inline __m256 rnd8(__m256 v, c10::BFloat16) {  // as rnd16
  const __m256i u = _mm256_castps_si256(v);
  const __m256i bias = _mm256_add_epi32(_mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1)),
                                        _mm256_set1_epi32(0x7FFF));
  return _mm256_castsi256_ps(_mm256_and_si256(_mm256_add_epi32(u, bias), _mm256_set1_epi32(-65536)));
}
inline void st8(c10::BFloat16* p, __m256 v) {
  const __m256i b = bf16_bits8(v);
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(b, b), 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}
#endif

// One row: y[i] = T(T(silu(g[i])) * u[i]) for i < n, with g = x, u = x + n: PyTorch's
// F.silu(gate) * up in T (each op in float32, rounded to T; for float32 T the two float32
// roundings, for bfloat16 silu rounded to bfloat16 before the product, as ATen does, so that
// the kernel's results are the reference path's, not half a step closer to the exact value).
template <typename T>
inline void silu_mul_row(const T* x, T* y, int64_t n) {
  const T* g = x;
  const T* u = x + n;
  int64_t i = 0;
#if defined(ACT_AVX512)
  if constexpr (std::is_same<T, c10::BFloat16>::value) {
    // 32 at a time: the 16-bit values interleaved with zeros within each 128-bit lane (unpacklo /
    // unpackhi: float32s in a permuted order, the same for gate and up) and packed back by packus,
    // which undoes that permutation: one shuffle per 16 values each way instead of two.
    const __m512i zero = _mm512_setzero_si512();
    for (; i + 32 <= n; i += 32) {
      const __m512i gv = _mm512_loadu_si512(g + i), uv = _mm512_loadu_si512(u + i);
      const __m512 g0 = _mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, gv));
      const __m512 g1 = _mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, gv));
      const __m512 u0 = _mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, uv));
      const __m512 u1 = _mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, uv));
      const __m512i y0 = bf16_bits16(_mm512_mul_ps(rnd16(silu16(g0), T()), u0));
      const __m512i y1 = bf16_bits16(_mm512_mul_ps(rnd16(silu16(g1), T()), u1));
      _mm512_storeu_si512(y + i, _mm512_packus_epi32(y0, y1));
    }
  }
  for (; i + 16 <= n; i += 16) st16(y + i, _mm512_mul_ps(rnd16(silu16(ld16(g + i)), T()), ld16(u + i)));
#elif defined(ACT_AVX2)
  for (; i + 8 <= n; i += 8) st8(y + i, _mm256_mul_ps(rnd8(silu8(ld8(g + i)), T()), ld8(u + i)));
#endif
  for (; i < n; ++i) {
    const float s = static_cast<float>(static_cast<T>(silu1(static_cast<float>(g[i]))));
    y[i] = static_cast<T>(s * static_cast<float>(u[i]));
  }
}

template <typename T>
void silu_mul_rows(const T* x, int64_t x_stride, T* y, int64_t rows, int64_t n) {
  // ~32K outputs per task at least: a decode step's few rows stay on the calling thread
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(n, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t k = begin; k < end; ++k) silu_mul_row<T>(x + k * x_stride, y + k * n, n);
  });
}

}  // namespace

// x [tokens, 2 * I] (float32 or bfloat16, contiguous rows, any row stride): the gate in the
// first I columns, up in the next I. Returns a new [tokens, I] tensor of x's dtype.
torch::Tensor silu_and_mul(torch::Tensor x) {
  TORCH_CHECK(x.device().is_cpu(), "x: a CPU tensor");
  TORCH_CHECK(x.dim() == 2, "x: [tokens, 2 * intermediate], got ", x.dim(), " dimensions");
  TORCH_CHECK(x.size(1) % 2 == 0, "x: an even number of columns (gate, then up), got ", x.size(1));
  TORCH_CHECK(x.stride(1) == 1 || x.size(1) <= 1, "x: contiguous rows (column stride 1), got ", x.stride(1));
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16,
              "x: float32 or bfloat16, got ", x.scalar_type());
  const int64_t rows = x.size(0), n = x.size(1) / 2;
  auto y = torch::empty({rows, n}, x.options());
  if (rows == 0 || n == 0) return y;
  if (x.scalar_type() == torch::kFloat32) {
    silu_mul_rows<float>(x.data_ptr<float>(), x.stride(0), y.data_ptr<float>(), rows, n);
  } else {
    using B = c10::BFloat16;
    silu_mul_rows<B>(x.data_ptr<B>(), x.stride(0), y.data_ptr<B>(), rows, n);
  }
  return y;
}

// Python bindings (the module name, TORCH_EXTENSION_NAME, is the build's name: see kvflow/ops/build.py).
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("silu_and_mul", torch::wrap_pybind_function_no_gil(silu_and_mul), "silu_and_mul");
}
