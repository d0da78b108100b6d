"""Tensor-parallel process group and how dimensions split over ranks (Megatron-LM; Shoeybi et al. 2019,
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

from dataclasses import dataclass

import torch
import torch.distributed as dist


def _split(n: int, parts: int, index: int) -> tuple[int, int]:
    base, extra = divmod(n, parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


def head_partition(num_heads: int, num_kv_heads: int, world_size: int, rank: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """The query heads and KV heads [start, end) that ``rank`` holds, split by KV groups.

    With at least as many KV heads as ranks the KV heads are divided as evenly as possible
    (ranks may differ by one head) and each rank takes the query heads of its KV heads; with
    fewer, each KV head is replicated on ``world_size / num_kv_heads`` ranks that each take a
    slice of its query heads.

    Raises:
        ValueError: naming ``tensor_parallel_size`` when the heads cannot be split that way.
    """
    group = num_heads // num_kv_heads
    if num_kv_heads >= world_size:
        kv = _split(num_kv_heads, world_size, rank)
        return (kv[0] * group, kv[1] * group), kv
    if world_size % num_kv_heads or group % (world_size // num_kv_heads):
        raise ValueError(
            f"tensor_parallel_size={world_size} cannot split {num_heads} query heads over {num_kv_heads} KV heads evenly"
        )
    replicas = world_size // num_kv_heads
    head = rank // replicas
    per = group // replicas
    start = head * group + (rank % replicas) * per
    return (start, start + per), (head, head + 1)


def even_partition(n: int, world_size: int, rank: int, what: str = "size") -> tuple[int, int]:
    """Rows [start, end) of an ``n``-row dimension split evenly over the ranks.

    Raises:
        ValueError: naming ``what`` and ``tensor_parallel_size`` when n is not divisible.
    """
    if n % world_size:
        raise ValueError(f"{what}={n} is not divisible by tensor_parallel_size={world_size}")
    per = n // world_size
    return rank * per, (rank + 1) * per


def vocab_partition(vocab_size: int, world_size: int, rank: int) -> tuple[int, int]:
    """Vocabulary rows [start, end) of ``rank``: the vocabulary padded to a multiple of the
    world size (rows past the real vocabulary are zero)."""
    per = -(-vocab_size // world_size)
    return rank * per, (rank + 1) * per


@dataclass
class TensorParallel:
    """This process's place in the tensor-parallel group.

    Attributes:
        rank, world_size: as in ``torch.distributed``.
    """

    rank: int
    world_size: int

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place; returns x."""
        dist.all_reduce(x)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's x along the last dimension (equal shapes)."""
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)
