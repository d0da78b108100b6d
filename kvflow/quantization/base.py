"""The quantization interface: a scheme is a ``QuantizationConfig`` that hands every linear
layer a ``LinearMethodBase`` (in the manner of vLLM's ``QuantizationConfig`` /
``QuantizeMethodBase``).

A linear layer (``kvflow.layers.linear.LinearBase``) never knows its scheme. At construction
it asks its method to ``create_weights`` (register the parameters and buffers the checkpoint
fills); the loader copies the checkpoint in through the layer's ``weight_loader``; then
``process_weights_after_loading`` turns what was loaded into what ``apply`` computes with
(quantize float weights, repack them for a kernel). ``apply(layer, x)`` is the forward.

A mixture-of-experts layer (``kvflow.layers.moe.FusedMoE``) takes its ``FusedMoEMethodBase``
the same way, from ``get_moe_method`` (the int8 / int4 / fp8 schemes quantize every expert
matrix as they quantize a linear: ``kvflow.quantization.moe``; a scheme without it refuses
MoE models by name).

Adding a scheme is one file with a ``QuantizationConfig`` subclass and its method(s),
registered by name in ``kvflow.quantization.registry``; no model code changes.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

# A method's ``layer`` is a ``kvflow.layers.linear.LinearBase``; it is annotated as the
# ``nn.Module`` it is, so that this layer below ``layers/`` never imports it (not even for types).
LinearBase = nn.Module


class LinearMethodBase:
    """How one linear layer stores and multiplies its weight.

    Subclasses implement ``create_weights`` and ``apply``; ``process_weights_after_loading``
    defaults to nothing.
    """

    #: True when the layer's weights are quantized (the layer then keeps the dtype of its
    #: quantized buffers through ``Module.to``; see ``LinearBase._apply``).
    quantized: bool = False

    def create_weights(
        self, layer: "LinearBase", input_size: int, output_size: int, bias: bool, dtype: torch.dtype
    ) -> None:
        """Register the layer's tensors for an [output_size, input_size] weight (this rank's
        partition) on ``layer``: at least a ``weight`` the loader fills, and ``bias``
        ([output_size]) when ``bias``."""
        raise NotImplementedError

    def process_weights_after_loading(self, layer: "LinearBase") -> None:
        """Convert the loaded tensors into the form ``apply`` uses (quantize, repack)."""

    def apply(self, layer: "LinearBase", x: torch.Tensor) -> torch.Tensor:
        """y = x W^T + b for x [M, input_size]; returns [M, output_size] in x's dtype."""
        raise NotImplementedError

    def dense_weight(self, layer: "LinearBase") -> torch.Tensor:
        """The weight as a float [output_size, input_size] tensor (dequantized, unpacked)."""
        raise NotImplementedError

    def saves_dense_weight(self, layer: "LinearBase") -> bool:
        """True when the layer holds its dense weight outside its parameters (a kernel's own
        layout): ``state_dict`` then yields ``dense_weight`` as ``weight``."""
        return False


class FusedMoEMethodBase:
    """How one mixture-of-experts layer (``kvflow.layers.moe.FusedMoE``) stores and runs its
    stacked expert weights: gate/up ``w13`` [num_experts, 2 * intermediate, hidden] and down
    ``w2`` [num_experts, hidden, intermediate] (this rank's intermediate slice).

    Subclasses implement ``create_weights``, ``apply`` and ``dense_weights``;
    ``process_weights_after_loading`` defaults to nothing.
    """

    #: True when the expert weights are quantized (kept in their storage dtype by ``Module.to``).
    quantized: bool = False

    def create_weights(self, layer: nn.Module, num_experts: int, hidden_size: int, intermediate_size: int,
                       dtype: torch.dtype) -> None:
        """Register the layer's tensors; at least the float parameters ``w13_weight``
        [num_experts, 2 * intermediate_size, hidden_size] and ``w2_weight`` [num_experts,
        hidden_size, intermediate_size] that the loader fills (unless the checkpoint is
        serialized in the scheme's format)."""
        raise NotImplementedError

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Convert the loaded tensors into the form ``apply`` uses (quantize, repack)."""

    def apply(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        """The experts' weighted sum: x [T, hidden], topk_weights float32 [T, top_k],
        topk_ids int64 [T, top_k] -> [T, hidden] in x's dtype (this rank's partial sum
        under tensor parallelism)."""
        raise NotImplementedError

    def dense_weights(self, layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13, w2) as float tensors of the shapes above (dequantized)."""
        raise NotImplementedError


class QuantizationConfig:
    """A weight-quantization scheme.

    Attributes:
        name: the registry name (``quantization=`` of ``EngineArgs``).
        group_size: INT4 group size along the input features (schemes with groups).
        serialized: True when the checkpoint already holds this scheme's tensors (a folder
            written by ``kvflow quantize``): methods then create the quantized buffers
            directly instead of float weights to quantize after loading.
    """

    name: str = ""

    def __init__(self, group_size: int = 32, serialized: bool = False) -> None:
        self.group_size = group_size
        self.serialized = serialized

    def get_linear_method(self, layer: "LinearBase", prefix: str) -> LinearMethodBase:
        """The method of the linear at module path ``prefix`` (e.g. ``layers.3.mlp.down_proj``)."""
        raise NotImplementedError

    def get_moe_method(self, layer: nn.Module, prefix: str) -> FusedMoEMethodBase:
        """The method of the mixture-of-experts layer at module path ``prefix`` (e.g.
        ``layers.3.mlp.experts``).

        Raises:
            ValueError: when the scheme does not quantize experts (the default).
        """
        raise ValueError(f"quantization={self.name!r} does not support mixture-of-experts layers ({prefix})")

    def build_dtype(self) -> torch.dtype:
        """The dtype the float weights are loaded in before ``process_weights_after_loading``
        quantizes them: float32, so that a saved checkpoint reloads to exactly the model
        quantized at load time, whatever the serving dtype."""
        return torch.float32

    def prepare_model(self, model: nn.Module, context: dict[str, Any]) -> None:
        """A model-level pass between loading and ``process_weights_after_loading`` (AWQ's
        activation-aware rescaling, the GGUF tensors' lookup). ``context`` carries the model
        folder (``model_dir``) and the tokenizer loader (``load_tokenizer``)."""

    def lm_head_method(self) -> str:
        """The LM head's scheme when ``quantize_lm_head`` is True (a registry name)."""
        return self.name

    def __repr__(self) -> str:
        return f"{type(self).__name__}(group_size={self.group_size}, serialized={self.serialized})"


def keep_storage_dtypes(module: nn.Module, fn, apply_super) -> nn.Module:
    """``Module._apply`` for a module holding quantized buffers: ``Module.to(dtype)`` casts
    every floating-point tensor, float8 included (an FP8 weight would come back float32, 4x
    the bytes; float32 scales would be rounded to the model dtype). The floating buffers
    travel as raw bytes instead (device moves still apply); parameters (a float bias) are cast
    as usual."""
    dtypes = {}
    for name, buf in module._buffers.items():
        if buf is not None and buf.is_floating_point():
            dtypes[name] = buf.dtype
            module._buffers[name] = buf.view(torch.uint8)
    try:
        return apply_super(fn)
    finally:
        for name, dtype in dtypes.items():
            module._buffers[name] = module._buffers[name].view(dtype)


# ---------------------------------------------------------------- helpers for the methods
#: Compute dtype of the weight-only kernels (activations cast to it, accumulation float32).
COMPUTE_DTYPE = torch.bfloat16


def finish(layer: "LinearBase", out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``out`` in the input's dtype plus the layer's bias."""
    if out.dtype != dtype:
        out = out.to(dtype)
    bias = layer.bias
    if bias is None:
        return out
    return out + (bias if bias.dtype == dtype else bias.to(dtype))


def dense_matmul(layer: "LinearBase", x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x W^T + b with a dequantized weight, in ``COMPUTE_DTYPE``: memory stays compact,
    compute is dense."""
    out = torch.nn.functional.linear(x.to(COMPUTE_DTYPE), weight.to(COMPUTE_DTYPE))
    return finish(layer, out, x.dtype)


def kernel_input(x: torch.Tensor) -> torch.Tensor:
    """x as PyTorch's packed weight-only kernels take it: bfloat16, contiguous (no copy when
    it already is)."""
    if x.dtype != COMPUTE_DTYPE:
        x = x.to(COMPUTE_DTYPE)
    return x if x.is_contiguous() else x.contiguous()


def compute_copy(layer: nn.Module, name: str) -> torch.Tensor:
    """Buffer ``name`` of ``layer`` in ``COMPUTE_DTYPE``, converted once per buffer object
    (not per call)."""
    source = getattr(layer, name)
    cache = layer.__dict__.setdefault("_compute_cache", {})
    cached = cache.get(name)
    if cached is None or cached[0] is not source:
        cached = (source, source.to(COMPUTE_DTYPE))
        cache[name] = cached
    return cached[1]


def replace_float_weight(layer: nn.Module, **buffers: torch.Tensor) -> None:
    """Drop the layer's float ``weight`` parameter and register the quantized ``buffers``."""
    layer._parameters.pop("weight", None)
    for name, tensor in buffers.items():
        layer._buffers.pop(name, None)
        layer.register_buffer(name, tensor)


def create_float_weights(layer: nn.Module, input_size: int, output_size: int, bias: bool, dtype: torch.dtype) -> None:
    """A float ``weight`` [output_size, input_size] to be quantized after loading, and a float
    ``bias``."""
    layer.weight = nn.Parameter(torch.empty(output_size, input_size, dtype=dtype), requires_grad=False)
    create_bias(layer, output_size, bias, dtype)


def create_bias(layer: nn.Module, output_size: int, bias: bool, dtype: torch.dtype) -> None:
    layer.bias = nn.Parameter(torch.zeros(output_size, dtype=dtype), requires_grad=False) if bias else None
