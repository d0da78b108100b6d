"""RMSNorm (Zhang & Sennrich 2019, "Root Mean Square Layer Normalization", eq. 4).

On the CPU a small C++ kernel (built on first use like ``cpu_attention``) computes it in one
pass per row. ``F.rms_norm`` costs ~10.5 us for one 576-wide bfloat16 row here (dispatch and
its casts), the kernel ~1.4 us, and a decode step runs it 2 x layers + 1 times (61 for
SmolLM2, ~0.6 ms of an ~11 ms single-stream INT4 step). Arithmetic: float32 throughout,
x * rsqrt(mean(x^2) + eps) * weight rounded once to the input dtype, like PyTorch's fused
CPU kernel; the sum of squares is added in a different order, so float32 results differ by
a few ulp and bfloat16 ones, rarely, by one rounding step.
``KVFLOW_CPU_NORM=0`` (or a failed build) keeps ``F.rms_norm``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvflow.layers.cpu_build import InlineExtension, takes_kernel_input

_SOURCE = r"""
#include <torch/extension.h>
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
"""

_EXTENSION = InlineExtension("kvflow_cpu_rms_norm", _SOURCE, ["rms_norm"], "KVFLOW_CPU_NORM", "CPU RMSNorm kernel")


def cpu_rms_norm_available() -> bool:
    """True when the C++ RMSNorm kernel is built (building it now if needed)."""
    return _EXTENSION.load() is not None


def cpu_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of the rows of x [rows, hidden] (float32 or bfloat16, rows contiguous) with
    weight [hidden] of x's dtype; float32 arithmetic. Returns [rows, hidden] in x's dtype.

    Raises:
        RuntimeError: if the kernel is unavailable or the inputs break the layout above.
    """
    return _EXTENSION.require().rms_norm(x, weight, eps)


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, computed in float32.

    Shapes: x [..., hidden_size] of any float dtype -> same shape and dtype.
    """

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if (
            takes_kernel_input(x, 2)
            and w.dtype == x.dtype
            and not (torch.is_grad_enabled() and w.requires_grad)
            and cpu_rms_norm_available()
        ):
            return cpu_rms_norm(x, w, self.eps)
        # One dispatch (PyTorch's composite computes in float32 and casts back).
        return F.rms_norm(x, w.shape, w, self.eps)
