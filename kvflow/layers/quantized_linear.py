"""Weight-only quantized linear layers (INT8, INT4, FP8).

Kernels on the CPU: PyTorch's weight-packed matmuls ``aten._weight_int8pack_mm`` (INT8
weight, per-channel scale) and ``aten._weight_int4pack_mm_for_cpu`` (INT4 weight with
group-wise scale and zero) read the compact weight directly. Measured on this project's
2-core AVX2 machine they are about twice as fast as a float32 matmul for a few rows, but
their cost grows linearly with the rows, while dequantizing the weight costs the same at
any row count. So up to ``INT8_PACKED_MAX_ROWS`` / ``INT4_PACKED_MAX_ROWS`` rows (decode
batches, speculative verification) the packed kernel runs (activations in bfloat16,
accumulation in float32); above it (long prefill chunks), and on CUDA, and for FP8
everywhere (no FP8 matmul on the CPU), the weight is dequantized to bfloat16 for that call
and a dense matmul runs: memory stays compact, compute is dense.

INT8 on a CPU with AVX-512 takes kvflow's own kernel instead of ``_weight_int8pack_mm`` in
that row range (``kvflow.layers.cpu_linear``: float32 activations and scale, about 2.4x
faster at one row on SmolLM2's linears here); elsewhere PyTorch's.

Shapes: inputs x [M, in_features] (float32 or bfloat16), outputs [M, out_features] in the
input's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvflow.layers import cpu_linear
from kvflow.quantization.schemes import dequantize_fp8, quantize_fp8, quantize_int4, quantize_int8

# Rows up to which the packed kernel beats dequantize-then-matmul: the packed kernels' cost
# grows with the rows, the dequantization (a full bfloat16 copy of the weight per call) does
# not. Measured with ``python -m benchmarks.micro_linear`` on an 8960 x 1536 weight here:
# INT8 packed 5.6 ms at 16 rows, 14.6 at 64, 48.9 at 256 vs ~24 ms dequantized; INT4 packed
# 2.9 / 11.5 / 46.0 ms vs ~60 ms dequantized.
INT8_PACKED_MAX_ROWS = 64
INT4_PACKED_MAX_ROWS = 256
_COMPUTE = torch.bfloat16


def _has_op(name: str) -> bool:
    return hasattr(torch.ops.aten, name)


# Shape limits of the packed CPU kernels (PyTorch 2.x, aten/src/ATen/native/cpu/int*mm_kernel.cpp):
# _weight_int8pack_mm reads K in chunks of 16 and crashes the process (segfault) otherwise;
# _convert_weight_to_int4pack_for_cpu needs N % 16 == 0 and _weight_int4pack_mm_for_cpu a group
# size of 32, 64, 128 or 256 (``group_size_for`` can pick 16 or 8). Outside them: dense path.
_INT8_PACK_K_MULTIPLE = 16
_INT4_PACK_N_MULTIPLE = 16
_INT4_PACK_GROUP_SIZES = (32, 64, 128, 256)


class _QuantizedLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None

    def _dense(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        out = F.linear(x.to(_COMPUTE), weight.to(_COMPUTE))
        return self._finish(out, x.dtype)

    def _apply(self, fn, recurse=True):
        # Module.to(dtype) / .half() cast every floating-point tensor, float8 included: an
        # FP8 weight would come back float32 (4x the bytes) and the float32 scales / zeros
        # would be rounded to the model dtype. The quantized storage keeps its dtype: the
        # floating buffers travel as raw bytes (device moves still apply).
        dtypes = {}
        for name, buf in self._buffers.items():
            if buf is not None and buf.is_floating_point():
                dtypes[name] = buf.dtype
                self._buffers[name] = buf.view(torch.uint8)
        try:
            return super()._apply(fn, recurse)
        finally:
            for name, dtype in dtypes.items():
                self._buffers[name] = self._buffers[name].view(dtype)

    def _finish(self, out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if out.dtype != dtype:
            out = out.to(dtype)
        if self.bias is None:
            return out
        return out + (self.bias if self.bias.dtype == dtype else self.bias.to(dtype))

    @staticmethod
    def _kernel_input(x: torch.Tensor) -> torch.Tensor:
        """x as the packed kernels take it: bfloat16, contiguous (no copy when it already is)."""
        if x.dtype != _COMPUTE:
            x = x.to(_COMPUTE)
        return x if x.is_contiguous() else x.contiguous()

    def _compute_copy(self, name: str) -> torch.Tensor:
        """Buffer ``name`` in bfloat16, converted once per buffer object (not per call)."""
        source = getattr(self, name)
        cached = self.__dict__.get("_compute_cache", {}).get(name)
        if cached is None or cached[0] is not source:
            cached = (source, source.to(_COMPUTE))
            self.__dict__.setdefault("_compute_cache", {})[name] = cached
        return cached[1]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"

    def dense_weight(self) -> torch.Tensor:
        """The dequantized weight, float32 [out_features, in_features]."""
        raise NotImplementedError


class _PerChannelLinear(_QuantizedLinear):
    """A weight of ``weight_dtype`` [N, K] with one float32 scale per output channel [N]."""

    weight_dtype: torch.dtype
    quantize = staticmethod(quantize_int8)

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__(in_features, out_features, bias)
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=self.weight_dtype))
        self.register_buffer("scale", torch.ones(out_features))

    @classmethod
    def from_float(cls, linear: nn.Linear) -> "_PerChannelLinear":
        module = cls(linear.in_features, linear.out_features, linear.bias is not None)
        module.weight, module.scale = cls.quantize(linear.weight.data)
        if linear.bias is not None:
            module.bias.data.copy_(linear.bias.data.float())
        return module


class Int8Linear(_PerChannelLinear):
    """y = x W^T + b with W ~= weight (int8 [N, K]) * scale (float32 [N])."""

    weight_dtype = torch.int8
    quantize = staticmethod(quantize_int8)

    def dense_weight(self) -> torch.Tensor:
        return self.weight.float() * self.scale.float()[:, None]

    def _float_scale(self) -> torch.Tensor:
        s = self.scale
        return s if s.dtype == torch.float32 and s.is_contiguous() else s.float().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (
            x.device.type == "cpu"
            and x.shape[0] <= INT8_PACKED_MAX_ROWS
            and self.in_features % _INT8_PACK_K_MULTIPLE == 0
        ):
            if x.dim() == 2 and x.shape[0] >= 1 and x.dtype in (torch.float32, torch.bfloat16) and cpu_linear.int8_available():
                if x.stride(-1) != 1:
                    x = x.contiguous()
                return self._finish(cpu_linear.int8_linear(x, self.weight, self._float_scale()), x.dtype)
            if _has_op("_weight_int8pack_mm"):
                # The kernel refuses inputs that are not contiguous (e.g. a column slice).
                out = torch.ops.aten._weight_int8pack_mm(self._kernel_input(x), self.weight, self._compute_copy("scale"))
                return self._finish(out, x.dtype)
        return self._dense(x, self.weight.to(_COMPUTE) * self.scale.to(_COMPUTE)[:, None])


class Int4Linear(_QuantizedLinear):
    """y = x W^T + b with W ~= (q - 8) * scale + zero per group of ``group_size`` inputs.

    Buffers: qweight uint8 [N, K / 2] (two 4-bit values per byte, low nibble first),
    scale and zero float32 [N, K / group_size]. On the CPU a copy in PyTorch's packed
    layout (same size) feeds ``_weight_int4pack_mm_for_cpu``.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False, group_size: int = 128) -> None:
        super().__init__(in_features, out_features, bias)
        if in_features % group_size:
            raise ValueError(f"in_features {in_features} is not divisible by group_size {group_size}")
        self.group_size = group_size
        groups = in_features // group_size
        self.register_buffer("qweight", torch.zeros(out_features, in_features // 2, dtype=torch.uint8))
        self.register_buffer("scale", torch.ones(out_features, groups))
        self.register_buffer("zero", torch.zeros(out_features, groups))
        self._packed: torch.Tensor | None = None
        self._scales_and_zeros: torch.Tensor | None = None

    @classmethod
    def from_float(cls, linear: nn.Linear, group_size: int) -> "Int4Linear":
        q, scale, zero = quantize_int4(linear.weight.data, group_size)
        return cls.from_quantized(q, scale, zero, linear.bias.data if linear.bias is not None else None, group_size)

    @classmethod
    def from_quantized(
        cls, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bias: torch.Tensor | None, group_size: int
    ) -> "Int4Linear":
        """From q uint8 [N, K] in [0, 15] and group scale / zero float32 [N, K / group_size]."""
        n, k = q.shape
        module = cls(k, n, bias is not None, group_size)
        module.qweight = (q[:, 0::2] | (q[:, 1::2] << 4)).to(torch.uint8)
        module.scale, module.zero = scale.float().contiguous(), zero.float().contiguous()
        if bias is not None:
            module.bias.data.copy_(bias.float())
        return module

    def unpacked(self) -> torch.Tensor:
        """q uint8 [N, K] in [0, 15]."""
        q = torch.empty(self.out_features, self.in_features, dtype=torch.uint8, device=self.qweight.device)
        q[:, 0::2] = self.qweight & 0x0F
        q[:, 1::2] = self.qweight >> 4
        return q

    def dense_weight(self) -> torch.Tensor:
        return self.dequantized(torch.float32)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        g = self.unpacked().view(self.out_features, -1, self.group_size).to(dtype)
        w = (g - 8) * self.scale.to(dtype)[..., None] + self.zero.to(dtype)[..., None]
        return w.view(self.out_features, self.in_features)

    def _cpu_kernel_inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._packed is None:
            self._packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(self.unpacked().to(torch.int32), 1)
            self._scales_and_zeros = (
                torch.stack([self.scale.t(), self.zero.t()], dim=-1).contiguous().to(_COMPUTE)
            )
        return self._packed, self._scales_and_zeros

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (
            x.device.type == "cpu"
            and x.shape[0] <= INT4_PACKED_MAX_ROWS
            and self.out_features % _INT4_PACK_N_MULTIPLE == 0
            and self.group_size in _INT4_PACK_GROUP_SIZES
            and _has_op("_weight_int4pack_mm_for_cpu")
        ):
            packed, scales_and_zeros = self._cpu_kernel_inputs()
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(
                self._kernel_input(x), packed, self.group_size, scales_and_zeros
            )
            return self._finish(out, x.dtype)
        return self._dense(x, self.dequantized(_COMPUTE))


class FP8Linear(_PerChannelLinear):
    """y = x W^T + b with W ~= weight (float8_e4m3fn [N, K]) * scale (float32 [N]).

    No FP8 matmul exists on the CPU: the weight is dequantized per call (memory saving only).
    """

    weight_dtype = torch.float8_e4m3fn
    quantize = staticmethod(quantize_fp8)

    def dense_weight(self) -> torch.Tensor:
        return dequantize_fp8(self.weight, self.scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._dense(x, dequantize_fp8(self.weight, self.scale))
