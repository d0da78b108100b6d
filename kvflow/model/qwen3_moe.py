"""Qwen3-MoE (and Qwen2-MoE): Qwen attention with a sparse mixture of experts per layer.

Qwen team 2025, "Qwen3 Technical Report" (arXiv 2505.09388), section 2: Qwen3-MoE layers
are grouped-query attention with a per-head RMSNorm on queries and keys before RoPE
(``q_norm``, ``k_norm`` over ``head_dim``; no QKV bias) and a feed-forward of
``num_experts`` fine-grained SwiGLU experts (``moe_intermediate_size``) of which a linear
router picks ``num_experts_per_tok`` per token; the top-k softmax weights are renormalized
to sum to 1 when ``norm_topk_prob`` (``kvflow.layers.moe``). Layers listed in
``mlp_only_layers``, or not on the ``decoder_sparse_step`` grid, have a dense SwiGLU MLP of
``intermediate_size`` instead (as transformers' ``Qwen3MoeDecoderLayer`` decides).

Qwen2-MoE (model_type "qwen2_moe", Qwen1.5-MoE / Qwen2-57B-A14B) is the same decoder without
q/k norms, with Q/K/V biases (``qkv_bias``) and a shared expert: a SwiGLU MLP of
``shared_expert_intermediate_size`` that every token takes, scaled by
sigmoid(``shared_expert_gate``(x)) (``SparseMoeBlock``).

The attention is the dense models': Qwen3's q/k-norm attention (``kvflow/model/qwen3.py``)
for Qwen3-MoE, Llama's with Q/K/V biases for Qwen2-MoE. With ``use_sliding_window`` the
window acts where transformers applies it (``ModelConfig.sliding_windows``): every layer for
Qwen3-MoE (its config has no ``layer_types``), the "sliding_attention" layers of
``layer_types`` for Qwen2-MoE.

Not supported (refused at load by ``check_qwen_moe_config``): activations other than SiLU,
cross-layer KV sharing, and a shared expert on qwen3_moe (transformers' Qwen3-MoE has none;
such a config is another architecture).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import gguf
from torch import nn

from kvflow.config import ModelConfig
from kvflow.distributed.parallel_state import TensorParallel
from kvflow.layers.moe import SparseMoeBlock, map_expert_weight
from kvflow.layers.norm import RMSNorm
from kvflow.model.arch import ArchSpec, GGUFMetadata, gguf_moe_fields
from kvflow.model.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from kvflow.model.qwen3 import Qwen3Attention
from kvflow.quantization.base import QuantizationConfig

QWEN_MOE_PROJECTIONS = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
T = gguf.MODEL_TENSOR


def qwen3_moe_gguf_fields(meta: GGUFMetadata, fields: dict[str, Any]) -> dict[str, Any]:
    """``Qwen3MoeConfig`` fields of a qwen3moe GGUF: ``expert_feed_forward_length`` is
    ``moe_intermediate_size``; ``norm_topk_prob`` is ``expert_weights_norm`` when present,
    else True (llama.cpp's qwen3moe graph always renormalizes the top-k weights,
    src/models/qwen3moe.cpp); layers without a router tensor are dense (``mlp_only_layers``).

    Raises:
        NotImplementedError: a gating function other than softmax, or shared experts.
    """
    moe, dense = gguf_moe_fields(meta, fields["num_hidden_layers"])
    return {
        **moe,
        "num_experts": int(meta.arch_get("expert_count")),
        "moe_intermediate_size": int(meta.arch_get("expert_feed_forward_length")),
        "norm_topk_prob": bool(meta.arch_get("expert_weights_norm", True)),
        "mlp_only_layers": dense,
    }


def check_qwen_moe_config(config: ModelConfig) -> None:
    """Refuse what kvflow's Qwen3-MoE / Qwen2-MoE do not implement.

    Raises:
        ValueError: naming the field: no transformers config, a ``layer_types`` entry other
            than full / sliding attention (``ModelConfig.sliding_windows``), ``hidden_act``
            other than "silu", ``cla_share_factor`` > 1, or
            ``shared_expert_intermediate_size`` > 0 on qwen3_moe.
    """
    hf, kind = config.hf_config, config.model_type
    if hf is None:
        raise ValueError(f"{kind} needs the transformers config (ModelConfig.from_hf_config) for its expert fields")
    config.sliding_windows  # noqa: B018 - raises for unknown layer_types
    if getattr(hf, "hidden_act", "silu") != "silu":
        raise ValueError(f"{kind}: hidden_act={hf.hidden_act!r} is not supported (only 'silu')")
    if config.cla_share_factor != 1:
        raise ValueError(f"{kind}: cla_share_factor={config.cla_share_factor} is not supported (only 1)")
    shared = getattr(hf, "shared_expert_intermediate_size", 0) or 0
    if kind == "qwen3_moe" and shared > 0:
        raise ValueError(f"qwen3_moe: shared_expert_intermediate_size={shared} is not supported: Qwen3-MoE has no "
                         "shared expert (a Qwen2-MoE-style checkpoint is model_type 'qwen2_moe')")


def is_sparse_layer(hf_config, layer_idx: int) -> bool:
    """Whether layer ``layer_idx`` has experts (transformers' ``Qwen3MoeDecoderLayer`` rule):
    not in ``mlp_only_layers``, experts configured, and on the ``decoder_sparse_step`` grid."""
    mlp_only = getattr(hf_config, "mlp_only_layers", None) or []
    step = getattr(hf_config, "decoder_sparse_step", 1) or 1
    return layer_idx not in mlp_only and hf_config.num_experts > 0 and (layer_idx + 1) % step == 0


class Qwen3MoeDecoderLayer(LlamaDecoderLayer):
    """Pre-norm attention, then the MoE block (or a dense MLP: ``is_sparse_layer``) as ``mlp``."""

    def __init__(self, config: ModelConfig, layer_idx: int, tp: TensorParallel | None = None,
                 quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        nn.Module.__init__(self)
        hf = config.hf_config
        if config.model_type == "qwen3_moe":
            self.self_attn = Qwen3Attention(config, layer_idx, tp, quant_config, f"{prefix}.self_attn")
        else:  # Qwen2-MoE: Q/K/V biases (its config's qkv_bias), none on the output projection
            qkv_bias = bool(getattr(hf, "qkv_bias", True))
            self.self_attn = LlamaAttention(dataclasses.replace(config, attention_bias=qkv_bias), layer_idx, tp,
                                            quant_config, f"{prefix}.self_attn")  # fmt: skip
        if is_sparse_layer(hf, layer_idx):
            self.mlp = SparseMoeBlock(
                config.hidden_size, hf.num_experts, hf.num_experts_per_tok, hf.moe_intermediate_size,
                renormalize=bool(hf.norm_topk_prob),
                shared_expert_intermediate_size=getattr(hf, "shared_expert_intermediate_size", 0) or 0,
                quant_config=quant_config, prefix=f"{prefix}.mlp", tp=tp,
            )
        else:
            self.mlp = LlamaMLP(config, tp, quant_config, f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    """Qwen3-MoE (model_type "qwen3_moe") and Qwen2-MoE ("qwen2_moe"); arguments as
    ``LlamaForCausalLM``.

    Raises:
        ValueError: for an unsupported config field (``check_qwen_moe_config``).
    """

    supports_lora = False  # its decoder layers do not pass a LoRA mapping on

    decoder_layer_cls = Qwen3MoeDecoderLayer
    arch_specs = (
        ArchSpec("qwen3_moe", "Qwen3MoeConfig", gguf_arch="qwen3moe", gguf_experts=True,
                 gguf_attention_bias_from_tensors=True, gguf_config_fields=qwen3_moe_gguf_fields,
                 gguf_moe_block=("mlp", {T.FFN_GATE_EXP: "gate_proj", T.FFN_UP_EXP: "up_proj",
                                         T.FFN_DOWN_EXP: "down_proj"})),
        ArchSpec("qwen2_moe"),
    )

    def __init__(self, config: ModelConfig, tp: TensorParallel | None = None,
                 quant_config: QuantizationConfig | None = None) -> None:
        check_qwen_moe_config(config)
        super().__init__(config, tp, quant_config)

    def map_weight_name(self, name: str) -> tuple[str, object]:
        return map_expert_weight(name, QWEN_MOE_PROJECTIONS) or super().map_weight_name(name)
