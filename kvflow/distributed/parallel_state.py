"""Tensor-parallel process group and sharding plan (Megatron-LM; Shoeybi et al. 2019,
"Megatron-LM: Training Multi-Billion Parameter Language Models Using Model Parallelism",
section 3).

Column-parallel layers (Q/K/V, gate/up) split their output features across ranks;
row-parallel layers (attention output, down projection) split their input features and
sum the partial outputs with an all-reduce; the embedding and the LM head split the
vocabulary (an all-reduce after the masked lookup, an all-gather of the logits). Attention
heads are split by KV-head groups, so every rank holds whole GQA groups: with more KV heads
than ranks the KV heads are divided as evenly as possible (ranks may differ by one head);
with fewer, each KV head is replicated on ``world_size / num_kv_heads`` ranks that each take
a slice of its query heads.

Per layer and token the two all-reduces move 2 x hidden_size elements per rank (ring
all-reduce: about 2 x (world_size - 1) / world_size of that over the wire each).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from kvflow.config import ModelConfig


@dataclass(frozen=True)
class ShardPlan:
    """What one rank holds, as [start, end) ranges of the full model's dimensions.

    Attributes:
        q_heads, kv_heads: attention heads (indices into the full model's heads).
        intermediate: MLP intermediate features.
        vocab: vocabulary rows of the embedding / LM head (padded to a multiple of the
            world size; rows past the real vocabulary are zero).
        full_vocab_size: the real vocabulary size.
    """

    q_heads: tuple[int, int]
    kv_heads: tuple[int, int]
    intermediate: tuple[int, int]
    vocab: tuple[int, int]
    full_vocab_size: int

    def shard_config(self, config: ModelConfig) -> ModelConfig:
        """The per-rank architecture the rank's modules are built with."""
        return replace(
            config,
            num_attention_heads=self.q_heads[1] - self.q_heads[0],
            num_key_value_heads=self.kv_heads[1] - self.kv_heads[0],
            intermediate_size=self.intermediate[1] - self.intermediate[0],
            vocab_size=self.vocab[1] - self.vocab[0],
        )


def _split(n: int, parts: int, index: int) -> tuple[int, int]:
    base, extra = divmod(n, parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


def make_shard_plan(config: ModelConfig, world_size: int, rank: int) -> ShardPlan:
    """Split heads by KV groups, the MLP and the vocabulary across ``world_size`` ranks.

    Raises:
        ValueError: when the model cannot be split that way (fewer KV heads than ranks and
            the ranks not a multiple of them, or query heads per KV head not divisible by
            the replication factor, or intermediate_size not divisible by world_size).
    """
    kvh, h = config.num_key_value_heads, config.num_attention_heads
    group = h // kvh
    if kvh >= world_size:
        kv = _split(kvh, world_size, rank)
        q = (kv[0] * group, kv[1] * group)
    else:
        if world_size % kvh or group % (world_size // kvh):
            raise ValueError(
                f"tensor_parallel_size={world_size} cannot split {h} query heads over {kvh} KV heads evenly"
            )
        replicas = world_size // kvh
        head = rank // replicas
        kv = (head, head + 1)
        per = group // replicas
        start = head * group + (rank % replicas) * per
        q = (start, start + per)
    if config.intermediate_size % world_size:
        raise ValueError(
            f"intermediate_size={config.intermediate_size} is not divisible by tensor_parallel_size={world_size}"
        )
    per_rank_vocab = -(-config.vocab_size // world_size)
    inter = config.intermediate_size // world_size
    return ShardPlan(
        q_heads=q,
        kv_heads=kv,
        intermediate=(rank * inter, (rank + 1) * inter),
        vocab=(rank * per_rank_vocab, (rank + 1) * per_rank_vocab),
        full_vocab_size=config.vocab_size,
    )


@dataclass
class TensorParallel:
    """This process's place in the tensor-parallel group.

    Attributes:
        rank, world_size: as in ``torch.distributed``.
        plan: what this rank holds.
    """

    rank: int
    world_size: int
    plan: ShardPlan | None  # None until the model's config is known

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place; returns x."""
        dist.all_reduce(x)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's x along the last dimension (equal shapes)."""
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)


def shard_hf_weight(name: str, tensor: torch.Tensor, config: ModelConfig, plan: ShardPlan) -> torch.Tensor:
    """The slice of a Hugging Face-named full tensor that a rank holds.

    Row slices for column-parallel weights and their biases (q/k/v, gate/up, embedding,
    LM head), column slices for row-parallel ones (o_proj, down_proj); norms whole.
    """
    hd = config.head_dim
    if name.endswith(("embed_tokens.weight", "lm_head.weight")):
        start, end = plan.vocab
        out = tensor[start : min(end, tensor.shape[0])]
        if out.shape[0] < end - start:
            out = torch.cat([out, out.new_zeros(end - start - out.shape[0], *out.shape[1:])])
        return out
    rows = None
    if ".q_proj." in name:
        rows = (plan.q_heads[0] * hd, plan.q_heads[1] * hd)
    elif ".k_proj." in name or ".v_proj." in name:
        rows = (plan.kv_heads[0] * hd, plan.kv_heads[1] * hd)
    elif ".gate_proj." in name or ".up_proj." in name:
        rows = plan.intermediate
    if rows is not None:
        return tensor[rows[0] : rows[1]]
    if name.endswith((".o_proj.bias", ".down_proj.bias")):  # added once, by rank 0's partial sum
        return tensor if plan.q_heads[0] == 0 and plan.intermediate[0] == 0 else torch.zeros_like(tensor)
    if ".o_proj.weight" in name:
        return tensor[:, plan.q_heads[0] * hd : plan.q_heads[1] * hd]
    if ".down_proj.weight" in name:
        return tensor[:, plan.intermediate[0] : plan.intermediate[1]]
    return tensor
