"""Batch-invariant dense linear layers for the CPU: a row's result never depends on the
other rows of the call (a small C++ kernel, built once on first use).

A quantized (int8 / fp8) KV cache rounds every stored key and value to a grid, and rounding
turns the last-bit differences of float arithmetic into whole grid steps. The BLAS behind
``F.linear`` picks its kernel by the number of rows: MKL's float32 SGEMM gives a row a
different result (last bits) at 1-3 rows than at 4 or more, and with two threads also at 5-7
and 9-11 rows (measured on this project's AMD EPYC, PyTorch 2.13 / MKL 2024.2). So a prompt
token's keys depend on how its prefill was chunked and on whether it came after a
prefix-cache hit; through a quantized cache a flipped code then changes later layers by a
grid step, which flips more codes: on SmolLM2-135M (float32, int8 cache), a 32-token prompt
prefilled in chunks of 3 against one chunk differed in 30,314 stored K/V codes and up to
0.38 nats in its prompt logprobs. (With a float cache the same drift stays ~1e-5.)
"Defeating Nondeterminism in LLM Inference" (He et al., Thinking Machines Lab, 2025) makes
the same point for GPUs and names the cure: batch-invariant kernels.

This kernel computes y[m, n] = sum_k x[m, k] w[n, k] + b[n] with one float32 accumulator per
output element, multiply-added (fused, one rounding) in increasing k, then the bias added:
the same operations in the same order for every row whatever the row count, thread count or
tile a row falls in. The weight is packed once into panels of 16 output channels,
``[ceil(N / 16), K, 16]`` (float32 or bfloat16), so a tile reads each panel as one stream;
with AVX-512 a tile is 4 rows x 64 channels (1 row x 128 channels for a single row), else
portable loops with ``std::fma`` (the same rounding, so the same results). Activations are
float32 in the kernel (bfloat16 ones are widened exactly) and results are rounded to the
input dtype once.

Needs a C++ compiler (``kvflow.layers.cpu_build``); ``invariant_linear_available()`` is
False without one or with ``KVFLOW_CPU_INVARIANT_LINEAR=0``, and then
``make_batch_invariant`` changes nothing (results are exact again only up to the BLAS's
behaviour).
"""

from __future__ import annotations

import torch
from torch import nn

from kvflow.layers.cpu_build import InlineExtension

_SOURCE = r"""
#include <torch/extension.h>
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

// Rows [0, M) of x times panels [p0, p1): 4-row tiles, then 1-row tiles for the rest;
// NP panels at a time, then one at a time (every output element gets the same operations).
template <typename W, int NP4, int NP1>
static void rows_panels(const float* x, int64_t ldx, int64_t M, const W* wp, int64_t K, int64_t p0, int64_t p1,
                        const float* bias, int64_t N, float* y, int64_t ldy) {
  int64_t r = 0;
  for (; r + 4 <= M; r += 4) {
    int64_t p = p0;
    for (; p + NP4 <= p1; p += NP4) tile<W, 4, NP4>(x + r * ldx, ldx, wp, K, p, bias, N, y + r * ldy, ldy);
    for (; p < p1; ++p) tile<W, 4, 1>(x + r * ldx, ldx, wp, K, p, bias, N, y + r * ldy, ldy);
  }
  for (; r < M; ++r) {
    int64_t p = p0;
    for (; p + NP1 <= p1; p += NP1) tile<W, 1, NP1>(x + r * ldx, ldx, wp, K, p, bias, N, y + r * ldy, ldy);
    for (; p < p1; ++p) tile<W, 1, 1>(x + r * ldx, ldx, wp, K, p, bias, N, y + r * ldy, ldy);
  }
}

torch::Tensor invariant_linear(torch::Tensor x, torch::Tensor wp, torch::Tensor bias, int64_t N) {
  TORCH_CHECK(x.device().is_cpu() && wp.device().is_cpu() && bias.device().is_cpu(), "CPU tensors");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.stride(1) == 1, "x: float32 [M, K], rows contiguous");
  TORCH_CHECK(wp.dim() == 3 && wp.size(2) == 16 && wp.size(1) == x.size(1) && wp.is_contiguous(), "wp: [P, K, 16]");
  TORCH_CHECK(N > 0 && (N + 15) / 16 == wp.size(0), "N does not match the panels");
  TORCH_CHECK(bias.numel() == 0 || (bias.scalar_type() == torch::kFloat32 && bias.numel() == N && bias.is_contiguous()),
              "bias: float32 [N] or empty");
  const int64_t M = x.size(0), K = x.size(1), P = wp.size(0);
  auto y = torch::empty({M, N}, x.options());
  if (M == 0) return y;
  const float* b = bias.numel() ? bias.data_ptr<float>() : nullptr;
  // Threads split the panels (groups of 8: whole 4-panel and 8-panel tiles); each thread
  // takes all rows of its panels, so a panel is read from memory once per call.
  const int64_t groups = (P + 7) / 8;
  auto run = [&](auto* w) {
    using W = std::remove_const_t<std::remove_pointer_t<decltype(w)>>;
    at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
      rows_panels<W, 4, 8>(x.data_ptr<float>(), x.stride(0), M, w, K, g0 * 8, std::min(P, g1 * 8), b, N,
                           y.data_ptr<float>(), N);
    });
  };
  if (wp.scalar_type() == torch::kFloat32) run(wp.data_ptr<float>());
  else if (wp.scalar_type() == torch::kBFloat16) run(wp.data_ptr<c10::BFloat16>());
  else TORCH_CHECK(false, "wp: float32 or bfloat16");
  return y;
}
"""

_EXTENSION = InlineExtension("kvflow_cpu_invariant_linear", _SOURCE, ["invariant_linear"],
                             "KVFLOW_CPU_INVARIANT_LINEAR", "batch-invariant linear kernel")

PANEL = 16
"""Output channels per weight panel."""


def invariant_linear_available() -> bool:
    """True when the kernel is built (building it now if needed) and usable."""
    return _EXTENSION.load() is not None


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] weight -> [ceil(N / 16), K, 16] panels (channels past N are 0), same dtype."""
    n, k = weight.shape
    panels = -(-n // PANEL)
    padded = weight.new_zeros(panels * PANEL, k)
    padded[:n] = weight
    return padded.view(panels, PANEL, k).transpose(1, 2).contiguous()


class InvariantLinear(nn.Module):
    """y = x W^T + b, each output row computed the same way whatever the other rows (see the
    module docstring): batch-invariant, for a quantized KV cache's exactness.

    Args:
        weight: [out_features, in_features], float32 or bfloat16, on the CPU (kept packed
            in panels, in its dtype).
        bias: [out_features] or None (kept as given; the kernel reads a float32 copy).

    Shapes: x [M, in_features] (float32 or bfloat16) -> [M, out_features] in x's dtype;
    float32 accumulation, one rounding to x's dtype at the end.

    Raises:
        ValueError: for a weight that is not a 2-D float32 / bfloat16 CPU tensor.
        RuntimeError: in forward, when the kernel is not available.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        if weight.dim() != 2 or weight.dtype not in (torch.float32, torch.bfloat16) or weight.device.type != "cpu":
            raise ValueError(f"InvariantLinear needs a 2-D float32/bfloat16 CPU weight, got {tuple(weight.shape)} "
                             f"{weight.dtype} on {weight.device}")
        self.out_features, self.in_features = weight.shape
        self.dtype = weight.dtype
        self.register_buffer("panels", pack_panels(weight.detach()), persistent=False)
        # ``bias`` stays an attribute of the usual name (LlamaAttention._key_offset reads it).
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.register_buffer("_bias32", torch.empty(0) if bias is None else bias.detach().float().contiguous(),
                             persistent=False)

    @classmethod
    def from_module(cls, module: nn.Module) -> "InvariantLinear":
        """From an ``nn.Linear`` or a ``kvflow.layers.linear.PackedLinear``."""
        weight = module.dense_weight() if hasattr(module, "dense_weight") else module.weight.data
        return cls(weight, None if module.bias is None else module.bias.data)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        xf = x2.float()
        if xf.stride(-1) != 1:
            xf = xf.contiguous()
        y = _EXTENSION.require().invariant_linear(xf, self.panels, self._bias32, self.out_features)
        return y.to(x.dtype).view(*shape[:-1], self.out_features)

    def dense_weight(self) -> torch.Tensor:
        """The weight back in the ordinary [out_features, in_features] layout."""
        return self.panels.transpose(1, 2).reshape(-1, self.in_features)[: self.out_features]

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "weight"] = self.dense_weight()

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, {self.dtype}, batch-invariant"
