"""Llama-family decoder (Llama, Mistral, Qwen2, SmolLM) over a paged KV cache.

Touvron et al. 2023, "LLaMA: Open and Efficient Foundation Language Models", section 2.2:
pre-norm RMSNorm, SwiGLU MLP, rotary embeddings; grouped-query attention (Ainslie et al.
2023, "GQA") when ``num_key_value_heads < num_attention_heads``. Qwen2 adds biases to the
Q/K/V projections. The forward works on a flat batch of tokens from many requests (no batch
or padding axis): linear layers see every token of the step at once, attention reads K/V
through the block tables (``kvflow/layers/attention.py``).

Weights use Hugging Face names; Q/K/V and gate/up projections are fused at load time so one
matrix product serves each pair.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from kvflow.config import ModelConfig
from kvflow.distributed.parallel_state import TensorParallel, shard_hf_weight
from kvflow.layers.attention import AttentionMetadata, KVCache, paged_attention, store_kv
from kvflow.layers.norm import RMSNorm
from kvflow.layers.rotary import RotaryEmbedding, apply_rotary


class LlamaAttention(nn.Module):
    """Self-attention; with cross-layer KV sharing only the first layer of a group projects
    and stores K/V, the others read it (``owns_kv`` False: the projection is Q only)."""

    def __init__(self, config: ModelConfig, layer_idx: int, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.tp = tp
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.owns_kv = layer_idx % config.cla_share_factor == 0
        out_size = self.q_size + (2 * self.kv_size if self.owns_kv else 0)
        self.qkv_proj = nn.Linear(config.hidden_size, out_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)
        self.scale = self.head_dim**-0.5

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

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: KVCache,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        if self.owns_kv:
            # Rotate the query and key heads together: [T, heads + kv_heads, head_dim].
            qk = apply_rotary(qkv[:, : self.q_size + self.kv_size].view(num_tokens, -1, self.head_dim), *cos_sin)
            q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
            v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
            store_kv(k, v, kv_cache, metadata, self._key_offset(kv_cache))
        else:
            q = apply_rotary(qkv.view(num_tokens, self.num_heads, self.head_dim), *cos_sin)
        o = paged_attention(q, kv_cache, metadata, self.scale)
        out = self.o_proj(o.reshape(num_tokens, self.q_size))
        return out if self.tp is None else self.tp.all_reduce(out)


class LlamaMLP(nn.Module):
    """SwiGLU MLP (Shazeer 2020, "GLU Variants Improve Transformer", eq. 6)."""

    def __init__(self, config: ModelConfig, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.tp = tp
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        out = self.down_proj(F.silu(gate) * up)
        return out if self.tp is None else self.tp.all_reduce(out)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx, tp)
        self.mlp = LlamaMLP(config, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, cos_sin, kv_cache, metadata) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos_sin, kv_cache, metadata)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    """The full decoder with its LM head.

    Args:
        config: architecture facts (see ``ModelConfig``) of the full model.
        tp: this rank's tensor-parallel place, or None. With it the model holds only its
            shard (``self.config`` is the per-rank architecture, ``self.full_config`` the
            whole model's) and sums / gathers partial results across ranks.
    """

    def __init__(self, config: ModelConfig, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.full_config = config
        self.tp = tp
        config = config if tp is None else tp.plan.shard_config(config)
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i, tp) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        )
        for layer in self.layers:  # a reference, not a submodule (LlamaAttention._key_offset)
            layer.self_attn.__dict__["rotary"] = self.rotary
        self.lm_head = None
        if not config.tie_word_embeddings:
            self.lm_head = nn.Parameter(torch.empty(config.vocab_size, config.hidden_size))
        # Not a submodule: the packed (or quantized) copy stays out of state_dict and Module.to.
        self.__dict__["packed_lm_head"] = None

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """[vocab_size, hidden_size]; the embedding matrix when embeddings are tied."""
        if self.config.tie_word_embeddings:
            return self.embed_tokens.weight
        return self.lm_head if self.lm_head is not None else self.packed_lm_head.dense_weight()

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Run the decoder over one step's flat token batch.

        Args:
            input_ids: int64 [T] token ids of all scheduled tokens.
            positions: int64 [T] position of each token in its request.
            kv_caches: per KV layer (``config.num_kv_layers`` of them: one per group of
                ``cla_share_factor`` layers), (K, V) tensors
                [num_blocks, block_size, num_kv_heads, head_dim] (plus scales for a
                quantized cache, see ``kvflow.layers.attention.KVCache``).
            metadata: slot mapping and attention groups of the step.

        Returns:
            Final hidden states [T, hidden_size] (after the last RMSNorm), model dtype.
        """
        x = self._embed(input_ids)
        cos_sin = self.rotary.cos_sin(positions, x.dtype)
        share = self.config.cla_share_factor
        for i, layer in enumerate(self.layers):
            x = layer(x, cos_sin, kv_caches[i // share], metadata)
        return self.norm(x)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return self.embed_tokens(input_ids)
        start, end = self.tp.plan.vocab  # vocabulary-parallel: look up own rows, sum over ranks
        local = (input_ids >= start) & (input_ids < end)
        x = self.embed_tokens(torch.where(local, input_ids - start, 0)) * local.unsqueeze(-1).to(self.embed_tokens.weight.dtype)
        return self.tp.all_reduce(x)

    def quantize_lm_head(self, method: str, group_size: int = 32) -> None:
        """Serve the LM head from a weight-only quantized copy of its weight (read as float32).

        The embedding lookup stays float: with tied embeddings the quantized head is a copy
        (the smaller of the two reads per step is the head's); untied, the dense head is
        dropped (``state_dict`` then holds its dequantized weight).

        Args:
            method: "int8" (per-channel), "int4" (round-to-nearest, ``group_size``) or "fp8".
            group_size: INT4 group size along hidden_size; where it does not divide
                hidden_size, the largest halving that does (as for the decoder linears,
                ``group_size_for``).

        Raises:
            ValueError: for another method.
        """
        from kvflow.layers.quantized_linear import FP8Linear, Int4Linear, Int8Linear

        weight = self.lm_head_weight.data.float()
        dense = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
        dense.weight = nn.Parameter(weight, requires_grad=False)
        if method == "int8":
            head = Int8Linear.from_float(dense)
        elif method == "int4":
            from kvflow.quantization.awq import group_size_for

            head = Int4Linear.from_float(dense, group_size_for(weight.shape[1], group_size))
        elif method == "fp8":
            head = FP8Linear.from_float(dense)
        else:
            raise ValueError(f"LM head quantization must be 'int8', 'int4' or 'fp8', got {method!r}")
        self.__dict__["packed_lm_head"] = head
        self.lm_head = None

    def pack_for_cpu(self) -> int:
        """Prepack the bfloat16 / float16 linears and the LM head for oneDNN
        (``kvflow.layers.linear``) where this CPU supports that dtype (``onednn_packs``);
        float32 and quantized layers, and 16-bit ones it cannot pack, stay as they are.

        Returns:
            Extra bytes held: the packed LM head is a copy when the embeddings are tied (the
            lookup table stays dense), else the dense LM head is dropped (0 extra).
        """
        from kvflow.layers.linear import PackedLinear, onednn_packs, pack_linears

        pack_linears(self.layers)
        if self.packed_lm_head is not None:  # already packed or quantized
            return 0
        weight = self.lm_head_weight
        # (a 16-bit type this CPU cannot pack, e.g. float16 without avx512_fp16: F.linear)
        if weight.device.type != "cpu" or not onednn_packs(weight.dtype):
            return 0
        self.__dict__["packed_lm_head"] = PackedLinear(weight.data)
        if self.lm_head is None:
            return weight.numel() * weight.element_size()
        self.lm_head = None  # the packed copy serves it; state_dict gets it back below
        return 0

    def make_batch_invariant(self) -> int:
        """Serve the float32 / bfloat16 CPU linears and the LM head from
        ``kvflow.layers.invariant_linear.InvariantLinear`` (a row's result independent of the
        other rows of the step), in place; quantized layers (and a quantized LM head) stay.
        What a quantized KV cache needs for a token's K/V not to depend on how its step was
        batched or chunked. Idempotent; a no-op without the kernel.

        Returns:
            The number of layers replaced.
        """
        from kvflow.layers.invariant_linear import InvariantLinear, invariant_linear_available

        if not invariant_linear_available():
            return 0

        def convertible(module: nn.Module) -> bool:
            if type(module) is nn.Linear:
                weight = module.weight
            elif type(module).__name__ == "PackedLinear":
                weight = module.dense_weight()
            else:
                return False
            return weight.dtype in (torch.float32, torch.bfloat16) and weight.device.type == "cpu"

        replaced = 0
        for module in list(self.layers.modules()):
            for name, child in list(module.named_children()):
                if convertible(child):
                    setattr(module, name, InvariantLinear.from_module(child))
                    replaced += 1
        head = self.packed_lm_head
        if head is None or convertible(head):
            weight = self.lm_head_weight.data
            if weight.dtype in (torch.float32, torch.bfloat16) and weight.device.type == "cpu":
                self.__dict__["packed_lm_head"] = InvariantLinear(weight)
                self.lm_head = None  # as pack_for_cpu: state_dict gets the dense head back
                replaced += 1
        return replaced

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.packed_lm_head is not None and not self.config.tie_word_embeddings:
            destination[prefix + "lm_head"] = self.packed_lm_head.dense_weight()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM head: [N, hidden_size] -> float32 logits [N, vocab_size] (of the full model;
        under tensor parallelism every rank gets all of them)."""
        if self.packed_lm_head is not None:  # oneDNN-packed or quantized (quantize_lm_head)
            logits = self.packed_lm_head(hidden).float()
        else:
            logits = F.linear(hidden, self.lm_head_weight).float()
        if self.tp is None:
            return logits
        return self.tp.all_gather_last_dim(logits)[:, : self.tp.plan.full_vocab_size]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors into the model, fusing Q/K/V and gate/up.

        Raises:
            ValueError: for an unexpected tensor name or shape, or when a parameter is left
                without a value.
        """
        if self.tp is not None:
            weights = ((n, shard_hf_weight(n, t, self.full_config, self.tp.plan)) for n, t in weights)
        params = dict(self.named_parameters())
        rows_loaded = dict.fromkeys(params, 0)
        cfg = self.config
        q_size = cfg.num_attention_heads * cfg.head_dim
        kv_size = cfg.num_key_value_heads * cfg.head_dim
        fused = {
            "q_proj": ("qkv_proj", 0, q_size),
            "k_proj": ("qkv_proj", q_size, kv_size),
            "v_proj": ("qkv_proj", q_size + kv_size, kv_size),
            "gate_proj": ("gate_up_proj", 0, cfg.intermediate_size),
            "up_proj": ("gate_up_proj", cfg.intermediate_size, cfg.intermediate_size),
        }
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            target, start, size = _map_weight_name(name, fused)
            if target == "lm_head" and cfg.tie_word_embeddings:
                continue
            param = params.get(target)
            if param is None or (size is not None and start + size > param.shape[0]):
                raise ValueError(f"unexpected weight {name!r}")
            dest = param.data if size is None else param.data.narrow(0, start, size)
            if dest.shape != tensor.shape:
                raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}")
            dest.copy_(tensor)
            rows_loaded[target] += dest.shape[0]
        missing = sorted(n for n, p in params.items() if rows_loaded[n] != p.shape[0])
        if missing:
            raise ValueError(f"checkpoint is missing or repeats tensors of {len(missing)} parameters, e.g. {missing[:3]}")


def _map_weight_name(name: str, fused: dict[str, tuple[str, int, int]]) -> tuple[str, int, int | None]:
    """HF tensor name -> (our parameter name, row offset, row count or None for the whole)."""
    if name.startswith("model."):
        name = name[len("model.") :]
    if name == "lm_head.weight":
        return "lm_head", 0, None
    for hf, (ours, start, size) in fused.items():
        marker = f".{hf}."
        if marker in name:
            return name.replace(marker, f".{ours}."), start, size
    return name, 0, None
