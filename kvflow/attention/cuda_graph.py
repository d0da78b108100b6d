"""CUDA graphs for decode steps (the GPU path's answer to per-kernel launch overhead).

A decode step of a small model is dozens of short kernels per layer; launching them one by
one from Python costs more than running them. ``DecodeGraphRunner`` records the model
forward once per batch size in ``batch_sizes`` (``torch.cuda.CUDAGraph``, all graphs sharing
one memory pool, largest first) over static input buffers, and replays the smallest graph
that holds a step's batch: the step's inputs are copied into the buffers, the rows past the
real batch are made inert (slot -1: nothing written; no query tokens: attention skips the
row), and the first ``B`` rows of the static output are the hidden states.

Only pure decode steps of the Triton attention backend are replayed (one query token per
request: the shapes are fixed by the batch size alone); prefills, speculative verification
and batches larger than the largest graph run eagerly. The LM head and sampling stay outside
the graph (their row count is the real batch).

On the CPU there is no CUDA graph; ``capture="eager"`` replays by calling the same function
on the same static buffers, which is how the tests check the padding and buffer logic.

It stands beside what it builds on: the backend's graph-safe metadata
(``AttentionBackend.graph_metadata``) and the paged cache (``kvflow.attention.cache_engine``);
the model is duck-typed. The runner's builder (``ModelRunner.from_config``) captures it right
after allocating the cache.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable

import torch

from kvflow.attention.backend import AttentionBackend


MAX_CAPTURE_SIZE = 512
"""The largest batch captured (vLLM's default ``max_cudagraph_capture_size``): a larger decode
runs eagerly. Each size is one capture at start and one static output buffer, so
``--max-num-seqs 4096`` would have meant 515 captures and ~1.2 GB of buffers for SmolLM2."""


def default_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, then multiples of 8, up to ``min(max_num_seqs, MAX_CAPTURE_SIZE)`` (always
    included)."""
    top = min(max_num_seqs, MAX_CAPTURE_SIZE)
    sizes = [b for b in (1, 2, 4) if b < top] + list(range(8, top, 8))
    return sorted(set(sizes + [top]))


class _EagerGraph:
    """Stand-in for ``torch.cuda.CUDAGraph`` where none exists: replay re-runs the function."""

    def __init__(self, fn: Callable[[], torch.Tensor], out: torch.Tensor) -> None:
        self.fn, self.out = fn, out

    def replay(self) -> None:
        self.out.copy_(self.fn())


class DecodeGraphRunner:
    """Captured decode forwards, one per batch size.

    Args:
        model: the decoder (``forward(input_ids, positions, kv_caches, metadata)``).
        kv_caches: the per-layer caches the graphs read and write (fixed addresses).
        max_blocks_per_seq: width of the static block table (``ceil(max_model_len /
            block_size)``).
        batch_sizes: batch sizes to capture, e.g. ``default_batch_sizes(max_num_seqs)``.
        device: the model's device.
        backend: the attention backend; it must offer graph-safe metadata
            (``supports_cuda_graphs``: ``graph_metadata`` over static buffers).
        capture: "cuda" (``torch.cuda.CUDAGraph``) or "eager" (no graph; tests on the CPU).

    Raises:
        ValueError: for an empty ``batch_sizes``, an unknown ``capture`` or a backend without
            graph-safe metadata.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list,
        max_blocks_per_seq: int,
        batch_sizes: list[int],
        device: torch.device,
        backend: AttentionBackend,
        capture: str = "cuda",
    ) -> None:
        if not backend.supports_cuda_graphs:
            raise ValueError(f"{backend!r} has no graph-safe metadata (CUDA graphs need the Triton backend)")
        if not batch_sizes:
            raise ValueError("batch_sizes must not be empty")
        if capture not in ("cuda", "eager"):
            raise ValueError(f"capture must be 'cuda' or 'eager', got {capture!r}")
        self.model = model
        self.backend = backend
        self.kv_caches = kv_caches
        self.batch_sizes = sorted(set(batch_sizes))
        self.max_batch = self.batch_sizes[-1]
        n = self.max_batch
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.query_start_loc = torch.zeros(n + 1, dtype=torch.int32, device=device)
        self.context_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.graphs: dict[int, object] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self._capture_all(capture, device)

    def _forward(self, b: int) -> torch.Tensor:
        metadata = self.backend.graph_metadata(
            self.slot_mapping[:b], self.block_tables[:b], self.query_start_loc[: b + 1], self.context_lens[:b]
        )
        return self.model(self.input_ids[:b], self.positions[:b], self.kv_caches, metadata)

    @torch.inference_mode()
    def _capture_all(self, capture: str, device: torch.device) -> None:
        # While capturing, every row is inert: no query tokens, no cache writes.
        pool = torch.cuda.graph_pool_handle() if capture == "cuda" else None
        for b in reversed(self.batch_sizes):  # largest first: the smaller ones reuse its pool
            fn = lambda b=b: self._forward(b)  # noqa: E731
            if capture == "eager":
                out = fn().clone()
                self.graphs[b] = _EagerGraph(fn, out)
                self.outputs[b] = out
                continue
            stream = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):  # warm-up outside the graph (allocator, autotuning)
                fn()
                fn()
            torch.cuda.current_stream(device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = fn()
            self.graphs[b] = graph
            self.outputs[b] = out

    def can_run(self, inputs) -> bool:
        """True for a decode-only step of the Triton backend that fits a captured batch."""
        meta = inputs.metadata
        return (
            meta.backend is self.backend
            and meta.max_query_len == 1
            and not inputs.prompt_logprob_rows
            and 0 < inputs.input_ids.shape[0] <= self.max_batch
            and meta.block_tables.shape[1] <= self.block_tables.shape[1]
        )

    @torch.inference_mode()
    def run(self, inputs) -> torch.Tensor:
        """Replay the smallest graph holding the batch.

        Returns:
            Hidden states [B, hidden_size] (a view of the graph's static output: valid
            until the next replay).
        """
        meta = inputs.metadata
        real = inputs.input_ids.shape[0]
        b = self.batch_sizes[bisect.bisect_left(self.batch_sizes, real)]
        width = meta.block_tables.shape[1]
        self.input_ids[:real].copy_(inputs.input_ids)
        self.positions[:real].copy_(inputs.positions)
        self.slot_mapping[:real].copy_(meta.slot_mapping)
        self.slot_mapping[real:b].fill_(-1)
        self.block_tables[:real, :width].copy_(meta.block_tables)
        self.query_start_loc[: real + 1].copy_(meta.query_start_loc)
        self.query_start_loc[real + 1 : b + 1].fill_(real)
        self.context_lens[:real].copy_(meta.context_lens)
        self.context_lens[real:b].fill_(0)
        self.graphs[b].replay()
        return self.outputs[b][:real]
