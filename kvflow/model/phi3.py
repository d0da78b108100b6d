"""Phi-3 decoder (Phi-3 / Phi-3.5-mini, Phi-4-mini: model_type "phi3").

Abdin et al. 2024, "Phi-3 Technical Report" (arXiv 2404.14219), section 2: the Llama-2
block structure (pre-norm RMSNorm, SwiGLU, RoPE, no biases) — so the model is
``LlamaForCausalLM``; what differs is configuration and checkpoint layout:

- the checkpoint stores Q/K/V fused as ``self_attn.qkv_proj`` [(heads + 2 kv_heads) x
  head_dim, hidden] and gate/up as ``mlp.gate_up_proj`` [2 x intermediate, hidden] (gate
  first); they load whole (shard_id None) into ``QKVParallelLinear`` /
  ``MergedColumnParallelLinear``, which take each rank's heads / rows of each part;
- LongRoPE ("longrope", formerly "su") scaling for the 128k-context variants, with its
  short / long factor sets fixed per engine by ``max_model_len`` (``kvflow.layers.rotary``);
- partial rotary (``partial_rotary_factor``, 0.75 in Phi-4-mini): RoPE on the first
  rotary_dim dimensions of each head;
- ``sliding_window`` (2047 in Phi-3-mini-4k): every layer attends within it
  (``ModelConfig.sliding_windows``, as Mistral).

GGUF (llama.cpp ``Phi3MiniModel``): the fused ``attn_qkv`` and ``ffn_up`` (gate then up, the
HF ``gate_up_proj``), the LongRoPE factors as the tensors ``rope_factors_long`` /
``rope_factors_short`` (no ``rope.scaling.type`` key), ``rope.scaling.attn_factor``,
``rope.scaling.original_context_length``, ``rope.dimension_count`` (partial rotary) and
``attention.sliding_window`` (0: none); Q/K are stored as in the HF checkpoint.
"""

from __future__ import annotations

from typing import Any

import gguf

from kvflow.model.arch import ArchSpec, GGUFMetadata, float32_value
from kvflow.model.llama import LlamaForCausalLM

_ROPE_FACTORS = (gguf.MODEL_TENSOR.ROPE_FACTORS_LONG, gguf.MODEL_TENSOR.ROPE_FACTORS_SHORT)


def phi3_gguf_fields(meta: GGUFMetadata, fields: dict[str, Any]) -> dict[str, Any]:
    """``Phi3Config`` fields from phi3 GGUF metadata: the LongRoPE factor tensors (their
    presence is how llama.cpp marks LongRoPE), the attention factor, partial rotary, the
    sliding window.

    Raises:
        NotImplementedError: incomplete LongRoPE data.
    """
    out: dict[str, Any] = {}
    rope = dict(fields["rope_parameters"])
    original = meta.arch_get("rope.scaling.original_context_length", None)
    if original is not None:
        out["original_max_position_embeddings"] = int(original)
    factors = {name: meta.tensors.get(f"rope_factors_{name}.weight") for name in ("long", "short")}
    if any(t is not None for t in factors.values()):
        if None in factors.values() or original is None:
            raise NotImplementedError("phi3 GGUF has incomplete LongRoPE data (needs rope_factors_long, "
                                      "rope_factors_short and rope.scaling.original_context_length)")
        rope.update(
            rope_type="longrope",
            original_max_position_embeddings=int(original),
            **{f"{name}_factor": [float32_value(v) for v in gguf.quants.dequantize(t.data, t.tensor_type).reshape(-1)]
               for name, t in factors.items()},
        )
        attn_factor = meta.arch_get("rope.scaling.attn_factor", None)
        if attn_factor is not None:
            rope["attention_factor"] = float32_value(attn_factor)
    head_dim = fields["head_dim"]
    rope["partial_rotary_factor"] = int(meta.arch_get("rope.dimension_count", head_dim)) / head_dim
    window = int(meta.arch_get("attention.sliding_window", 0))
    return {**out, "rope_parameters": rope, "sliding_window": window or None}


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3; same constructor, forward and config checks as ``LlamaForCausalLM``."""

    arch_specs = (ArchSpec(
        "phi3", "Phi3Config", gguf_arch="phi3", gguf_tensor_names={gguf.MODEL_TENSOR.FFN_UP: "mlp.gate_up_proj"},
        gguf_partial_rotary=True, gguf_config_tensors=_ROPE_FACTORS, gguf_config_fields=phi3_gguf_fields,
    ),)
