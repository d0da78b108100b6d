"""Build a model, load its weights and quantize it: the one path from a model folder to a
ready ``CausalLM`` (this rank's shard under tensor parallelism).

Steps (``build_model``, over a resolved ``ModelConfig`` and ``LoadConfig``: what the folder
holds, a saved quantized checkpoint included, is known before loading; ``load_model`` reads
the folder's config first):

1. the architecture's class from ``kvflow.model.registry``, built directly in the serving
   dtype on the target device, or in float32 when a scheme quantizes it (quantization reads
   float32 weights, so a saved checkpoint reloads to exactly the model quantized at load);
   every linear layer takes its method from the scheme (``kvflow.quantization.registry``);
2. the weights: Hugging Face-named tensors through each layer's ``weight_loader`` (which takes
   this rank's slice), or a saved quantized checkpoint's state dict;
3. the scheme's model-level pass (``QuantizationConfig.prepare_model``: AWQ's rescaling, the
   GGUF tensors' plan), then every linear's ``process_weights_after_loading`` (quantize,
   repack);
4. the optional quantized LM head, the move to the serving dtype, and on the CPU the oneDNN
   prepacking of the dense bfloat16 / float16 linears and LM head.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import nn

from kvflow.config import LoadConfig, ModelConfig
from kvflow.distributed.parallel_state import TensorParallel
from kvflow.layers.gguf_kernels import GGUFWeight
from kvflow.layers.linear import UnquantizedLinearMethod, linear_layers
from kvflow.layers.moe import moe_layers
from kvflow.model import registry
from kvflow.model.resolve import gguf_source, iter_weights, load_config, load_tokenizer
from kvflow.quantization.checkpoint import quantization_of
from kvflow.quantization.registry import get_quantization_config


def process_weights_after_loading(model: nn.Module) -> None:
    """Run every linear and mixture-of-experts layer's ``quant_method.process_weights_after_loading``."""
    for layer in [*linear_layers(model), *moe_layers(model)]:
        layer.quant_method.process_weights_after_loading(layer)


def pack_for_cpu(model: nn.Module) -> int:
    """Prepack the dense bfloat16 / float16 CPU linears and the LM head for oneDNN
    (``kvflow.layers.linear``); float32 and quantized layers stay as they are.

    Returns:
        Extra bytes held: the packed LM head is a copy when the embeddings are tied (the
        lookup table stays dense), else the dense head is dropped (0 extra).
    """
    for layer in linear_layers(model):
        if isinstance(layer.quant_method, UnquantizedLinearMethod):
            layer.quant_method.process_weights_after_loading(layer)
    return model.lm_head.pack_for_cpu()


def quantize_model(model: nn.Module, method: str, group_size: int = 32, calibration_ids: list[int] | None = None) -> None:
    """Quantize a loaded float model's decoder linears in place (as loading with
    ``quantization=method`` does; the model must not be packed for the CPU yet).

    Args:
        model: a float model.
        method: "int8", "int4" (round-to-nearest), "int4-awq" (needs ``calibration_ids``) or
            "fp8".
        group_size: INT4 group size (32, 64 or 128); a linear whose in_features it does not
            divide uses the largest halving of it that does.
        calibration_ids: token ids of real text for AWQ (a few hundred tokens suffice).

    Raises:
        ValueError: for an unknown method, "gguf" (a load-time format), or AWQ without
            calibration data.
    """
    config = get_quantization_config(method, group_size)
    if config.name == "gguf":
        raise ValueError("quantization='gguf' applies to GGUF files at load time (kvflow.quantization.gguf)")
    for layer in linear_layers(model):
        if getattr(layer, "keep_float", False):  # built without the scheme (a MoE router)
            continue
        # A float layer holds exactly what a scheme's method loads before quantizing it.
        layer.quant_method = config.get_linear_method(layer, layer.prefix)
    for layer in moe_layers(model):
        layer.quant_method = config.get_moe_method(layer, layer.prefix)
    config.prepare_model(model, {"calibration_ids": calibration_ids})
    process_weights_after_loading(model)


def load_model(
    model_dir: str | os.PathLike,
    dtype: torch.dtype,
    device: torch.device,
    quantization: str | None = None,
    group_size: int = 32,
    tp: TensorParallel | None = None,
    quantize_lm_head: bool | str = False,
    calibration_ids: list[int] | None = None,
    max_model_len: int | None = None,
    model_config: ModelConfig | None = None,
) -> tuple[nn.Module, ModelConfig]:
    """Read a folder's architecture (unless ``model_config`` is given) and ``build_model``:
    the entry point for tools and tests that start from a folder. The engine resolves the
    config once (``EngineArgs.create_config``) and calls ``build_model`` itself.

    Args:
        model_dir, dtype, device, quantization, group_size, tp, quantize_lm_head,
            calibration_ids: as ``build_model``.
        max_model_len: the engine's context limit in tokens (``ModelConfig.max_model_len``;
            it fixes LongRoPE's factor set and decides whether a sliding window would act),
            or None for the model's context.
        model_config: the folder's architecture when already read, else read from
            ``model_dir`` (``kvflow.model.registry.model_config``).

    Returns:
        The model and the full model's ``ModelConfig``.

    Raises:
        ValueError: as ``build_model``; an unsupported architecture (``registry.model_config``).
    """
    if model_config is None:
        model_config = registry.model_config(load_config(model_dir))
    if max_model_len is not None:
        model_config = dataclasses.replace(model_config, max_model_len=max_model_len)
    load = resolve_load_config(str(model_dir), model_dir, quantization, group_size, quantize_lm_head)
    return build_model(model_config, load, dtype, device, tp, calibration_ids), model_config


def resolve_load_config(model: str, model_dir: str | os.PathLike, quantization: str | None = None,
                        group_size: int = 32, quantize_lm_head: bool | str = False) -> LoadConfig:
    """What loading ``model_dir`` means, resolved before anything loads: a saved quantized
    checkpoint (its config.json's ``kvflow_quantization``: ``kvflow.quantization.checkpoint``)
    loads with the scheme and group size it was saved with (``serialized``), whatever
    ``quantization`` says; any other folder with ``quantization`` / ``group_size``.

    Args:
        model: the model as the user named it.
        model_dir: the resolved Hugging Face-format folder.
        quantization, group_size, quantize_lm_head: as ``build_model``'s ``LoadConfig``.
    """
    saved = quantization_of(model_dir)
    if saved is not None:
        return LoadConfig(model, str(model_dir), saved["method"], saved["group_size"], quantize_lm_head, serialized=True)
    return LoadConfig(model, str(model_dir), quantization, group_size, quantize_lm_head)


def build_model(
    model_config: ModelConfig,
    load: LoadConfig,
    dtype: torch.dtype,
    device: torch.device,
    tp: TensorParallel | None = None,
    calibration_ids: list[int] | None = None,
) -> nn.Module:
    """Build and load a model of a resolved architecture (this rank's shard under tensor
    parallelism); see the module docstring for the steps. Reads no config: ``model_config``
    and ``load`` are what ``EngineArgs.create_config`` (or ``load_model``) resolved.

    Args:
        model_config: the full model's architecture (``max_model_len`` set by the engine).
        load: what to load (``LoadConfig``): ``model_dir``, a Hugging Face-format folder
            (``kvflow.model.resolve.resolve_model``) or a saved quantized checkpoint
            (``serialized``); ``quantization``, a scheme of ``kvflow.quantization.registry``
            or None; ``group_size``, the INT4 group size; ``quantize_lm_head``, True for the
            scheme's head method (``lm_head_method``), or "int8", "int4", "fp8" (False keeps
            the head dense). ``resolve_load_config`` makes one.
        dtype: the serving dtype.
        device: where the model lives.
        tp: this rank's tensor-parallel place, or None.
        calibration_ids: AWQ calibration tokens (default: the default text).

    Returns:
        The model (this rank's shard).

    Raises:
        ValueError: an unsupported option (a config field the model refuses is named), a
            checkpoint that does not match the model, or tensor parallelism over a compact
            GGUF / saved quantized checkpoint.
    """
    model_cls = registry.model_class(model_config.model_type)
    model_dir, quantization, quantize_lm_head = load.model_dir, load.quantization, load.quantize_lm_head
    if tp is not None and load.serialized:
        raise ValueError("tensor parallelism loads float or GGUF checkpoints (a saved quantized checkpoint cannot be "
                         "sharded yet); load the float model with quantization='int8'/'int4'/'fp8' instead")
    quant_config = None
    if quantization is not None:
        quant_config = get_quantization_config(quantization, load.group_size, serialized=load.serialized)
    # Build the parameters directly in the target dtype when nothing is quantized from them,
    # so that loading never holds a float32 copy of a bfloat16 model.
    build_dtype = (quant_config.build_dtype() if quant_config is not None else None) or dtype
    previous = torch.get_default_dtype()
    torch.set_default_dtype(build_dtype)
    try:
        with torch.device(device):
            model = model_cls(model_config, tp, quant_config)
    finally:
        torch.set_default_dtype(previous)
    if load.serialized:
        load_quantized(model, model_dir)
    else:
        # A GGUF scheme takes the file's quantized blocks as stored (no float copy).
        _load_weights(model, model_dir, native=getattr(quant_config, "native_gguf", False))
    model.eval()
    if quant_config is not None:
        context: dict[str, Any] = {
            "model_dir": model_dir, "load_tokenizer": lambda: load_tokenizer(model_dir), "calibration_ids": calibration_ids,
        }
        quant_config.prepare_model(model, context)
    process_weights_after_loading(model)
    if getattr(quant_config, "native_gguf", False) and device.type == "cpu":
        from kvflow.quantization.gguf import pack_lm_head

        pack_lm_head(model)  # chunk by chunk: the stored head and its packed copy never both resident
    if quantize_lm_head:
        if quant_config is None:
            raise ValueError(f"quantize_lm_head needs a quantized model (quantization int8, int4, int4-awq, fp8 "
                             f"or gguf), got quantization={quantization!r}")
        head_method = quant_config.lm_head_method() if quantize_lm_head is True else quantize_lm_head
        stored = model.lm_head.stored_gguf
        if stored is not None and quantize_lm_head is not True:
            raise ValueError(f"quantize_lm_head={quantize_lm_head!r}: this GGUF file's LM head is stored quantized "
                             f"({getattr(stored.qtype, 'name', stored.qtype)}) and is computed as "
                             "stored; quantization='none' dequantizes the file first if another head scheme is wanted")
        model.lm_head.quantize(head_method, quant_config.group_size)
    # Quantized storage keeps its dtype (``LinearBase._apply``); the rest moves to dtype.
    model.to(device=device, dtype=dtype)
    if device.type == "cpu":
        pack_for_cpu(model)
    return model


def load_quantized(model: nn.Module, model_dir: str | os.PathLike) -> None:
    """Fill a model built with its scheme in serialized mode (``get_quantization_config(...,
    serialized=True)``) from a saved checkpoint folder's ``model.safetensors``.

    Raises:
        ValueError: when the checkpoint's tensors do not match the model.
    """
    missing, unexpected = model.load_state_dict(load_file(str(Path(model_dir) / "model.safetensors")), strict=False)
    missing = [m for m in missing if not m.startswith("rotary")]
    if missing or unexpected:
        raise ValueError(f"quantized checkpoint does not match the model: missing {missing[:3]}, unexpected {unexpected[:3]}")


def _load_weights(model: nn.Module, model_dir: str | os.PathLike, native: bool) -> None:
    """``model.load_weights`` over the folder's tensors (``iter_weights``). For a folder made
    from a GGUF file, a tensor the model refuses is named with the file and the type the
    file stores it in; nothing of the model stays referenced (its mapped tensors are
    unmapped when the exception is dropped).

    Raises:
        ValueError: as ``CausalLM.load_weights`` (plus the GGUF file and stored type).
    """
    source = gguf_source(model_dir)
    last: list[Any] = [None]

    def tracked() -> Any:
        for item in iter_weights(model_dir, native=native):
            last[0] = item
            yield item

    try:
        model.load_weights(tracked())
    except ValueError as exc:
        if source is None:
            raise
        stored = last[0][1] if last[0] is not None else None
        kind = stored.qtype.name if isinstance(stored, GGUFWeight) else str(getattr(stored, "dtype", "?"))
        last[0] = stored = None
        raise ValueError(f"{source}: {exc} (the file's tensor, loaded as {kind})") from None
