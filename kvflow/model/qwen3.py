"""Qwen3 (dense) decoder: Llama with a per-head RMSNorm on queries and keys before RoPE.

Qwen Team 2025, "Qwen3 Technical Report" (arXiv 2505.09388), section 2: Qwen2's grouped-query
attention, SwiGLU and RoPE with pre-norm RMSNorm, minus the QKV biases, plus QK-Norm
(Dehghani et al. 2023, "Scaling Vision Transformers to 22 Billion Parameters", section 3.1):
each query and key head is RMS-normalized over its ``head_dim`` with a learned weight
``q_norm`` / ``k_norm`` [head_dim] shared by all heads of the layer. ``head_dim`` is its own
config field (128 in every Qwen3, whatever hidden_size / num_heads). Biases follow
``attention_bias`` (Q/K/V and output projection, as transformers' ``Qwen3Attention``).

Qwen3 configs carry ``use_sliding_window`` / ``sliding_window`` / ``max_window_layers`` /
``layer_types``; released checkpoints leave the window off. With it on, the "sliding_attention"
layers of ``layer_types`` attend within the window (``ModelConfig.sliding_windows``).
"""

from __future__ import annotations

import torch

from kvflow.config import ModelConfig
from kvflow.distributed.parallel_state import TensorParallel
from kvflow.layers.norm import RMSNorm
from kvflow.layers.rotary import apply_rotary
from kvflow.model.arch import ArchSpec
from kvflow.model.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM
from kvflow.quantization.base import QuantizationConfig


class Qwen3Attention(LlamaAttention):
    """``LlamaAttention`` with QK-Norm: RMSNorm over each query / key head, then RoPE."""

    def __init__(self, config: ModelConfig, layer_idx: int, tp: TensorParallel | None = None,
                 quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        super().__init__(config, layer_idx, tp, quant_config, prefix, o_proj_bias=config.attention_bias)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)

    def rotate_heads(self, heads: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """heads [T, num_heads (+ num_kv_heads), head_dim]: normalize each query head with
        ``q_norm`` and each key head with ``k_norm`` (rows [T x heads, head_dim]), then rotate."""
        num_tokens, d = heads.shape[0], self.head_dim
        parts = [self.q_norm(heads[:, : self.num_heads].reshape(-1, d)).view(num_tokens, -1, d)]
        if heads.shape[1] > self.num_heads:
            parts.append(self.k_norm(heads[:, self.num_heads :].reshape(-1, d)).view(num_tokens, -1, d))
        return apply_rotary(torch.cat(parts, dim=1) if len(parts) > 1 else parts[0], *cos_sin)


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen3Attention


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3 dense; same constructor and forward as ``LlamaForCausalLM``.

    Raises:
        ValueError: for a ``layer_types`` entry other than full / sliding attention
            (``ModelConfig.sliding_windows``).
    """

    decoder_layer_cls = Qwen3DecoderLayer
    arch_specs = (ArchSpec("qwen3", "Qwen3Config", gguf_arch="qwen3", gguf_attention_bias_from_tensors=True),)
