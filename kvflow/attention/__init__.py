"""Paged attention backends: one small interface (``backend.AttentionBackend``: build a
step's metadata from the batch, write and attend over the paged KV cache), one selector
(``selector.select_attention_backend``) that chooses by device, dtypes and config, and one
file per backend (``torch_backend``, ``cpu_backend``, ``triton_backend``). The paged cache
storage itself (K/V layout, quantized K/V) is ``kv_cache``."""
