"""Engine configuration: the small typed configs each part of the engine reads.

``ModelConfig`` (architecture facts from the checkpoint), ``CacheConfig`` (paged KV cache),
``SchedulerConfig`` (batching) and the rest, gathered in one ``EngineConfig``. They are
plain frozen dataclasses: this module resolves nothing. ``kvflow.engine.arg_utils.EngineArgs``
(what the user sets) resolves the model and sizes the cache once, in one order, and makes
the ``EngineConfig`` the engine and its workers receive.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch

from kvflow.utils import is_positive_finite

if TYPE_CHECKING:
    from kvflow.core.kv_cache_groups import KVCacheGroups


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
DTYPE_NAMES = tuple(_DTYPES)
"""Every float dtype name ``resolve_dtype`` accepts besides "auto"."""

QUANTIZED_KV_DTYPES = (torch.int8, torch.float8_e4m3fn)
_KV_CACHE_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn}
KV_CACHE_DTYPE_NAMES = ("auto", *_KV_CACHE_DTYPES, *_DTYPES)
"""Every name ``resolve_kv_cache_dtype`` accepts (``kv_cache_dtype`` / ``--kv-cache-dtype``)."""
KV_SCALE_BYTES = 2
"""Bytes of one quantization scale of an int8 / fp8 KV cache (float16, one per token, KV head
and K/V: ``kvflow.attention.kv_cache``)."""


def resolve_kv_cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV cache element dtype: "auto" follows the model dtype (``model_dtype``, already
    resolved); "int8" / "fp8" quantize per token and head; float names as in
    ``resolve_dtype``.

    Raises:
        ValueError: for an unknown name.
    """
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype in _KV_CACHE_DTYPES:
        return _KV_CACHE_DTYPES[kv_cache_dtype]
    try:
        return resolve_dtype(kv_cache_dtype)
    except ValueError:
        raise ValueError(
            f"kv_cache_dtype must be 'auto', 'int8', 'fp8' or a float dtype name, got {kv_cache_dtype!r}"
        ) from None


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """Map a float dtype name ("float32", "bfloat16", "float16", ... : ``DTYPE_NAMES``) to a
    torch dtype (a torch dtype is returned as it is). "auto" depends on the device and is the
    platform's choice (``kvflow.platforms.platform_for(device).resolve_dtype``).

    Raises:
        ValueError: for an unknown name, or "auto".
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        raise ValueError("dtype 'auto' depends on the device: resolve it with kvflow.platforms.platform_for(device)"
                         ".resolve_dtype")
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {['auto', *_DTYPES]}, got {dtype!r}")
    return _DTYPES[dtype]


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


def _check_model_sizes(hf_config: Any) -> None:
    """Refuse a checkpoint config (or a GGUF file's metadata made into one) that no model can
    be built from: a size that is not a positive integer, KV heads that do not divide the
    query heads, a norm epsilon, rotary base or rotary scaling factor that is not a positive
    finite number (a NaN base, or a zero factor, made every logit NaN; a zero head count
    divided by zero).

    Raises:
        ValueError: naming the config field and its value.
    """
    required = ("num_hidden_layers", "num_attention_heads", "hidden_size", "vocab_size", "max_position_embeddings")
    for name in (*required, "num_key_value_heads", "head_dim", "intermediate_size"):  # (the last three: if set)
        value = getattr(hf_config, name, None)
        if (value is not None or name in required) and (isinstance(value, bool) or not isinstance(value, int)
                                                         or value < 1):
            raise ValueError(f"the model config's {name} must be a positive integer, got {value!r}")
    kv = getattr(hf_config, "num_key_value_heads", None)
    if kv is not None and hf_config.num_attention_heads % kv:
        raise ValueError(f"the model config's num_key_value_heads ({kv}) must divide num_attention_heads "
                         f"({hf_config.num_attention_heads})")
    rope = dict(getattr(hf_config, "rope_parameters", None) or {})
    rope = rope.get("full_attention", rope) if isinstance(rope.get("full_attention"), dict) else rope
    for name, value in (("rms_norm_eps", getattr(hf_config, "rms_norm_eps", None)),
                        ("rope_theta", rope.get("rope_theta", getattr(hf_config, "rope_theta", None))),
                        ("rope_parameters' factor", rope.get("factor"))):
        if value is not None and not is_positive_finite(value):
            raise ValueError(f"the model config's {name} must be a positive finite number, got {value!r}")


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
    """Architecture facts of a decoder (the model_types of ``kvflow.model.registry``).

    Built from a Hugging Face ``PretrainedConfig`` by ``kvflow.model.registry.model_config``
    (:meth:`from_hf_config` with the architecture's ``ArchSpec`` facts). Sizes are in
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
    def from_hf_config(cls, hf_config: Any, max_model_len: int | None = None,
                       attention_bias: bool | None = None) -> "ModelConfig":
        """Read the fields of a transformers config as they are; ``max_model_len``: the
        engine's context limit (None: the model's); ``attention_bias``: True where the
        architecture always has Q/K/V biases (None: the config's ``attention_bias``).

        Architecture facts (which model_types kvflow runs, a multimodal config's text
        config, ``attention_bias``) come from the model's ``ArchSpec``: read a checkpoint's
        config with ``kvflow.model.registry.model_config``, which calls this.

        Raises:
            ValueError: ``max_model_len`` exceeds the model's context; a size that is not a
                positive integer (layers, heads, hidden size, vocabulary, context), KV heads
                that do not divide the query heads, an RMS norm epsilon or rotary base that is
                not a positive finite number (``_check_model_sizes``).
        """
        _check_model_sizes(hf_config)
        model_type = hf_config.model_type
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
            attention_bias=bool(attention_bias) or bool(getattr(hf_config, "attention_bias", False)),
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
            cut to the tokens a step is predicted to compute in this time (its duration fitted as a fixed
            part plus a part per token, ``kvflow/core/step_time.py``; 0: no bound).
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
            speculation saves), or None to always speculate. A seeded sampled request's
            tokens then depend on the batch (its draws differ with and without drafts),
            not only on its seed; greedy requests' do not.
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
        serialized: ``model_dir`` is a saved quantized checkpoint (``kvflow quantize``):
            ``quantization`` and ``group_size`` are the ones it was saved with, and the loader
            fills the quantized buffers from its state dict (resolved before loading:
            ``kvflow.model.loader.resolve_load_config``).
    """

    model: str
    model_dir: str
    quantization: str | None = None
    group_size: int = 32
    quantize_lm_head: bool | str = False
    serialized: bool = False


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
        draft: the draft model's own ``EngineConfig`` (``speculative.method ==
            "draft_model"``; None otherwise), resolved with the target's
            (``EngineConfig.with_draft``): what its runner is built from, the same way as
            the target's.
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
    draft: EngineConfig | None = None
    kernels: KernelConfig = field(default_factory=KernelConfig)
    seed: int = 0
    lora: LoRAConfig | None = None

    def with_draft(self, model: ModelConfig, load: LoadConfig | None) -> EngineConfig:
        """This config with its draft's (``draft``): the draft's architecture and load
        settings, a KV block pool of as many blocks as the target's (same block size and
        dtype; prefix caching off, no swap space, one KV cache group), on one rank, without
        speculation or LoRA; device, batching limits and seed as the target's.
        ``EngineArgs.create_config`` calls it once, after sizing the target's pool."""
        cache = CacheConfig(self.cache.block_size, self.cache.num_blocks, self.cache.dtype, enable_prefix_caching=False)
        draft = replace(self, model=model, load=load, cache=cache, parallel=ParallelConfig(), speculative=None,
                        draft=None, lora=None)
        return replace(self, draft=draft)


def _positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
