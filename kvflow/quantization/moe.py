"""Weight-only quantized experts: every expert matrix stored and multiplied as the scheme
stores and multiplies a linear layer's weight.

``ExpertLinearsMoEMethod`` quantizes each expert's gate/up [2 I, hidden] and down [hidden, I]
matrices with the scheme's own ``LinearMethodBase`` (INT8 per output channel, INT4 group-wise,
FP8 E4M3 per output channel: ``kvflow.quantization.schemes``), so an expert carries exactly
the error a quantized dense linear of its shape does. The quantized tensors are stacked per
layer as buffers ``w13_<name>`` / ``w2_<name>`` [num_experts, ...] (e.g. ``w13_weight`` int8
[E, 2 I, hidden] and ``w13_scale`` float32 [E, 2 I]); the forward groups the (token, expert)
pairs by expert (``kvflow.layers.moe.group_by_expert``) and runs each active expert's two
products through the scheme's ``apply`` — its CPU kernels (kvflow's INT8 kernel, PyTorch's
packed INT4 matmul) included — on per-expert views of the stacked buffers.
"""

from __future__ import annotations

import torch
from torch import nn

from kvflow.layers.linear import LinearBase
from kvflow.layers.moe import UnquantizedFusedMoEMethod, experts_through_linears
from kvflow.quantization.base import FusedMoEMethodBase, QuantizationConfig

#: The two stacked matrices of each expert: gate/up [2 I, H] and down [H, I].
_MATRICES = ("w13", "w2")


class ExpertLinearsMoEMethod(FusedMoEMethodBase):
    """Experts quantized with ``quant_config``'s linear method (see the module docstring).

    Args:
        quant_config: the scheme (int8, int4, fp8); its ``serialized`` flag says whether the
            checkpoint already holds the stacked quantized buffers (``kvflow quantize``).
    """

    quantized = True

    def __init__(self, quant_config: QuantizationConfig) -> None:
        self.quant_config = quant_config
        self.serialized_config = type(quant_config)(quant_config.group_size, serialized=True)

    @staticmethod
    def _shape(layer: nn.Module, which: str) -> tuple[int, int]:
        h, i = layer.hidden_size, layer.intermediate_size_per_partition
        return (2 * i, h) if which == "w13" else (h, i)

    def _empty_expert(self, layer: nn.Module, which: str, e: int) -> LinearBase:
        """A serialized-mode linear of one expert's shape, its buffers on the meta device."""
        out_features, in_features = self._shape(layer, which)
        with torch.device("meta"):
            return LinearBase(in_features, out_features, False, self.serialized_config, f"{layer.prefix}.{e}.{which}")

    def create_weights(self, layer, num_experts, hidden_size, intermediate_size, dtype) -> None:
        if not self.quant_config.serialized:
            UnquantizedFusedMoEMethod().create_weights(layer, num_experts, hidden_size, intermediate_size, dtype)
            return
        for which in _MATRICES:
            for name, buf in self._empty_expert(layer, which, 0)._buffers.items():
                layer.register_buffer(f"{which}_{name}", torch.zeros(num_experts, *buf.shape, dtype=buf.dtype))

    def process_weights_after_loading(self, layer) -> None:
        for which in _MATRICES:
            weight = layer._parameters.get(f"{which}_weight")
            if weight is None:
                continue
            experts = [LinearBase.from_weights(weight.data[e], None, self.quant_config, f"{layer.prefix}.{e}.{which}")
                       for e in range(layer.num_experts)]
            del layer._parameters[f"{which}_weight"]
            for name in experts[0]._buffers:
                layer.register_buffer(f"{which}_{name}", torch.stack([ex._buffers[name] for ex in experts]))
        layer.__dict__.pop("_expert_linears", None)

    def _experts(self, layer, which: str) -> list[LinearBase]:
        """One linear per expert over views of the stacked buffers (rebuilt when a buffer
        object changes, e.g. after ``Module.to``)."""
        cache = layer.__dict__.setdefault("_expert_linears", {})
        prefix = f"{which}_"
        sources = {n[len(prefix):]: b for n, b in layer._buffers.items() if n.startswith(prefix)}
        entry = cache.get(which)
        if entry is None or entry[0].keys() != sources.keys() or any(entry[0][n] is not b for n, b in sources.items()):
            linears = []
            for e in range(layer.num_experts):
                linear = self._empty_expert(layer, which, e)
                for name, stacked in sources.items():
                    linear._buffers[name] = stacked[e]
                linears.append(linear)
            entry = cache[which] = (sources, linears)
        return entry[1]

    def apply(self, layer, x, topk_weights, topk_ids) -> torch.Tensor:
        return experts_through_linears(x, topk_weights, topk_ids, layer.hidden_size, self._experts(layer, "w13"),
                                       self._experts(layer, "w2"))

    def dense_weights(self, layer) -> tuple[torch.Tensor, torch.Tensor]:
        return tuple(torch.stack([ex.dense_weight() for ex in self._experts(layer, which)]) for which in _MATRICES)
