"""Engine configuration: what the user sets (``EngineArgs``) and what the parts read.

``EngineArgs`` is the flat, user-facing set of options (the keyword arguments of ``LLM`` and
the CLI flags). ``EngineArgs.create_config()`` validates them and splits them into the small
typed configs that each part of the engine reads: ``ModelConfig`` (architecture facts from
the checkpoint), ``CacheConfig`` (paged KV cache) and ``SchedulerConfig`` (batching).
"""

from __future__ import annotations

import dataclasses
import os
import logging
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

import torch

from kvflow import envs
from kvflow.attention.selector import ATTENTION_BACKENDS, check_attention_backend_name
from kvflow.quantization.registry import LM_HEAD_METHODS, QUANTIZATION_METHODS
from kvflow.utils import parse_bytes

if TYPE_CHECKING:
    from kvflow.core.kv_cache_groups import KVCacheGroups

logger = logging.getLogger(__name__)

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
}

QUANTIZED_KV_DTYPES = (torch.int8, torch.float8_e4m3fn)
_KV_CACHE_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn}
KV_CACHE_DTYPE_NAMES = ("auto", *_KV_CACHE_DTYPES, *_DTYPES)
"""Every name ``resolve_kv_cache_dtype`` accepts (``kv_cache_dtype`` / ``--kv-cache-dtype``)."""
KV_SCALE_BYTES = 2
"""Bytes of one quantization scale of an int8 / fp8 KV cache (float16, one per token, KV head
and K/V: ``kvflow.attention.kv_cache``)."""


def resolve_kv_cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The KV cache element dtype: "auto" follows the model dtype; "int8" / "fp8" quantize
    per token and head; float names as in ``resolve_dtype``.

    Raises:
        ValueError: for an unknown name.
    """
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype in _KV_CACHE_DTYPES:
        return _KV_CACHE_DTYPES[kv_cache_dtype]
    try:
        return resolve_dtype(kv_cache_dtype, device)
    except ValueError:
        raise ValueError(
            f"kv_cache_dtype must be 'auto', 'int8', 'fp8' or a float dtype name, got {kv_cache_dtype!r}"
        ) from None


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """Map a dtype name ("auto", "float32", "bfloat16", "float16", ...) to a torch dtype.

    "auto" is bfloat16 on CUDA; on the CPU it is bfloat16 where oneDNN runs bfloat16
    natively (AVX512-BF16 or AMX-BF16: ``kvflow.layers.linear.onednn_bf16_native``) and
    float32 elsewhere (there bfloat16 is emulated and float32 is as fast or faster);
    ``KVFLOW_CPU_AUTO_DTYPE`` fixes the CPU's choice. The CPU's choice is logged once.

    Raises:
        ValueError: for an unknown name.
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else auto_cpu_dtype()
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {['auto', *_DTYPES]}, got {dtype!r}")
    return _DTYPES[dtype]


_auto_logged: set[torch.dtype] = set()


def auto_cpu_dtype() -> torch.dtype:
    """What ``dtype="auto"`` means on the CPU (see ``resolve_dtype``); logs the choice and
    its reason at INFO, once per process and outcome."""
    from kvflow.layers.linear import onednn_bf16_native

    forced = envs.KVFLOW_CPU_AUTO_DTYPE
    if forced is not None:
        dtype, reason = _DTYPES[forced], f"KVFLOW_CPU_AUTO_DTYPE={forced}"
    elif onednn_bf16_native():
        dtype, reason = torch.bfloat16, "this CPU's oneDNN runs bfloat16 natively (AVX512-BF16 / AMX-BF16)"
    else:
        dtype, reason = torch.float32, "no native bfloat16 in this CPU's oneDNN (AVX512-BF16 / AMX-BF16)"
    if dtype not in _auto_logged:
        _auto_logged.add(dtype)
        logger.info("dtype auto: %s on the CPU (%s; dtype='float32' is the exactness reference)",
                    str(dtype).replace("torch.", ""), reason)
    return dtype


@dataclass(frozen=True)
class KVCacheSpec:
    """The geometry of one rank's paged KV cache: per KV layer, K and V tensors
    [num_blocks, block_size, num_kv_heads, head_dim].

    Attributes:
        num_layers: layers that hold their own K/V (one per cross-layer-sharing group).
        num_kv_heads: this rank's KV heads.
        head_dim: elements per head.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        """KV cache bytes per token, the one formula of the project: 2 (K and V) x layers x
        kv_heads x head_dim x element size; an int8 / fp8 cache adds one float16 scale per
        token, head and K/V (``scale_bytes_per_token``; DESIGN.md, "Reference facts")."""
        elem = torch.tensor([], dtype=dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * elem + self.scale_bytes_per_token(dtype)

    def scale_bytes_per_token(self, dtype: torch.dtype) -> int:
        """The part of ``bytes_per_token`` that is quantization scales: 2 x layers x kv_heads x
        ``KV_SCALE_BYTES`` for an int8 / fp8 cache, 0 for a float one."""
        return 2 * self.num_layers * self.num_kv_heads * KV_SCALE_BYTES if dtype in QUANTIZED_KV_DTYPES else 0


def hybrid_kv_cache_groups(model_config: ModelConfig, disable: bool = False) -> KVCacheGroups | None:
    """The model's ``KVCacheGroups`` when its layers declare more than one attention kind
    (``ModelConfig.sliding_windows``: sliding-window and full layers), else None (one group:
    every layer in one block table), or None when ``disable``d (keep-all)."""
    from kvflow.core.kv_cache_groups import build_kv_cache_groups

    if disable or model_config.cla_share_factor > 1:
        return None
    return build_kv_cache_groups(model_config.sliding_windows)


def groups_page_spec(spec: KVCacheSpec, groups: KVCacheGroups) -> KVCacheSpec:
    """The geometry of one page of a hybrid cache: ``groups.group_size`` layer positions
    (``bytes_per_token`` x block_size is then the bytes of one pool block)."""
    return KVCacheSpec(groups.group_size, spec.num_kv_heads, spec.head_dim)


def kv_layer_count(num_hidden_layers: int, cla_share_factor: int = 1) -> int:
    """Layers that hold their own K/V under cross-layer attention: one per group of
    ``cla_share_factor`` adjacent layers, ceil(layers / factor) (a last, shorter group still
    stores its own).

    Raises:
        ValueError: for a factor below 1.
    """
    if cla_share_factor < 1:
        raise ValueError(f"cla_share_factor must be >= 1, got {cla_share_factor}")
    return -(-num_hidden_layers // cla_share_factor)


def _scaled_rope(scaling: dict[str, Any], max_position_embeddings: int) -> tuple[dict[str, Any], int]:
    """A RoPE scaling dict completed with what ``kvflow.layers.rotary.rope_frequencies``
    reads, and the model's context in tokens under it.

    - "yarn": ``factor`` defaults to max_position_embeddings / original (as transformers);
      the context is max(max_position_embeddings, original x factor) (vLLM's derived length).
    - "dynamic": the unscaled context max_position_embeddings goes in as
      ``original_max_position_embeddings``; the context becomes max_position_embeddings x
      factor (vLLM's; the length its base is fixed for).
    - "longrope" / "su": ``factor`` defaults to max_position_embeddings / original (the
      attention factor's input in transformers); the context stays max_position_embeddings.
    """
    scaling = dict(scaling)
    rope_type = scaling["rope_type"]
    context = max_position_embeddings
    if rope_type in ("yarn", "longrope", "su"):
        original = scaling.setdefault("original_max_position_embeddings", max_position_embeddings)
        if scaling.get("factor") is None:
            scaling["factor"] = max_position_embeddings / original
        if rope_type == "yarn":
            context = max(context, int(original * float(scaling["factor"])))
    elif rope_type == "dynamic":
        scaling["original_max_position_embeddings"] = max_position_embeddings
        context = int(max_position_embeddings * float(scaling["factor"]))
    return scaling, context


@dataclass(frozen=True)
class ModelConfig:
    """Architecture facts of a Llama-shaped decoder (llama, mistral, qwen2, qwen3, phi3).

    Built from a Hugging Face ``PretrainedConfig`` by :meth:`from_hf_config`. Sizes are in
    elements; ``max_position_embeddings`` in tokens: the model's context, which for "yarn"
    and "dynamic" RoPE scaling is the scaled one (as vLLM derives it: ``factor`` x the
    original context), the config's own value otherwise.

    ``partial_rotary_factor``: RoPE rotates the first ``rotary_dim = head_dim x factor``
    dimensions of each head (Phi-3 / Phi-4-mini), 1.0 for all.

    ``max_model_len``: the engine's context limit in tokens when the model is loaded for an
    engine (``kvflow.model.loader.load_model``), else None (``max_position_embeddings``). It
    fixes LongRoPE's factor set (``kvflow.layers.rotary``) and decides whether a sliding
    window would ever act (``context_len``, ``sliding_windows``).

    ``cla_share_factor`` (config.json key of the same name, default 1) enables cross-layer
    attention (Brandon et al. 2024, "Reducing Transformer Key-Value Cache Size with
    Cross-Layer Attention", arXiv 2405.12981, section 2): each group of that many adjacent
    layers shares one K/V, projected and stored by the group's first layer only, which
    divides the KV cache by the factor.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    cla_share_factor: int = 1
    partial_rotary_factor: float = 1.0
    max_model_len: int | None = None
    # The transformers config it was read from (architecture-specific fields), if any.
    hf_config: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.cla_share_factor < 1:
            raise ValueError(f"cla_share_factor must be >= 1, got {self.cla_share_factor}")
        rotary_dim = self.head_dim * self.partial_rotary_factor
        if not (0 < self.partial_rotary_factor <= 1) or int(rotary_dim) % 2 or int(rotary_dim) == 0:
            raise ValueError(
                f"partial_rotary_factor={self.partial_rotary_factor} gives a rotary dimension of {rotary_dim} of "
                f"head_dim {self.head_dim}; kvflow needs an even number of rotated dimensions, 0 < factor <= 1"
            )
        if self.max_model_len is not None and self.max_model_len > self.max_position_embeddings:
            raise ValueError(
                f"max_model_len={self.max_model_len} exceeds the model's context "
                f"({self.max_position_embeddings} tokens)"
            )

    @property
    def rotary_dim(self) -> int:
        """The rotated dimensions of each head (``head_dim`` x ``partial_rotary_factor``)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def context_len(self) -> int:
        """The longest sequence this model will run, in tokens: ``max_model_len`` when the
        engine set it, else ``max_position_embeddings``."""
        return self.max_model_len or self.max_position_embeddings

    @property
    def sliding_windows(self) -> list[int | None]:
        """Per decoder layer, its attention's sliding window in tokens (key j is visible from
        query i when ``i - W < j <= i``, transformers' convention), or None for full causal
        attention.

        Read from the transformers config: ``sliding_window`` with ``layer_types`` (Gemma 3,
        Qwen2/Qwen3 with ``use_sliding_window``: "sliding_attention" layers take the window,
        "full_attention" ones none), or ``sliding_window`` alone for every layer (Mistral,
        Mixtral, Phi-3). A window of at least ``context_len`` tokens never acts and reads as
        None.

        Raises:
            ValueError: naming ``layer_types`` for an attention type other than full /
                sliding, or ``cla_share_factor`` with an acting window (shared K/V layers).
        """
        hf = self.hf_config
        n = self.num_hidden_layers
        window = getattr(hf, "sliding_window", None) if hf is not None else None
        types = list(getattr(hf, "layer_types", None) or []) if hf is not None else []
        unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
        if unknown:
            raise ValueError(f"{self.model_type}: layer_types {unknown} are not supported "
                             "(full_attention, sliding_attention)")
        if not window or window >= self.context_len:
            return [None] * n
        windows = [window if t == "sliding_attention" else None for t in types] if types else [window] * n
        if self.cla_share_factor > 1 and any(windows):
            raise ValueError("cla_share_factor > 1 with a sliding window is not supported")
        return windows

    @property
    def kv_free_window(self) -> int | None:
        """The window after which a request's KV blocks may be freed: the largest window when
        every layer has one (no layer reads further back), else None (a full-attention layer
        reads the whole context: every block is kept)."""
        windows = self.sliding_windows
        return max(windows) if windows and all(windows) else None

    @property
    def num_kv_layers(self) -> int:
        """Layers that hold their own K/V: one per group of ``cla_share_factor`` layers."""
        return kv_layer_count(self.num_hidden_layers, self.cla_share_factor)

    @classmethod
    def from_hf_config(cls, hf_config: Any, max_model_len: int | None = None) -> "ModelConfig":
        """Read a transformers config of an architecture in ``kvflow.model.registry``;
        ``max_model_len``: the engine's context limit (None: the model's).

        A multimodal config whose language model kvflow runs (Gemma 3's "gemma3",
        ``kvflow.model.registry.TEXT_MODELS_OF``) is read as its ``text_config``.

        Raises:
            ValueError: if the architecture is not one kvflow runs (the message lists them),
                or ``max_model_len`` exceeds the model's context.
        """
        from kvflow.model.registry import check_supported, text_model_config

        hf_config = text_model_config(hf_config)

        model_type = hf_config.model_type
        check_supported(model_type)
        num_heads = hf_config.num_attention_heads
        num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or num_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        rope_params = dict(getattr(hf_config, "rope_parameters", None) or {})
        if isinstance(rope_params.get("full_attention"), dict):
            # Per-layer-type parameters (Gemma 3): the full-attention layers' are the model's;
            # the model reads the others (e.g. "sliding_attention") itself.
            rope_params = dict(rope_params["full_attention"])
        legacy_scaling = getattr(hf_config, "rope_scaling", None)
        if legacy_scaling:
            rope_params = {**dict(legacy_scaling), **rope_params}
        rope_theta = rope_params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        rope_type = rope_params.get("rope_type", rope_params.get("type", "default"))
        rope_scaling = None if rope_type == "default" else {**rope_params, "rope_type": rope_type}
        partial_rotary = rope_params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", None))
        context = hf_config.max_position_embeddings
        if rope_scaling is not None:
            rope_scaling, context = _scaled_rope(rope_scaling, context)
        eos = hf_config.eos_token_id
        if isinstance(eos, (list, tuple)):
            eos = eos[0] if eos else None
        return cls(
            model_type=model_type,
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_hidden_layers=hf_config.num_hidden_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=hf_config.rms_norm_eps,
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            max_position_embeddings=context,
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            attention_bias=model_type == "qwen2" or bool(getattr(hf_config, "attention_bias", False)),
            mlp_bias=bool(getattr(hf_config, "mlp_bias", False)),
            bos_token_id=hf_config.bos_token_id,
            eos_token_id=eos,
            cla_share_factor=int(getattr(hf_config, "cla_share_factor", 1) or 1),
            partial_rotary_factor=float(1.0 if partial_rotary is None else partial_rotary),
            hf_config=hf_config,
            max_model_len=max_model_len,
        )

    def kv_cache_spec(self, world_size: int = 1, rank: int = 0) -> KVCacheSpec:
        """Rank ``rank``'s KV cache geometry under ``world_size``-way tensor parallelism
        (KV heads split by ``head_partition``)."""
        from kvflow.distributed.parallel_state import head_partition

        _, kv = head_partition(self.num_attention_heads, self.num_key_value_heads, world_size, rank)
        return KVCacheSpec(self.num_kv_layers, kv[1] - kv[0], self.head_dim)

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """KV cache bytes per token of the whole model (``KVCacheSpec.bytes_per_token``)."""
        return self.kv_cache_spec().bytes_per_token(dtype)


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache layout.

    Attributes:
        block_size: tokens per KV block.
        num_blocks: number of physical blocks in the pool (per layer).
        dtype: element type of the K/V tensors.
        enable_prefix_caching: reuse the K/V of full blocks across requests with the same
            prefix (automatic prefix caching).
        num_cpu_blocks: host-memory blocks for swap preemption (0: no swap space).
        kv_cache_groups: the hybrid layout (``kvflow/core/kv_cache_groups.py``: one block is a
            page of ``group_size`` layers' slices, each group its own block table, sliding
            groups free behind their window), or None: one table, a block holds every layer.
    """

    block_size: int
    num_blocks: int
    dtype: torch.dtype
    enable_prefix_caching: bool = True
    num_cpu_blocks: int = 0
    kv_cache_groups: KVCacheGroups | None = None


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous-batching limits.

    Attributes:
        max_num_batched_tokens: per-step token budget (prefill chunks plus decodes).
        max_num_seqs: at most this many requests run at once.
        max_model_len: context length limit per request, in tokens.
        policy: "fcfs" (arrival order) or "priority" (lower ``priority`` value first, then
            arrival order; preemption takes the lowest priority first).
        preemption_mode: "recompute" or "swap" (to host memory, falling back to recompute
            when the swap space is full).
        max_head_skips: how many times later requests may be admitted past a waiting request
            that does not fit yet, before admission waits for it.
        max_step_seconds: bound on one step's duration, in seconds: a step's token budget is
            cut to what the measured throughput computes in this time (0: no bound).
        max_loras: distinct LoRA adapters one step may use (0: LoRA off).
    """

    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    policy: str = "fcfs"
    preemption_mode: str = "recompute"
    max_head_skips: int = 16
    max_step_seconds: float = 0.0
    max_loras: int = 0


@dataclass(frozen=True)
class LoRAConfig:
    """Multi-LoRA serving (``enable_lora``; see ``kvflow.lora``).

    Attributes:
        max_loras: adapters one step may use (the slot table's size).
        max_lora_rank: the largest adapter rank (slots are this wide).
        max_cpu_loras: validated adapters kept in host memory.
    """

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int = 1


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding settings (``speculative_config`` of ``LLM`` / the CLI).

    Attributes:
        method: "ngram" (prompt lookup, no extra model) or "draft_model".
        num_speculative_tokens: draft tokens k verified per step (>= 1).
        model: the draft model (short name, .gguf or HF directory) for "draft_model".
        prompt_lookup_min, prompt_lookup_max: n-gram sizes for "ngram".
        quantization: weight-only quantization of the draft model ("int8", "int4",
            "int4-awq", "fp8", or None for the target's dtype); a cheaper draft lowers the
            cost ratio c of Leviathan et al. (2023), section 3.4.
        disable_by_batch_size: skip speculation in steps where at least this many requests
            are running (batched decoding already amortizes the weight reads that
            speculation saves), or None to always speculate.
    """

    method: str
    num_speculative_tokens: int
    model: str | None = None
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    quantization: str | None = None
    disable_by_batch_size: int | None = None

    @classmethod
    def from_dict(cls, spec: dict[str, Any]) -> "SpeculativeConfig":
        """Validate a user dict.

        Raises:
            ValueError: naming the field, for an unknown key or an invalid value.
        """
        if not isinstance(spec, dict):
            raise ValueError(f"speculative_config must be a dict, got {type(spec).__name__}")
        known = set(cls.__dataclass_fields__)
        unknown = set(spec) - known
        if unknown:
            raise ValueError(f"speculative_config has unknown keys {sorted(unknown)}; known: {sorted(known)}")
        if spec.get("method") not in ("ngram", "draft_model"):
            raise ValueError(f"speculative_config.method must be 'ngram' or 'draft_model', got {spec.get('method')!r}")
        _positive_int("speculative_config.num_speculative_tokens", spec.get("num_speculative_tokens"))
        if spec["method"] == "draft_model" and not spec.get("model"):
            raise ValueError("speculative_config.model is required for method 'draft_model'")
        if spec.get("disable_by_batch_size") is not None:
            _positive_int("speculative_config.disable_by_batch_size", spec["disable_by_batch_size"])
        if spec.get("quantization") is not None:
            if spec["method"] != "draft_model":
                raise ValueError("speculative_config.quantization applies to method 'draft_model' only")
            if spec["quantization"] not in ("int8", "int4", "int4-awq", "fp8"):
                raise ValueError(
                    "speculative_config.quantization must be 'int8', 'int4', 'int4-awq', 'fp8' or None, "
                    f"got {spec['quantization']!r}"
                )
        config = cls(**spec)
        _positive_int("speculative_config.prompt_lookup_min", config.prompt_lookup_min)
        _positive_int("speculative_config.prompt_lookup_max", config.prompt_lookup_max)
        if config.prompt_lookup_min > config.prompt_lookup_max:
            raise ValueError("speculative_config.prompt_lookup_min must be <= prompt_lookup_max")
        return config


DEFAULT_KV_CACHE_MEMORY_BYTES = 512 * 1024 * 1024
DEFAULT_SWAP_SPACE_BYTES = 256 * 1024 * 1024
# Seconds a tensor-parallel rank waits at the start-up rendezvous and in a collective before
# failing (``EngineArgs.collective_timeout_s``; ``KVFLOW_COLLECTIVE_TIMEOUT_S`` overrides).
DEFAULT_COLLECTIVE_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class DeviceConfig:
    """Where the model runs and in what precision.

    Attributes:
        device: the torch device.
        dtype: weights' and activations' dtype.
        num_threads: torch intra-op threads on the CPU (None: torch's choice).
    """

    device: torch.device = torch.device("cpu")
    dtype: torch.dtype = torch.float32
    num_threads: int | None = None


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor parallelism (Megatron-style, on torch.distributed).

    Attributes:
        tensor_parallel_size: ranks the model is sharded over.
        collective_timeout_s: seconds a rank waits at the start-up rendezvous and in each
            collective before failing.
    """

    tensor_parallel_size: int = 1
    collective_timeout_s: float = 600.0  # DEFAULT_COLLECTIVE_TIMEOUT_S


@dataclass(frozen=True)
class LoadConfig:
    """What to load and how to quantize it.

    Attributes:
        model: the model as the user named it (short name, .gguf file or folder).
        model_dir: the resolved Hugging Face-format folder (``kvflow.model.resolve``).
        quantization: weight-only scheme of ``kvflow.quantization.registry``, or None.
        group_size: INT4 group size.
        quantize_lm_head: False, True (the scheme's head method) or a head scheme name.
    """

    model: str
    model_dir: str
    quantization: str | None = None
    group_size: int = 32
    quantize_lm_head: bool | str = False


@dataclass(frozen=True)
class KernelConfig:
    """Kernel choices.

    Attributes:
        attention_backend: "auto", "torch", "cpu" or "triton", resolved once per engine by
            ``kvflow.attention.selector``.
        enforce_eager: never replay CUDA graphs.
    """

    attention_backend: str = "auto"
    enforce_eager: bool = False


@dataclass(frozen=True)
class EngineConfig:
    """Everything an engine is built from, made once by ``EngineArgs.create_config()`` and
    passed whole to every part (and to every tensor-parallel rank).

    Attributes:
        model: the target model's architecture (``max_model_len`` set).
        cache: the paged KV block pool.
        scheduler: batching limits.
        device: device, dtype, threads.
        load: where the weights come from and their quantization (None: the model is handed
            to the engine built, as tests do).
        parallel: tensor parallelism.
        speculative: speculative decoding, or None.
        draft: the draft model's load settings (``speculative.method == "draft_model"``).
        draft_model: the draft model's architecture.
        kernels: kernel choices.
        seed: seed of the engine generator for requests without their own seed.
        lora: LoRA adapters' limits, or None without ``enable_lora``.
    """

    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    device: DeviceConfig = field(default_factory=DeviceConfig)
    load: LoadConfig | None = None
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    speculative: SpeculativeConfig | None = None
    draft: LoadConfig | None = None
    draft_model: ModelConfig | None = None
    kernels: KernelConfig = field(default_factory=KernelConfig)
    seed: int = 0
    lora: LoRAConfig | None = None


def _option(default: Any, help: str, **cli: Any) -> Any:
    """A dataclass field carrying its documentation: ``help`` is the one text from which the
    class docstring's Attributes section and the CLI flag's help are made; ``cli`` holds
    hints for the flag (``choices``, ``metavar``, ``byte_size``: also parsed from strings
    such as "1GiB" by ``EngineArgs``, ``method_flag``)."""
    return field(default=default, metadata={"help": help, **cli})


@dataclass
class EngineArgs:
    """User-facing engine options (the keyword arguments of ``LLM`` and the CLI flags).

    Each field's documentation is its ``help`` metadata (``EngineArgs.help_text(name)``),
    listed below; the CLI makes one flag per field from it (``--block-size``...).
    """

    model: str = _option(
        "smollm2-135m",
        "a short name of a packaged model (smollm2-135m, qwen2.5-coder-0.5b, qwen2.5-coder-1.5b), a .gguf file "
        "or a Hugging Face directory (see docs/models.md)")
    dtype: str = _option(
        "auto", "weight and activation dtype: auto (bfloat16 on CUDA and on a CPU whose oneDNN runs bfloat16 "
        "natively, AVX512-BF16 / AMX-BF16; float32 on other CPUs), float32 (the exactness reference), bfloat16, "
        "float16", choices=("auto", *_DTYPES))
    device: str | None = _option(None, "cpu or cuda (default: cuda when available)")
    block_size: int = _option(16, "tokens per KV cache block")
    num_kv_blocks: int | None = _option(None, "number of KV blocks; overrides kv_cache_memory_bytes")
    kv_cache_memory_bytes: int | None = _option(
        None, "memory budget for the KV cache: bytes, or a size such as 512MiB, 1GiB (default: 512MiB)",
        byte_size=True)
    max_num_batched_tokens: int = _option(2048, "per-step token budget (prefill chunks plus decodes)")
    max_num_seqs: int = _option(64, "maximum number of concurrently running requests")
    max_step_seconds: float = _option(
        1.0, "bound on one engine step's duration: the step's token budget is cut to what the measured "
        "throughput computes in this many seconds (long prompts then prefill in smaller chunks on a slow or "
        "loaded CPU, so that an abort or a new request waits at most about this long); 0: no bound",
        metavar="SECONDS")
    max_model_len: int | None = _option(None, "context limit in tokens (default: the model's)")
    enable_prefix_caching: bool = _option(True, "reuse cached K/V of shared prompt prefixes")
    disable_hybrid_kv_cache_manager: bool = _option(
        False, "for a model with both sliding-window and full-attention layers (Gemma 3), keep every layer's "
        "KV blocks for the whole context instead of freeing the sliding layers' blocks behind their window")
    scheduling_policy: str = _option("fcfs", "fcfs (arrival order) or priority (lower priority value first)",
                                     choices=("fcfs", "priority"))
    preemption_mode: str = _option("recompute", "recompute or swap (to host memory) when KV blocks run out",
                                   choices=("recompute", "swap"))
    swap_space_bytes: int | None = _option(
        None, "host memory for swapped-out KV blocks: bytes, or a size such as 256MiB (default: 256MiB with "
        "preemption_mode swap, else 0)", byte_size=True)
    quantization: str | None = _option(
        None, "weight-only quantization at load: gguf (compute a GGUF file's quantized tensors as stored, with "
        "native int8-dot kernels; the default for a GGUF model on the CPU unless dtype is float32), int8, int4 "
        "(round-to-nearest), int4-awq, fp8, or none (float weights; a GGUF file is dequantized). A quantized "
        "checkpoint folder (kvflow quantize) loads quantized whatever this says", choices=(*QUANTIZATION_METHODS, "none"))
    quantization_group_size: int = _option(
        32, "INT4 group size: 32, 64 or 128 (32 measured far better than 128 on SmolLM2)", choices=(32, 64, 128))
    quantize_lm_head: bool | str = _option(
        False, "also quantize the LM head: True takes the decoder's scheme (INT4 for int4 / int4-awq, INT8 for "
        "int8 and gguf, FP8 for fp8); int8, int4 or fp8 picks one (e.g. an INT8 head under INT4 decoder "
        "linears). The embedding lookup stays float. Needs quantization (or a quantized checkpoint)",
        choices=LM_HEAD_METHODS, method_flag="--lm-head-quantization")
    kv_cache_dtype: str = _option(
        "auto", "KV cache element type: auto (the model dtype), int8 or fp8 (per-token, per-head scales; "
        "dequantized inside attention), or a float dtype name", choices=KV_CACHE_DTYPE_NAMES)
    speculative_config: dict[str, Any] | None = _option(
        None, 'speculative decoding, e.g. {"method": "ngram", "num_speculative_tokens": 4} (a JSON object on '
        "the command line; see SpeculativeConfig); default: off", metavar="JSON")
    tensor_parallel_size: int = _option(
        1, "shard the model over this many processes (Megatron-style tensor parallelism on torch.distributed: "
        "gloo on the CPU, NCCL on CUDA)")
    collective_timeout_s: float | None = _option(
        None, "seconds a tensor-parallel rank waits at the start-up rendezvous (while the other ranks load "
        "their shards) and in each collective before failing; a rank that exits is detected at once whatever "
        f"this says (default: $KVFLOW_COLLECTIVE_TIMEOUT_S, else {DEFAULT_COLLECTIVE_TIMEOUT_S:.0f})",
        metavar="SECONDS")
    seed: int = _option(0, "seed of the engine's generator for requests without their own seed")
    num_threads: int | None = _option(
        None, "CPU threads for the model (torch intra-op threads); default: torch's choice")
    model_cache_dir: str | None = _option(
        None, "where converted GGUF models are cached (default: $KVFLOW_CACHE_DIR or ~/.cache/kvflow/models)")
    attention_backend: str = _option(
        "auto", "auto (on CUDA: triton when the triton package is installed; on the CPU: cpu when its kernel "
        "builds; else torch), torch (gather + scaled_dot_product_attention, any device), cpu (decode attention "
        "in kvflow's C++ kernel, built on first use; prefill as torch) or triton (needs CUDA, or Triton's CPU "
        "interpreter with TRITON_INTERPRET=1, for tests only)", choices=ATTENTION_BACKENDS)
    pooling: str = _option(
        "last", "how embedding requests (LLM.embed, POST /v1/embeddings) pool the final hidden states when "
        "they do not choose: last (the prompt's last token) or mean (all prompt tokens; no prefix-cache hits)",
        choices=("last", "mean"))
    enforce_eager: bool = _option(
        False, "never use CUDA graphs (otherwise, on CUDA with the triton backend and no tensor parallelism, "
        "decode steps replay CUDA graphs captured at load)")
    enable_lora: bool = _option(
        False, "serve LoRA adapters (PEFT folders) on top of the base model, chosen per request (LoRARequest; on "
        "the server a request's model names the adapter) and mixed in one batch (see docs/lora.md)")
    max_loras: int = _option(1, "with enable_lora: distinct adapters one step may use (the slot table's size)")
    max_lora_rank: int = _option(16, "with enable_lora: the largest adapter rank r accepted")
    max_cpu_loras: int | None = _option(
        None, "with enable_lora: validated adapters kept in host memory, least recently used evicted (default: "
        "max_loras; at least max_loras)")

    def __post_init__(self) -> None:
        # Byte sizes may be written as users write them ("1GiB"); the engine reads ints.
        for f in fields(self):
            value = getattr(self, f.name)
            if f.metadata.get("byte_size") and isinstance(value, str):
                setattr(self, f.name, parse_bytes(value, f.name))

    @classmethod
    def help_text(cls, name: str) -> str:
        """The documentation of field ``name``.

        Raises:
            KeyError: for a name that is not a field.
        """
        return cls.__dataclass_fields__[name].metadata["help"]

    def verify(self) -> None:
        """Check the ranges of the numeric options.

        Raises:
            ValueError: naming the field that is out of range.
        """
        _positive_int("block_size", self.block_size)
        _positive_int("max_num_batched_tokens", self.max_num_batched_tokens)
        _positive_int("max_num_seqs", self.max_num_seqs)
        if isinstance(self.max_step_seconds, bool) or not isinstance(self.max_step_seconds, (int, float)) or not (
                0 <= self.max_step_seconds < float("inf")):
            raise ValueError(f"max_step_seconds must be a number of seconds >= 0, got {self.max_step_seconds!r}")
        _positive_int("tensor_parallel_size", self.tensor_parallel_size)
        if self.num_kv_blocks is not None:
            _positive_int("num_kv_blocks", self.num_kv_blocks)
        if self.kv_cache_memory_bytes is not None:
            _positive_int("kv_cache_memory_bytes", self.kv_cache_memory_bytes)
        if self.max_model_len is not None:
            _positive_int("max_model_len", self.max_model_len)
        if self.num_threads is not None:
            _positive_int("num_threads", self.num_threads)
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}")
        if self.swap_space_bytes is not None and (
            isinstance(self.swap_space_bytes, bool) or not isinstance(self.swap_space_bytes, int) or self.swap_space_bytes < 0
        ):
            raise ValueError(f"swap_space_bytes must be a non-negative integer, got {self.swap_space_bytes!r}")
        if self.speculative_config is not None:
            SpeculativeConfig.from_dict(self.speculative_config)
        from kvflow.quantization.registry import check_method

        if self.quantization != "none":
            check_method(self.quantization)
        resolve_kv_cache_dtype(self.kv_cache_dtype, torch.float32, torch.device("cpu"))
        if not isinstance(self.quantize_lm_head, bool) and self.quantize_lm_head not in LM_HEAD_METHODS:
            raise ValueError(f"quantize_lm_head must be True, False or one of {', '.join(LM_HEAD_METHODS)}, "
                             f"got {self.quantize_lm_head!r}")
        if self.quantization_group_size not in (32, 64, 128):
            raise ValueError(f"quantization_group_size must be 32, 64 or 128, got {self.quantization_group_size!r}")
        if self.device not in (None, "cpu", "cuda") and not str(self.device).startswith("cuda:"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.device is not None and self.device != "cpu" and not torch.cuda.is_available():
            why = "this PyTorch build has no CUDA support" if torch.version.cuda is None else "no CUDA device is visible"
            raise ValueError(f"device={self.device!r}, but {why} (torch {torch.__version__}); use device='cpu' "
                             "or leave device unset to pick CUDA only when it is available")
        if self.collective_timeout_s is not None and (
            isinstance(self.collective_timeout_s, bool) or not isinstance(self.collective_timeout_s, (int, float))
            or not 0 < self.collective_timeout_s < float("inf")
        ):
            raise ValueError(f"collective_timeout_s must be a positive number of seconds, got {self.collective_timeout_s!r}")
        if self.pooling not in ("last", "mean"):
            raise ValueError(f"pooling must be 'last' or 'mean', got {self.pooling!r}")
        check_attention_backend_name(self.attention_backend)
        _positive_int("max_loras", self.max_loras)
        _positive_int("max_lora_rank", self.max_lora_rank)
        if self.max_cpu_loras is not None:
            _positive_int("max_cpu_loras", self.max_cpu_loras)
            if self.max_cpu_loras < self.max_loras:
                raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras ({self.max_loras})")
        if self.enable_lora and self.tensor_parallel_size > 1:
            raise ValueError("enable_lora is not supported with tensor_parallel_size > 1 (kvflow's LoRA deltas are not "
                             "sharded yet); serve adapters with tensor_parallel_size=1")

    def resolved_collective_timeout_s(self) -> float:
        """``collective_timeout_s``, else ``$KVFLOW_COLLECTIVE_TIMEOUT_S``, else the default.

        Raises:
            ValueError: for an environment value that is not a positive number.
        """
        if self.collective_timeout_s is not None:
            return float(self.collective_timeout_s)
        value = envs.KVFLOW_COLLECTIVE_TIMEOUT_S
        return DEFAULT_COLLECTIVE_TIMEOUT_S if value is None else value

    def resolved_quantization(self, requested: str | None, model_dir: str | os.PathLike, model: ModelConfig,
                              device: torch.device) -> str | None:
        """The scheme a model loads with: ``requested`` ("none" -> None); when unset, "gguf" for
        a GGUF model on the CPU (computed as stored) unless ``dtype`` is explicitly "float32"
        (the exactness reference: the file's blocks dequantized) or the model has
        mixture-of-experts layers (their stacked GGUF tensors are not computed as stored
        yet); else None.

        Raises:
            FileNotFoundError: the folder's GGUF file is gone.
        """
        from kvflow.model.resolve import gguf_source

        if requested == "none":
            return None
        if requested is not None:
            return requested
        hf = model.hf_config
        moe = hf is not None and bool(getattr(hf, "num_experts", None) or getattr(hf, "num_local_experts", None))
        if device.type == "cpu" and self.dtype != "float32" and not moe and gguf_source(model_dir) is not None:
            return "gguf"
        return None

    def create_config(self) -> EngineConfig:
        """Validate the options and make the engine's ``EngineConfig``: resolve the model (a
        packaged short name or GGUF file is converted once into a cached folder), read its
        architecture (and the draft model's), and size the KV block pool.

        Raises:
            ValueError: naming the field, for an invalid option, an unsupported model, or a
                budget that holds no block.
            FileNotFoundError: for a model path that does not exist.
        """
        from kvflow.model.resolve import load_config, resolve_model

        self.verify()
        device = self.torch_device()
        dtype = resolve_dtype(self.dtype, device)
        model_dir = resolve_model(self.model, cache_dir=self.model_cache_dir)
        model_config = ModelConfig.from_hf_config(load_config(model_dir), max_model_len=self.max_model_len)
        scheduler = self.scheduler_config(model_config)
        spec = SpeculativeConfig.from_dict(self.speculative_config) if self.speculative_config is not None else None
        draft = draft_model = None
        if spec is not None and spec.method == "draft_model":
            draft_dir = resolve_model(spec.model, cache_dir=self.model_cache_dir)
            draft_model = ModelConfig.from_hf_config(load_config(draft_dir))
            draft = LoadConfig(spec.model, str(draft_dir),
                               self.resolved_quantization(spec.quantization, draft_dir, draft_model, device),
                               self.quantization_group_size)
            if draft_model.vocab_size != model_config.vocab_size:
                raise ValueError(
                    f"speculative_config.model has vocab_size {draft_model.vocab_size}, the target "
                    f"{model_config.vocab_size}: the draft must share the target's vocabulary"
                )
        world = self.tensor_parallel_size
        if world > 1:
            # Every rank has as many blocks, sized for the rank holding the most KV heads (the
            # draft, on rank 0 only, comes on top of the budget).
            kv_spec = max((model_config.kv_cache_spec(world, r) for r in range(world)), key=lambda k: k.num_kv_heads)
            extra = 0
        else:
            # The draft's cache has as many blocks as the target's (it mirrors every request),
            # and both come out of the one KV budget.
            kv_spec = model_config.kv_cache_spec()
            kv_dtype = resolve_kv_cache_dtype(self.kv_cache_dtype, dtype, device)
            extra = draft_model.kv_bytes_per_token(kv_dtype) if draft_model is not None else 0
        groups = hybrid_kv_cache_groups(model_config, self.disable_hybrid_kv_cache_manager)
        if groups is not None:
            kv_spec = groups_page_spec(kv_spec, groups)  # a block is a page of group_size layers
        cache = self.cache_config(kv_spec, dtype, extra_bytes_per_token=extra)
        if groups is not None:
            cache = dataclasses.replace(cache, kv_cache_groups=groups)
        return EngineConfig(
            model=model_config,
            cache=cache,
            scheduler=scheduler,
            device=DeviceConfig(device, dtype, self.num_threads),
            load=LoadConfig(self.model, str(model_dir),
                            self.resolved_quantization(self.quantization, model_dir, model_config, device),
                            self.quantization_group_size, self.quantize_lm_head),
            parallel=ParallelConfig(world, self.resolved_collective_timeout_s()),
            speculative=spec,
            draft=draft,
            draft_model=draft_model,
            kernels=KernelConfig(self.attention_backend, self.enforce_eager),
            seed=self.seed,
            lora=LoRAConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras or self.max_loras)
            if self.enable_lora else None,
        )

    def torch_device(self) -> torch.device:
        if self.device is None:
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def cache_config(self, kv_spec: KVCacheSpec, dtype: torch.dtype, extra_bytes_per_token: int = 0) -> CacheConfig:
        """Size the block pool from ``num_kv_blocks`` or the byte budget (``dtype``: the
        model dtype; the cache's own follows ``kv_cache_dtype``).

        Args:
            kv_spec: the KV cache geometry the pool holds (under tensor parallelism the rank
                with the most KV heads: every rank has the same blocks).
            dtype: the model dtype.
            extra_bytes_per_token: bytes per token of another cache with as many blocks,
                paid from the same budget (a draft model's), 0 for none.

        Raises:
            ValueError: if the budget does not hold a single block.
        """
        dtype = resolve_kv_cache_dtype(self.kv_cache_dtype, dtype, self.torch_device())
        bytes_per_block = kv_spec.bytes_per_token(dtype) * self.block_size
        if self.num_kv_blocks is not None:
            num_blocks = self.num_kv_blocks
        else:
            budget = self.kv_cache_memory_bytes or DEFAULT_KV_CACHE_MEMORY_BYTES
            num_blocks = budget // (bytes_per_block + extra_bytes_per_token * self.block_size)
            if num_blocks < 1:
                raise ValueError(
                    f"kv_cache_memory_bytes={budget} holds no block of "
                    f"{bytes_per_block + extra_bytes_per_token * self.block_size} bytes"
                )
        swap_space = self.swap_space_bytes
        if swap_space is None:
            swap_space = DEFAULT_SWAP_SPACE_BYTES if self.preemption_mode == "swap" else 0
        return CacheConfig(
            block_size=self.block_size,
            num_blocks=num_blocks,
            dtype=dtype,
            enable_prefix_caching=self.enable_prefix_caching,
            num_cpu_blocks=swap_space // bytes_per_block,
        )

    def scheduler_config(self, model_config: ModelConfig) -> SchedulerConfig:
        """The batching limits; the context limit is ``max_model_len`` or the model's.

        Raises:
            ValueError: for a ``max_model_len`` beyond the model's context.
        """
        max_model_len = self.max_model_len or model_config.max_position_embeddings
        if max_model_len > model_config.max_position_embeddings:
            raise ValueError(
                f"max_model_len={max_model_len} exceeds the model's context "
                f"({model_config.max_position_embeddings} tokens)"
            )
        return SchedulerConfig(
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_seqs=self.max_num_seqs,
            max_model_len=max_model_len,
            policy=self.scheduling_policy,
            preemption_mode=self.preemption_mode,
            max_step_seconds=float(self.max_step_seconds),
            max_loras=self.max_loras if self.enable_lora else 0,
        )


def _attributes_doc(cls: type) -> str:
    """An "Attributes:" docstring section from the fields' ``help`` metadata."""
    import textwrap

    lines = ["", "    Attributes:"]
    for f in fields(cls):
        lines += textwrap.wrap(f"{f.name}: {f.metadata['help']}.", width=92, initial_indent=" " * 8,
                               subsequent_indent=" " * 12)
    return "\n".join(lines) + "\n"


EngineArgs.__doc__ = (EngineArgs.__doc__ or "").rstrip() + "\n" + _attributes_doc(EngineArgs)


def _positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
