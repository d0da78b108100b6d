// kvflow C++ CPU kernel: RMSNorm, one pass per row, float32 arithmetic rounded once.
// Python side and documentation: kvflow/layers/norm.py.
// Built on first use by kvflow.ops.build (torch.utils.cpp_extension.load, -O3 -march=$KVFLOW_CPU_MARCH).

// torch/extension.h's tensor API and pybind11 casters without its C++ frontend (torch/all.h:
// nn, optim, data, serialization), which took a third of a small kernel's compile time
#include <torch/types.h>
#include <torch/csrc/Exceptions.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <cmath>

template <typename T>
static void rms_rows(const T* x, const T* w, T* y, int64_t rows, int64_t n, int64_t x_stride, double eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * x_stride;
      T* yr = y + r * n;
      // 16 partial sums by index (vectorizable, and the same order whatever the row's
      // address: a row gives the same result in any batch), then added in a fixed order.
      float part[16] = {};
      int64_t i = 0;
      for (; i + 16 <= n; i += 16)
        for (int j = 0; j < 16; ++j) {
          const float v = static_cast<float>(xr[i + j]);
          part[j] += v * v;
        }
      for (int j = 0; i < n; ++i, ++j) {
        const float v = static_cast<float>(xr[i]);
        part[j] += v * v;
      }
      float ss = 0.f;
      for (int j = 0; j < 16; ++j) ss += part[j];
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + static_cast<float>(eps));
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) {
        // x * r * w in float32, rounded once (as PyTorch's fused CPU rms_norm)
        yr[i] = static_cast<T>(static_cast<float>(xr[i]) * inv * static_cast<float>(w[i]));
      }
    }
  });
}

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "CPU tensors");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x: [rows, hidden] with contiguous rows");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous(), "weight: [hidden]");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "x and weight must share a dtype");
  auto y = torch::empty({x.size(0), x.size(1)}, x.options());
  if (x.scalar_type() == torch::kFloat32) {
    rms_rows<float>(x.data_ptr<float>(), weight.data_ptr<float>(), y.data_ptr<float>(), x.size(0), x.size(1),
                    x.stride(0), eps);
  } else {
    TORCH_CHECK(x.scalar_type() == torch::kBFloat16, "float32 or bfloat16");
    rms_rows<c10::BFloat16>(x.data_ptr<c10::BFloat16>(), weight.data_ptr<c10::BFloat16>(),
                            y.data_ptr<c10::BFloat16>(), x.size(0), x.size(1), x.stride(0), eps);
  }
  return y;
}

// Python bindings (the module name, TORCH_EXTENSION_NAME, is the build's name: see kvflow/ops/build.py).
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", torch::wrap_pybind_function_no_gil(rms_norm), "rms_norm");
}
