"""The LoRA delta of a mixed batch: a segment (grouped) gather-matmul on the CPU.

Punica (Chen et al. 2023, "Punica: Multi-Tenant LoRA Serving", arXiv 2310.18547, section 4)
serves many adapters in one batch with SGMV: the batch's tokens are grouped by adapter and
each group does its own shrink ``x A^T`` ([n, r]) and expand ``(x A^T) B^T`` ([n, out]),
added to the base layer's output. The same here with PyTorch matmuls: a step's tokens come
request by request (each request's tokens contiguous), so a group is a run of rows (a slice)
or, when an adapter's requests are apart, gathered rows (``index_select`` /
``index_add_``). Tokens without an adapter (slot -1) cost nothing.

``LoRALayerWeights`` is one layer's slot table: every loaded adapter's A and B in
``max_loras`` slots of rank ``max_lora_rank`` (zero-padded: padded rank columns add exact
zeros), with one shrink per output part (q / k / v of a fused QKV layer, gate / up).

With one adapter in a step its rows get their shrink and expand alone. With several, operator
dispatch per group would cost more than the arithmetic on a CPU (30 layers x 7 linears x
groups x parts small matmuls per step), so the groups' rows are gathered into one padded
[G, n, in] tensor (padding reads an appended zero row) and shrunk and expanded by two batched
matmuls (``torch.bmm``) against their slots' A and B, then the real rows' deltas added back
with ``index_add_`` (the padding rows' dropped: 0 x a NaN or an overflowing product is not 0,
and must not reach another request's row). B is stored per part as [S * R, out] with zeros
outside the part's columns, so one expand serves the fused q / k / v (or gate / up) parts;
the zeros cost S times the expand's work, a few percent of the base layer's at these ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class LoRALayerWeights:
    """One linear's adapters in ``max_loras`` slots.

    Attributes:
        a: [max_loras, S, R, in_features]: each of the S output parts' A (R = max_lora_rank).
        b: [max_loras, S * R, out_features]: B transposed, part s's rows feeding only part
            s's output columns (zeros elsewhere), the scaling folded in.
        slices: (first output column, columns) of each of the S output parts.
    """

    def __init__(self, in_features: int, out_features: int, slices: list[tuple[int, int]], max_loras: int,
                 max_rank: int, dtype: torch.dtype, device: torch.device) -> None:
        self.slices = slices
        self.rank = max_rank
        self.a = torch.zeros(max_loras, len(slices), max_rank, in_features, dtype=dtype, device=device)
        self.b = torch.zeros(max_loras, len(slices) * max_rank, out_features, dtype=dtype, device=device)

    @property
    def width(self) -> int:
        """Shrink columns per slot (S * R)."""
        return self.b.shape[1]

    @property
    def nbytes_per_slot(self) -> int:
        return (self.a[0].nelement() + self.b[0].nelement()) * self.a.element_size()

    def set_slot(self, slot: int, parts: list[tuple[int | None, torch.Tensor, torch.Tensor]]) -> None:
        """Write one adapter's parts of this layer into ``slot`` (zeroed first; parts it does
        not target stay 0). A part with index None covers the whole layer: its A feeds every
        output part."""
        self.clear_slot(slot)
        R = self.rank
        for index, a, b in parts:
            r = a.shape[0]
            for s, (first, cols) in enumerate(self.slices):
                if index is not None and index != s:
                    continue
                self.a[slot, s, :r] = a.to(self.a.device)
                rows = b if index is not None else b[first : first + cols]
                self.b[slot, s * R : s * R + r, first : first + cols] = rows.T.to(self.b.device)

    def clear_slot(self, slot: int) -> None:
        self.a[slot].zero_()
        self.b[slot].zero_()

    def delta(self, slot: int, x: torch.Tensor) -> torch.Tensor:
        """``s (x A^T) B^T`` of the adapter in ``slot``: x [n, in_features] -> [n, out_features]."""
        return (x @ self.a[slot].flatten(0, 1).T) @ self.b[slot]

    def delta_grouped(self, x_groups: torch.Tensor, slots: slice | torch.Tensor) -> torch.Tensor:
        """The deltas of G groups of tokens padded to one length, each with its own slot, in
        two batched matmuls: x_groups [G, n, in_features], ``slots`` the G slots (a slice of
        the table, or an index tensor) -> [G, n, out_features]."""
        a = self.a[slots].flatten(1, 2)  # [G, S * R, in]
        return torch.bmm(torch.bmm(x_groups, a.transpose(1, 2)), self.b[slots])


@dataclass
class LoRAMapping:
    """Which slot each token of a step uses, grouped for the gather-matmul; passed with the
    step's inputs to the model's forward (as the attention metadata is).

    Attributes:
        token_slots: int64 [T], the slot of each token, -1 for the base model.
        groups: (slot, rows) per adapter in the step: rows a ``slice`` of the batch when its
            tokens are contiguous, else an int64 index tensor.
        gather: with several groups, int64 [G * group_len], the batch row each padded group row
            reads (padding: row T, the appended zero row).
        scatter: the batch row each real (not padding) padded group row adds to.
        keep: the positions of the real rows among the G * group_len padded rows; None when no
            group is padded.
        group_slots: the G groups' slots (a slice when consecutive).
        group_len: the longest group's rows.
    """

    token_slots: torch.Tensor
    groups: list[tuple[int, slice | torch.Tensor]]
    gather: torch.Tensor | None = None
    scatter: torch.Tensor | None = None
    keep: torch.Tensor | None = None
    group_slots: slice | torch.Tensor | None = None
    group_len: int = 0

    @classmethod
    def from_runs(cls, runs: list[tuple[int, int]], device: torch.device) -> "LoRAMapping | None":
        """From (slot, tokens) runs in batch order (one per request); None when no token has
        an adapter."""
        slots = torch.tensor([s for s, n in runs for _ in range(n)], dtype=torch.int64)
        spans: dict[int, list[tuple[int, int]]] = {}
        start = 0
        for slot, n in runs:
            if slot >= 0 and n > 0:
                spans.setdefault(slot, []).append((start, start + n))
            start += n
        if not spans:
            return None
        groups: list[tuple[int, slice | torch.Tensor]] = []
        for slot, ranges in sorted(spans.items()):
            if all(ranges[i][1] == ranges[i + 1][0] for i in range(len(ranges) - 1)):
                groups.append((slot, slice(ranges[0][0], ranges[-1][1])))
            else:
                index = torch.cat([torch.arange(a, b, dtype=torch.int64) for a, b in ranges]).to(device)
                groups.append((slot, index))
        mapping = cls(slots.to(device), groups)
        if len(groups) > 1:  # the rows of each group, padded to the longest with a zero row
            rows = [torch.cat([torch.arange(a, b, dtype=torch.int64) for a, b in spans[slot]]) for slot, _ in groups]
            n = max(len(r) for r in rows)
            mapping.group_len = n
            mapping.gather = torch.cat([torch.cat([r, torch.full((n - len(r),), start)]) for r in rows]).to(device)
            mapping.scatter = torch.cat(rows).to(device)
            if any(len(r) < n for r in rows):  # padding rows' deltas are dropped, not added anywhere
                mapping.keep = torch.cat([torch.arange(g * n, g * n + len(r)) for g, r in enumerate(rows)]).to(device)
            ids = [slot for slot, _ in groups]
            contiguous = ids == list(range(ids[0], ids[0] + len(ids)))
            mapping.group_slots = slice(ids[0], ids[-1] + 1) if contiguous else torch.tensor(ids, device=device)
        return mapping

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Add each group's LoRA delta to ``out`` [T, out_features] (the base layer's output
        for x [T, in_features]), in place; ``out`` unchanged for a layer without adapters."""
        weights: LoRALayerWeights | None = layer.__dict__.get("lora_weights")
        if weights is None:
            return out
        if self.gather is not None:  # several adapters: batched over the groups
            x_pad = torch.cat([x, x.new_zeros(1, x.shape[1])])  # (padding rows read the zero row T)
            x_groups = x_pad.index_select(0, self.gather).view(len(self.groups), self.group_len, -1)
            delta = weights.delta_grouped(x_groups, self.group_slots).flatten(0, 1)
            if self.keep is not None:  # (drop the padding rows: their deltas touch no real row)
                delta = delta.index_select(0, self.keep)
            return out.index_add_(0, self.scatter, delta.to(out.dtype))
        for slot, rows in self.groups:
            if isinstance(rows, slice):
                out[rows] += weights.delta(slot, x[rows]).to(out.dtype)
            else:
                out.index_add_(0, rows, weights.delta(slot, x.index_select(0, rows)).to(out.dtype))
        return out
