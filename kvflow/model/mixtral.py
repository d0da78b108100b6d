"""Mixtral: the Mistral decoder with a sparse mixture of experts in place of each MLP.

Jiang et al. 2024, "Mixtral of Experts" (arXiv 2401.04088), section 2.1: every layer's
feed-forward is 8 SwiGLU experts of which a linear router picks the top 2 per token, their
outputs weighted by a softmax over the two chosen logits (``kvflow.layers.moe``, with
``renormalize``: the softmax over all experts followed by division by the top-2 sum, as the
transformers code computes it). Attention, norms and rotary embeddings are Llama's
(``kvflow.model.llama``).

Checkpoint names (Hugging Face): ``layers.{i}.block_sparse_moe.gate.weight`` (router
[num_local_experts, hidden]) and ``layers.{i}.block_sparse_moe.experts.{e}.w1 / w3 / w2
.weight`` (gate, up, down), loaded into the stacked expert parameters.

``sliding_window`` acts in every layer (``ModelConfig.sliding_windows``, as Mistral). Not
supported (refused at load by ``check_mixtral_config``): activations other than SiLU.
``router_jitter_noise`` only acts in training and is ignored.
"""

from __future__ import annotations

from typing import Any

import gguf
from torch import nn

from kvflow.config import ModelConfig
from kvflow.distributed.parallel_state import TensorParallel
from kvflow.layers.moe import SparseMoeBlock, map_expert_weight
from kvflow.layers.norm import RMSNorm
from kvflow.model.arch import ArchSpec, GGUFMetadata, gguf_moe_fields
from kvflow.model.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM
from kvflow.quantization.base import QuantizationConfig

MIXTRAL_PROJECTIONS = {"w1": "w1", "w3": "w3", "w2": "w2"}
T = gguf.MODEL_TENSOR


def mixtral_gguf_fields(meta: GGUFMetadata, fields: dict[str, Any]) -> dict[str, Any]:
    """``MixtralConfig`` fields of a GGUF arch "llama" file with experts (llama.cpp writes
    Mixtral that way): ``num_local_experts``, ``num_experts_per_tok``, no sliding window.

    Raises:
        NotImplementedError: a layer without experts, a gating other than softmax, shared experts.
    """
    moe, dense = gguf_moe_fields(meta, fields["num_hidden_layers"])
    if dense:
        raise NotImplementedError(f"GGUF Mixtral layers {dense} have no experts (ffn_gate_inp)")
    return {**moe, "num_local_experts": int(meta.arch_get("expert_count")), "sliding_window": None}


def check_mixtral_config(config: ModelConfig) -> None:
    """Refuse what kvflow's Mixtral does not implement.

    Raises:
        ValueError: naming the field: no transformers config, ``hidden_act`` other than "silu".
    """
    hf = config.hf_config
    if hf is None:
        raise ValueError("mixtral needs the transformers config (ModelConfig.from_hf_config) for its expert fields")
    if getattr(hf, "hidden_act", "silu") != "silu":
        raise ValueError(f"mixtral: hidden_act={hf.hidden_act!r} is not supported (only 'silu')")


class MixtralDecoderLayer(LlamaDecoderLayer):
    """Llama attention, then the sparse MoE block ``block_sparse_moe`` (pre-norm residuals)."""

    def __init__(self, config: ModelConfig, layer_idx: int, tp: TensorParallel | None = None,
                 quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        nn.Module.__init__(self)
        hf = config.hf_config
        self.self_attn = LlamaAttention(config, layer_idx, tp, quant_config, f"{prefix}.self_attn")
        self.block_sparse_moe = SparseMoeBlock(
            config.hidden_size, hf.num_local_experts, hf.num_experts_per_tok, config.intermediate_size,
            renormalize=True, quant_config=quant_config, prefix=f"{prefix}.block_sparse_moe", tp=tp,
        )
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, cos_sin, kv_cache, metadata):
        x = x + self.self_attn(self.input_layernorm(x), cos_sin, kv_cache, metadata)
        return x + self.block_sparse_moe(self.post_attention_layernorm(x))


class MixtralForCausalLM(LlamaForCausalLM):
    """Mixtral (model_type "mixtral"); arguments as ``LlamaForCausalLM``.

    Raises:
        ValueError: for an unsupported config field (``check_mixtral_config``).
    """

    supports_lora = False  # its decoder layers do not pass a LoRA mapping on

    decoder_layer_cls = MixtralDecoderLayer
    arch_specs = (ArchSpec(
        "mixtral", "MixtralConfig", gguf_arch="llama", gguf_experts=True, gguf_qk_permuted=True,
        gguf_moe_block=("block_sparse_moe", {T.FFN_GATE_EXP: "w1", T.FFN_UP_EXP: "w3", T.FFN_DOWN_EXP: "w2"}),
        gguf_config_fields=mixtral_gguf_fields,
    ),)

    def __init__(self, config: ModelConfig, tp: TensorParallel | None = None,
                 quant_config: QuantizationConfig | None = None) -> None:
        check_mixtral_config(config)
        super().__init__(config, tp, quant_config)

    def map_weight_name(self, name: str) -> tuple[str, object]:
        return map_expert_weight(name, MIXTRAL_PROJECTIONS) or super().map_weight_name(name)
