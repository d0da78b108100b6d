"""KV cache groups of a hybrid model (sliding-window and full-attention layers, Gemma 3).

Adapted from vLLM's hybrid KV cache allocator (``vllm/v1/core/kv_cache_utils.py``,
``_get_kv_cache_config_uniform_page_size``; ``vllm/v1/core/kv_cache_coordinator.py``): the
layers are split into groups of ``group_size`` layers of one attention kind (one window, or
full). All groups share ONE block pool; a block ("page") holds one ``block_size`` slice of
K/V for each of the ``group_size`` layer *positions*, so the cache is ``group_size`` tensor
pairs ``[num_blocks, block_size, kv_heads, head_dim]`` and layer l reads and writes tensor
``layer_position[l]`` through the block table of its group ``layer_group[l]``. Each group has
its own block table per request: a sliding group frees the blocks behind its window as the
request advances, a full group keeps them all. The memory of a request is then
``(sliding groups x window + full groups x context)`` pages instead of all layers x context.

``group_size`` is the smallest number of layers of one kind (Gemma-3-270M: 15 local and 3
global layers -> groups of 3: 5 local groups and 1 global group); a kind whose count it does
not divide gets a last group with unused positions (padding: those slices of its pages are
allocated and never read).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """One KV cache group: the layers that share its block table, and their attention kind.

    Attributes:
        layer_ids: the decoder layers of the group, ascending.
        sliding_window: the group's window in tokens (vLLM's ``SlidingWindowSpec``), or None
            for full attention (``FullAttentionSpec``).
    """

    layer_ids: tuple[int, ...]
    sliding_window: int | None


@dataclass(frozen=True)
class KVCacheGroups:
    """The group layout of a hybrid model's KV cache.

    Attributes:
        group_size: layer positions per page (K/V tensor pairs of the cache).
        group_windows: per group, its sliding window in tokens, or None (full attention).
        layer_group: per decoder layer, its group.
        layer_position: per decoder layer, its position (K/V tensor pair) in its group.
    """

    group_size: int
    group_windows: tuple[int | None, ...]
    layer_group: tuple[int, ...]
    layer_position: tuple[int, ...]

    @property
    def num_groups(self) -> int:
        return len(self.group_windows)

    @property
    def groups(self) -> tuple[KVCacheGroupSpec, ...]:
        """Per group, its layers and sliding window (what a model runner reads)."""
        return tuple(
            KVCacheGroupSpec(tuple(l for l, g in enumerate(self.layer_group) if g == group), window)
            for group, window in enumerate(self.group_windows)
        )

    @property
    def num_padding_positions(self) -> int:
        """Positions of the groups that no layer uses (allocated, never read)."""
        return self.num_groups * self.group_size - len(self.layer_group)


def build_kv_cache_groups(sliding_windows: list[int | None]) -> KVCacheGroups | None:
    """Split the layers into KV cache groups by attention kind (see the module docstring).

    Args:
        sliding_windows: per layer, its window in tokens or None (``ModelConfig.sliding_windows``).

    Returns:
        The layout, or None when every layer has the same kind (one group: a block holds every
        layer, the plain layout; ``KVCacheManager`` then has one group, windowed when every
        layer is).
    """
    kinds: dict[int | None, list[int]] = {}
    for layer, window in enumerate(sliding_windows):
        kinds.setdefault(window, []).append(layer)
    if len(kinds) < 2:
        return None
    group_size = min(len(layers) for layers in kinds.values())
    windows: list[int | None] = []
    layer_group = [0] * len(sliding_windows)
    layer_position = [0] * len(sliding_windows)
    # Full groups first (group 0 then holds every block: the table other code may inspect).
    for window in sorted(kinds, key=lambda w: (w is not None, w or 0)):
        layers = kinds[window]
        for start in range(0, len(layers), group_size):
            for position, layer in enumerate(layers[start : start + group_size]):
                layer_group[layer] = len(windows)
                layer_position[layer] = position
            windows.append(window)
    return KVCacheGroups(group_size, tuple(windows), tuple(layer_group), tuple(layer_position))
