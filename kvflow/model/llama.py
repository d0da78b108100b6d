"""Llama-family decoder (Llama, Mistral, Qwen2, SmolLM) over a paged KV cache.

Touvron et al. 2023, "LLaMA: Open and Efficient Foundation Language Models", section 2.2:
pre-norm RMSNorm, SwiGLU MLP, rotary embeddings; grouped-query attention (Ainslie et al.
2023, "GQA") when ``num_key_value_heads < num_attention_heads``. Qwen2 adds biases to the
Q/K/V projections. Mistral (Jiang et al. 2023, "Mistral 7B", section 2) and Qwen2 with
``use_sliding_window`` attend within a sliding window (``ModelConfig.sliding_windows``: every
layer, or the config's ``layer_types``). The forward works on a flat batch of tokens from many requests (no batch
or padding axis): linear layers see every token of the step at once, attention reads K/V
through the block tables (``kvflow/layers/attention.py``, run by a ``kvflow.attention`` backend).

Weights use Hugging Face names; Q/K/V and gate/up projections are fused at load time
(``CausalLM.stacked_params_mapping``) so one matrix product serves each group.
"""

from __future__ import annotations

import math
from typing import Any

import gguf
import torch
from torch import nn

from kvflow.config import ModelConfig
from kvflow.distributed.parallel_state import TensorParallel
from kvflow.attention.backend import AttentionMetadata, layer_metadata
from kvflow.attention.kv_cache import KVCache
from kvflow.layers import fused_decode
from kvflow.layers.activation import silu_and_mul
from kvflow.layers.attention import Attention
from kvflow.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from kvflow.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from kvflow.layers.norm import RMSNorm
from kvflow.layers.rotary import RotaryEmbedding, _default_inv_freq, apply_rotary
from kvflow.lora.punica import LoRAMapping
from kvflow.model.arch import ArchSpec, GGUFMetadata, float32_value
from kvflow.model.base import CausalLM
from kvflow.quantization.base import QuantizationConfig


class LlamaAttention(nn.Module):
    """Self-attention; with cross-layer KV sharing only the first layer of a group projects
    and stores K/V, the others read it (``owns_kv`` False: the projection is Q only).

    Subclasses change what happens between the projection and the cache by overriding
    ``rotate_heads`` (Qwen3 normalizes each head there); ``o_proj_bias`` gives the output
    projection a bias (None: Llama's rule, transformers' ``LlamaAttention``: ``attention_bias``
    puts a bias on Q/K/V and the output projection alike; Mistral and Qwen2 have none there)."""

    def __init__(self, config: ModelConfig, layer_idx: int, tp: TensorParallel | None = None,
                 quant_config: QuantizationConfig | None = None, prefix: str = "",
                 o_proj_bias: bool | None = None) -> None:
        super().__init__()
        if o_proj_bias is None:
            o_proj_bias = config.model_type == "llama" and config.attention_bias
        self.head_dim = config.head_dim
        self.owns_kv = layer_idx % config.cla_share_factor == 0
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, config.head_dim, config.num_attention_heads, config.num_key_value_heads,
            bias=config.attention_bias, quant_config=quant_config, prefix=f"{prefix}.qkv_proj", tp=tp,
            with_kv=self.owns_kv,
        )
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.num_kv_heads * config.head_dim
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * config.head_dim, config.hidden_size, bias=o_proj_bias, quant_config=quant_config,
            prefix=f"{prefix}.o_proj", tp=tp, input_range=self.qkv_proj.q_range,
        )
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5,
                              sliding_window=config.sliding_windows[layer_idx])

    def _key_offset(self, kv_cache: KVCache) -> torch.Tensor | None:
        """For a quantized cache, the part of every key that its k_proj bias makes, where RoPE
        turns slowly: the bias on the rotary pairs that rotate by at most 60 degrees over all
        positions (``RotaryEmbedding.slow_mask``), 0 elsewhere, [num_kv_heads, head_dim].
        Keys are stored minus it (``store_kv``'s key_offset), which leaves attention
        unchanged. Trained models put their large constant key components in these
        low-frequency pairs; there the bias's contribution to a stored key, R_t b - b, is
        never longer than the bias itself and near 0 at early positions, and elsewhere
        nothing changes.
        None without a bias or for a float cache."""
        bias = self.qkv_proj.bias
        rotary = self.__dict__.get("rotary")
        if bias is None or rotary is None or len(kv_cache) != 4:
            return None
        b = bias[self.q_size : self.q_size + self.kv_size].view(self.num_kv_heads, self.head_dim)
        return b * rotary.slow_mask.to(b.dtype)

    def rotate_heads(self, heads: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Apply RoPE to projected heads [T, num_heads (+ num_kv_heads), head_dim]: the query
        heads, followed by the key heads when this layer owns K/V. Returns the same shape."""
        return apply_rotary(heads, *cos_sin)

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: KVCache,
        metadata: AttentionMetadata,
        lora: LoRAMapping | None = None,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x, lora)
        if self.owns_kv:
            # Rotate the query and key heads together: [T, heads + kv_heads, head_dim].
            qk = self.rotate_heads(qkv[:, : self.q_size + self.kv_size].view(num_tokens, -1, self.head_dim), cos_sin)
            q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
            v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
            o = self.attn(q, k, v, kv_cache, metadata, self._key_offset(kv_cache))
        else:
            q = self.rotate_heads(qkv.view(num_tokens, self.num_heads, self.head_dim), cos_sin)
            o = self.attn(q, None, None, kv_cache, metadata)
        return self.o_proj(o.reshape(num_tokens, self.q_size), lora)


class LlamaMLP(nn.Module):
    """SwiGLU MLP (Shazeer 2020, "GLU Variants Improve Transformer", eq. 6)."""

    def __init__(self, config: ModelConfig, tp: TensorParallel | None = None,
                 quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [config.intermediate_size] * 2, bias=config.mlp_bias, quant_config=quant_config,
            prefix=f"{prefix}.gate_up_proj", tp=tp,
        )
        self.intermediate_size = self.gate_up_proj.part_sizes[0]
        self.down_proj = RowParallelLinear(
            config.intermediate_size, config.hidden_size, bias=config.mlp_bias, quant_config=quant_config,
            prefix=f"{prefix}.down_proj", tp=tp,
        )

    def forward(self, x: torch.Tensor, lora: LoRAMapping | None = None) -> torch.Tensor:
        # silu(gate) * up of the merged [T, 2I] product in one pass (C++ kernel on the CPU,
        # else PyTorch's F.silu(gate) * up: kvflow/layers/activation.py)
        return self.down_proj(silu_and_mul(self.gate_up_proj(x, lora)), lora)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention and MLP blocks with residuals; ``attention_cls`` builds the
    attention (a subclass of ``LlamaAttention`` for Llama-shaped variants)."""

    attention_cls: type[LlamaAttention] = LlamaAttention

    def __init__(self, config: ModelConfig, layer_idx: int, tp: TensorParallel | None = None,
                 quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        super().__init__()
        self.self_attn = self.attention_cls(config, layer_idx, tp, quant_config, f"{prefix}.self_attn")
        self.mlp = LlamaMLP(config, tp, quant_config, f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, cos_sin, kv_cache, metadata, lora: LoRAMapping | None = None) -> torch.Tensor:
        # x + attention and the second norm in one pass (RMSNorm.forward_with_residual)
        x, h = self.post_attention_layernorm.forward_with_residual(
            self.self_attn(self.input_layernorm(x), cos_sin, kv_cache, metadata, lora), x)
        # A mixture-of-experts block (Qwen3-MoE's SparseMoeBlock) takes no adapters.
        return x + (self.mlp(h, lora) if lora is not None else self.mlp(h))

# The Llama 3.1 / 3.2 / 3.3 "llama3" RoPE parameters besides ``factor`` (Meta's
# ``apply_scaling``; every released Llama 3.x checkpoint uses these): low_freq_factor,
# high_freq_factor, original_max_position_embeddings.
_LLAMA3_ROPE_DEFAULTS = (1.0, 4.0, 8192)


def llama3_rope_freqs(inv_freq: torch.Tensor, factor: float, low_freq_factor: float, high_freq_factor: float,
                      original_max_position_embeddings: int) -> torch.Tensor:
    """Per-frequency divisors of the "llama3" RoPE scaling, as llama.cpp's converter stores
    them in a GGUF's ``rope_freqs.weight`` (``convert_hf_to_gguf.py``, ``LlamaModel``: 1 for
    wavelengths below ``original / high_freq_factor``, ``factor`` above ``original /
    low_freq_factor``, ``1 / ((1 - s) / factor + s)`` between).

    Args:
        inv_freq: float32 [rotary_dim // 2], the unscaled inverse frequencies.

    Returns:
        float32 [rotary_dim // 2]: the scaled inverse frequencies are ``inv_freq / result``.
    """
    wavelen = 2 * math.pi / inv_freq.double()
    smooth = (original_max_position_embeddings / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    medium = 1 / ((1 - smooth) / factor + smooth)
    freqs = torch.where(wavelen < original_max_position_embeddings / high_freq_factor, 1.0,
                        torch.where(wavelen > original_max_position_embeddings / low_freq_factor, factor, medium))
    return freqs.float()


def llama_gguf_fields(meta: GGUFMetadata, fields: dict[str, Any]) -> dict[str, Any]:
    """``LlamaConfig`` fields from a llama GGUF's ``rope_freqs.weight`` (Llama 3.1 and later).

    llama.cpp writes the "llama3" RoPE scaling of a checkpoint as that tensor of per-frequency
    divisors (``llama3_rope_freqs``), with no ``rope.scaling.*`` metadata. When the tensor
    equals the divisors of Llama 3's parameters (``factor`` = its largest entry), the config
    gets that "llama3" ``rope_parameters``, as in the original checkpoint; any other set of
    divisors is kept as stored, as a LongRoPE schedule with equal short and long factors and
    attention factor 1 (inverse frequency i = ``1 / (rope_freqs[i] * theta ** (2i / d))``,
    what llama.cpp computes).

    Raises:
        ValueError: ``rope_freqs.weight`` of another length than rotary_dim / 2, or with an
            entry that is not a finite positive number (naming the file and tensor).
        NotImplementedError: ``rope_freqs.weight`` together with ``rope.scaling.type`` metadata.
    """
    tensor = meta.tensors.get("rope_freqs.weight")
    if tensor is None:
        return {}
    rope = dict(fields["rope_parameters"])
    if rope["rope_type"] != "default":
        raise NotImplementedError(f"{meta.source}: rope_freqs.weight together with {rope['rope_type']!r} rope "
                                  "scaling metadata is not supported")
    freqs = torch.from_numpy(gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(-1).astype("float32"))
    rotary_dim = int(meta.arch_get("rope.dimension_count", fields["head_dim"]))
    if freqs.numel() != rotary_dim // 2 or not bool(torch.isfinite(freqs).all() and (freqs > 0).all()):
        raise ValueError(f"{meta.source}: rope_freqs.weight must hold {rotary_dim // 2} finite positive "
                         f"numbers (rotary_dim / 2), got {freqs.numel()} ({freqs[:4].tolist()} ...)")
    theta = rope["rope_theta"]
    inv_freq = _default_inv_freq(rotary_dim, theta)
    factor = float32_value(float(freqs.max()))
    low, high, original = _LLAMA3_ROPE_DEFAULTS
    if factor > 1 and torch.allclose(llama3_rope_freqs(inv_freq, factor, low, high, original), freqs,
                                     rtol=1e-5, atol=0.0):
        rope.update(rope_type="llama3", factor=factor, low_freq_factor=low, high_freq_factor=high,
                    original_max_position_embeddings=original)
    else:
        values = [float32_value(float(v)) for v in freqs]
        rope.update(rope_type="longrope", short_factor=values, long_factor=values, factor=1.0, attention_factor=1.0,
                    original_max_position_embeddings=fields["max_position_embeddings"])
    return {"rope_parameters": rope}


class LlamaForCausalLM(CausalLM):
    """The full decoder with its LM head.

    Llama-shaped variants subclass it with their own ``decoder_layer_cls`` and extend
    ``check_config`` (``qwen3.py``, ``phi3.py``).

    Args:
        config: architecture facts (see ``ModelConfig``) of the full model.
        tp: this rank's tensor-parallel place, or None. With it the layers hold only this
            rank's shard and sum / gather partial results across ranks.
        quant_config: weight quantization of the decoder linears, or None.

    Attributes:
        decoder_layer_cls: the class of each decoder layer, called as ``(config, layer_idx,
            tp, quant_config, prefix)``; an architecture that differs only inside its
            layers (Mixtral's experts, Qwen3-MoE, Qwen3's q/k norms) subclasses this model and
            sets it.

    Raises:
        ValueError: from ``check_config``, naming a config field kvflow does not implement.
    """

    decoder_layer_cls: type[LlamaDecoderLayer] = LlamaDecoderLayer
    #: The forward takes ``lora`` (a ``kvflow.lora.punica.LoRAMapping``) down to the linears;
    #: a subclass whose layers do not pass it on sets False (``kvflow.lora.manager``).
    supports_lora: bool = True
    arch_specs = (
        # llama.cpp permutes Q/K rows of arch "llama" (convert_hf_to_gguf.py LlamaModel.permute)
        # and also writes Mistral checkpoints as "llama".
        # Llama 3.1+ files store their "llama3" RoPE scaling as the tensor rope_freqs.
        ArchSpec("llama", "LlamaConfig", gguf_arch="llama", gguf_qk_permuted=True,
                 gguf_attention_bias_from_tensors=True, gguf_config_tensors=(gguf.MODEL_TENSOR.ROPE_FREQS,),
                 gguf_config_fields=llama_gguf_fields),
        ArchSpec("mistral"),
        ArchSpec("qwen2", "Qwen2Config", gguf_arch="qwen2", attention_bias=True),  # Q/K/V biases always
    )

    @classmethod
    def check_config(cls, config: ModelConfig) -> None:
        """Refuse config fields this architecture's code would silently get wrong.

        Raises:
            ValueError: naming the field (here: ``hidden_act`` other than "silu").
        """
        hf = config.hf_config
        act = getattr(hf, "hidden_act", None) if hf is not None else None
        if act not in (None, "silu"):
            raise ValueError(f"hidden_act={act!r} is not supported by kvflow's {config.model_type} model (SwiGLU: 'silu')")

    def __init__(self, config: ModelConfig, tp: TensorParallel | None = None,
                 quant_config: QuantizationConfig | None = None) -> None:
        super().__init__()
        self.check_config(config)
        self.config = config
        self.tp = tp
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(
            self.decoder_layer_cls(config, i, tp, quant_config, f"layers.{i}") for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling,
            rotary_dim=config.rotary_dim, max_model_len=config.max_model_len,
        )
        for layer in self.layers:  # a reference, not a submodule (LlamaAttention._key_offset)
            layer.self_attn.__dict__["rotary"] = self.rotary
        self.lm_head = ParallelLMHead(
            config.vocab_size, config.hidden_size, tp, tied=self.embed_tokens if config.tie_word_embeddings else None
        )

    def fused_decode_layout(self) -> str | None:
        """Why this model's layers are not the plain Llama ones that the fused decode step
        (``kvflow.layers.fused_decode``) computes — a sentence — or None when they are:
        every layer a ``LlamaDecoderLayer`` with ``LlamaAttention``'s forward and rotary and
        a ``LlamaMLP`` (Qwen3's q/k norms, MoE blocks and other subclasses are not)."""
        for i, layer in enumerate(self.layers):
            attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
            if (type(layer).forward is not LlamaDecoderLayer.forward or type(attn).forward is not LlamaAttention.forward
                    or type(attn).rotate_heads is not LlamaAttention.rotate_heads or type(mlp) is not LlamaMLP):
                return f"layer {i} is a {type(layer).__name__} with its own attention or MLP"
        return None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        metadata: AttentionMetadata,
        lora: LoRAMapping | None = None,
    ) -> torch.Tensor:
        """Run the decoder over one step's flat token batch.

        Args:
            input_ids: int64 [T] token ids of all scheduled tokens.
            positions: int64 [T] position of each token in its request.
            kv_caches: per KV layer (``config.num_kv_layers`` of them: one per group of
                ``cla_share_factor`` layers), (K, V) tensors
                [num_blocks, block_size, num_kv_heads, head_dim] (plus scales for a
                quantized cache, see ``kvflow.attention.kv_cache.KVCache``).
            metadata: slot mapping and attention groups of the step.
            lora: the step's LoRA adapter of each token (``kvflow.lora.punica.LoRAMapping``),
                or None for the base model only.

        Returns:
            Final hidden states [T, hidden_size] (after the last RMSNorm), model dtype.

        A GGUF model's generated tokens (decodes, verifications) run in one C++ call instead,
        its prompt tokens beside them on this PyTorch path (``kvflow.layers.fused_decode``:
        bound at the first step, ``fused_decode`` in the instance's dict; None there keeps
        the PyTorch path, the reference, for every token).
        """
        if lora is None:  # a GGUF model's generated tokens: the whole decoder in one C++ call
            fused = self.__dict__.get("fused_decode", fused_decode.PENDING)
            if fused is fused_decode.PENDING:
                fused = self.__dict__["fused_decode"] = fused_decode.bind(self)
            if fused is not None and fused is not fused_decode.PENDING:
                hidden = fused(input_ids, positions, kv_caches, metadata, rest=self._pytorch_forward)
                if hidden is not None:
                    return hidden
        return self._pytorch_forward(input_ids, positions, kv_caches, metadata, lora)

    def _pytorch_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                         metadata: AttentionMetadata, lora: LoRAMapping | None = None) -> torch.Tensor:
        """``forward`` on the PyTorch path, every token (also the prompt tokens of a step the
        fused decode step splits: ``FusedDecodeStep.__call__``'s ``rest``)."""
        x = self.embed_tokens(input_ids)
        cos_sin = self.rotary.cos_sin(positions, x.dtype)
        share = self.config.cla_share_factor
        for i, layer in enumerate(self.layers):
            meta = layer_metadata(metadata, i)  # a hybrid KV cache: its group's (kvflow/core/kv_cache_groups.py)
            x = layer(x, cos_sin, kv_caches[i // share], meta, lora) if lora is not None \
                else layer(x, cos_sin, kv_caches[i // share], meta)
        return self.norm(x)
