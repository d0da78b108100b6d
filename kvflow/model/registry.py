"""Architecture registry: a checkpoint's ``model_type`` -> the kvflow model class that runs it,
and that class's ``ArchSpec`` (``kvflow.model.arch``).

A new architecture is one model file under ``kvflow/model/`` (the class and its
``arch_specs``) plus one line: an entry of ``_MODELS`` for a built-in model, or a
``register_model(TheClass)`` call for one defined elsewhere (a plugin, a test). Built-in
classes are imported on first use, so reading this table imports no model code.
"""

from __future__ import annotations

import copy
import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvflow.config import ModelConfig
    from kvflow.model.arch import ArchSpec

# model_type (transformers' config.model_type) -> (module under kvflow.model, class name)
_MODELS: dict[str, tuple[str, str] | type] = {
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


def register_model(model_cls: type) -> None:
    """Register ``model_cls`` (a ``CausalLM`` subclass) for every ``model_type`` of its
    ``arch_specs`` (vLLM: ``ModelRegistry.register_model``). A spec's ``hf_config_class``
    that transformers does not know is registered with ``transformers.AutoConfig``, so an HF
    folder of that model_type reads.

    Raises:
        ValueError: the class declares no ``arch_specs``, or a model_type is already taken by
            another class.
    """
    specs = getattr(model_cls, "arch_specs", ())
    if not specs:
        raise ValueError(f"{model_cls.__name__} declares no arch_specs (kvflow.model.arch.ArchSpec)")
    for spec in specs:
        taken = _MODELS.get(spec.model_type)
        if taken is not None and _load(taken) is not model_cls:
            raise ValueError(f"model_type {spec.model_type!r} is already registered to {_load(taken).__name__}")
    for spec in specs:
        _MODELS[spec.model_type] = model_cls
        if isinstance(spec.hf_config_class, type):
            import transformers

            if spec.model_type not in transformers.CONFIG_MAPPING:
                transformers.AutoConfig.register(spec.model_type, spec.hf_config_class)


def _load(entry: tuple[str, str] | type) -> type:
    if isinstance(entry, type):
        return entry
    module, name = entry
    return getattr(importlib.import_module(f"kvflow.model.{module}"), name)


def supported_model_types() -> list[str]:
    return sorted(_MODELS)


def check_supported(model_type: str) -> None:
    """Raises ValueError naming ``model_type`` and the supported ones when kvflow lacks it:
    the registered model_types and the multimodal ones whose language model kvflow runs
    (``ArchSpec.text_model_of``, e.g. ``gemma3``)."""
    if model_type not in _MODELS:
        wrappers = sorted({m for spec in arch_specs() for m in spec.text_model_of})
        also = f", and the language model of {wrappers}" if wrappers else ""
        raise ValueError(f"model_type {model_type!r} is not supported; kvflow runs {supported_model_types()}{also}")


def model_class(model_type: str) -> type:
    """The model class for ``model_type``.

    Raises:
        ValueError: for an unsupported ``model_type``.
    """
    check_supported(model_type)
    return _load(_MODELS[model_type])


def arch_spec(model_type: str) -> ArchSpec:
    """The ``ArchSpec`` its model class declares for ``model_type``.

    Raises:
        ValueError: for an unsupported ``model_type``, or a class that declares no spec for it.
    """
    cls = model_class(model_type)
    for spec in getattr(cls, "arch_specs", ()):
        if spec.model_type == model_type:
            return spec
    raise ValueError(f"{cls.__name__} declares no ArchSpec for model_type {model_type!r}")


def arch_specs() -> list[ArchSpec]:
    """Every registered ``ArchSpec`` (imports every registered model class)."""
    return [arch_spec(model_type) for model_type in supported_model_types()]


def gguf_arch_spec(gguf_arch: str, has_experts: bool) -> ArchSpec:
    """The spec that reads GGUF files of ``general.architecture`` ``gguf_arch`` (with
    ``{arch}.expert_count`` > 0 when ``has_experts``).

    Raises:
        NotImplementedError: naming the architecture and the supported ones.
    """
    specs = [spec for spec in arch_specs() if spec.gguf_arch is not None]
    for spec in specs:
        if spec.gguf_arch == gguf_arch and spec.gguf_experts == has_experts:
            return spec
    if any(spec.gguf_arch == gguf_arch for spec in specs):
        raise NotImplementedError(f"GGUF architecture {gguf_arch!r} "
                                  f"{'with' if has_experts else 'without'} {gguf_arch}.expert_count is not supported")
    names = sorted({spec.gguf_arch for spec in specs})
    raise NotImplementedError(f"GGUF architecture {gguf_arch!r} is not supported ({', '.join(names)} are)")


def text_model_config(hf_config):
    """The config kvflow runs for ``hf_config``: its ``text_config`` for a multimodal
    model_type some spec lists in ``text_model_of``, else ``hf_config`` itself.

    Raises:
        ValueError: a multimodal config whose text config is not the expected model_type.
    """
    if hf_config.model_type in _MODELS:
        return hf_config
    want = next((spec.model_type for spec in arch_specs() if hf_config.model_type in spec.text_model_of), None)
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


def model_config(hf_config: Any, max_model_len: int | None = None) -> ModelConfig:
    """The ``ModelConfig`` of a transformers config of a registered architecture: a
    multimodal config's text config (``text_model_config``), with its spec's facts
    (``ArchSpec.attention_bias``); ``max_model_len`` as ``ModelConfig.from_hf_config``.

    Raises:
        ValueError: the architecture is not one kvflow runs (the message lists them), or
            ``max_model_len`` exceeds the model's context.
    """
    from kvflow.config import ModelConfig

    hf_config = text_model_config(hf_config)
    spec = arch_spec(hf_config.model_type)
    return ModelConfig.from_hf_config(hf_config, max_model_len, attention_bias=spec.attention_bias)
