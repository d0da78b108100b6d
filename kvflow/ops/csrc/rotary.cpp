// kvflow C++ CPU kernel: rotary position embedding from cos / signed-sin tables (PyTorch's roundings, exactly).
// Python side and documentation: kvflow/layers/rotary.py.
// Built on first use by kvflow.ops.build (torch.utils.cpp_extension.load, -O3 -march=$KVFLOW_CPU_MARCH).

// torch/extension.h's tensor API and pybind11 casters without its C++ frontend (torch/all.h:
// nn, optim, data, serialization), which took a third of a small kernel's compile time
#include <torch/types.h>
#include <torch/csrc/Exceptions.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <cmath>
#include <type_traits>

// out[t, h, d] = T(x * cos) + x[t, h, (d + D/2) % D] * signed_sin, rounded to T: the
// arithmetic of x * cos (rounded) followed by addcmul (computed in float, rounded once).
// No implicit contraction: the roundings of PyTorch's two ops, exactly.
#pragma GCC optimize("fp-contract=off")
template <typename T>
static void rotate(const T* x, const T* cos, const T* sin, T* out, int64_t tokens, int64_t heads, int64_t D,
                   int64_t xs_t, int64_t xs_h) {
  const int64_t half = D / 2;
  at::parallel_for(0, tokens, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* c = cos + t * D;
      const T* s = sin + t * D;
      for (int64_t h = 0; h < heads; ++h) {
        const T* xr = x + t * xs_t + h * xs_h;
        T* o = out + (t * heads + h) * D;
        for (int64_t d = 0; d < D; ++d) {
          const float a = static_cast<float>(static_cast<T>(static_cast<float>(xr[d]) * static_cast<float>(c[d])));
          const float r = static_cast<float>(xr[d < half ? d + half : d - half]);
          // float32: addcmul's vectorized fused multiply-add; bfloat16: its float opmath
          if constexpr (std::is_same<T, float>::value) o[d] = std::fma(r, static_cast<float>(s[d]), a);
          else o[d] = static_cast<T>(a + r * static_cast<float>(s[d]));
        }
      }
    }
  });
}

torch::Tensor apply_rotary(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(x.device().is_cpu() && cos.device().is_cpu() && sin.device().is_cpu(), "CPU tensors");
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0, "x: [T, heads, head_dim], head_dim even, rows contiguous");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == x.size(0) * x.size(2) &&
              sin.numel() == cos.numel(), "cos / sin: contiguous [T, 1, head_dim]");
  TORCH_CHECK(cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(), "one dtype");
  auto out = torch::empty({x.size(0), x.size(1), x.size(2)}, x.options());
  if (x.scalar_type() == torch::kFloat32) {
    rotate<float>(x.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(), out.data_ptr<float>(),
                  x.size(0), x.size(1), x.size(2), x.stride(0), x.stride(1));
  } else {
    TORCH_CHECK(x.scalar_type() == torch::kBFloat16, "float32 or bfloat16");
    rotate<c10::BFloat16>(x.data_ptr<c10::BFloat16>(), cos.data_ptr<c10::BFloat16>(), sin.data_ptr<c10::BFloat16>(),
                          out.data_ptr<c10::BFloat16>(), x.size(0), x.size(1), x.size(2), x.stride(0), x.stride(1));
  }
  return out;
}

// Python bindings (the module name, TORCH_EXTENSION_NAME, is the build's name: see kvflow/ops/build.py).
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("apply_rotary", torch::wrap_pybind_function_no_gil(apply_rotary), "apply_rotary");
}
