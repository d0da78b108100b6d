"""Gemma 3 (text) decoder: interleaved local (sliding-window) and global attention layers.

Gemma Team 2025, "Gemma 3 Technical Report" (arXiv 2503.19786), section 2: grouped-query
attention with QK-norm in place of Gemma 2's attention soft-capping, pre- and post-norm
around attention and MLP, local layers of a sliding window (``sliding_window`` tokens; the
config's ``layer_types``, five local per global layer in released models) with RoPE base
``rope_local_base_freq`` (10k) and global layers with their own base (1M; and, in the larger
models, linear RoPE scaling). From Gemma 1/2 (transformers' ``Gemma3TextModel``):

- RMSNorm with a ``(1 + weight)`` gain (checkpoints store the offset from 1; ``GemmaRMSNorm``
  adds the 1 at load time, so the fused RMSNorm kernel runs it);
- GeGLU MLP: ``down(gelu_tanh(gate(x)) * up(x))``;
- embeddings multiplied by ``sqrt(hidden_size)`` (rounded to the model dtype, as transformers);
- softmax scale ``query_pre_attn_scalar ** -0.5`` instead of ``head_dim ** -0.5``;
- tied LM head; final logits soft-capped, ``cap * tanh(logits / cap)``, when
  ``final_logit_softcapping`` is set.

Refused at load: ``attn_logit_softcapping`` (Gemma 2's), ``use_bidirectional_attention``
(EmbeddingGemma), an activation other than gelu-tanh, attention types other than full / sliding.

GGUF (llama.cpp ``Gemma3Model``): norm weights stored as ``1 + w`` (the HF checkpoint's ``w``;
transformers' GGUF loader subtracts the 1 back, ``Gemma2TensorProcessor``), ``ffn_norm`` /
``post_attention_norm`` / ``post_ffw_norm`` are the pre-/post-feed-forward and post-attention
norms, ``attention.sliding_window``; what llama.cpp fixes in code and does not store (its
``llama-model.cpp``, LLM_ARCH_GEMMA3): a local layer in every position but each sixth
(``set_swa_pattern(6)``), local RoPE base 10000, ``query_pre_attn_scalar`` = head_dim except
the 62-layer 27B model (hidden / heads).
"""

from __future__ import annotations

from typing import Any

import gguf
import torch
import torch.nn.functional as F
from torch import nn

from kvflow.attention.backend import layer_metadata
from kvflow.attention.kv_cache import KVCache
from kvflow.config import ModelConfig
from kvflow.distributed.parallel_state import TensorParallel
from kvflow.layers.attention import Attention
from kvflow.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from kvflow.layers.norm import RMSNorm
from kvflow.layers.rotary import RotaryEmbedding
from kvflow.model.arch import ArchSpec, GGUFMetadata
from kvflow.model.base import CausalLM
from kvflow.model.llama import LlamaMLP
from kvflow.model.qwen3 import Qwen3Attention
from kvflow.quantization.base import QuantizationConfig

_GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh")


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm, ``x / rms(x) * (1 + w)``: the checkpoint's ``w`` loads as ``1 + w``
    (``weight_loader``; in a bfloat16 model ``1 + w`` is rounded once to bfloat16, where
    transformers keeps it in float32)."""

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if param.shape != loaded.shape:
            raise ValueError(f"shape {tuple(loaded.shape)}, expected {tuple(param.shape)}")
        param.data.copy_(loaded.float() + 1.0)


def _layer_rope(config: ModelConfig, layer_type: str) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling or None) of one layer type from the config's per-type
    ``rope_parameters`` (transformers 5), else ``rope_local_base_freq`` / the common fields.

    Raises:
        ValueError: for a RoPE type other than default / linear on the local layers.
    """
    if layer_type == "full_attention":
        return config.rope_theta, config.rope_scaling
    hf = config.hf_config
    params = dict((getattr(hf, "rope_parameters", None) or {}).get(layer_type) or {})
    theta = float(params.get("rope_theta", getattr(hf, "rope_local_base_freq", 10000.0)))
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        return theta, None
    if rope_type != "linear":
        raise ValueError(f"gemma3: rope_parameters[{layer_type!r}] rope_type={rope_type!r} is not supported "
                         "for local layers (default, linear)")
    return theta, {**params, "rope_type": rope_type}


class Gemma3Attention(Qwen3Attention):
    """QK-normed attention (Gemma norms), scale ``query_pre_attn_scalar ** -0.5``, the
    layer's sliding window (None on global layers)."""

    def __init__(self, config: ModelConfig, layer_idx: int, tp: TensorParallel | None = None,
                 quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        super().__init__(config, layer_idx, tp, quant_config, prefix)
        self.q_norm = GemmaRMSNorm(config.head_dim, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(config.head_dim, config.rms_norm_eps)
        scale = float(config.hf_config.query_pre_attn_scalar) ** -0.5
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, scale,
                              sliding_window=config.sliding_windows[layer_idx])


class Gemma3MLP(LlamaMLP):
    """GeGLU: ``down(gelu_tanh(gate(x)) * up(x))`` (Shazeer 2020, "GLU Variants", eq. 5)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class Gemma3DecoderLayer(nn.Module):
    """x + post_attn_norm(attn(input_norm(x))), then x + post_ffn_norm(mlp(pre_ffn_norm(x)))."""

    def __init__(self, config: ModelConfig, layer_idx: int, tp: TensorParallel | None = None,
                 quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        super().__init__()
        self.is_sliding = config.sliding_windows[layer_idx] is not None
        self.self_attn = Gemma3Attention(config, layer_idx, tp, quant_config, f"{prefix}.self_attn")
        self.mlp = Gemma3MLP(config, tp, quant_config, f"{prefix}.mlp")
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)

    def forward(self, x, cos_sin, kv_cache, metadata) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos_sin, kv_cache, metadata))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


def gemma3_gguf_fields(meta: GGUFMetadata, fields: dict[str, Any]) -> dict[str, Any]:
    """``Gemma3TextConfig`` fields of a gemma3 GGUF: the window, the per-layer-type RoPE (the
    global layers' from the metadata, the local ones' base 10000) and what llama.cpp fixes in
    code (see the module docstring)."""
    layers, heads = fields["num_hidden_layers"], fields["num_attention_heads"]
    window = int(meta.arch_get("attention.sliding_window", 0))
    return {
        "sliding_window": window or None,
        "layer_types": ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)],
        "rope_parameters": {"full_attention": fields["rope_parameters"],
                            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
        "query_pre_attn_scalar": fields["hidden_size"] // heads if layers == 62 else fields["head_dim"],
        "hidden_activation": "gelu_pytorch_tanh",
        "final_logit_softcapping": None,
    }


T = gguf.MODEL_TENSOR


class Gemma3ForCausalLM(CausalLM):
    """Gemma 3 text model (``model_type`` gemma3_text) with its tied LM head.

    Also the language model of a multimodal Gemma 3 checkpoint (``model_type`` gemma3,
    Gemma3ForConditionalGeneration: 4B / 12B / 27B): its ``text_config`` is read
    (its spec's ``text_model_of``), its ``language_model.`` tensors load here
    and the vision tower and projector are not loaded (text only).

    Args: as ``LlamaForCausalLM`` (config, tp, quant_config).

    Raises:
        ValueError: from ``check_config``, naming a config field kvflow does not implement.
    """

    supports_lora = False  # its decoder layers do not pass a LoRA mapping on
    arch_specs = (ArchSpec(
        "gemma3_text", "Gemma3TextConfig", hf_architecture="Gemma3ForCausalLM", gguf_arch="gemma3",
        gguf_tensor_names={T.FFN_PRE_NORM: "pre_feedforward_layernorm", T.ATTN_POST_NORM: "post_attention_layernorm",
                           T.FFN_POST_NORM: "post_feedforward_layernorm"},
        gguf_norm_offset=1.0, gguf_config_fields=gemma3_gguf_fields,
        text_model_of=("gemma3",),  # Gemma3ForConditionalGeneration's language model
    ),)

    skip_weights = (*CausalLM.skip_weights, "vision_tower.", "multi_modal_projector.")
    # Gemma3ForConditionalGeneration as saved (language_model.model.*, language_model.lm_head)
    # and as transformers 5 names it in memory (model.language_model.*).
    renamed_prefixes = (("language_model.model.", "model."), ("model.language_model.", "model."),
                        ("language_model.", ""))  # fmt: skip

    @classmethod
    def check_config(cls, config: ModelConfig) -> None:
        """Raises ValueError naming ``hidden_activation``, ``attn_logit_softcapping``,
        ``use_bidirectional_attention`` or ``layer_types`` where kvflow would compute
        something else than transformers."""
        hf = config.hf_config
        if hf is None:
            raise ValueError("gemma3 needs its transformers config (query_pre_attn_scalar, layer_types)")
        act = getattr(hf, "hidden_activation", None) or getattr(hf, "hidden_act", None)
        if act not in _GELU_TANH:
            raise ValueError(f"gemma3: hidden_activation={act!r} is not supported (GeGLU: 'gelu_pytorch_tanh')")
        if getattr(hf, "attn_logit_softcapping", None) is not None:
            raise ValueError(f"gemma3: attn_logit_softcapping={hf.attn_logit_softcapping} is not supported")
        if getattr(hf, "use_bidirectional_attention", False):
            raise ValueError("gemma3: use_bidirectional_attention=True is not supported (causal decoding only)")
        config.sliding_windows  # noqa: B018 - raises for unknown layer_types

    def __init__(self, config: ModelConfig, tp: TensorParallel | None = None,
                 quant_config: QuantizationConfig | None = None) -> None:
        super().__init__()
        self.check_config(config)
        self.config = config
        self.tp = tp
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(config, i, tp, quant_config, f"layers.{i}") for i in range(config.num_hidden_layers)
        )
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

        def rotary(layer_type: str) -> RotaryEmbedding:
            theta, scaling = _layer_rope(config, layer_type)
            return RotaryEmbedding(config.head_dim, config.max_position_embeddings, theta, scaling,
                                   max_model_len=config.max_model_len)

        self.rotary = rotary("full_attention")
        self.rotary_local = rotary("sliding_attention")
        for layer in self.layers:  # a reference, not a submodule (LlamaAttention._key_offset)
            layer.self_attn.__dict__["rotary"] = self.rotary_local if layer.is_sliding else self.rotary
        self.lm_head = ParallelLMHead(
            config.vocab_size, config.hidden_size, tp, tied=self.embed_tokens if config.tie_word_embeddings else None
        )
        self.final_logit_softcapping = getattr(config.hf_config, "final_logit_softcapping", None)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                metadata) -> torch.Tensor:
        """As ``LlamaForCausalLM.forward``: input_ids, positions int64 [T], one KV cache per
        layer -> final hidden states [T, hidden_size] (after the last norm), model dtype."""
        x = self.embed_tokens(input_ids)
        x = x * torch.tensor(self.config.hidden_size**0.5).to(x.dtype)  # float32, then rounded: transformers
        global_cs = self.rotary.cos_sin(positions, x.dtype)
        local_cs = self.rotary_local.cos_sin(positions, x.dtype)
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):  # (a hybrid cache: its group's)
            x = layer(x, local_cs if layer.is_sliding else global_cs, kv_cache, layer_metadata(metadata, i))
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM head, then ``cap * tanh(logits / cap)`` with ``final_logit_softcapping`` when set:
        [N, hidden_size] -> float32 [N, vocab_size]."""
        logits = super().compute_logits(hidden)
        cap = self.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap
