"""The attention-backend interface, and the step layout every backend builds its metadata from.

A backend is a stateless object that knows one way to run paged attention:

- ``decode_groups``: how the runner should order the step's decodes (a padding-bound
  backend groups them by context length; kernels that read the block tables take them all);
- ``build_metadata(layout)``: the per-step metadata (built once, shared by every layer);
- ``forward(q, k, v, kv_cache, metadata, scale, key_offset)``: write the step's K/V into one
  layer's cache, then attend every query over its request's cached K/V (causal).

The metadata carries its backend (``metadata.backend``), so a model's ``Attention`` layer
runs whatever backend the runner chose, passed explicitly with the step (no global context).
Which backend runs is decided once, by ``kvflow.attention.selector``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvflow.attention.kv_cache import KVCache, subtract_key_offset


#: A backend's per-step metadata (``torch_backend.GroupedMetadata``, ``FlatMetadata``): it
#: carries ``backend`` and ``slot_mapping``; only its backend reads the rest.
AttentionMetadata = Any


@dataclass
class BatchLayout:
    """One step's requests as the model runner flattened them.

    Attributes:
        slot_mapping: int64 [T] on the device: the flat cache slot of each new token.
        query_lens: new tokens per request, in flat token order (request r's tokens follow
            request r - 1's): int64 [R] (a list of ints is converted).
        context_lens: tokens in each request's cache after this step's writes: int64 [R]
            (a list is converted).
        block_tables: physical block ids per request, covering ``context_lens``: int64
            [R, W] padded with block 0 (the runner's ``InputBatch`` builds it with vectorized
            indexing), or a list of lists (padded here, ``padded_block_tables``).
        group_sizes: requests per attention group, in order (sums to the request count):
            the decode groups the backend asked for (``decode_groups``), then the prefills.
        block_size: tokens per block.
        device: where the metadata tensors go.
        block_table_lens: int64 [R], the length of each request's own table (columns past
            it are padding); None: every row's (set from a list of lists, else W).
        prompt_lens: int64 [R]: how many of each request's new tokens are prompt tokens
            (they come first in its query: a prefill chunk; the rest are tokens it generated:
            a decode, a draft verification, the recompute of a preempted request's output).
            A list is converted; None (not given): every new token is taken for a prompt
            token (the step then runs as a prefill does).
    """

    slot_mapping: torch.Tensor
    query_lens: torch.Tensor | list[int]
    context_lens: torch.Tensor | list[int]
    block_tables: torch.Tensor | list[list[int]]
    group_sizes: list[int]
    block_size: int
    device: torch.device
    block_table_lens: torch.Tensor | None = None
    prompt_lens: torch.Tensor | list[int] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.query_lens, torch.Tensor):
            self.query_lens = torch.tensor(self.query_lens, dtype=torch.int64)
        if not isinstance(self.context_lens, torch.Tensor):
            self.context_lens = torch.tensor(self.context_lens, dtype=torch.int64)
        if not isinstance(self.block_tables, torch.Tensor):
            self.block_table_lens = torch.tensor([len(t) for t in self.block_tables], dtype=torch.int64)
            self.block_tables = padded_block_tables(self.block_tables, torch.int64)
        elif self.block_table_lens is None:
            self.block_table_lens = torch.full((self.block_tables.shape[0],), self.block_tables.shape[1],
                                               dtype=torch.int64)
        if self.prompt_lens is None:
            self.prompt_lens = self.query_lens.to(torch.int64)
        elif not isinstance(self.prompt_lens, torch.Tensor):
            self.prompt_lens = torch.tensor(self.prompt_lens, dtype=torch.int64)

    @property
    def num_prompt_tokens(self) -> int:
        """How many of the step's new tokens are prompt tokens (0: decodes and verifications only)."""
        return int(self.prompt_lens.sum())

    def tables(self, first: int, last: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        """The block tables of requests ``first .. last - 1``: ``dtype`` [last - first, W']
        where W' is the longest of their own tables (at least 1)."""
        lens = self.block_table_lens[first:last]
        width = max(int(lens.max()) if len(lens) else 1, 1)
        table = self.block_tables[first:last, :width]
        if table.shape[1] < width:  # (a list of empty tables)
            table = torch.nn.functional.pad(table, (0, width - table.shape[1]))
        return table.to(dtype)


def padded_block_tables(block_tables: list[list[int]], dtype: torch.dtype) -> torch.Tensor:
    """Block tables as one [R, max(len, 1)] tensor of ``dtype``, short rows padded with block 0
    (never read past a request's context)."""
    width = max((len(t) for t in block_tables), default=1) or 1
    table = torch.zeros(len(block_tables), width, dtype=dtype)
    for i, t in enumerate(block_tables):
        table[i, : len(t)] = torch.tensor(t, dtype=dtype)
    return table


class AttentionBackend:
    """Base class of the paged-attention backends (see the module docstring).

    Attributes:
        name: the backend's name in ``EngineArgs.attention_backend`` and the logs.
        needs_batch_invariant_linears: the model's dense CPU linears must be batch-invariant
            for this backend's guarantee that a token's stored K/V never depend on how its
            step was batched (a quantized cache, ``kvflow.layers.invariant_linear``).
        supports_cuda_graphs: decode steps may replay CUDA graphs over ``graph_metadata``.
        supports_sliding_window: ``attend`` takes a layer's ``sliding_window`` (the selector
            never gives a model with windowed layers a backend without it).
    """

    name = "base"
    needs_batch_invariant_linears = False
    supports_cuda_graphs = False
    supports_sliding_window = False

    def decode_groups(self, context_blocks: list[int], block_size: int) -> list[list[int]]:
        """The step's decodes (their context lengths in blocks, in batch order) split into
        attention groups: lists of indices, in the order the runner lays them out. Default:
        all in one group, in order."""
        return [list(range(len(context_blocks)))] if context_blocks else []

    def build_metadata(self, layout: BatchLayout):
        raise NotImplementedError

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache, metadata) -> None:
        """Store this step's K/V [T, num_kv_heads, head_dim] at ``metadata.slot_mapping``."""
        raise NotImplementedError

    def attend(self, q: torch.Tensor, kv_cache: KVCache, metadata, scale: float,
               sliding_window: int | None = None) -> torch.Tensor:
        """Causal attention of q [T, num_heads, head_dim] over the cached K/V (already holding
        this step's); with ``sliding_window`` W only keys at positions ``i - W < j <= i`` of
        the query's position i. Returns [T, num_heads, head_dim] in q's dtype."""
        raise NotImplementedError

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        kv_cache: KVCache,
        metadata,
        scale: float,
        key_offset: torch.Tensor | None = None,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        """Write k, v [T, num_kv_heads, head_dim] (None: a layer that reads another layer's
        K/V) into ``kv_cache`` (keys minus ``key_offset`` for a quantized cache, see
        ``kv_cache.subtract_key_offset``), then attend (within ``sliding_window`` tokens when
        given); returns [T, num_heads, head_dim].

        Raises:
            ValueError: a ``sliding_window`` on a backend without ``supports_sliding_window``
                (the selector prevents it; never attend to the whole context instead).
        """
        if k is not None:
            self.write_kv(subtract_key_offset(k, kv_cache, key_offset), v, kv_cache, metadata)
        if sliding_window is None:
            return self.attend(q, kv_cache, metadata, scale)
        if not self.supports_sliding_window:
            raise ValueError(f"attention backend {self!r} does not implement sliding-window attention")
        return self.attend(q, kv_cache, metadata, scale, sliding_window)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


@dataclass
class FlatMetadata:
    """Per-request metadata, requests in flat token order, for the kernels that read the
    block tables themselves (Triton; the CPU kernel over a quantized cache).

    Attributes:
        backend: the backend that runs it.
        slot_mapping: int64 [T]; flat cache slot of each new token (negative: not stored,
            CUDA-graph padding rows of the Triton backend).
        block_tables: [R, max_blocks] physical blocks per request (dtype as the backend's
            kernel reads it).
        query_start_loc: int32 [R + 1]; request r's tokens are rows
            ``query_start_loc[r] : query_start_loc[r + 1]``.
        context_lens: int32 [R], tokens in the cache after this step's writes.
        max_query_len: longest query chunk of the step, in tokens.
        layout: the ``BatchLayout`` it was built from (None: built by hand), which says
            which tokens are prompt tokens (``kvflow.layers.fused_decode`` splits a step by it).
    """

    backend: AttentionBackend
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    query_start_loc: torch.Tensor
    context_lens: torch.Tensor
    max_query_len: int
    layout: BatchLayout | None = None

    @classmethod
    def build(cls, backend: AttentionBackend, layout: BatchLayout, table_dtype: torch.dtype) -> "FlatMetadata":
        num_reqs = len(layout.query_lens)
        table = layout.tables(0, num_reqs, table_dtype)
        starts = torch.zeros(num_reqs + 1, dtype=torch.int32)
        starts[1:] = layout.query_lens.to(torch.int32).cumsum(0)
        return cls(
            backend=backend,
            slot_mapping=layout.slot_mapping,
            block_tables=table.to(layout.device),
            query_start_loc=starts.to(layout.device),
            context_lens=layout.context_lens.to(torch.int32).to(layout.device),
            max_query_len=int(layout.query_lens.max()) if num_reqs else 0,
            layout=layout,
        )


@dataclass
class HybridMetadata:
    """A step's metadata for a hybrid KV cache (``kvflow/core/kv_cache_groups.py``): one
    backend metadata per KV cache group (its own slot_mapping and block tables) and the
    group of each decoder layer. A model passes layer i ``layer_metadata(metadata, i)``.

    Attributes:
        groups: per KV cache group, the backend's metadata over that group's tables.
        layer_group: per decoder layer, its group.
    """

    groups: list[AttentionMetadata]
    layer_group: tuple[int, ...]

    @property
    def backend(self) -> AttentionBackend:
        return self.groups[0].backend


def layer_metadata(metadata: AttentionMetadata, layer_idx: int) -> AttentionMetadata:
    """The metadata decoder layer ``layer_idx`` attends with: its group's for a
    ``HybridMetadata``, else ``metadata`` itself (one table for every layer)."""
    if isinstance(metadata, HybridMetadata):
        return metadata.groups[metadata.layer_group[layer_idx]]
    return metadata
