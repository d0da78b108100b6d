"""Architecture registry: a checkpoint's ``model_type`` -> the kvflow model class that runs it.

A new architecture is one model file under ``kvflow/model/`` plus one line in ``_MODELS``.
Classes are imported on first use, so reading this table imports no model code.
"""

from __future__ import annotations

import importlib

# model_type (transformers' config.model_type) -> (module under kvflow.model, class name)
_MODELS: dict[str, tuple[str, str]] = {
    "llama": ("llama", "LlamaForCausalLM"),
    "mistral": ("llama", "LlamaForCausalLM"),
    "qwen2": ("llama", "LlamaForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "phi3": ("phi3", "Phi3ForCausalLM"),
    "mixtral": ("mixtral", "MixtralForCausalLM"),
    "qwen2_moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "qwen3_moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "gemma3_text": ("gemma3", "Gemma3ForCausalLM"),
}


def supported_model_types() -> list[str]:
    return sorted(_MODELS)


def check_supported(model_type: str) -> None:
    """Raises ValueError naming ``model_type`` and the supported ones when kvflow lacks it."""
    if model_type not in _MODELS:
        raise ValueError(f"model_type {model_type!r} is not supported; kvflow runs {supported_model_types()}")


def model_class(model_type: str) -> type:
    """The model class for ``model_type``.

    Raises:
        ValueError: for an unsupported ``model_type``.
    """
    check_supported(model_type)
    module, name = _MODELS[model_type]
    return getattr(importlib.import_module(f"kvflow.model.{module}"), name)
