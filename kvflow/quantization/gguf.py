"""Keeping a GGUF file's quantized tensors compact (``quantization="gguf"``).

The model loads the float weights of the converted folder as usual; ``GGUFConfig.prepare_model``
then reads the source GGUF file and plans each decoder linear, and its method's
``process_weights_after_loading`` stores it in the plan's format.

GGUF block formats (ggml's ``ggml-quants.c``; the ``gguf`` package's ``quants.py``):
Q4_0 stores blocks of 32 weights as a float16 scale d and 4-bit q: w = d * (q - 8);
Q4_1 adds a float16 minimum m: w = d * q + m. Both map exactly onto kvflow's INT4 layout
with group size 32 (scale = d, zero = 0 for Q4_0 and m + 8 d for Q4_1): they are repacked
losslessly (up to float16 -> float32, which is exact). Other types are dequantized with the
``gguf`` package and requantized: Q4_K to INT4 group 32 by round-to-nearest (lossy: the
group's grid is re-fitted to its actual min / max), Q5_0, Q5_K, Q6_K and Q8_0 to INT8 per
output channel (lossy, at most half an INT8 step per weight). Embeddings and the LM head
stay float, as everywhere in kvflow.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch

from kvflow.model.resolve import SOURCE_MARKER, _unpermute_rows
from kvflow.quantization.base import LinearMethodBase, QuantizationConfig
from kvflow.quantization.int4 import Int4LinearMethod, set_int4_weights
from kvflow.quantization.int8 import Int8LinearMethod

_QT = gguf.GGMLQuantizationType
_INT4_EXACT = {_QT.Q4_0, _QT.Q4_1}
_INT4_REQUANT = {_QT.Q4_K}


def gguf_source(model_dir: str | Path) -> Path:
    """The GGUF file a converted folder came from.

    Raises:
        ValueError: for a folder that was not converted from a GGUF file.
    """
    marker = Path(model_dir) / SOURCE_MARKER
    if not marker.exists():
        raise ValueError("quantization='gguf' needs a GGUF model (a .gguf file or a packaged short name)")
    return Path(json.loads(marker.read_text())["source"])


def _q4_blocks(raw: np.ndarray, qtype, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q uint8 [rows, cols], scale and zero float32 [rows, cols / 32] of a Q4_0 / Q4_1 tensor."""
    header = 2 if qtype == _QT.Q4_0 else 4
    blocks = np.ascontiguousarray(raw).reshape(rows, cols // 32, header + 16)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    qs = blocks[..., header:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(rows, cols)  # element j, then j + 16
    if qtype == _QT.Q4_0:
        zero = np.zeros_like(d)
    else:
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        zero = m + 8.0 * d
    return torch.from_numpy(q.astype(np.uint8)), torch.from_numpy(d), torch.from_numpy(zero)


# Our decoder linear (module path suffix) -> the GGUF tensors it is made of, in order.
_PARTS = {
    "self_attn.qkv_proj": ("attn_q", "attn_k", "attn_v"),
    "self_attn.o_proj": ("attn_output",),
    "mlp.gate_up_proj": ("ffn_gate", "ffn_up"),
    "mlp.down_proj": ("ffn_down",),
}


def plan_gguf_linears(model, model_dir: str | Path) -> dict[str, tuple]:
    """How each decoder linear of ``model`` is stored, from the GGUF tensors' types.

    Returns:
        module path (``layers.{i}.{name}``) -> ("int4-exact" | "int4-requantized", q, scale,
        zero) for Q4 types (q uint8 [N, K], group-32 scale / zero float32), or ("int8",) for
        the others (requantized from the float weights already loaded). Linears without GGUF
        tensors (a cross-layer-attention layer without K/V) are not in it.
    """
    reader = gguf.GGUFReader(str(gguf_source(model_dir)))
    cfg = model.config
    tensors = {t.name: t for t in reader.tensors}
    plan: dict[str, tuple] = {}
    for i in range(cfg.num_hidden_layers):
        for name, gguf_parts in _PARTS.items():
            sources = [tensors.get(f"blk.{i}.{p}.weight") for p in gguf_parts]
            if any(t is None for t in sources):
                continue
            types = {t.tensor_type for t in sources}
            if types <= _INT4_EXACT | _INT4_REQUANT:
                qs, scales, zeros = zip(*(_int4_parts(t, cfg) for t in sources))
                kind = "int4-exact" if types <= _INT4_EXACT else "int4-requantized"
                plan[f"layers.{i}.{name}"] = (kind, torch.cat(qs), torch.cat(scales), torch.cat(zeros))
            else:
                plan[f"layers.{i}.{name}"] = ("int8",)
    return plan


class GGUFLinearMethod(LinearMethodBase):
    """Loads a float weight; after loading it takes the format its GGUF tensors plan
    (``plan_gguf_linears``) and serves through that format's method (``inner``)."""

    def __init__(self, config: "GGUFConfig") -> None:
        self.config = config
        self.inner: LinearMethodBase | None = None
        self.kind: str | None = None

    @property
    def quantized(self) -> bool:  # type: ignore[override]
        return self.inner is not None and self.inner.quantized

    def create_weights(self, layer, input_size, output_size, bias, dtype) -> None:
        Int8LinearMethod().create_weights(layer, input_size, output_size, bias, dtype)

    def process_weights_after_loading(self, layer) -> None:
        if self.inner is not None:
            return
        entry = self.config.plan.get(layer.prefix)
        if entry is None:  # no GGUF tensors: stays dense
            from kvflow.layers.linear import UnquantizedLinearMethod

            self.inner, self.kind = UnquantizedLinearMethod(), "float"
        elif entry[0] == "int8":
            self.inner, self.kind = Int8LinearMethod(), "int8"
        else:
            layer.group_size = 32
            set_int4_weights(layer, *entry[1:])
            self.inner, self.kind = Int4LinearMethod(32, serialized=True), entry[0]
        self.inner.process_weights_after_loading(layer)

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        return self.inner.apply(layer, x)

    def dense_weight(self, layer) -> torch.Tensor:
        return self.inner.dense_weight(layer) if self.inner is not None else layer.weight


class GGUFConfig(QuantizationConfig):
    """``quantization="gguf"``: keep a GGUF file's quantized decoder tensors compact: Q4_0 /
    Q4_1 repacked losslessly to INT4 group 32, Q4_K requantized to INT4 group 32, the other
    types to INT8 (see the module docstring). The LM head (``quantize_lm_head``) takes INT8:
    a GGUF file's tied head (token_embd) is usually Q8_0."""

    name = "gguf"

    def __init__(self, group_size: int = 32, serialized: bool = False) -> None:
        super().__init__(group_size, serialized)
        self.plan: dict[str, tuple] = {}

    def get_linear_method(self, layer, prefix) -> LinearMethodBase:
        return GGUFLinearMethod(self)

    def get_moe_method(self, layer, prefix):
        """Refused: GGUF's stacked expert tensors are not repacked yet.

        Raises:
            ValueError: always.
        """
        raise ValueError(f"quantization='gguf' does not support mixture-of-experts layers yet ({prefix}): load the "
                         "GGUF file without quantization (float weights) or with quantization='int8', 'int4' or 'fp8'")

    def prepare_model(self, model, context) -> None:
        self.plan = plan_gguf_linears(model, context["model_dir"])

    def lm_head_method(self) -> str:
        return "int8"


def gguf_report(model) -> dict[str, str]:
    """Module path -> how each decoder linear is stored ("int4-exact", "int4-requantized",
    "int8", "float") after loading with ``quantization="gguf"``."""
    return {name: m.quant_method.kind for name, m in model.named_modules() if isinstance(m.__dict__.get("quant_method"), GGUFLinearMethod)}


def _int4_parts(tensor, cfg) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rows, cols = int(tensor.shape[1]), int(tensor.shape[0])
    if tensor.tensor_type in _INT4_EXACT:
        q, scale, zero = _q4_blocks(tensor.data, tensor.tensor_type, rows, cols)
    else:
        from kvflow.quantization.schemes import quantize_int4

        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(rows, cols)
        q, scale, zero = quantize_int4(torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)), 32)
    if cfg.model_type == "llama" and (".attn_q." in tensor.name or ".attn_k." in tensor.name):
        heads = cfg.num_attention_heads if ".attn_q." in tensor.name else cfg.num_key_value_heads
        q, scale, zero = (torch.from_numpy(_unpermute_rows(t.numpy(), heads).copy()) for t in (q, scale, zero))
    return q, scale, zero
