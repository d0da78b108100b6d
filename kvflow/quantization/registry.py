"""The one registry of weight-quantization schemes: name -> ``QuantizationConfig`` class.

A new scheme is one file with its config and method(s) plus one line here. Nothing here
imports model code.
"""

from __future__ import annotations

from kvflow.quantization.awq import AWQConfig
from kvflow.quantization.base import QuantizationConfig
from kvflow.quantization.fp8 import FP8Config
from kvflow.quantization.gguf import GGUFConfig
from kvflow.quantization.int4 import Int4Config
from kvflow.quantization.int8 import Int8Config

_SCHEMES: dict[str, type[QuantizationConfig]] = {
    cls.name: cls for cls in (Int8Config, Int4Config, AWQConfig, FP8Config, GGUFConfig)
}
_ALIASES = {"int4-rtn": "int4"}

#: Names ``quantization=`` accepts.
QUANTIZATION_METHODS: tuple[str, ...] = tuple(_SCHEMES)
#: Schemes an LM head can take (``quantize_lm_head``).
LM_HEAD_METHODS: tuple[str, ...] = ("int8", "int4", "fp8")
#: Schemes a saved quantized checkpoint (``kvflow quantize``) can hold.
CHECKPOINT_METHODS: tuple[str, ...] = ("int8", "int4", "int4-awq", "fp8")


def canonical_name(name: str) -> str:
    return _ALIASES.get(name, name)


def check_method(method: str | None) -> None:
    """Raises ValueError naming ``quantization`` for an unknown scheme."""
    if method is not None and canonical_name(method) not in _SCHEMES:
        raise ValueError(f"quantization must be one of {list(QUANTIZATION_METHODS)} or None, got {method!r}")


def get_quantization_config(method: str, group_size: int = 32, serialized: bool = False) -> QuantizationConfig:
    """A fresh config of scheme ``method``.

    Raises:
        ValueError: for an unknown scheme.
    """
    check_method(method)
    return _SCHEMES[canonical_name(method)](group_size=group_size, serialized=serialized)
