"""Multi-LoRA serving: many PEFT adapters over one base model, mixed in one batch.

``request`` (``LoRARequest``), ``peft`` (reading and checking an adapter), ``punica`` (the
per-token slot mapping and the segment gather-matmul), ``manager`` (the slot table and the
CPU-side LRU cache). See docs/lora.md.
"""

from kvflow.lora.request import LoRARequest

__all__ = ["LoRARequest"]
