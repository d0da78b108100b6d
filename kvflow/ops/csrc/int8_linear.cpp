// kvflow C++ CPU kernel: Weight-only INT8 matrix products for a few rows (AVX-512).
// Python side and documentation: kvflow/layers/cpu_linear.py.
// Built on first use by kvflow.ops.build (torch.utils.cpp_extension.load, -O3 -march=$KVFLOW_CPU_MARCH).

// torch/extension.h's tensor API and pybind11 casters without its C++ frontend (torch/all.h:
// nn, optim, data, serialization), which took a third of a small kernel's compile time
#include <torch/types.h>
#include <torch/csrc/Exceptions.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>
#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define KVFLOW_INT8 1
#endif

bool int8_supported() {
#if defined(KVFLOW_INT8)
  return true;
#else
  return false;
#endif
}

#if defined(KVFLOW_INT8)
// Sixteen accumulators in, one vector out whose lane i is the sum of v[i]'s lanes.
static inline __m512 reduce16(__m512* v) {
  __m512 s[8];
  for (int i = 0; i < 8; ++i)
    s[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  __m512 u[4];
  for (int i = 0; i < 4; ++i)
    u[i] = _mm512_add_ps(_mm512_shuffle_ps(s[2 * i], s[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(s[2 * i], s[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 w01 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88), _mm512_shuffle_f32x4(u[0], u[1], 0xDD));
  const __m512 w23 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88), _mm512_shuffle_f32x4(u[2], u[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w01, w23, 0x88), _mm512_shuffle_f32x4(w01, w23, 0xDD));
}

// Rows [n0, n0 + nr) of y [M, N] (float32): tile of NR = 16 / M channels, accumulator r * M + m.
template <int M, typename OutT>
static void int8_tile(const float* x, const int8_t* w, const float* scale, int64_t K, int64_t N, int64_t n0,
                      int64_t nr, OutT* y) {
  constexpr int NR = 16 / M;
  __m512 acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
  const int8_t* rows[NR];
  for (int r = 0; r < NR; ++r) rows[r] = w + (n0 + std::min<int64_t>(r, nr - 1)) * K;  // spare lanes repeat a row
  // The tile's rows are one contiguous region, read 16 columns at a time across the rows:
  // too short a stream per row for the hardware prefetcher, so the next tile's region is
  // prefetched evenly over this tile's steps.
  const int64_t next_bytes = n0 + NR < N ? std::min<int64_t>(NR, N - n0 - NR) * K : 0;
  const char* next = reinterpret_cast<const char*>(next_bytes > 0 ? w + (n0 + NR) * K : w);
  const int64_t per_step = (next_bytes / (K / 16) + 63) / 64 * 64;
  for (int64_t k = 0; k < K; k += 16) {
    for (int64_t off = (k / 16) * per_step; off < std::min(next_bytes, (k / 16 + 1) * per_step); off += 64)
      __builtin_prefetch(next + off, 0, 3);
    __m512 xv[M];
    for (int m = 0; m < M; ++m) xv[m] = _mm512_loadu_ps(x + m * K + k);
#pragma GCC unroll 16
    for (int r = 0; r < NR; ++r) {
      const __m512 wv = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[r] + k))));
      for (int m = 0; m < M; ++m) acc[r * M + m] = _mm512_fmadd_ps(wv, xv[m], acc[r * M + m]);
    }
  }
  alignas(64) float sums[16];
  _mm512_store_ps(sums, reduce16(acc));
  for (int r = 0; r < nr; ++r)
    for (int m = 0; m < M; ++m) y[m * N + n0 + r] = static_cast<OutT>(sums[r * M + m] * scale[n0 + r]);
}
#endif

// x [M, K] (float32 or bfloat16) as float32, row-major, into buf.
static const float* as_float(const torch::Tensor& x, std::vector<float>& buf) {
  const int64_t M = x.size(0), K = x.size(1);
  buf.resize(M * K);
  if (x.scalar_type() == torch::kFloat32) {
    const float* p = x.data_ptr<float>();
    for (int64_t m = 0; m < M; ++m) std::memcpy(buf.data() + m * K, p + m * x.stride(0), K * sizeof(float));
  } else {
    const c10::BFloat16* p = x.data_ptr<c10::BFloat16>();
    for (int64_t m = 0; m < M; ++m)
      for (int64_t k = 0; k < K; ++k) buf[m * K + k] = static_cast<float>(p[m * x.stride(0) + k]);
  }
  return buf.data();
}

static void check_input(const torch::Tensor& x, int64_t max_rows) {
  TORCH_CHECK(x.device().is_cpu(), "x: a CPU tensor");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x: [M, K] with contiguous rows");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16, "x: float32 or bfloat16");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= max_rows, "1 <= M <= ", max_rows, " rows");
}

torch::Tensor int8_linear(torch::Tensor x, torch::Tensor weight, torch::Tensor scale) {
#if defined(KVFLOW_INT8)
  check_input(x, 64);  // MAX_ROWS
  TORCH_CHECK(weight.dim() == 2 && x.size(1) == weight.size(1), "x [M, K] and weight [N, K]");
  TORCH_CHECK(weight.scalar_type() == torch::kInt8 && weight.is_contiguous() && weight.device().is_cpu(),
              "weight: contiguous int8 on the CPU");
  TORCH_CHECK(scale.device().is_cpu(), "scale: a CPU tensor");
  TORCH_CHECK(scale.scalar_type() == torch::kFloat32 && scale.is_contiguous() && scale.numel() == weight.size(0),
              "scale: contiguous float32 [N]");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(K > 0 && K % 16 == 0, "K % 16 == 0 and K > 0");
  thread_local std::vector<float> buf;
  const float* xp = as_float(x, buf);
  auto y = torch::empty({M, N}, x.options());
  const int8_t* wp = weight.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  auto run = [&](auto* yp) {
    using OutT = std::remove_pointer_t<decltype(yp)>;
    for (int64_t m0 = 0; m0 < M; m0 += 4) {  // four rows per pass over the weight
      const int64_t mc = std::min<int64_t>(4, M - m0), nr = 16 / mc, tiles = (N + nr - 1) / nr;
      const float* xc = xp + m0 * K;
      OutT* yc = yp + m0 * N;
      at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) {
          const int64_t n0 = t * nr, n = std::min(nr, N - n0);
          switch (mc) {
            case 1: int8_tile<1, OutT>(xc, wp, sp, K, N, n0, n, yc); break;
            case 2: int8_tile<2, OutT>(xc, wp, sp, K, N, n0, n, yc); break;
            case 3: int8_tile<3, OutT>(xc, wp, sp, K, N, n0, n, yc); break;
            default: int8_tile<4, OutT>(xc, wp, sp, K, N, n0, n, yc); break;
          }
        }
      });
    }
  };
  if (x.scalar_type() == torch::kFloat32) run(y.data_ptr<float>());
  else run(y.data_ptr<c10::BFloat16>());
  return y;
#else
  TORCH_CHECK(false, "kvflow's INT8 kernel needs AVX-512 (F, BW)");
#endif
}

// Python bindings (the module name, TORCH_EXTENSION_NAME, is the build's name: see kvflow/ops/build.py).
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int8_supported", torch::wrap_pybind_function(int8_supported), "int8_supported");
  m.def("int8_linear", torch::wrap_pybind_function_no_gil(int8_linear), "int8_linear");
}
