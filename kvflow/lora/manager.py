"""The engine's LoRA adapters: a slot table of ``max_loras`` adapters the forward reads, and a
CPU-side LRU cache of ``max_cpu_loras`` validated adapters (as vLLM's ``LRUCacheLoRAModelManager``).

A step may use at most ``max_loras`` distinct adapters (the scheduler admits no request that
would exceed it); ``activate`` puts them into slots, evicting the least recently used slots
the step does not need. An adapter evicted from the CPU cache is read again from its folder
when a request needs it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch

from kvflow.lora.peft import LoRAModel, load_peft_adapter, lora_targets, output_slices
from kvflow.lora.punica import LoRALayerWeights, LoRAMapping
from kvflow.lora.request import LoRARequest


class LoRAManager:
    """Adapters of one model (tensor-parallel size 1).

    Args:
        model: the base ``CausalLM``; its class must set ``supports_lora``.
        max_loras: adapters in one step (slots).
        max_lora_rank: the largest rank an adapter may have.
        max_cpu_loras: validated adapters kept in host memory (>= max_loras).

    Raises:
        ValueError: for a model whose architecture has no LoRA support in kvflow, or limits
            that are not positive (``max_cpu_loras`` below ``max_loras``).
    """

    def __init__(self, model: torch.nn.Module, max_loras: int, max_lora_rank: int, max_cpu_loras: int) -> None:
        if not getattr(type(model), "supports_lora", False):
            raise ValueError(f"enable_lora: kvflow's {type(model).__name__} has no LoRA support (Llama, Mistral, "
                             "Qwen2, Qwen3 and Phi-3 do)")
        if max_cpu_loras < max_loras:
            raise ValueError(f"max_cpu_loras ({max_cpu_loras}) must be at least max_loras ({max_loras})")
        self.model = model
        self.max_loras, self.max_lora_rank, self.max_cpu_loras = max_loras, max_lora_rank, max_cpu_loras
        param = next(model.parameters())
        self.dtype, self.device = param.dtype if param.is_floating_point() else torch.get_default_dtype(), param.device
        self.layers: dict[str, LoRALayerWeights] = {}
        for name, layer in lora_targets(model).items():
            slices = [(first, rows) for _, first, rows in output_slices(layer)]
            weights = LoRALayerWeights(layer.in_features, layer.out_features, slices, max_loras, max_lora_rank,
                                       self.dtype, self.device)
            layer.__dict__["lora_weights"] = weights  # not a parameter: state_dict is unchanged
            self.layers[name] = weights
        self.slots: list[int | None] = [None] * max_loras  # adapter id in each slot
        self._slot_lru: OrderedDict[int, int] = OrderedDict()  # adapter id -> slot, least recent first
        self.cpu_cache: OrderedDict[int, LoRAModel] = OrderedDict()  # adapter id -> adapter, LRU
        self.known: dict[int, LoRARequest] = {}  # every adapter id seen -> its request (name, path)
        self._lock = threading.RLock()  # requests are validated on server threads while the engine steps

    @property
    def nbytes_per_slot(self) -> int:
        """Bytes of one slot over all layers (the slot table holds ``max_loras`` of them)."""
        return sum(w.nbytes_per_slot for w in self.layers.values())

    def get(self, lora_request: LoRARequest) -> LoRAModel:
        """The validated adapter, from the CPU cache or read from its folder (then cached,
        evicting the least recently used one beyond ``max_cpu_loras``).

        Raises:
            ValueError: see ``kvflow.lora.peft.load_peft_adapter``; an id already used by
                another adapter name or path.
        """
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}")
        with self._lock:
            seen = self.known.get(lora_request.lora_int_id)
            if seen is not None and (seen.lora_name, seen.lora_path) != (lora_request.lora_name, lora_request.lora_path):
                raise ValueError(f"lora_int_id {lora_request.lora_int_id} is adapter {seen.lora_name!r} "
                                 f"({seen.lora_path}); {lora_request.lora_name!r} ({lora_request.lora_path}) "
                                 "needs another id")
            lora = self.cpu_cache.get(lora_request.lora_int_id)
            if lora is not None:
                self.cpu_cache.move_to_end(lora_request.lora_int_id)
                return lora
        lora = load_peft_adapter(lora_request, self.model, self.max_lora_rank, self.dtype)  # outside the lock
        with self._lock:
            self.known[lora_request.lora_int_id] = lora_request
            self.cpu_cache[lora_request.lora_int_id] = lora
            self.cpu_cache.move_to_end(lora_request.lora_int_id)
            while len(self.cpu_cache) > self.max_cpu_loras:
                self.cpu_cache.popitem(last=False)
        return lora

    def remove(self, lora_int_id: int) -> bool:
        """Forget an adapter (CPU cache, slot, id). True when it was known."""
        with self._lock:
            known = self.known.pop(lora_int_id, None) is not None
            self.cpu_cache.pop(lora_int_id, None)
            slot = self._slot_lru.pop(lora_int_id, None)
            if slot is not None:
                self.slots[slot] = None
                for w in self.layers.values():
                    w.clear_slot(slot)
            return known

    def activate(self, lora_requests: list[LoRARequest]) -> dict[int, int]:
        """Put the step's adapters into slots; adapter id -> slot.

        Raises:
            ValueError: more than ``max_loras`` distinct adapters (the scheduler prevents it),
                or an adapter that no longer loads.
        """
        wanted = {r.lora_int_id: r for r in lora_requests}
        if len(wanted) > self.max_loras:
            raise ValueError(f"a step uses {len(wanted)} LoRA adapters, more than max_loras={self.max_loras}")
        with self._lock:
            result = {}
            for lora_id, request in wanted.items():
                slot = self._slot_lru.get(lora_id)
                if slot is None:
                    lora = self.get(request)
                    slot = self._free_slot(set(wanted))
                    for name, weights in self.layers.items():
                        parts = lora.modules.get(name)
                        if parts:
                            weights.set_slot(slot, parts)
                        else:
                            weights.clear_slot(slot)
                    self.slots[slot] = lora_id
                self._slot_lru[lora_id] = slot
                self._slot_lru.move_to_end(lora_id)
                result[lora_id] = slot
            return result

    def _free_slot(self, keep: set[int]) -> int:
        if None in self.slots:
            return self.slots.index(None)
        for lora_id, slot in self._slot_lru.items():  # least recently used first
            if lora_id not in keep:
                del self._slot_lru[lora_id]
                self.slots[slot] = None
                return slot
        raise ValueError(f"no free LoRA slot (max_loras={self.max_loras})")

    def mapping(self, runs: list[tuple[LoRARequest | None, int]]) -> LoRAMapping | None:
        """The step's ``LoRAMapping`` from (adapter or None, tokens) per request in batch
        order, activating the adapters; None when no request has one."""
        used = [r for r, _ in runs if r is not None]
        if not used:
            return None
        slots = self.activate(used)
        return LoRAMapping.from_runs([(-1 if r is None else slots[r.lora_int_id], n) for r, n in runs], self.device)
