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

The C++ source is ``kvflow/ops/csrc/invariant_linear.cpp``. Needs a C++ compiler
(``kvflow.ops.build``); ``invariant_linear_available()`` is False without one or with
``KVFLOW_CPU_INVARIANT_LINEAR=0``, and then
``make_batch_invariant`` changes nothing (results are exact again only up to the BLAS's
behaviour).
"""

from __future__ import annotations

import torch
from torch import nn

from kvflow import ops
from kvflow.quantization.base import LinearMethodBase

_EXTENSION = ops.INVARIANT_LINEAR

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
