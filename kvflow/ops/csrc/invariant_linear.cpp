// kvflow C++ CPU kernel: Batch-invariant dense linear: a row's result never depends on the other rows of the call.
// Python side and documentation: kvflow/layers/invariant_linear.py.
// Built on first use by kvflow.ops.build (torch.utils.cpp_extension.load, -O3 -march=$KVFLOW_CPU_MARCH).

// torch/extension.h's tensor API and pybind11 casters without its C++ frontend (torch/all.h:
// nn, optim, data, serialization), which took a third of a small kernel's compile time
#include <torch/types.h>
#include <torch/csrc/Exceptions.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

static inline float to_f(float v) { return v; }
static inline float to_f(c10::BFloat16 v) { return static_cast<float>(v); }

#if defined(__AVX512F__)
static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 load16(const c10::BFloat16* p) {  // bfloat16 is the top half of a float32
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// Rows [0, MR) of x times panels [p0, p0 + NP): acc[r][j] = fma(x[r][k], w[k][j], acc) for
// k = 0 .. K-1, then + bias, stored to y (float32, ldy) for the channels below N.
template <typename W, int MR, int NP>
static inline void tile(const float* x, int64_t ldx, const W* wp, int64_t K, int64_t p0, const float* bias,
                        int64_t N, float* y, int64_t ldy) {
  __m512 acc[MR][NP];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NP; ++j) acc[r][j] = _mm512_setzero_ps();
  const W* w[NP];
  for (int j = 0; j < NP; ++j) w[j] = wp + (p0 + j) * K * 16;
  for (int64_t k = 0; k < K; ++k) {
    __m512 wk[NP];
    for (int j = 0; j < NP; ++j) wk[j] = load16(w[j] + k * 16);
    for (int r = 0; r < MR; ++r) {
      const __m512 xr = _mm512_set1_ps(x[r * ldx + k]);
      for (int j = 0; j < NP; ++j) acc[r][j] = _mm512_fmadd_ps(xr, wk[j], acc[r][j]);
    }
  }
  for (int j = 0; j < NP; ++j) {
    const int64_t n0 = (p0 + j) * 16;
    const int64_t cnt = std::min<int64_t>(16, N - n0);
    if (cnt <= 0) continue;
    const __mmask16 m = static_cast<__mmask16>((1u << cnt) - 1u);
    const __m512 b = bias != nullptr ? _mm512_maskz_loadu_ps(m, bias + n0) : _mm512_setzero_ps();
    for (int r = 0; r < MR; ++r) _mm512_mask_storeu_ps(y + r * ldy + n0, m, _mm512_add_ps(acc[r][j], b));
  }
}
#else
template <typename W, int MR, int NP>
static inline void tile(const float* x, int64_t ldx, const W* wp, int64_t K, int64_t p0, const float* bias,
                        int64_t N, float* y, int64_t ldy) {
  for (int j = 0; j < NP; ++j) {
    const int64_t n0 = (p0 + j) * 16;
    if (n0 >= N) continue;
    float acc[MR][16] = {};
    const W* w = wp + (p0 + j) * K * 16;
    for (int64_t k = 0; k < K; ++k) {
      float wk[16];
      for (int l = 0; l < 16; ++l) wk[l] = to_f(w[k * 16 + l]);
      for (int r = 0; r < MR; ++r) {
        const float xr = x[r * ldx + k];
#pragma omp simd
        for (int l = 0; l < 16; ++l) acc[r][l] = std::fma(xr, wk[l], acc[r][l]);
      }
    }
    const int64_t cnt = std::min<int64_t>(16, N - n0);
    for (int r = 0; r < MR; ++r)
      for (int64_t l = 0; l < cnt; ++l) y[r * ldy + n0 + l] = acc[r][l] + (bias != nullptr ? bias[n0 + l] : 0.f);
  }
}
#endif

#if defined(__AVX512BF16__)
// bfloat16 x bfloat16 pairs (panels [P, K / 2, 16, 2]): acc[r][j] = vdpbf16ps(acc, pair of x,
// pair of w) for pair kk = 0 .. K/2 - 1, then + bias; the same instruction sequence for every
// output element, as in tile().
template <int MR, int NP>
static inline void tile_pairs(const c10::BFloat16* x, int64_t ldx, const c10::BFloat16* wp, int64_t K2, int64_t p0,
                              const float* bias, int64_t N, float* y, int64_t ldy) {
  __m512 acc[MR][NP];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NP; ++j) acc[r][j] = _mm512_setzero_ps();
  const c10::BFloat16* w[NP];
  for (int j = 0; j < NP; ++j) w[j] = wp + (p0 + j) * K2 * 32;
  for (int64_t kk = 0; kk < K2; ++kk) {
    __m512bh wk[NP];
    for (int j = 0; j < NP; ++j) wk[j] = (__m512bh)_mm512_loadu_si512(w[j] + kk * 32);
    for (int r = 0; r < MR; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + r * ldx + 2 * kk, sizeof(pair));
      const __m512bh xr = (__m512bh)_mm512_set1_epi32(pair);
      for (int j = 0; j < NP; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], xr, wk[j]);
    }
  }
  for (int j = 0; j < NP; ++j) {
    const int64_t n0 = (p0 + j) * 16;
    const int64_t cnt = std::min<int64_t>(16, N - n0);
    if (cnt <= 0) continue;
    const __mmask16 m = static_cast<__mmask16>((1u << cnt) - 1u);
    const __m512 b = bias != nullptr ? _mm512_maskz_loadu_ps(m, bias + n0) : _mm512_setzero_ps();
    for (int r = 0; r < MR; ++r) _mm512_mask_storeu_ps(y + r * ldy + n0, m, _mm512_add_ps(acc[r][j], b));
  }
}
#endif

bool pairs_supported() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

// Rows [0, M) times panels [p0, p1): 4-row tiles of 4 panels, then 1-row tiles of 8 panels,
// single panels at the ends. run(mr, np, row, panel) computes one tile; every output element
// gets the same operations whichever tile it falls in.
template <typename Run>
static void rows_panels(int64_t M, int64_t p0, int64_t p1, Run&& run) {
  using I1 = std::integral_constant<int, 1>;
  using I4 = std::integral_constant<int, 4>;
  using I8 = std::integral_constant<int, 8>;
  int64_t r = 0;
  for (; r + 4 <= M; r += 4) {
    int64_t p = p0;
    for (; p + 4 <= p1; p += 4) run(I4(), I4(), r, p);
    for (; p < p1; ++p) run(I4(), I1(), r, p);
  }
  for (; r < M; ++r) {
    int64_t p = p0;
    for (; p + 8 <= p1; p += 8) run(I1(), I8(), r, p);
    for (; p < p1; ++p) run(I1(), I1(), r, p);
  }
}

static void check_common(const torch::Tensor& x, const torch::Tensor& wp, const torch::Tensor& bias, int64_t N) {
  TORCH_CHECK(x.device().is_cpu() && wp.device().is_cpu() && bias.device().is_cpu(), "CPU tensors");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x: [M, K], rows contiguous");
  TORCH_CHECK(wp.is_contiguous() && N > 0 && (N + 15) / 16 == wp.size(0), "N does not match the panels");
  TORCH_CHECK(bias.numel() == 0 || (bias.scalar_type() == torch::kFloat32 && bias.numel() == N && bias.is_contiguous()),
              "bias: float32 [N] or empty");
}

// x float32 [M, K], panels [P, K, 16] float32 / bfloat16 -> float32 [M, N].
torch::Tensor invariant_linear(torch::Tensor x, torch::Tensor wp, torch::Tensor bias, int64_t N) {
  check_common(x, wp, bias, N);
  TORCH_CHECK(x.scalar_type() == torch::kFloat32, "x: float32");
  TORCH_CHECK(wp.dim() == 3 && wp.size(2) == 16 && wp.size(1) == x.size(1), "wp: [P, K, 16]");
  const int64_t M = x.size(0), K = x.size(1), P = wp.size(0);
  auto y = torch::empty({M, N}, x.options());
  if (M == 0) return y;
  const float* b = bias.numel() ? bias.data_ptr<float>() : nullptr;
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  // Threads split the panels (groups of 8: whole tiles); each thread takes all rows of its
  // panels, so a panel is read from memory once per call.
  auto go = [&](auto* w) {
    using W = std::remove_const_t<std::remove_pointer_t<decltype(w)>>;
    at::parallel_for(0, (P + 7) / 8, 1, [&](int64_t g0, int64_t g1) {
      rows_panels(M, g0 * 8, std::min(P, g1 * 8), [&](auto mr, auto np, int64_t r, int64_t p) {
        tile<W, decltype(mr)::value, decltype(np)::value>(xp + r * ldx, ldx, w, K, p, b, N, yp + r * N, N);
      });
    });
  };
  if (wp.scalar_type() == torch::kFloat32) go(wp.data_ptr<float>());
  else if (wp.scalar_type() == torch::kBFloat16) go(wp.data_ptr<c10::BFloat16>());
  else TORCH_CHECK(false, "wp: float32 or bfloat16");
  return y;
}

// x bfloat16 [M, K] (K even), panels bfloat16 [P, K / 2, 16, 2] -> float32 [M, N] (vdpbf16ps).
torch::Tensor invariant_linear_pairs(torch::Tensor x, torch::Tensor wp, torch::Tensor bias, int64_t N) {
  check_common(x, wp, bias, N);
  TORCH_CHECK(pairs_supported(), "built without AVX512-BF16");
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && wp.scalar_type() == torch::kBFloat16, "bfloat16 x and panels");
  TORCH_CHECK(wp.dim() == 4 && wp.size(2) == 16 && wp.size(3) == 2 && 2 * wp.size(1) == x.size(1),
              "wp: [P, K / 2, 16, 2]");
  const int64_t M = x.size(0), K2 = wp.size(1), P = wp.size(0);
  auto y = torch::empty({M, N}, x.options().dtype(torch::kFloat32));
#if defined(__AVX512BF16__)
  if (M == 0) return y;
  const float* b = bias.numel() ? bias.data_ptr<float>() : nullptr;
  const c10::BFloat16* xp = x.data_ptr<c10::BFloat16>();
  const c10::BFloat16* w = wp.data_ptr<c10::BFloat16>();
  float* yp = y.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  at::parallel_for(0, (P + 7) / 8, 1, [&](int64_t g0, int64_t g1) {
    rows_panels(M, g0 * 8, std::min(P, g1 * 8), [&](auto mr, auto np, int64_t r, int64_t p) {
      tile_pairs<decltype(mr)::value, decltype(np)::value>(xp + r * ldx, ldx, w, K2, p, b, N, yp + r * N, N);
    });
  });
#endif
  return y;
}

// Python bindings (the module name, TORCH_EXTENSION_NAME, is the build's name: see kvflow/ops/build.py).
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("invariant_linear", torch::wrap_pybind_function_no_gil(invariant_linear), "invariant_linear");
  m.def("invariant_linear_pairs", torch::wrap_pybind_function_no_gil(invariant_linear_pairs), "invariant_linear_pairs");
  m.def("pairs_supported", torch::wrap_pybind_function(pairs_supported), "pairs_supported");
}
