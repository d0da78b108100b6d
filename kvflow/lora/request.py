"""``LoRARequest``: which LoRA adapter a request runs with (vLLM's ``vllm.lora.request``).

A request without one runs the base model. The adapter is a PEFT folder
(``adapter_config.json`` + ``adapter_model.safetensors``); ``lora_int_id`` identifies it in the
engine (its slot, its prefix-cache key): two requests with the same id must name the same
adapter.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """A LoRA adapter to apply to one request.

    Args:
        lora_name: the adapter's name (what the server lists and a request's ``model`` selects).
        lora_int_id: a positive integer, unique per adapter in this engine.
        lora_path: the PEFT adapter folder.
        base_model_name: vLLM's: the base model the adapter was trained on, carried along
            (the adapter runs on the engine's model whatever it says).
        load_inplace: vLLM's: True would replace the adapter already loaded under this id;
            only False (kvflow: an id names one adapter for the engine's lifetime, so
            ``remove_lora`` it and add the new one under another id).
        is_3d_lora_weight: vLLM's fused-MoE weight layout; only False (PEFT adapters of the
            decoder's 2-D linears).

    Raises:
        ValueError: for an empty name, an id that is not a positive integer, an empty path,
            a ``base_model_name`` that is no string, or ``load_inplace`` /
            ``is_3d_lora_weight`` other than False (naming the field).
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None
    load_inplace: bool = False
    is_3d_lora_weight: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive integer, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path of adapter {self.lora_name!r} must name its PEFT folder, got {self.lora_path!r}")
        if self.base_model_name is not None and not isinstance(self.base_model_name, str):
            raise ValueError(f"base_model_name must be a string or None, got {self.base_model_name!r}")
        if self.load_inplace is not False:
            raise ValueError(f"load_inplace={self.load_inplace!r} is not supported by kvflow: an id names one adapter "
                             "for the engine's lifetime (remove_lora it, then give the new adapter another id)")
        if self.is_3d_lora_weight is not False:
            raise ValueError(f"is_3d_lora_weight={self.is_3d_lora_weight!r} is not supported by kvflow (PEFT adapters "
                             "of the decoder's 2-D linears only)")

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def path(self) -> str:
        return self.lora_path

    @property
    def cache_key(self) -> bytes:
        """Bytes mixed into the prefix-cache hash of the request's blocks: its K/V depend on
        the adapter, so blocks are shared only between requests of the same adapter."""
        return f"lora:{self.lora_int_id}:{self.lora_path}".encode()
