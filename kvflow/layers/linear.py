"""Linear layers: replicated, column-, row-, QKV- and merged-parallel, each with a quantization
method and a ``weight_loader`` that takes this rank's slice of a checkpoint tensor.

Tensor parallelism follows Megatron-LM (Shoeybi et al. 2019, section 3): a column-parallel
layer splits its output features across ranks (Q/K/V, gate/up), a row-parallel layer its
input features, summing the partial outputs with an all-reduce (attention output, down
projection). The sharding lives here, in the layers: each one knows which rows or columns of
the full checkpoint tensor its rank holds (``weight_loader``), so a model file only says which
layer is which. Attention heads are split by KV-head groups (``head_partition``).

How a layer stores and multiplies its weight is its ``quant_method``
(``kvflow.quantization.base.LinearMethodBase``): ``UnquantizedLinearMethod`` below, or a
scheme's method from ``kvflow.quantization.registry``.

Dense CPU weights in bfloat16 / float16 are prepacked for oneDNN after loading
(``PackedLinear``). ATen's generic bfloat16 matmul on this project's 2-core machines reads
the weight at well under the memory bandwidth and its cost grows with the number of rows;
oneDNN's inner-product primitive on a weight reordered once into its blocked layout
(``torch.ops.mkldnn._reorder_linear_weight``, the prepacking PyTorch Inductor applies to
frozen CPU graphs) costs about the same for 1 to 16 rows. Measured with
``benchmarks/micro_linear.py`` (bfloat16, 8960 x 1536 weight, 8 distinct weights to defeat
the cache, median per call):

==========  ======  ======  ======  =======
rows         1       5       16      64
==========  ======  ======  ======  =======
ATen        1.35ms  1.47ms  1.51ms  2.19ms
oneDNN      1.02ms  1.06ms  1.06ms  1.83ms
==========  ======  ======  ======  =======

Flat cost in the row count is what makes speculative verification (1 + k rows per request)
and batched decode cheap. float32 weights are left to ATen: in the model, oneDNN's float32
path was slower at one row (23.6 vs 31 tokens/s single-stream on SmolLM2-135M), and float32
is the exactness reference.

oneDNN packs a 16-bit weight only where the CPU converts that type natively (PyTorch's checks,
``torch.ops.mkldnn._is_mkldnn_bf16_supported`` / ``_is_mkldnn_fp16_supported``): bfloat16
needs AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT, float16 needs AVX512-FP16 or AVX-NE-CONVERT
(an AMD Zen 4 has AVX-512 and bfloat16 but neither float16 feature). Elsewhere those layers
stay on ATen's matmul (correct, slower; logged once), and ``PackedLinear`` refuses the weight
naming the missing feature.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from kvflow import envs
from kvflow.distributed.parallel_state import TensorParallel, even_partition, head_partition
from kvflow.layers.gguf_kernels import GGUFWeight
from kvflow.quantization.base import LinearMethodBase, keep_storage_dtypes

if TYPE_CHECKING:
    from kvflow.quantization.base import QuantizationConfig

logger = logging.getLogger(__name__)

PACKED_DTYPES = (torch.bfloat16, torch.float16)
# What oneDNN's 16-bit paths need of an x86 CPU (the /proc/cpuinfo flag names).
CPU_FEATURES_NEEDED = {
    torch.bfloat16: "avx512bw, avx512vl and avx512dq, or avx_ne_convert",
    torch.float16: "avx512_fp16 or avx_ne_convert",
}
_warned: set[torch.dtype] = set()


def onednn_available() -> bool:
    """True when this PyTorch build has the oneDNN linear ops used by ``PackedLinear``."""
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def onednn_packs(dtype: torch.dtype) -> bool:
    """True when oneDNN can prepack and run a ``dtype`` weight on this CPU (bfloat16 /
    float16 only; see ``CPU_FEATURES_NEEDED``)."""
    if dtype not in PACKED_DTYPES or not onednn_available():
        return False
    check = "_is_mkldnn_bf16_supported" if dtype == torch.bfloat16 else "_is_mkldnn_fp16_supported"
    return bool(getattr(torch.ops.mkldnn, check)())


# oneDNN's instruction-set names (ONEDNN_MAX_CPU_ISA) below the first with native bfloat16
# arithmetic (AVX512_CORE_BF16: vdpbf16ps; the AMX levels above it have tile bfloat16).
_ONEDNN_ISAS_WITHOUT_NATIVE_BF16 = ("SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE",
                                    "AVX512_CORE_VNNI")


def onednn_bf16_native() -> bool:
    """True when oneDNN runs bfloat16 matmuls natively on this CPU: it can pack bfloat16
    (``onednn_packs``), the CPU has AVX512-BF16 or AMX tiles (PyTorch's cpuinfo checks,
    ``torch.cpu._is_avx512_bf16_supported`` / ``_is_amx_tile_supported``), and
    ``ONEDNN_MAX_CPU_ISA`` does not cap oneDNN below ``AVX512_CORE_BF16``. Elsewhere oneDNN
    emulates bfloat16 with float32 arithmetic and conversions (AVX-512 without BF16), or
    does not pack it at all. What ``dtype="auto"`` on the CPU keys on
    (``kvflow.platforms.cpu.CpuPlatform.auto_dtype``)."""
    if not onednn_packs(torch.bfloat16):
        return False
    cap = (envs.read("ONEDNN_MAX_CPU_ISA") or "").upper()
    if cap in _ONEDNN_ISAS_WITHOUT_NATIVE_BF16:
        return False
    cpu = torch.cpu
    return bool(getattr(cpu, "_is_avx512_bf16_supported", lambda: False)()
                or getattr(cpu, "_is_amx_tile_supported", lambda: False)())


def warn_unpacked(dtype: torch.dtype) -> None:
    """Log once per dtype that 16-bit linears stay on ATen's (slower) matmul on this CPU."""
    if dtype in PACKED_DTYPES and dtype not in _warned and onednn_available():
        _warned.add(dtype)
        logger.warning("%s linears use PyTorch's generic matmul on this CPU (oneDNN's prepacked path needs %s); "
                       "dtype='bfloat16' is usually faster", dtype, CPU_FEATURES_NEEDED[dtype])


class PackedLinear(nn.Module):
    """y = x W^T + b with W [out_features, in_features] in oneDNN's blocked layout (CPU).

    The packed weight is an opaque oneDNN tensor: not a parameter or buffer, so ``Module.to``
    does not touch it; ``state_dict`` still yields the dense ``weight`` (and ``bias``).

    Args:
        weight: [out_features, in_features], bfloat16 or float16, on the CPU.
        bias: [out_features] or None.

    Shapes: x [M, in_features] in the weight's dtype -> [M, out_features], same dtype.

    Raises:
        ValueError: for a weight that is not a 2-D bfloat16 / float16 CPU tensor.
        RuntimeError: when this CPU lacks what oneDNN needs for the weight's dtype (the
            message names the CPU features; ``onednn_packs`` tells beforehand).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        if weight.dim() != 2 or weight.dtype not in PACKED_DTYPES or weight.device.type != "cpu":
            raise ValueError(
                f"PackedLinear needs a 2-D bfloat16/float16 CPU weight, got {tuple(weight.shape)} "
                f"{weight.dtype} on {weight.device}"
            )
        self.out_features, self.in_features = weight.shape
        self.dtype = weight.dtype
        if not onednn_packs(weight.dtype):
            raise RuntimeError(
                f"oneDNN cannot prepack {weight.dtype} weights on this CPU: it needs "
                f"{CPU_FEATURES_NEEDED[weight.dtype]} (see /proc/cpuinfo), or a PyTorch build with oneDNN"
            )
        # Batch-size hint 1: the decode case; measured no slower at 5-64 rows than no hint.
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), 1)
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(weight.dtype), requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "PackedLinear":
        return cls(linear.weight.data, None if linear.bias is None else linear.bias.data)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.dtype:
            raise ValueError(f"PackedLinear holds {self.dtype} weights, got {x.dtype} input")
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")

    def dense_weight(self) -> torch.Tensor:
        """The weight back in the ordinary [out_features, in_features] layout."""
        return self.packed.to_dense()

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "weight"] = self.dense_weight()

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, {self.dtype}, oneDNN"


def can_pack(weight: torch.Tensor) -> bool:
    """Whether a dense weight goes to oneDNN: a bfloat16 / float16 CPU tensor of a type this
    CPU packs (``onednn_packs``; a 16-bit type it cannot is logged once and stays on ATen)."""
    if weight.device.type != "cpu" or weight.dtype not in PACKED_DTYPES:
        return False
    if onednn_packs(weight.dtype):
        return True
    warn_unpacked(weight.dtype)
    return False


class UnquantizedLinearMethod(LinearMethodBase):
    """A dense weight [output_size, input_size] in the model dtype; on the CPU in bfloat16 /
    float16 it is prepacked for oneDNN after loading (the dense ``weight`` parameter is then
    dropped; ``state_dict`` still yields it)."""

    def create_weights(self, layer, input_size, output_size, bias, dtype) -> None:
        layer.weight = nn.Parameter(torch.empty(output_size, input_size, dtype=dtype), requires_grad=False)
        layer.bias = nn.Parameter(torch.empty(output_size, dtype=dtype), requires_grad=False) if bias else None

    def process_weights_after_loading(self, layer) -> None:
        if layer.__dict__.get("packed") is None and "weight" in layer._parameters and can_pack(layer.weight):
            layer.__dict__["packed"] = torch.ops.mkldnn._reorder_linear_weight(layer.weight.detach().contiguous(), 1)
            layer.__dict__["packed_dtype"] = layer.weight.dtype
            del layer._parameters["weight"]

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        packed = layer.__dict__.get("packed")
        if packed is None:
            return F.linear(x, layer.weight, layer.bias)
        if x.dtype != layer.packed_dtype:
            raise ValueError(f"{type(layer).__name__} holds {layer.packed_dtype} weights, got {x.dtype} input")
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, layer.bias, "none", [], "")

    def dense_weight(self, layer) -> torch.Tensor:
        packed = layer.__dict__.get("packed")
        return layer.weight if packed is None else packed.to_dense()

    @staticmethod
    def is_packed(layer) -> bool:
        return layer.__dict__.get("packed") is not None

    def saves_dense_weight(self, layer) -> bool:
        return self.is_packed(layer)


class LinearBase(nn.Module):
    """y = x W^T + b over this rank's partition, computed by ``quant_method``.

    Args:
        input_size, output_size: this rank's partition of the weight's columns and rows.
        bias: whether the layer has a bias.
        quant_config: the model's quantization scheme, or None for dense weights.
        prefix: the layer's module path in the model (e.g. ``layers.0.mlp.down_proj``), by
            which a scheme may treat layers differently.
        tp: this rank's tensor-parallel place, or None.
        params_dtype: dtype of the float parameters (default: torch's default dtype, which
            the loader sets to the build dtype).

    Shapes: x [M, input_size] -> [M, output_size], x's dtype.
    """

    #: The checkpoint parts ``weight_loader`` takes (``shard_id``); a loader checks that each
    #: arrives exactly once. None: the whole tensor.
    shard_ids: tuple = (None,)

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool,
        quant_config: "QuantizationConfig | None" = None,
        prefix: str = "",
        tp: TensorParallel | None = None,
        params_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = input_size, output_size
        self.tp = tp
        self.prefix = prefix
        method = quant_config.get_linear_method(self, prefix) if quant_config is not None else None
        self.quant_method: LinearMethodBase = method or UnquantizedLinearMethod()
        self.quant_method.create_weights(self, input_size, output_size, bias, params_dtype or torch.get_default_dtype())
        if "bias" not in self._parameters and "bias" not in self._buffers:
            self.bias = None

    @property
    def world_size(self) -> int:
        return 1 if self.tp is None else self.tp.world_size

    @property
    def rank(self) -> int:
        return 0 if self.tp is None else self.tp.rank

    @classmethod
    def from_weights(cls, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     quant_config: "QuantizationConfig | None" = None, prefix: str = "") -> "LinearBase":
        """A single-rank layer over float ``weight`` [out_features, in_features] (no copy) and
        ``bias`` [out_features], processed by ``quant_config``'s method (None: dense, and
        prepacked where ``can_pack``).

        Raises:
            ValueError: for a serialized ``quant_config`` (it loads quantized tensors, not
                float ones).
        """
        if quant_config is not None and quant_config.serialized:
            raise ValueError("from_weights takes float weights; a serialized scheme loads quantized tensors")
        with torch.device("meta"):
            layer = cls(weight.shape[1], weight.shape[0], bias is not None, quant_config, prefix, params_dtype=weight.dtype)
        layer.weight = nn.Parameter(weight.detach(), requires_grad=False)
        if bias is not None:
            layer.bias = nn.Parameter(bias.detach().to(weight.dtype), requires_grad=False)
        layer.quant_method.process_weights_after_loading(layer)
        return layer

    def forward(self, x: torch.Tensor, lora: Any = None) -> torch.Tensor:
        """x [M, input_size] -> [M, output_size]; ``lora``: the step's adapter mapping, whose
        per-token LoRA deltas are added to the base output (a ``kvflow.lora.punica.LoRAMapping``)."""
        out = self._matmul(x)
        return out if lora is None else lora.apply(self, x, out)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        weight = self._parameters.get("weight")
        if weight is not None and weight.numel() and not isinstance(self.quant_method, UnquantizedLinearMethod):
            # Float weights a scheme has not processed yet (AWQ's calibration forward runs here;
            # a GGUF method's weight is an empty placeholder).
            return F.linear(x, weight, self.bias)
        return self.quant_method.apply(self, x)

    def dense_weight(self) -> torch.Tensor:
        """This rank's weight as a float [output_size, input_size] tensor."""
        return self.quant_method.dense_weight(self)

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
        """Copy this rank's part of the full checkpoint tensor ``loaded`` into ``param``
        (a replicated layer: all of it).

        A ``GGUFWeight`` (a GGUF file's stored blocks, ``kvflow.quantization.gguf``) is kept
        as stored by a GGUF method, and dequantized for any other.

        Raises:
            ValueError: when the shapes do not match.
        """
        self._load_rows(param, 0, self.out_features, loaded)

    def _load_rows(self, param: torch.Tensor, offset: int, size: int, src) -> None:
        """Rows [offset, offset + size) of this rank's ``param`` (weight or bias) from ``src``
        (a float tensor, or a ``GGUFWeight`` for the weight): copied, or for the weight of a
        GGUF method kept as a segment of stored rows."""
        if param is self._parameters.get("weight") and hasattr(self.quant_method, "load_segment"):
            rows, cols = _shape(src)
            if rows != size or cols != self.in_features:
                raise ValueError(f"shape {(rows, cols)}, expected ({size}, {self.in_features})")
            self.quant_method.load_segment(self, offset, src)
            return
        if isinstance(src, GGUFWeight):
            src = src.dequantize(torch.float32)
        _copy(param.data.narrow(0, offset, size), src)

    def _apply(self, fn, recurse=True):
        if self.quant_method.quantized:
            return keep_storage_dtypes(self, fn, lambda f: super(LinearBase, self)._apply(f, recurse))
        return super()._apply(fn, recurse)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.quant_method.saves_dense_weight(self):
            destination[prefix + "weight"] = self.dense_weight()

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"method={type(self.quant_method).__name__}")


def _shape(src) -> tuple[int, ...]:
    return (src.n, src.k) if isinstance(src, GGUFWeight) else tuple(src.shape)


def _rows(loaded, start: int, end: int, total: int):
    """Rows [start, end) of a checkpoint tensor or ``GGUFWeight`` of ``total`` rows.

    Raises:
        ValueError: when ``loaded`` has another number of rows (a tensor larger than the
            config says is refused, not cut to size).
    """
    if _shape(loaded)[0] != total:
        raise ValueError(f"shape {_shape(loaded)}, expected {total} rows")
    if isinstance(loaded, GGUFWeight):
        return loaded if (start, end) == (0, loaded.n) else loaded.narrow_rows(start, end - start)
    return loaded[start:end]


def _split_rows(loaded, sizes: list[int]) -> list:
    """A fused checkpoint tensor (or ``GGUFWeight``) cut into consecutive row blocks of ``sizes``.

    Raises:
        ValueError: when ``loaded`` has another number of rows than ``sizes`` add up to (a
            tensor too: ``Tensor.split`` would fail with a RuntimeError naming no weight).
    """
    if _shape(loaded)[0] != sum(sizes):
        raise ValueError(f"shape {_shape(loaded)}, expected {sum(sizes)} rows")
    if not isinstance(loaded, GGUFWeight):
        return list(loaded.split(sizes))
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    return [loaded.narrow_rows(o, n) for o, n in zip(offsets, sizes)]


def _copy(dest: torch.Tensor, src: torch.Tensor) -> None:
    if dest.shape != src.shape:
        raise ValueError(f"shape {tuple(src.shape)}, expected {tuple(dest.shape)}")
    dest.copy_(src)


class ReplicatedLinear(LinearBase):
    """Every rank holds the whole weight (e.g. a MoE router)."""


class ColumnParallelLinear(LinearBase):
    """Output features split evenly across ranks; each rank's output is its slice (no
    communication). ``output_size`` is the full size.

    Raises:
        ValueError: when ``output_size`` is not divisible by the world size.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool, quant_config=None, prefix: str = "",
                 tp: TensorParallel | None = None) -> None:
        world, rank = (1, 0) if tp is None else (tp.world_size, tp.rank)
        self.full_output_size = output_size
        self.output_range = even_partition(output_size, world, rank, what=f"{prefix or 'linear'} output size")
        super().__init__(input_size, self.output_range[1] - self.output_range[0], bias, quant_config, prefix, tp)

    def weight_loader(self, param, loaded, shard_id=None) -> None:
        start, end = self.output_range
        self._load_rows(param, 0, self.out_features, _rows(loaded, start, end, self.full_output_size))


class MergedColumnParallelLinear(LinearBase):
    """Several column-parallel outputs in one matrix (gate and up projections): the full
    outputs ``output_sizes`` are each split evenly across ranks and this rank's slices are
    stacked in order. Checkpoint tensors arrive one per part: ``weight_loader(param,
    tensor, shard_id=i)``."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool, quant_config=None, prefix: str = "",
                 tp: TensorParallel | None = None) -> None:
        world, rank = (1, 0) if tp is None else (tp.world_size, tp.rank)
        self.output_sizes = list(output_sizes)
        self.part_ranges = [even_partition(n, world, rank, what=f"{prefix or 'linear'} output size") for n in output_sizes]
        self.part_sizes = [end - start for start, end in self.part_ranges]
        self.shard_ids = tuple(range(len(output_sizes)))
        super().__init__(input_size, sum(self.part_sizes), bias, quant_config, prefix, tp)

    def weight_loader(self, param, loaded, shard_id=None) -> None:
        if shard_id is None:  # a checkpoint that already stores the merged matrix (e.g. Phi-3)
            for i, part in enumerate(_split_rows(loaded, self.output_sizes)):
                self.weight_loader(param, part, i)
            return
        offset = sum(self.part_sizes[:shard_id])
        start, end = self.part_ranges[shard_id]
        self._load_rows(param, offset, self.part_sizes[shard_id], _rows(loaded, start, end, self.output_sizes[shard_id]))


class QKVParallelLinear(LinearBase):
    """The query, key and value projections in one matrix [q | k | v], split by attention
    heads: each rank holds whole GQA groups (``head_partition``). Checkpoint tensors arrive
    one per projection: ``weight_loader(param, tensor, shard_id="q" / "k" / "v")``, or as the
    fused matrix (``shard_id=None``).

    Args:
        hidden_size: input features.
        head_dim: features per head.
        num_heads, num_kv_heads: the full model's query and KV heads.
        bias: Q/K/V biases (Qwen2).
        with_kv: False for a cross-layer-attention layer that reads another layer's K/V
            (the matrix is then Q only).
    """

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool,
                 quant_config=None, prefix: str = "", tp: TensorParallel | None = None, with_kv: bool = True) -> None:
        world, rank = (1, 0) if tp is None else (tp.world_size, tp.rank)
        self.head_dim = head_dim
        self.total_num_heads, self.total_num_kv_heads = num_heads, num_kv_heads
        q_heads, kv_heads = head_partition(num_heads, num_kv_heads, world, rank)
        self.q_range = (q_heads[0] * head_dim, q_heads[1] * head_dim)
        self.kv_range = (kv_heads[0] * head_dim, kv_heads[1] * head_dim)
        self.num_heads = q_heads[1] - q_heads[0]
        self.num_kv_heads = kv_heads[1] - kv_heads[0]
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim if with_kv else 0
        self.with_kv = with_kv
        self.shard_ids = ("q", "k", "v") if with_kv else ("q",)
        super().__init__(hidden_size, self.q_size + 2 * self.kv_size, bias, quant_config, prefix, tp)

    def weight_loader(self, param, loaded, shard_id=None) -> None:
        if shard_id is None:
            q = self.total_num_heads * self.head_dim
            kv = self.total_num_kv_heads * self.head_dim
            for part, sid in zip(_split_rows(loaded, [q, kv, kv] if self.with_kv else [q]), "qkv"):
                self.weight_loader(param, part, sid)
            return
        if shard_id != "q" and not self.with_kv:
            raise ValueError(f"unexpected {shard_id}_proj: {self.prefix} reads another layer's K/V (cross-layer attention)")
        offset, size, (start, end) = {
            "q": (0, self.q_size, self.q_range),
            "k": (self.q_size, self.kv_size, self.kv_range),
            "v": (self.q_size + self.kv_size, self.kv_size, self.kv_range),
        }[shard_id]
        heads = self.total_num_heads if shard_id == "q" else self.total_num_kv_heads
        self._load_rows(param, offset, size, _rows(loaded, start, end, heads * self.head_dim))


class RowParallelLinear(LinearBase):
    """Input features split across ranks; the partial outputs are summed with an all-reduce
    (``reduce_results``). The bias is added once (by rank 0's partial sum).

    Args:
        input_size, output_size: the full sizes.
        input_range: this rank's columns [start, end) of the full input, when the split is
            not even (the attention output projection takes the rank's query heads); None:
            an even split.
        reduce_results: all-reduce the output (False: the caller reduces).
    """

    def __init__(self, input_size: int, output_size: int, bias: bool, quant_config=None, prefix: str = "",
                 tp: TensorParallel | None = None, input_range: tuple[int, int] | None = None,
                 reduce_results: bool = True) -> None:
        world, rank = (1, 0) if tp is None else (tp.world_size, tp.rank)
        self.full_input_size = input_size
        self.input_range = input_range or even_partition(input_size, world, rank, what=f"{prefix or 'linear'} input size")
        self.reduce_results = reduce_results
        super().__init__(self.input_range[1] - self.input_range[0], output_size, bias, quant_config, prefix, tp)

    def weight_loader(self, param, loaded, shard_id=None) -> None:
        start, end = self.input_range
        if len(_shape(loaded)) == 2 and _shape(loaded)[1] != self.full_input_size:
            raise ValueError(f"shape {_shape(loaded)}, expected {self.full_input_size} columns")
        if isinstance(loaded, GGUFWeight):
            part = loaded if (start, end) == (0, loaded.k) else loaded.narrow_cols(start, end - start)
            self._load_rows(param, 0, self.out_features, part)
            return
        if loaded.dim() == 1:  # the bias: whole on rank 0, zero elsewhere
            _copy(param.data, loaded if self.rank == 0 else torch.zeros_like(loaded))
            return
        self._load_rows(param, 0, self.out_features, loaded[:, start:end])

    def forward(self, x: torch.Tensor, lora: Any = None) -> torch.Tensor:
        out = self._matmul(x)
        if lora is not None:  # (LoRA runs at tensor-parallel size 1 only: EngineArgs.verify)
            out = lora.apply(self, x, out)
        if self.tp is not None and self.reduce_results:
            out = self.tp.all_reduce(out)
        return out


def linear_layers(model: nn.Module) -> list[LinearBase]:
    """Every ``LinearBase`` in ``model``, in module order."""
    return [m for m in model.modules() if isinstance(m, LinearBase)]
