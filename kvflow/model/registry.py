"""Architecture registry: a checkpoint's ``model_type`` -> the kvflow model class that runs it.

A new architecture is one model file under ``kvflow/model/`` plus one line in ``_MODELS``.
Classes are imported on first use, so reading this table imports no model code.
"""

from __future__ import annotations

import copy
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

# Multimodal model_types whose language model kvflow serves as a text model: the config's
# ``text_config`` is read, the vision tower's weights are skipped at load (the model class's
# ``skip_weights``), and image inputs are refused by the server. Gemma 3 4B / 12B / 27B are
# released this way (Gemma3ForConditionalGeneration).
TEXT_MODELS_OF: dict[str, str] = {"gemma3": "gemma3_text"}


def text_model_config(hf_config):
    """The config kvflow runs for ``hf_config``: its ``text_config`` for a multimodal
    model_type of ``TEXT_MODELS_OF``, else ``hf_config`` itself.

    Raises:
        ValueError: a multimodal config whose text config is not the expected model_type.
    """
    want = TEXT_MODELS_OF.get(hf_config.model_type)
    if want is None:
        return hf_config
    text = copy.deepcopy(hf_config.get_text_config())
    if getattr(text, "model_type", None) != want:
        raise ValueError(f"{hf_config.model_type}: expected a text_config of model_type {want!r}, "
                         f"got {getattr(text, 'model_type', None)!r}")
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):  # the released configs set these at the top
        if getattr(hf_config, key, None) is not None:
            setattr(text, key, getattr(hf_config, key))
    return text


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
