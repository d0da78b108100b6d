"""The model runner's persistent batch: one row per request the runner holds.

After vLLM v1's ``InputBatch`` and ``BlockTable`` (``vllm/v1/worker/gpu_input_batch.py``,
``vllm/v1/worker/block_table.py``), at kvflow's size: the per-request numbers the step's
inputs are computed from live in preallocated CPU arrays indexed by the request's row
(numpy arrays, viewed as torch tensors without a copy), written by the scheduler's diffs
(``kvflow/core/sched_output.py``) and read by a handful of vectorized operations for the
whole batch each step (``ModelRunner.prepare_inputs``):

- ``token_ids`` int64 [rows, cols]: the prompt and the generated tokens the runner was sent
  (columns grow by doubling up to the longest request seen);
- ``num_tokens``, ``num_prompt_tokens``, ``num_computed_tokens`` int64 [rows];
- ``block_tables[g]`` int64 [rows, blocks]: KV cache group g's physical block ids in logical
  order, ``num_blocks[g]`` int64 [rows] of them (appended by the diffs, replaced on a
  copy-on-write or a roll-back);
- the sampling parameters as arrays (``temperature`` float32, 0 for greedy; ``top_k`` int64,
  0 where off; ``top_p``, ``min_p`` float32; ``needs_logits_processing`` bool: a grammar,
  bad words, ``min_tokens``, ``logit_bias``, ``allowed_token_ids`` or a penalty), written
  once when a request joins.

Rows are kept dense: removing a request moves the last row into its place (vLLM's
``condense``), so rows ``0 .. num_reqs - 1`` are the held requests. The batch grows (rows
and columns doubling) when a request does not fit; nothing is ever truncated. The
request's Python-side handles the sampler and the logits processors read (its
``SamplingParams``, generator, grammar matcher, token list, pooling and LoRA data) stay on
its ``CachedRequestState`` (``states[row]``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

_FLOAT32_MAX = float(torch.finfo(torch.float32).max)


class InputBatch:
    """Row-indexed arrays of the requests a model runner holds (see the module docstring).

    Args:
        num_kv_cache_groups: KV cache groups (one block table each); 1 for a plain cache.
        max_num_reqs: rows allocated at first (the batch grows past it when needed).
        max_model_len: token columns allocated at first (grows likewise).
        block_size: tokens per KV block (sizes the block-table columns).

    Raises:
        ValueError: a count below 1.
    """

    def __init__(self, num_kv_cache_groups: int = 1, max_num_reqs: int = 16, max_model_len: int = 256,
                 block_size: int = 16) -> None:
        for name, value in (("num_kv_cache_groups", num_kv_cache_groups), ("max_num_reqs", max_num_reqs),
                            ("max_model_len", max_model_len), ("block_size", block_size)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.num_kv_cache_groups = num_kv_cache_groups
        self.block_size = block_size
        rows, cols = max_num_reqs, max_model_len
        blocks = -(-cols // block_size)
        self.token_ids = np.zeros((rows, cols), dtype=np.int64)
        self.num_tokens = np.zeros(rows, dtype=np.int64)
        self.num_prompt_tokens = np.zeros(rows, dtype=np.int64)
        self.num_computed_tokens = np.zeros(rows, dtype=np.int64)
        self.block_tables = [np.zeros((rows, blocks), dtype=np.int64) for _ in range(num_kv_cache_groups)]
        self.num_blocks = np.zeros((num_kv_cache_groups, rows), dtype=np.int64)
        self.temperature = np.zeros(rows, dtype=np.float32)
        self.top_k = np.zeros(rows, dtype=np.int64)
        self.top_p = np.ones(rows, dtype=np.float32)
        self.min_p = np.zeros(rows, dtype=np.float32)
        # rows with a logits processor (``kvflow.sample.logits_processor``: a grammar, bad
        # words, min_tokens, logit_bias, allowed_token_ids or a penalty): only those go through it
        self.needs_logits_processing = np.zeros(rows, dtype=bool)
        self.req_ids: list[str] = []
        self.states: list[Any] = []  # CachedRequestState per row
        self.req_id_to_index: dict[str, int] = {}
        # rows whose inputs need the per-request path of ``prepare_inputs`` (prompt
        # logprobs, pooling): while there are none the step takes the vectorized one
        self.num_special_reqs = 0
        # rows with their own seeded generator (the sampler saves and restores those)
        self.num_generator_reqs = 0

    @staticmethod
    def _is_special(state: Any) -> bool:
        return (getattr(state, "pooling_params", None) is not None
                or state.sampling_params.prompt_logprobs is not None)

    @staticmethod
    def _needs_logits_processing(state: Any) -> bool:
        p = state.sampling_params
        return bool(getattr(state, "grammar", None) is not None or getattr(state, "bad_words_token_ids", None)
                    or p.min_tokens > 0 or p.logit_bias or p.allowed_token_ids is not None or p.has_penalties)

    # --- capacity --------------------------------------------------------------------------

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    def _grow_rows(self, rows: int) -> None:
        def grow(a: np.ndarray, axis: int = 0, fill=0) -> np.ndarray:
            shape = list(a.shape)
            shape[axis] = rows
            b = np.full(shape, fill, dtype=a.dtype)
            b[tuple(slice(0, n) for n in a.shape)] = a
            return b

        self.token_ids = grow(self.token_ids)
        self.num_tokens, self.num_prompt_tokens = grow(self.num_tokens), grow(self.num_prompt_tokens)
        self.num_computed_tokens = grow(self.num_computed_tokens)
        self.block_tables = [grow(t) for t in self.block_tables]
        self.num_blocks = grow(self.num_blocks, axis=1)
        self.temperature, self.top_k = grow(self.temperature), grow(self.top_k)
        self.top_p, self.min_p = grow(self.top_p, fill=1), grow(self.min_p)
        self.needs_logits_processing = grow(self.needs_logits_processing)

    def _ensure_tokens(self, cols: int) -> None:
        if cols > self.token_ids.shape[1]:
            new = np.zeros((self.token_ids.shape[0], max(cols, 2 * self.token_ids.shape[1])), dtype=np.int64)
            new[:, : self.token_ids.shape[1]] = self.token_ids
            self.token_ids = new

    def _ensure_blocks(self, group: int, n: int) -> None:
        table = self.block_tables[group]
        if n > table.shape[1]:
            new = np.zeros((table.shape[0], max(n, 2 * table.shape[1])), dtype=np.int64)
            new[:, : table.shape[1]] = table
            self.block_tables[group] = new

    # --- rows --------------------------------------------------------------------------------

    def add_request(self, state: Any, block_ids: tuple[list[int], ...] | list[list[int]]) -> int:
        """Add a request as the last row; returns its row.

        Args:
            state: its ``CachedRequestState`` (request_id, all_token_ids, prompt_token_ids,
                num_computed_tokens, sampling_params).
            block_ids: per KV cache group, its block table.

        Raises:
            ValueError: a request id the batch holds already, or a block table per group count
                that is not ``num_kv_cache_groups``.
        """
        if state.request_id in self.req_id_to_index:
            raise ValueError(f"request {state.request_id!r} is in the batch already")
        if len(block_ids) != self.num_kv_cache_groups:
            raise ValueError(f"request {state.request_id!r}: {len(block_ids)} block tables for "
                             f"{self.num_kv_cache_groups} KV cache groups")
        row = self.num_reqs
        if row >= self.token_ids.shape[0]:
            self._grow_rows(2 * self.token_ids.shape[0])
        tokens = state.all_token_ids
        self._ensure_tokens(len(tokens))
        self.token_ids[row, : len(tokens)] = tokens
        self.num_tokens[row] = len(tokens)
        self.num_prompt_tokens[row] = len(state.prompt_token_ids)
        self.num_computed_tokens[row] = state.num_computed_tokens
        for g, ids in enumerate(block_ids):
            self._ensure_blocks(g, len(ids))
            self.block_tables[g][row, : len(ids)] = ids
            self.num_blocks[g, row] = len(ids)
        p = state.sampling_params
        # a temperature past float32's range (1e300 is valid) is capped there, not cast to inf:
        # -inf (masked) logits / inf are NaN, and a NaN row samples token 0 whatever was masked
        self.temperature[row] = 0.0 if p.greedy else min(p.temperature, _FLOAT32_MAX)
        # top_k <= 0: off; any int (2**63 does not fit int64) is capped far above a vocabulary
        self.top_k[row] = min(p.top_k, 2**62) if p.top_k > 0 else 0
        self.top_p[row] = p.top_p
        self.min_p[row] = p.min_p
        self.needs_logits_processing[row] = self._needs_logits_processing(state)
        self.req_ids.append(state.request_id)
        self.states.append(state)
        self.req_id_to_index[state.request_id] = row
        self.num_special_reqs += self._is_special(state)
        self.num_generator_reqs += getattr(state, "generator", None) is not None
        return row

    def remove_request(self, request_id: str) -> bool:
        """Drop a request; the last row moves into its place (rows stay dense). False when
        the batch does not hold it."""
        row = self.req_id_to_index.pop(request_id, None)
        if row is None:
            return False
        self.num_special_reqs -= self._is_special(self.states[row])
        self.num_generator_reqs -= getattr(self.states[row], "generator", None) is not None
        last = self.num_reqs - 1
        if row != last:
            moved = self.req_ids[last]
            self.req_ids[row], self.states[row] = moved, self.states[last]
            self.req_id_to_index[moved] = row
            n = int(self.num_tokens[last])
            self.token_ids[row, :n] = self.token_ids[last, :n]
            for a in (self.num_tokens, self.num_prompt_tokens, self.num_computed_tokens, self.temperature,
                      self.top_k, self.top_p, self.min_p, self.needs_logits_processing):
                a[row] = a[last]
            for g, table in enumerate(self.block_tables):
                nb = int(self.num_blocks[g, last])
                table[row, :nb] = table[last, :nb]
                self.num_blocks[g, row] = nb
        self.req_ids.pop()
        self.states.pop()
        return True

    def append_tokens(self, row: int, token_ids: list[int]) -> None:
        """Append tokens (sampled, or accepted drafts) to a row."""
        n = int(self.num_tokens[row])
        end = n + len(token_ids)
        if end > self.token_ids.shape[1]:
            self._ensure_tokens(end)
        self.token_ids[row, n:end] = token_ids
        self.num_tokens[row] = end

    def append_tokens_batch(self, rows: np.ndarray, token_ids: list[list[int]]) -> None:
        """Append ``token_ids[i]`` to row ``rows[i]`` for every i (distinct rows), in one
        scatter (one row: ``append_tokens``, without the array bookkeeping)."""
        if len(token_ids) == 1:
            self.append_tokens(int(rows[0]), token_ids[0])
            return
        counts = np.fromiter(map(len, token_ids), dtype=np.int64, count=len(token_ids))
        total = int(counts.sum())
        if not total:
            return
        starts = self.num_tokens[rows]
        if total == len(token_ids) and int(counts.max()) == 1:  # one token each: a decode step
            self._ensure_tokens(int(starts.max()) + 1)
            self.token_ids[rows, starts] = [ids[0] for ids in token_ids]
            self.num_tokens[rows] = starts + 1
            return
        ends = starts + counts
        self._ensure_tokens(int(ends.max()))
        first = np.cumsum(counts) - counts
        positions = np.repeat(starts - first, counts) + np.arange(total, dtype=np.int64)
        self.token_ids[np.repeat(rows, counts), positions] = [t for ids in token_ids for t in ids]
        self.num_tokens[rows] = ends

    def set_block_ids(self, row: int, group: int, block_ids: list[int], replace: bool) -> None:
        """Append ``block_ids`` to group ``group``'s table of a row, or replace the table."""
        start = 0 if replace else int(self.num_blocks[group, row])
        end = start + len(block_ids)
        self._ensure_blocks(group, end)
        self.block_tables[group][row, start:end] = block_ids
        self.num_blocks[group, row] = end

    def block_ids(self, row: int, group: int = 0) -> list[int]:
        """A row's block table of one group, as a list."""
        return self.block_tables[group][row, : self.num_blocks[group, row]].tolist()

    # --- the step's inputs ---------------------------------------------------------------------

    def token_positions(self, rows: np.ndarray, query_lens: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Flatten the scheduled chunks of ``rows`` (in that order): request r computes
        ``query_lens[r]`` tokens from its ``num_computed_tokens``.

        Returns:
            (token_rows, positions, query_start_loc): int64 [T] the row of each flat token,
            int64 [T] its position, int64 [R + 1] the first flat token of each request.
        """
        starts = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(query_lens, out=starts[1:])
        req_of_token = np.repeat(np.arange(len(rows)), query_lens)
        offsets = np.arange(starts[-1], dtype=np.int64) - starts[:-1][req_of_token]
        positions = self.num_computed_tokens[rows][req_of_token] + offsets
        return rows[req_of_token], positions, starts

    def slot_mapping(self, group: int, token_rows: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """int64 [T]: the flat cache slot (``block * block_size + offset``) of each token in
        group ``group``'s table."""
        bs = self.block_size
        return self.block_tables[group][token_rows, positions // bs] * bs + positions % bs

    def padded_block_tables(self, group: int, rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Group ``group``'s tables of ``rows``: int64 [R, W] (W: the longest of their tables,
        at least 1), each row past its own table padded with block 0 (never read past a
        request's context), and int64 [R] their lengths."""
        lens = self.num_blocks[group, rows]
        width = max(int(lens.max()) if len(lens) else 1, 1)
        self._ensure_blocks(group, width)
        table = self.block_tables[group][rows, :width]
        table[np.arange(width)[None, :] >= lens[:, None]] = 0
        return torch.from_numpy(table), torch.from_numpy(lens)
