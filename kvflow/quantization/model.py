"""Quantizing a loaded model, and saving / loading quantized checkpoints.

``quantize_model`` replaces the decoder's linear layers (Q/K/V, output, gate/up and down
projections) by quantized ones in place. Embeddings, the LM head and the norms stay in float.
A quantized checkpoint (``save_quantized``) is a folder with the tokenizer files, the
model's ``config.json`` plus a ``kvflow_quantization`` entry ({"method", "group_size"}),
and ``model.safetensors`` holding kvflow's own parameter names (fused ``qkv_proj`` and
``gate_up_proj``) and quantized buffers; ``LLM(model=DIR)`` loads it directly.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file
from torch import nn

from kvflow.layers.quantized_linear import FP8Linear, Int4Linear, Int8Linear
from kvflow.model.llama import LlamaForCausalLM
from kvflow.quantization.awq import apply_awq, group_size_for

from kvflow.config import QUANTIZATION_METHODS as METHODS  # noqa: E402 - one list for config, CLI and here
LINEAR_NAMES = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
CONFIG_KEY = "kvflow_quantization"


def check_method(method: str | None) -> None:
    """Raises ValueError naming ``quantization`` for an unknown method."""
    if method is not None and method not in METHODS:
        raise ValueError(f"quantization must be one of {list(METHODS)} or None, got {method!r}")


def _linears(model: LlamaForCausalLM):
    for layer in model.layers:
        for name in LINEAR_NAMES:
            parent_name, attr = name.split(".")
            parent = getattr(layer, parent_name)
            yield parent, attr, getattr(parent, attr)


def quantize_model(
    model: LlamaForCausalLM, method: str, group_size: int = 32, calibration_ids: list[int] | None = None
) -> None:
    """Replace the decoder's linears by quantized ones, in place.

    Args:
        model: a float model.
        method: "int8", "int4" (round-to-nearest), "int4-awq" (needs ``calibration_ids``) or
            "fp8".
        group_size: INT4 group size (32, 64 or 128); a linear whose in_features it does not
            divide uses the largest halving of it that does.
        calibration_ids: token ids of real text for AWQ (a few hundred tokens suffice).

    Raises:
        ValueError: for an unknown method or AWQ without calibration data.
    """
    check_method(method)
    if method == "gguf":
        raise ValueError("quantization='gguf' applies to GGUF files at load time (kvflow.quantization.gguf)")
    if method == "int4-awq":
        if not calibration_ids:
            raise ValueError("int4-awq needs calibration_ids (token ids of real text)")
        apply_awq(model, calibration_ids, group_size)
    for parent, attr, linear in _linears(model):
        if method == "int8":
            new = Int8Linear.from_float(linear)
        elif method == "fp8":
            new = FP8Linear.from_float(linear)
        else:
            new = Int4Linear.from_float(linear, group_size_for(linear.in_features, group_size))
        setattr(parent, attr, new)


def empty_quantized_modules(model: LlamaForCausalLM, method: str, group_size: int) -> None:
    """Swap in quantized linears of the right shapes (to be filled by a state dict)."""
    for parent, attr, linear in _linears(model):
        bias = linear.bias is not None
        if method == "int8":
            new: nn.Module = Int8Linear(linear.in_features, linear.out_features, bias)
        elif method == "fp8":
            new = FP8Linear(linear.in_features, linear.out_features, bias)
        else:
            new = Int4Linear(linear.in_features, linear.out_features, bias, group_size_for(linear.in_features, group_size))
        setattr(parent, attr, new)


def save_quantized(model: LlamaForCausalLM, source_dir: str | os.PathLike, out_dir: str | os.PathLike, method: str, group_size: int) -> Path:
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


def load_quantized_weights(model: LlamaForCausalLM, model_dir: str | os.PathLike, method: str, group_size: int) -> None:
    """Fill a freshly built model from a quantized checkpoint folder.

    Raises:
        ValueError: when the checkpoint's tensors do not match the model.
    """
    empty_quantized_modules(model, method, group_size)
    state = load_file(str(Path(model_dir) / "model.safetensors"))
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not m.startswith("rotary")]
    if missing or unexpected:
        raise ValueError(f"quantized checkpoint does not match the model: missing {missing[:3]}, unexpected {unexpected[:3]}")


def quantization_of(model_dir: str | os.PathLike) -> dict | None:
    """The ``kvflow_quantization`` entry of a folder's config.json, or None."""
    path = Path(model_dir) / "config.json"
    if not path.exists():
        return None
    return json.loads(path.read_text()).get(CONFIG_KEY)


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's saved tensors (parameters and persistent buffers; a tied LM head
    is the embedding, counted once)."""
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def default_calibration_ids(tokenizer, num_tokens: int = 512) -> list[int]:
    """Token ids of real English text for AWQ calibration (the GPL-3 license text that
    Debian ships; a different text can be given to ``kvflow quantize --calibration``).

    Raises:
        ValueError: when the file is not there.
    """
    path = Path("/usr/share/common-licenses/GPL-3")
    if not path.exists():
        raise ValueError("int4-awq needs calibration text: pass calibration_ids / --calibration FILE")
    return tokenizer.encode(path.read_text())[:num_tokens]
