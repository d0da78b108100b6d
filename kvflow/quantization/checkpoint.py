"""Quantized checkpoints: saving a quantized model, recognizing a saved one.

A quantized checkpoint (``kvflow quantize``) is a folder with the tokenizer files, the
model's ``config.json`` plus a ``kvflow_quantization`` entry ({"method", "group_size"}),
and ``model.safetensors`` holding kvflow's own parameter names (fused ``qkv_proj`` and
``gate_up_proj``) and quantized buffers. ``LLM(model=DIR)`` loads it directly: the loader
builds the model with the scheme's methods in serialized mode (they create the quantized
buffers) and fills them from the state dict (``kvflow.model.loader.load_quantized``).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from safetensors.torch import save_file
from torch import nn

CONFIG_KEY = "kvflow_quantization"


def save_quantized(model: nn.Module, source_dir: str | os.PathLike, out_dir: str | os.PathLike, method: str, group_size: int) -> Path:
    """Write a quantized checkpoint folder (see the module docstring).

    Args:
        model: the quantized model.
        source_dir: the float model's folder (config and tokenizer files are copied).
        out_dir: the folder to write (created).
        method, group_size: recorded in config.json.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    source = Path(source_dir)
    for f in source.iterdir():
        if f.is_file() and (f.name.startswith("tokenizer") or f.name.endswith((".jinja", ".model", ".txt")) or f.name == "special_tokens_map.json"):
            shutil.copy(f, out / f.name)
    config = json.loads((source / "config.json").read_text())
    config[CONFIG_KEY] = {"method": method, "group_size": group_size}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(out / "model.safetensors"))
    return out


def quantization_of(model_dir: str | os.PathLike) -> dict | None:
    """The ``kvflow_quantization`` entry of a folder's config.json, or None."""
    path = Path(model_dir) / "config.json"
    if not path.exists():
        return None
    return json.loads(path.read_text()).get(CONFIG_KEY)


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's saved tensors (parameters and persistent buffers; a tied LM head
    is the embedding, counted once), plus the GGUF blocks a model computes as stored."""
    from kvflow.quantization.gguf import gguf_stored_bytes

    return sum(t.numel() * t.element_size() for t in model.state_dict().values()) + gguf_stored_bytes(model)
