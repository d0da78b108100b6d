"""Keeping a GGUF file's quantized tensors compact (``quantization="gguf"``).

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

from kvflow.layers.quantized_linear import Int4Linear, Int8Linear
from kvflow.model.llama import LlamaForCausalLM
from kvflow.model.loader import SOURCE_MARKER, _unpermute_rows

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


def load_gguf_linears(model: LlamaForCausalLM, model_dir: str | Path) -> dict[str, str]:
    """Replace the model's decoder linears by compact ones built from the GGUF tensors.

    The model must already hold the float weights (biases and the rest come from them).

    Returns:
        Our parameter name -> how it was stored ("int4-exact", "int4-requantized", "int8").
    """
    reader = gguf.GGUFReader(str(gguf_source(model_dir)))
    cfg = model.config
    tensors = {t.name: t for t in reader.tensors}
    report: dict[str, str] = {}
    parts = {"self_attn.qkv_proj": ("attn_q", "attn_k", "attn_v"), "self_attn.o_proj": ("attn_output",),
             "mlp.gate_up_proj": ("ffn_gate", "ffn_up"), "mlp.down_proj": ("ffn_down",)}
    for i, layer in enumerate(model.layers):
        for name, gguf_parts in parts.items():
            parent_name, attr = name.split(".")
            parent = getattr(layer, parent_name)
            linear = getattr(parent, attr)
            sources = [tensors.get(f"blk.{i}.{p}.weight") for p in gguf_parts]
            if any(t is None for t in sources):
                continue  # e.g. a cross-layer-attention layer without K/V
            types = {t.tensor_type for t in sources}
            if types <= _INT4_EXACT | _INT4_REQUANT:
                qs, scales, zeros = zip(*(_int4_parts(t, cfg) for t in sources))
                bias = linear.bias.data if linear.bias is not None else None
                new = Int4Linear.from_quantized(torch.cat(qs), torch.cat(scales), torch.cat(zeros), bias, 32)
                kind = "int4-exact" if types <= _INT4_EXACT else "int4-requantized"
            else:
                new = Int8Linear.from_float(linear)  # from the dequantized float weights already loaded
                kind = "int8"
            setattr(parent, attr, new)
            report[f"layers.{i}.{name}"] = kind
    return report


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
