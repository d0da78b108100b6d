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
from kvflow.quantization.base import LinearMethodBase

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
"""

_EXTENSION = InlineExtension("kvflow_cpu_invariant_linear", _SOURCE,
                             ["invariant_linear", "invariant_linear_pairs", "pairs_supported"],
                             "KVFLOW_CPU_INVARIANT_LINEAR", "batch-invariant linear kernel")

PANEL = 16
"""Output channels per weight panel."""


def invariant_linear_available() -> bool:
    """True when the kernel is built (building it now if needed) and usable."""
    return _EXTENSION.load() is not None


def pack_panels(weight: torch.Tensor, pairs: bool = False) -> torch.Tensor:
    """[N, K] weight -> panels of 16 output channels (channels past N are 0), same dtype:
    [ceil(N / 16), K, 16], or with ``pairs`` (K even) [ceil(N / 16), K / 2, 16, 2], each
    channel's weights for k = 2i, 2i + 1 side by side (the operand layout of vdpbf16ps)."""
    n, k = weight.shape
    panels = -(-n // PANEL)
    padded = weight.new_zeros(panels * PANEL, k)
    padded[:n] = weight
    if pairs:
        return padded.view(panels, PANEL, k // 2, 2).permute(0, 2, 1, 3).contiguous()
    return padded.view(panels, PANEL, k).transpose(1, 2).contiguous()


def _pairs_supported() -> bool:
    module = _EXTENSION.load()
    return module is not None and module.pairs_supported()


class InvariantLinear(nn.Module):
    """y = x W^T + b, each output row computed the same way whatever the other rows (see the
    module docstring): batch-invariant, for a quantized KV cache's exactness.

    A bfloat16 weight with an even in_features, on a CPU with AVX512-BF16, is multiplied by
    pairs (vdpbf16ps: two bfloat16 products added into the float32 accumulator per
    instruction, one fixed sequence per output element, twice the float32 FMA rate);
    otherwise every product is a float32 FMA.

    Args:
        weight: [out_features, in_features], float32 or bfloat16, on the CPU (kept packed
            in panels, in its dtype).
        bias: [out_features] or None (kept as given; the kernel reads a float32 copy).

    Shapes: x [M, in_features] in the weight's dtype (float32 or bfloat16) -> [M,
    out_features] in x's dtype; float32 accumulation, one rounding to x's dtype at the end.

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
        self.pairs = weight.dtype == torch.bfloat16 and self.in_features % 2 == 0 and _pairs_supported()
        self.register_buffer("panels", pack_panels(weight.detach(), self.pairs), persistent=False)
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
        kernel = _EXTENSION.require()
        if self.pairs:
            xb = x2.to(torch.bfloat16)
            if xb.stride(-1) != 1:
                xb = xb.contiguous()
            y = kernel.invariant_linear_pairs(xb, self.panels, self._bias32, self.out_features)
        else:
            xf = x2.float()
            if xf.stride(-1) != 1:
                xf = xf.contiguous()
            y = kernel.invariant_linear(xf, self.panels, self._bias32, self.out_features)
        return y.to(x.dtype).view(*shape[:-1], self.out_features)

    def dense_weight(self) -> torch.Tensor:
        """The weight back in the ordinary [out_features, in_features] layout."""
        if self.pairs:
            panels, half = self.panels.shape[:2]
            dense = self.panels.permute(0, 2, 1, 3).reshape(panels * PANEL, 2 * half)
        else:
            dense = self.panels.transpose(1, 2).reshape(-1, self.in_features)
        return dense[: self.out_features]

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "weight"] = self.dense_weight()

    def extra_repr(self) -> str:
        kind = "bf16 pairs" if self.pairs else "float32 FMA"
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"{self.dtype}, batch-invariant ({kind})")


class InvariantLinearMethod(LinearMethodBase):
    """A dense float32 / bfloat16 weight served by ``InvariantLinear`` (the layer's ``bias``
    parameter stays for readers of it; the kernel adds its own copy)."""

    def __init__(self, kernel: InvariantLinear) -> None:
        self.kernel = kernel

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        return self.kernel(x)

    def dense_weight(self, layer) -> torch.Tensor:
        return self.kernel.dense_weight()

    def saves_dense_weight(self, layer) -> bool:
        return True


def _invariant_weight(weight: torch.Tensor) -> bool:
    return weight.dtype in (torch.float32, torch.bfloat16) and weight.device.type == "cpu"


def make_batch_invariant(model: nn.Module) -> int:
    """Serve the model's dense float32 / bfloat16 CPU linears and its LM head from
    ``InvariantLinear`` (a row's result independent of the other rows of the step), in place;
    quantized layers (and a quantized LM head) stay. What a quantized KV cache needs for a
    token's K/V not to depend on how its step was batched or chunked. Idempotent; a no-op
    without the kernel.

    Returns:
        The number of layers switched.
    """
    from kvflow.layers.linear import LinearBase, UnquantizedLinearMethod, linear_layers

    if not invariant_linear_available():
        return 0
    switched = 0
    for layer in linear_layers(model):
        if isinstance(layer.quant_method, UnquantizedLinearMethod) and _invariant_weight(layer.dense_weight()):
            weight = layer.dense_weight()
            kernel = InvariantLinear(weight, None if layer.bias is None else layer.bias.data)
            layer._parameters.pop("weight", None)
            layer.__dict__.pop("packed", None)
            layer.quant_method = InvariantLinearMethod(kernel)
            switched += 1
    head = getattr(model, "lm_head", None)
    if head is not None and (head.packed is None or isinstance(head.packed.quant_method, UnquantizedLinearMethod)):
        weight = head.dense.data
        if _invariant_weight(weight):
            with torch.device("meta"):
                layer = LinearBase(weight.shape[1], weight.shape[0], False, prefix="lm_head", params_dtype=weight.dtype)
            layer._parameters.pop("weight", None)
            layer.quant_method = InvariantLinearMethod(InvariantLinear(weight))
            head.replace_with(layer)
            switched += 1
    return switched
