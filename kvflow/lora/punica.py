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

With one adapter in a step its rows get their shrink and expand alone. With several, Python
and operator dispatch per group would cost more than the arithmetic on a CPU (30 layers x 7
linears x groups small matmuls per step), so the step does two matmuls per layer over the
whole table instead: the shrink of every token against every slot, masked to the token's own
slot, and the expand (the wasted shrink columns are ``max_loras - 1`` times the rank, a few
percent of the base layer's work).
"""

from __future__ import annotations

from dataclasses import dataclass, field

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

    def delta_masked(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Every token's delta with its own slot in two matmuls over the whole table: the
        shrink against all slots, ``mask`` [T, max_loras * S * R] (1 on the columns of the
        token's slot, 0 elsewhere and for base tokens) keeping the token's own, and the
        expand. x [T, in_features] -> [T, out_features]."""
        shrink = x @ self.a.flatten(0, 2).T
        return (shrink * mask) @ self.b.flatten(0, 1)


@dataclass
class LoRAMapping:
    """Which slot each token of a step uses, grouped for the gather-matmul; passed with the
    step's inputs to the model's forward (as the attention metadata is).

    Attributes:
        token_slots: int64 [T], the slot of each token, -1 for the base model.
        groups: (slot, rows) per adapter in the step: rows a ``slice`` of the batch when its
            tokens are contiguous, else an int64 index tensor.
    """

    token_slots: torch.Tensor
    groups: list[tuple[int, slice | torch.Tensor]]
    _masks: dict = field(default_factory=dict, repr=False)

    def mask(self, max_loras: int, width: int, dtype: torch.dtype) -> torch.Tensor:
        """[T, max_loras * width] in ``dtype``: 1 on the ``width`` columns of each token's slot."""
        key = (max_loras, width, dtype)
        mask = self._masks.get(key)
        if mask is None:
            one_hot = torch.zeros(self.token_slots.shape[0], max_loras + 1, dtype=dtype, device=self.token_slots.device)
            one_hot[torch.arange(self.token_slots.shape[0], device=one_hot.device), self.token_slots + 1] = 1
            mask = self._masks[key] = one_hot[:, 1:].repeat_interleave(width, dim=1)
        return mask

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
        for slot, ranges in spans.items():
            if all(ranges[i][1] == ranges[i + 1][0] for i in range(len(ranges) - 1)):
                groups.append((slot, slice(ranges[0][0], ranges[-1][1])))
            else:
                index = torch.cat([torch.arange(a, b, dtype=torch.int64) for a, b in ranges]).to(device)
                groups.append((slot, index))
        return cls(slots.to(device), groups)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Add each group's LoRA delta to ``out`` [T, out_features] (the base layer's output
        for x [T, in_features]), in place; ``out`` unchanged for a layer without adapters."""
        weights: LoRALayerWeights | None = layer.__dict__.get("lora_weights")
        if weights is None:
            return out
        if len(self.groups) > 1:  # several adapters: one masked pass over the slot table
            return out.add_(weights.delta_masked(x, self.mask(weights.a.shape[0], weights.width, x.dtype)).to(out.dtype))
        for slot, rows in self.groups:
            if isinstance(rows, slice):
                out[rows] += weights.delta(slot, x[rows]).to(out.dtype)
            else:
                out.index_add_(0, rows, weights.delta(slot, x.index_select(0, rows)).to(out.dtype))
        return out
