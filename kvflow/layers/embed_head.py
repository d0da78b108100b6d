"""Token embedding and LM head, vocabulary-parallel under tensor parallelism.

Each rank holds a slice of the vocabulary rows (the vocabulary padded to a multiple of the
world size, ``vocab_partition``): the embedding looks up the tokens in its slice, zeroes the
others and sums over the ranks (one all-reduce); the LM head computes its slice of the logits
and all-gathers them (Megatron-LM, Shoeybi et al. 2019, section 3).

The LM head also owns how its product runs: a dense matmul; on the CPU in bfloat16 /
float16 a oneDNN-prepacked copy (``kvflow.layers.linear``); or a weight-only quantized copy
(``quantize``, the opt-in ``quantize_lm_head``). With tied embeddings the head reads the
embedding's weight, and a packed or quantized head is a copy of it (the lookup table stays
dense: the smaller of the two reads per step is the head's).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvflow.distributed.parallel_state import TensorParallel, vocab_partition
from kvflow.layers.gguf_kernels import GGUFWeight, gguf_linear
from kvflow.layers.linear import LinearBase, can_pack


def _keep_gguf(module: nn.Module, loaded: GGUFWeight) -> None:
    """Keep this rank's vocabulary rows of a GGUF matrix as stored (``module.gguf``; rows past
    the vocabulary are not stored) and shrink ``module.weight`` to an empty placeholder that
    only carries the model dtype (it follows ``Module.to``)."""
    start, end = module.vocab_range
    if (loaded.n, loaded.k) != (module.vocab_size, module.hidden_size):
        raise ValueError(f"shape ({loaded.n}, {loaded.k}), expected ({module.vocab_size}, {module.hidden_size})")
    stop = min(end, loaded.n)
    module.__dict__["gguf"] = loaded if (start, stop) == (0, loaded.n) else loaded.narrow_rows(start, stop - start)
    module.weight = nn.Parameter(torch.empty(0, dtype=module.weight.dtype), requires_grad=False)


def _vocab_rows(loaded: torch.Tensor, rows: tuple[int, int]) -> torch.Tensor:
    """Rows [start, end) of a [vocab, hidden] tensor, zero-padded past the vocabulary."""
    start, end = rows
    out = loaded[start : min(end, loaded.shape[0])]
    if out.shape[0] < end - start:
        out = torch.cat([out, out.new_zeros(end - start - out.shape[0], *out.shape[1:])])
    return out


class VocabParallelEmbedding(nn.Module):
    """Token embedding [vocab_size, hidden_size], this rank's vocabulary rows.

    Shapes: input_ids int64 [T] -> [T, hidden_size] in the weight's dtype.
    """

    shard_ids = (None,)

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        self.vocab_range = (0, vocab_size) if tp is None else vocab_partition(vocab_size, tp.world_size, tp.rank)
        self.weight = nn.Parameter(torch.empty(self.vocab_range[1] - self.vocab_range[0], hidden_size))
        #: This rank's rows as a GGUF file stores them (``GGUFWeight``), or None (``weight``).
        self.__dict__["gguf"] = None

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
        """This rank's vocabulary rows of the checkpoint tensor (zero rows past the vocabulary);
        a ``GGUFWeight`` is kept as stored (rows dequantized at lookup).

        Raises:
            ValueError: when the shape is not [vocab_size, hidden_size].
        """
        if isinstance(loaded, GGUFWeight):
            _keep_gguf(self, loaded)
            return
        rows = _vocab_rows(loaded, self.vocab_range)
        if rows.shape != param.shape:
            raise ValueError(f"shape {tuple(loaded.shape)}, expected {(self.vocab_size, param.shape[1])}")
        param.data.copy_(rows)

    @property
    def dense(self) -> torch.Tensor:
        """This rank's table [vocab rows, hidden_size] (dequantized when kept as GGUF blocks)."""
        return self.weight if self.gguf is None else self.gguf.dequantize(self.weight.dtype)

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.gguf is None:
            return F.embedding(ids, self.weight)
        return self.gguf.embedding(ids.reshape(-1), self.weight.dtype).reshape(*ids.shape, self.gguf.k)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return self._lookup(input_ids)
        start, end = self.vocab_range  # look up own rows, sum over ranks
        stored = end - start if self.gguf is None else self.gguf.n
        local = (input_ids >= start) & (input_ids < start + stored)
        x = self._lookup(torch.where(local, input_ids - start, 0)) * local.unsqueeze(-1).to(self.weight.dtype)
        return self.tp.all_reduce(x)


class ParallelLMHead(nn.Module):
    """hidden [N, hidden_size] -> float32 logits [N, vocab_size] of the full vocabulary (under
    tensor parallelism every rank gets all of them).

    Args:
        vocab_size, hidden_size: the full model's.
        tp: this rank's tensor-parallel place, or None.
        tied: the embedding whose weight the head reads (tied embeddings), or None for an
            own ``weight``.
    """

    shard_ids = (None,)

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel | None = None,
                 tied: VocabParallelEmbedding | None = None) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        self.vocab_range = (0, vocab_size) if tp is None else vocab_partition(vocab_size, tp.world_size, tp.rank)
        # Not a submodule: the embedding is registered by the model, the packed copy stays
        # out of state_dict and Module.to.
        self.__dict__["tied"] = tied
        self.__dict__["packed"] = None
        self.__dict__["gguf"] = None
        if tied is None:
            self.weight = nn.Parameter(torch.empty(self.vocab_range[1] - self.vocab_range[0], hidden_size))

    weight_loader = VocabParallelEmbedding.weight_loader

    @property
    def stored_gguf(self) -> GGUFWeight | None:
        """The head's rows as a GGUF file stores them (own, or the tied embedding's), or None."""
        return self.tied.gguf if self.tied is not None else self.gguf

    @property
    def dense(self) -> torch.Tensor:
        """The head's weight [vocab rows of this rank, hidden_size] (dequantized / unpacked)."""
        if self.tied is not None:
            return self.tied.dense
        if self.gguf is not None:
            return self.gguf.dequantize(self.weight.dtype)
        return self.weight if "weight" in self._parameters else self.packed.dense_weight()

    def replace_with(self, head: LinearBase) -> None:
        """Serve the head from ``head`` (a processed layer over this head's weight)."""
        self.__dict__["packed"] = head
        if self.tied is None:
            self._parameters.pop("weight", None)  # the copy serves it; state_dict gets it back below

    def quantize(self, method: str, group_size: int = 32) -> None:
        """Serve the head from a weight-only quantized copy of its weight (read as float32).

        Args:
            method: "int8" (per channel), "int4" (round-to-nearest, ``group_size``; where it
                does not divide hidden_size, the largest halving that does) or "fp8".
            group_size: INT4 group size along hidden_size.

        Raises:
            ValueError: for another method.
        """
        from kvflow.quantization.registry import LM_HEAD_METHODS, get_quantization_config

        if self.stored_gguf is not None:
            return  # already computed in its stored GGUF type
        if method not in LM_HEAD_METHODS:
            raise ValueError(f"LM head quantization must be one of {', '.join(LM_HEAD_METHODS)}, got {method!r}")
        self.replace_with(LinearBase.from_weights(self.dense.data.float(), None, get_quantization_config(method, group_size), "lm_head"))

    def pack_for_cpu(self) -> int:
        """Prepack a bfloat16 / float16 CPU head for oneDNN (a no-op when already packed or
        quantized, or for float32).

        Returns:
            Extra bytes held: the packed head is a copy when the embeddings are tied, else the
            dense weight is dropped (0 extra).
        """
        if self.packed is not None or self.stored_gguf is not None:
            return 0
        weight = self.dense
        if not can_pack(weight):
            return 0
        self.replace_with(LinearBase.from_weights(weight.data, prefix="lm_head"))
        return weight.numel() * weight.element_size() if self.tied is not None else 0

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        stored = self.stored_gguf
        if stored is not None:  # the GGUF blocks as stored
            logits = gguf_linear(hidden, stored).float()
            missing = (self.vocab_range[1] - self.vocab_range[0]) - stored.n  # padding rows past the vocabulary
            if missing:
                logits = F.pad(logits, (0, missing))
        elif self.packed is not None:  # oneDNN-packed or quantized
            logits = self.packed(hidden).float()
        else:
            logits = F.linear(hidden, self.dense).float()
        if self.tp is None:
            return logits
        return self.tp.all_gather_last_dim(logits)[:, : self.vocab_size]

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.tied is None and self.packed is not None:
            destination[prefix + "weight"] = self.dense
