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
"""

from __future__ import annotations

from kvflow.model.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3; same constructor, forward and config checks as ``LlamaForCausalLM``."""
