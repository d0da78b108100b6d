"""Helpers of the LoRA tests: tiny random transformers models with random PEFT adapters
(non-zero B), and kvflow's forward with a LoRA mapping."""

from __future__ import annotations

from pathlib import Path

import peft
import torch
import transformers

from conftest import randomize_hf_model
from kvflow.attention.torch_backend import AttentionGroup, GroupedMetadata
from kvflow.config import CacheConfig
from kvflow.lora.punica import LoRAMapping
from kvflow.attention.cache_engine import CacheEngine

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def tiny_config(arch: str, **overrides) -> transformers.PretrainedConfig:
    """2 layers, 4 query / 2 KV heads: Llama (hidden 64 / heads 4 = head_dim 16) or Qwen3
    (head_dim 32, QK-norm)."""
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False)
    if arch == "qwen3":
        return transformers.Qwen3Config(**{**common, "head_dim": 32, **overrides})
    if arch == "qwen2":
        return transformers.Qwen2Config(**{**common, **overrides})
    return transformers.LlamaConfig(**{**common, **overrides})


def save_base(path: Path, arch: str, seed: int = 0, **overrides):
    cls = {"llama": transformers.LlamaForCausalLM, "qwen3": transformers.Qwen3ForCausalLM,
           "qwen2": transformers.Qwen2ForCausalLM}[arch]
    hf = randomize_hf_model(cls(tiny_config(arch, **overrides)), seed, std=0.1)
    hf.save_pretrained(path)
    return hf


def save_adapter(base_dir: Path, path: Path, seed: int, r: int = 8, alpha: int = 16, targets=None,
                 use_rslora: bool = False, std: float = 0.05):
    """A PEFT LoRA adapter of the model in ``base_dir`` with random A and B (PEFT initializes
    B to 0; here both are N(0, std), seeded), saved to ``path``; returns the merged
    transformers model (``merge_and_unload``), the reference."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=targets or ALL_TARGETS, lora_dropout=0.0,
                             use_rslora=use_rslora, task_type="CAUSAL_LM")
    model = peft.get_peft_model(hf, config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(std * torch.randn(p.shape, generator=g))
    model.save_pretrained(path)
    return model.merge_and_unload().eval()


def lora_logits(model, token_ids: list[int], mapping_runs: list[tuple[int, int]], block_size: int = 4) -> torch.Tensor:
    """Logits of ``token_ids`` as one prefill of several requests laid end to end: runs of
    (slot, tokens), each its own request from position 0, through a paged cache."""
    n = len(token_ids)
    num_blocks = sum(-(-k // block_size) for _, k in mapping_runs)
    cache = CacheEngine(model.kv_cache_spec, CacheConfig(block_size, num_blocks, torch.float32), torch.device("cpu"))
    positions, slots, tables, q_lens = [], [], [], []
    next_block = 0
    for _, k in mapping_runs:
        table = list(range(next_block, next_block + -(-k // block_size)))
        next_block += len(table)
        pos = torch.arange(k)
        positions.append(pos)
        slots.append(torch.tensor(table)[pos // block_size] * block_size + pos % block_size)
        tables.append(table)
        q_lens.append(k)
    group = AttentionGroup.build(0, q_lens, q_lens, tables, block_size, torch.device("cpu"))
    lora = LoRAMapping.from_runs(mapping_runs, torch.device("cpu"))
    with torch.inference_mode():
        hidden = model(torch.tensor(token_ids), torch.cat(positions), cache.kv_caches,
                       GroupedMetadata(torch.cat(slots), [group]), lora=lora)
        return model.compute_logits(hidden)
