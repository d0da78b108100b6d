"""What kvflow knows about one architecture, declared in the model's own file.

A model class (a ``CausalLM`` subclass) lists in ``arch_specs`` one ``ArchSpec`` per
Hugging Face ``model_type`` it runs; ``kvflow.model.registry`` collects them. Everything
outside the model file that depends on the architecture reads the spec: the HF config ->
``ModelConfig`` facts (``attention_bias`` forced on, a multimodal wrapper's text config), and
the GGUF reading of ``kvflow.model.resolve`` (which transformers config class the metadata
fills, tensor names, Q/K row permutation, norm weights stored as ``1 + w``, metadata that
becomes config fields). ``resolve.py`` and ``config.py`` name no architecture.

GGUF tensor names come from gguf-py's ``gguf.constants`` (``MODEL_TENSOR`` and
``TENSOR_NAMES``: the names llama.cpp's converter writes); metadata keys are the GGUF spec's
``{arch}.*`` keys (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import gguf
import numpy as np

T = gguf.MODEL_TENSOR

# GGUF per-layer tensor (gguf-py MODEL_TENSOR) -> HF module path under ``model.layers.{i}.``:
# the Llama layout every Llama-shaped architecture shares (a spec overrides entries).
GGUF_LAYER_TENSORS: Mapping[gguf.MODEL_TENSOR, str] = MappingProxyType({
    T.ATTN_Q: "self_attn.q_proj",
    T.ATTN_K: "self_attn.k_proj",
    T.ATTN_V: "self_attn.v_proj",
    T.ATTN_OUT: "self_attn.o_proj",
    T.ATTN_QKV: "self_attn.qkv_proj",  # fused (phi3)
    T.ATTN_Q_NORM: "self_attn.q_norm",  # per-head q/k RMSNorm (Qwen3, Gemma 3)
    T.ATTN_K_NORM: "self_attn.k_norm",
    T.FFN_GATE: "mlp.gate_proj",
    T.FFN_UP: "mlp.up_proj",
    T.FFN_DOWN: "mlp.down_proj",
    T.ATTN_NORM: "input_layernorm",
    T.FFN_NORM: "post_attention_layernorm",
})
# Whole-model GGUF tensors -> HF module path.
GGUF_GLOBAL_TENSORS: Mapping[gguf.MODEL_TENSOR, str] = MappingProxyType({
    T.TOKEN_EMBD: "model.embed_tokens",
    T.OUTPUT_NORM: "model.norm",
    T.OUTPUT: "lm_head",
})


def gguf_layer_name(tensor: gguf.MODEL_TENSOR) -> str:
    """The layer-relative GGUF name of ``tensor``: ``attn_q`` for ``blk.{bid}.attn_q``."""
    return gguf.TENSOR_NAMES[tensor].removeprefix("blk.{bid}.")


_MISSING: Any = object()


class GGUFMetadata:
    """A GGUF file's metadata and tensor table as the spec hooks see them.

    Attributes:
        arch: ``general.architecture``.
        tensors: tensor name -> a tensor with ``gguf.ReaderTensor``'s ``name``, ``shape``
            (ggml order), ``tensor_type`` and ``data`` (read when asked for).
    """

    def __init__(self, values: Mapping[str, Any], tensors: Mapping[str, Any], source: str = "GGUF file") -> None:
        """``values``: metadata key -> value (``gguf.ReaderField.contents()``'s form);
        ``tensors``: name -> tensor (above); ``source``: named in errors. Prefer
        ``from_file`` (which skips the vocabulary) or ``from_reader``.

        Raises:
            ValueError: ``general.architecture`` is missing, or the file is a shard of a split
                model (``split.count`` > 1), naming ``source``.
        """
        self.values = values
        self.source = source
        self.tensors: dict[str, Any] = dict(tensors)
        shards = values.get("split.count")
        if isinstance(shards, (int, np.integer)) and shards > 1:
            raise ValueError(f"{source} is shard {int(values.get('split.no', 0)) + 1} of {shards} of a split GGUF "
                             "model (llama.cpp's gguf-split), which kvflow does not read: merge the shards into one file "
                             "with `llama-gguf-split --merge FIRST_SHARD.gguf OUT.gguf` and pass that")
        if values.get("general.architecture") is None:
            raise ValueError(f"{source}: GGUF metadata key 'general.architecture' is missing, which every model file "
                             "has (it names the architecture)")
        self.arch: str = self.get("general.architecture")

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> GGUFMetadata:
        """Read ``path``'s header with ``kvflow.model.gguf_file.read_header`` (scalars and
        numeric arrays; the vocabulary's string arrays skipped; tensor data read on access).

        Raises:
            ValueError: the file is not a readable GGUF file, or ``general.architecture`` is
                missing (naming it).
        """
        from kvflow.model.gguf_file import read_header

        header = read_header(path)
        return cls(header.metadata, {i.name: _FileTensor(header.path, i) for i in header.tensors}, str(path))

    @classmethod
    def from_reader(cls, reader: gguf.GGUFReader) -> GGUFMetadata:
        """Over an open ``gguf.GGUFReader`` (every value already parsed)."""
        values = {key: field.contents() for key, field in reader.fields.items()}
        return cls(values, {tensor.name: tensor for tensor in reader.tensors}, str(getattr(reader.data, "filename", None) or "GGUF file"))

    def get(self, key: str, default: Any = _MISSING) -> Any:
        """The value of metadata ``key``, else ``default``.

        Raises:
            KeyError: naming the key, when it is missing and no default is given.
        """
        value = self.values.get(key)
        if value is None:
            if default is _MISSING:
                raise KeyError(f"GGUF metadata key {key!r} is missing")
            return default
        return value

    def arch_get(self, key: str, default: Any = _MISSING) -> Any:
        """``get(f"{arch}.{key}")``: an architecture-scoped key (``rope.freq_base``, ...)."""
        return self.get(f"{self.arch}.{key}", default)


class _FileTensor:
    """A tensor of a GGUF file whose ``data`` is read (``pread``) when asked for."""

    def __init__(self, path: os.PathLike[str], info: Any) -> None:
        self.path, self.info = path, info
        self.name, self.shape, self.tensor_type = info.name, info.shape, info.tensor_type

    @property
    def data(self) -> Any:
        """The stored values (``kvflow.model.gguf_file.GGUFTensorInfo.read``'s form)."""
        with open(self.path, "rb", buffering=0) as file:
            return self.info.read(file)


# (metadata, the config fields read so far) -> more config fields; may replace read ones.
ConfigFieldsHook = Callable[[GGUFMetadata, dict[str, Any]], dict[str, Any]]


@dataclass(frozen=True)
class ArchSpec:
    """One Hugging Face ``model_type`` a model class runs, and how to read it from GGUF.

    Attributes:
        model_type: transformers' ``config.model_type`` ("llama", "qwen2", ...).
        hf_config_class: the transformers config class of this ``model_type``, or its name in
            ``transformers``; the GGUF metadata fills it, and ``registry.register_model``
            registers a class transformers lacks with ``AutoConfig``. None: no GGUF reading.
        hf_architecture: ``config.architectures[0]`` written for a GGUF file (None: the
            config class name with "Config" replaced by "ForCausalLM").
        gguf_arch: the GGUF ``general.architecture`` read as this model_type (None: none).
        gguf_experts: files of ``gguf_arch`` with ``{arch}.expert_count`` > 0 are this model
            (llama.cpp writes Mixtral as arch "llama" with experts), else those without.
        gguf_tensor_names: per-layer GGUF tensor -> HF module path, over ``GGUF_LAYER_TENSORS``.
        gguf_moe_block: the MoE block's module path and GGUF expert tensor -> HF projection
            name (stacked ``ffn_*_exps`` tensors [n_expert, out, in] are split per expert).
        gguf_qk_permuted: Q/K rows stored in llama.cpp's ``LlamaModel.permute`` order (undone).
        gguf_norm_offset: subtracted from every ``*norm.weight`` (llama.cpp stores Gemma's
            ``1 + w``).
        gguf_attention_bias_from_tensors: ``attention_bias`` is whether ``blk.0.attn_q.bias``
            exists.
        gguf_partial_rotary: ``{arch}.rope.dimension_count`` < head_dim is allowed (the hook
            sets ``partial_rotary_factor``); else refused.
        gguf_config_tensors: GGUF tensors that are config fields, not weights.
        gguf_config_fields: hook adding the config fields only this architecture's metadata
            holds (``ConfigFieldsHook``).
        attention_bias: True when the architecture always has Q/K/V biases whatever its
            config says (Qwen2's config has no field for it); None: the config's
            ``attention_bias``.
        text_model_of: multimodal model_types whose ``text_config`` is this model_type (the
            vision tower is skipped at load, images refused).
    """

    model_type: str
    hf_config_class: type | str | None = None
    hf_architecture: str | None = None
    gguf_arch: str | None = None
    gguf_experts: bool = False
    gguf_tensor_names: Mapping[gguf.MODEL_TENSOR, str] = field(default_factory=dict)
    gguf_moe_block: tuple[str, Mapping[gguf.MODEL_TENSOR, str]] | None = None
    gguf_qk_permuted: bool = False
    gguf_norm_offset: float = 0.0
    gguf_attention_bias_from_tensors: bool = False
    gguf_partial_rotary: bool = False
    gguf_config_tensors: tuple[gguf.MODEL_TENSOR, ...] = ()
    gguf_config_fields: ConfigFieldsHook | None = None
    attention_bias: bool | None = None
    text_model_of: tuple[str, ...] = ()

    def config_class(self) -> type:
        """The transformers config class (``hf_config_class`` resolved)."""
        import transformers

        cls = self.hf_config_class
        return getattr(transformers, cls) if isinstance(cls, str) else cls

    def layer_tensors(self) -> dict[str, str]:
        """Layer-relative GGUF name (``attn_q``) -> HF module path, overrides applied."""
        names = {gguf_layer_name(tensor): path for tensor, path in GGUF_LAYER_TENSORS.items()}
        names.update((gguf_layer_name(tensor), path) for tensor, path in self.gguf_tensor_names.items())
        return names

    def moe_tensors(self) -> tuple[str, dict[str, str]] | None:
        """(MoE block path, layer-relative GGUF expert tensor name -> HF projection), or None."""
        if self.gguf_moe_block is None:
            return None
        block, projections = self.gguf_moe_block
        return block, {gguf_layer_name(tensor): name for tensor, name in projections.items()}

    def config_tensor_names(self) -> tuple[str, ...]:
        """GGUF tensor names (``rope_factors_long.weight``) that are config fields."""
        return tuple(f"{gguf.TENSOR_NAMES[tensor]}.weight" for tensor in self.gguf_config_tensors)


def float32_value(value: float) -> float:
    """The shortest decimal that rounds to the same float32 (GGUF stores e.g. 1e-5 as float32)."""
    import numpy as np

    return float(str(np.float32(value)))


# Shared by the MoE architectures' hooks: GGUF `{arch}.expert_gating_func` softmax
# (llama.cpp LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX).
GATING_SOFTMAX = 1


def gguf_moe_fields(meta: GGUFMetadata, num_layers: int) -> tuple[dict[str, Any], list[int]]:
    """The MoE fields every MoE architecture reads (``num_experts_per_tok``) and the layers
    without a router tensor (dense layers).

    Raises:
        NotImplementedError: a gating function other than softmax, or shared experts.
    """
    gating = meta.arch_get("expert_gating_func", GATING_SOFTMAX)
    if int(gating) != GATING_SOFTMAX:
        raise NotImplementedError(f"GGUF {meta.arch}.expert_gating_func={gating} is not supported (only softmax, 1)")
    shared = int(meta.arch_get("expert_shared_count", 0))
    if shared:
        raise NotImplementedError(f"GGUF {meta.arch}.expert_shared_count={shared}: shared experts are not supported here")
    router = gguf_layer_name(T.FFN_GATE_INP)
    dense = [i for i in range(num_layers) if f"blk.{i}.{router}.weight" not in meta.tensors]
    return {"num_experts_per_tok": int(meta.arch_get("expert_used_count"))}, dense
