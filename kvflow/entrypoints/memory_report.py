"""``kvflow memory``: KV cache bytes per token and per block, attention variants, budgets,
from a model's config alone (no weight is loaded), and the bytes its weights take as stored.

Every size here is in **bytes**, every length in **tokens**. The bytes come from the
engine's own formula, ``kvflow.config.KVCacheSpec.bytes_per_token`` (DESIGN.md, "Reference
facts"; Kwon et al. 2023, PagedAttention, section 2 for the K/V cache itself):

    KV bytes per token = 2 (K and V) x kv_layers x kv_heads x head_dim x bytes per element
                         (+ 2 x kv_layers x kv_heads x 2 for an int8 / fp8 cache's float16 scales)

where ``kv_layers = ceil(num_hidden_layers / cla_factor)`` (``kvflow.config.kv_layer_count``):

- multi-head attention (MHA) keeps one K/V head per query head (``kv_heads = heads``);
- grouped-query attention (GQA, Ainslie et al. 2023, arXiv 2305.13245) shares one K/V head
  among ``heads / kv_heads`` query heads, dividing by that group size;
- multi-query attention (MQA, Shazeer 2019, arXiv 1911.02150) keeps a single K/V head;
- cross-layer attention (CLA, Brandon et al. 2024, arXiv 2405.12981) lets groups of
  ``cla_factor`` adjacent layers share one K/V, dividing the layer count by the sharing
  factor (rounded up: a last, shorter group still stores its own K/V). A model configured
  with CLA (``cla_share_factor`` in config.json / ``ModelConfig``, as kvflow's engine runs
  it) is sized with its factor.

int8 and fp8 caches take 1 byte per element plus one float16 scale per token, K/V head and
K/V, **included** in every number here, as the engine allocates them (``scale_bytes_per_token``
says how much of a token's bytes they are). KV cache dtype names are the engine's
(``kvflow.config.resolve_kv_cache_dtype``; ``auto`` is the engine's default model dtype,
``kvflow.platforms.platform_for(device).resolve_dtype("auto")``: bfloat16 on CUDA and on a CPU whose oneDNN runs bfloat16 natively,
float32 on other CPUs).

The functions are pure: they take a ``KVSpec`` or anything with the same attribute names
(``kvflow.config.ModelConfig`` works as is). ``load_kv_spec`` reads those numbers from a
model argument (HF folder, ``.gguf`` file, packaged short name) without loading weights.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from kvflow.config import QUANTIZED_KV_DTYPES, KVCacheSpec, kv_layer_count, resolve_kv_cache_dtype
from kvflow.platforms import platform_for
from kvflow.utils import human_bytes

DEFAULT_BUDGET_BYTES = 512 * 1024**2
DEFAULT_BLOCK_SIZE = 16


class KVShapeLike(Protocol):
    """What the accounting reads: a ``ModelConfig``, a ``KVSpec`` or any lookalike."""

    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    # optional: cla_share_factor (adjacent layers sharing one K/V; 1 when absent)


def _cla_of(spec: Any) -> int:
    return int(getattr(spec, "cla_share_factor", 1) or 1)


@dataclass(frozen=True)
class KVSpec:
    """The architecture numbers that size a KV cache (same names as ``ModelConfig``).

    Attributes:
        num_hidden_layers: decoder layers.
        num_attention_heads: query heads per layer.
        num_key_value_heads: K/V heads per layer (= heads for MHA, 1 for MQA).
        head_dim: elements per head.
        max_position_embeddings: the model's context length, in tokens.
        cla_share_factor: adjacent layers sharing one K/V (cross-layer attention; 1 = none).
        model_type: HF ``model_type`` ("llama", "qwen2", ...), for display.
        source: where the numbers were read from, for display.
    """

    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    cla_share_factor: int = 1
    model_type: str = "unknown"
    source: str = ""
    sliding_windows: tuple[int | None, ...] | None = None

    @classmethod
    def from_config(cls, config: Any, source: str = "") -> "KVSpec":
        """From a ``ModelConfig``, a transformers ``PretrainedConfig`` or a ``config.json`` dict.

        ``num_key_value_heads`` falls back to ``num_attention_heads`` (MHA) and ``head_dim``
        to ``hidden_size // num_attention_heads`` when absent or null, as transformers'
        Llama does. A multimodal config's ``text_config`` is used when the top level has no
        ``num_hidden_layers``.

        Raises:
            ValueError: a required field (layers, heads, hidden size or head_dim) is missing.
        """
        get = config.get if isinstance(config, dict) else (lambda k, d=None: getattr(config, k, d))
        if get("num_hidden_layers") is None and get("text_config") is not None:
            return cls.from_config(get("text_config"), source)
        layers, heads = get("num_hidden_layers"), get("num_attention_heads")
        if layers is None or heads is None:
            raise ValueError(
                f"{source or 'config'} has no num_hidden_layers / num_attention_heads "
                "(kvflow reads Llama-family config.json fields)"
            )
        kv_heads = get("num_key_value_heads") or heads
        head_dim = get("head_dim")
        if not head_dim:
            hidden = get("hidden_size")
            if hidden is None:
                raise ValueError(f"{source or 'config'} has neither head_dim nor hidden_size")
            head_dim = hidden // heads
        return cls(
            num_hidden_layers=int(layers),
            num_attention_heads=int(heads),
            num_key_value_heads=int(kv_heads),
            head_dim=int(head_dim),
            max_position_embeddings=int(get("max_position_embeddings") or 0),
            cla_share_factor=int(get("cla_share_factor") or 1),
            model_type=str(get("model_type") or "unknown"),
            source=source,
            sliding_windows=_layer_windows(get, int(layers)),
        )


def _layer_windows(get, layers: int) -> tuple[int | None, ...] | None:
    """Per layer, its sliding window (``layer_types`` "sliding_attention" layers, or every
    ``sliding_window_pattern``-th layer global as older Gemma 3 configs say), None: full; None
    when the config has no window (as ``ModelConfig.sliding_windows`` reads it)."""
    window = get("sliding_window")
    if not window:
        return None
    types = get("layer_types")
    if types:
        return tuple(window if t == "sliding_attention" else None for t in types)
    pattern = get("sliding_window_pattern")
    if pattern:
        return tuple(None if (i + 1) % int(pattern) == 0 else window for i in range(layers))
    return (window,) * layers


# ---------------------------------------------------------------------------- formulas
def kv_cache_dtype_for(name: str | torch.dtype, device: torch.device | None = None) -> torch.dtype:
    """The KV cache element dtype of ``name`` as the engine resolves ``kv_cache_dtype`` with its
    default model dtype (``auto``: ``platform_for(device).resolve_dtype("auto")``, bfloat16 on CUDA and on a
    CPU with native bfloat16, float32 on other CPUs; ``device`` defaults to the engine's: CUDA
    when available).

    Raises:
        ValueError: for an unknown name.
    """
    if device is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if isinstance(name, torch.dtype):
        return name
    return resolve_kv_cache_dtype(name, platform_for(device).resolve_dtype("auto"))


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float16`` -> ``"float16"``."""
    return str(dtype).removeprefix("torch.")


def cache_spec(spec: KVShapeLike, kv_heads: int | None = None, cla_factor: int | None = None) -> KVCacheSpec:
    """The whole model's (one rank's) KV cache geometry, optionally with another number of KV
    heads or another cross-layer sharing factor (the variants' rows)."""
    cla = _cla_of(spec) if cla_factor is None else cla_factor
    kv = spec.num_key_value_heads if kv_heads is None else kv_heads
    return KVCacheSpec(kv_layer_count(spec.num_hidden_layers, cla), kv, spec.head_dim)


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold ``num_tokens`` tokens: ceil(num_tokens / block_size)."""
    return -(-num_tokens // block_size)


@dataclass(frozen=True)
class BudgetFit:
    """What a byte budget holds in a paged cache of ``block_size``-token blocks.

    Attributes:
        budget_bytes: the budget, in bytes.
        bytes_per_block: bytes of one block (all layers, K and V).
        blocks: whole blocks that fit: budget // bytes_per_block.
        tokens: tokens those blocks hold: blocks x block_size.
        full_length_requests: requests of ``max_model_len`` tokens that fit at once:
            blocks // ceil(max_model_len / block_size).
        unused_bytes: budget left over after the whole blocks.
    """

    budget_bytes: int
    bytes_per_block: int
    blocks: int
    tokens: int
    full_length_requests: int
    unused_bytes: int


def budget_fit(bytes_per_token: int, block_size: int, budget_bytes: int, max_model_len: int) -> BudgetFit:
    """How many blocks, tokens and full-length requests ``budget_bytes`` holds.

    Raises:
        ValueError: non-positive bytes_per_token, block_size, max_model_len or negative budget.
    """
    if bytes_per_token < 1 or block_size < 1 or max_model_len < 1 or budget_bytes < 0:
        raise ValueError(
            "bytes_per_token, block_size and max_model_len must be positive and budget_bytes "
            f"non-negative; got {bytes_per_token}, {block_size}, {max_model_len}, {budget_bytes}"
        )
    per_block = bytes_per_token * block_size
    blocks = budget_bytes // per_block
    return BudgetFit(
        budget_bytes=budget_bytes,
        bytes_per_block=per_block,
        blocks=blocks,
        tokens=blocks * block_size,
        full_length_requests=blocks // blocks_for(max_model_len, block_size),
        unused_bytes=budget_bytes - blocks * per_block,
    )


@dataclass(frozen=True)
class Variant:
    """One row of the attention-variant comparison.

    Attributes:
        name: "MHA", "GQA", "MQA", "CLA2", "CLA3", "MQA+CLA2".
        kv_heads: K/V heads per KV-storing layer.
        kv_layers: layers that store K/V (layers / cla_factor, rounded up).
        cla_factor: adjacent layers sharing one K/V (1 = no sharing).
        bytes_per_token: KV bytes per token.
        vs_mha: bytes_per_token / the MHA row's.
        configured: True for the row that is the model as configured.
        fit: what the budget holds under this variant.
    """

    name: str
    kv_heads: int
    kv_layers: int
    cla_factor: int
    bytes_per_token: int
    vs_mha: float
    configured: bool
    fit: BudgetFit


def attention_variants(
    spec: KVShapeLike, kv_cache_dtype: str | torch.dtype, block_size: int, budget_bytes: int, max_model_len: int
) -> list[Variant]:
    """The model under MHA, its configured GQA (when 1 < kv_heads < heads), MQA (all without
    cross-layer sharing), CLA2 and CLA3 (over the configured KV heads) and MQA+CLA2 (the
    paper's headline combination); plus a row for the configuration itself when it is none
    of those (e.g. CLA4). Exactly one row is marked ``configured``.

    Same layers, heads, head_dim and dtype throughout; only the K/V sharing changes.

    Raises:
        ValueError: for an unknown KV cache dtype name.
    """
    dtype = kv_cache_dtype_for(kv_cache_dtype)
    heads, kv = spec.num_attention_heads, spec.num_key_value_heads
    cla_cfg = _cla_of(spec)
    rows: list[tuple[str, int, int]] = [("MHA", heads, 1)]
    if 1 < kv < heads:
        rows.append(("GQA", kv, 1))
    rows += [("MQA", 1, 1), ("CLA2", kv, 2), ("CLA3", kv, 3), ("MQA+CLA2", 1, 2)]
    if (kv, cla_cfg) not in {(h, c) for _, h, c in rows}:
        kind = "MHA" if kv == heads else "MQA" if kv == 1 else "GQA"
        rows.append((f"{kind}+CLA{cla_cfg}", kv, cla_cfg))
    mha = cache_spec(spec, heads, 1).bytes_per_token(dtype)
    out = []
    for name, kv_heads, cla in rows:
        configured = (kv_heads, cla) == (kv, cla_cfg)
        geometry = cache_spec(spec, kv_heads, cla)
        bpt = geometry.bytes_per_token(dtype)
        out.append(
            Variant(
                name=name,
                kv_heads=kv_heads,
                kv_layers=geometry.num_layers,
                cla_factor=cla,
                bytes_per_token=bpt,
                vs_mha=bpt / mha,
                configured=configured,
                fit=budget_fit(bpt, block_size, budget_bytes, max_model_len),
            )
        )
    return out


def hybrid_report(spec: KVShapeLike, dtype: torch.dtype, block_size: int, budget_bytes: int,
                  max_model_len: int) -> dict[str, Any] | None:
    """The window-aware KV cache of a model with sliding-window layers, as the engine
    allocates it: the hybrid groups of a model with sliding-window and full layers
    (``kvflow.config.hybrid_kv_cache_groups``), or one group when every layer is windowed (the
    engine then frees the blocks behind the window too); None for any other model: its
    groups, the bytes of one page (a pool block: ``group_size`` layers), ``pool_blocks`` (what the engine's pool holds in the budget), and per full-length request
    the pages held while decoding at the end (steps of one token: every full group's blocks,
    ``ceil((W + block_size - 1) / block_size)`` per sliding group), their bytes, and how many
    such requests fit at once, next to keep-all (``disable_hybrid_kv_cache_manager``)."""
    from kvflow.config import groups_page_spec
    from kvflow.core.kv_cache_groups import build_kv_cache_groups

    windows = getattr(spec, "sliding_windows", None)
    if not windows or _cla_of(spec) > 1:
        return None
    acting = [w if w is not None and w < max_model_len else None for w in windows]
    groups = build_kv_cache_groups(acting)
    if groups is not None:
        group_size, group_windows, padding = groups.group_size, groups.group_windows, groups.num_padding_positions
        bytes_per_page = groups_page_spec(cache_spec(spec), groups).bytes_per_token(dtype) * block_size
    elif all(acting):
        # Every layer windowed (Mistral with a sliding window): one group, a block holds every
        # layer, and the engine frees the blocks behind the largest window (ModelConfig.kv_free_window).
        group_size, group_windows, padding = len(acting), (max(acting),), 0
        bytes_per_page = cache_spec(spec).bytes_per_token(dtype) * block_size
    else:
        return None
    blocks = blocks_for(max_model_len, block_size)
    pages = sum(blocks if w is None else min(blocks, blocks_for(w + block_size - 1, block_size))
                for w in group_windows)
    pool = budget_bytes // bytes_per_page
    keep_all = blocks * cache_spec(spec).bytes_per_token(dtype) * block_size
    return {
        "group_size": group_size,
        "num_groups": len(group_windows),
        "num_sliding_groups": sum(w is not None for w in group_windows),
        "num_padding_positions": padding,
        "windows": sorted({w for w in group_windows if w is not None}),
        "bytes_per_page": bytes_per_page,
        "pool_blocks": pool,
        "pages_per_full_length_request": pages,
        "bytes_per_full_length_request": pages * bytes_per_page,
        "bytes_per_full_length_request_keep_all": keep_all,
        "full_length_requests": pool // pages,
        "saving": 1 - pages * bytes_per_page / keep_all,
    }


def memory_report(
    spec: KVShapeLike,
    kv_cache_dtype: str | torch.dtype,
    block_size: int = DEFAULT_BLOCK_SIZE,
    budget_bytes: int = DEFAULT_BUDGET_BYTES,
    max_model_len: int | None = None,
) -> dict[str, Any]:
    """Everything ``kvflow memory`` prints, as a JSON-ready dict (bytes and tokens).

    ``kv_cache_dtype``: a name as the engine's ``kv_cache_dtype`` ("auto", "fp16", "int8",
    ...) or a torch dtype. ``max_model_len`` defaults to the model's ``max_position_embeddings``.

    Raises:
        ValueError: unknown dtype, no positive max_model_len, one beyond the model's context
            (``max_position_embeddings``, which the engine refuses too), or a budget of no
            bytes.
    """
    dtype = kv_cache_dtype_for(kv_cache_dtype)
    if max_model_len is not None and max_model_len < 1:
        raise ValueError(f"max_model_len must be a positive number of tokens, got {max_model_len}")
    context = spec.max_position_embeddings
    if max_model_len is not None and context and max_model_len > context:
        raise ValueError(f"max_model_len={max_model_len} exceeds the model's context ({context} tokens)")
    if budget_bytes < 1:
        raise ValueError(f"budget must be a positive number of bytes, got {budget_bytes}")
    if block_size < 1:
        raise ValueError(f"block_size must be a positive number of tokens, got {block_size}")
    max_len = max_model_len or spec.max_position_embeddings
    if not max_len or max_len < 1:
        raise ValueError("max_model_len is unknown (the config has no max_position_embeddings); pass --max-model-len")
    layers, kv, hd, cla = spec.num_hidden_layers, spec.num_key_value_heads, spec.head_dim, _cla_of(spec)
    geometry = cache_spec(spec)
    bpt = geometry.bytes_per_token(dtype)
    fit = budget_fit(bpt, block_size, budget_bytes, max_len)
    variants = attention_variants(spec, dtype, block_size, budget_bytes, max_len)
    blocks_per_request = blocks_for(max_len, block_size)
    return {
        "model": {
            "source": getattr(spec, "source", ""),
            "model_type": getattr(spec, "model_type", "unknown"),
            "num_hidden_layers": layers,
            "num_attention_heads": spec.num_attention_heads,
            "num_key_value_heads": kv,
            "head_dim": hd,
            "max_position_embeddings": spec.max_position_embeddings,
            "cla_share_factor": cla,
            "num_kv_layers": geometry.num_layers,
        },
        "kv_cache_dtype": dtype_name(dtype),
        "bytes_per_element": dtype.itemsize,
        "scales": "included" if dtype in QUANTIZED_KV_DTYPES else "none",
        "scale_bytes_per_token": geometry.scale_bytes_per_token(dtype),
        "block_size": block_size,
        "max_model_len": max_len,
        "bytes_per_token": bpt,
        "bytes_per_block": bpt * block_size,
        "blocks_per_full_length_request": blocks_per_request,
        "bytes_per_full_length_request": blocks_per_request * block_size * bpt,
        "budget": asdict(fit),
        "variants": [{**asdict(v), "fit": asdict(v.fit)} for v in variants],
        "hybrid": hybrid_report(spec, dtype, block_size, budget_bytes, max_len),
    }


# ---------------------------------------------------------------------------- parsing, text
def format_report(report: dict[str, Any]) -> str:
    """The human-readable text of ``memory_report``."""
    m = report["model"]
    dtype, elem, bs, max_len = report["kv_cache_dtype"], report["bytes_per_element"], report["block_size"], report["max_model_len"]
    heads, kv = m["num_attention_heads"], m["num_key_value_heads"]
    kind = "MHA" if kv == heads else "MQA" if kv == 1 else f"GQA, {heads // kv if heads % kv == 0 else heads / kv} query heads per KV head"
    bpt, budget = report["bytes_per_token"], report["budget"]
    scales = " (int8/fp8: plus one float16 scale per token per K/V head)" if report["scales"] == "included" else ""
    cla = m["cla_share_factor"]
    layers_text = (
        f"{m['num_kv_layers']} KV layers ({m['num_hidden_layers']} layers / CLA{cla}, rounded up)"
        if cla > 1
        else f"{m['num_hidden_layers']} layers"
    )
    lines = [
        f"model: {m['source']} ({m['model_type']}; config only, no weights loaded)",
        f"  {m['num_hidden_layers']} layers, {heads} attention heads, {kv} KV heads ({kind}), "
        f"head_dim {m['head_dim']}, max_position_embeddings {m['max_position_embeddings']}"
        + (f", cross-layer K/V sharing factor {cla}" if cla > 1 else ""),
        f"KV cache dtype: {dtype} ({elem} byte{'s' if elem > 1 else ''}/element){scales}",
        "",
        f"KV bytes per token:  {bpt:,} B ({human_bytes(bpt)})"
        f" = 2 (K,V) x {layers_text} x {kv} KV heads x {m['head_dim']} head_dim x {elem} B"
        + (f" + {report['scale_bytes_per_token']:,} B of scales" if report["scales"] == "included" else ""),
        f"KV bytes per block:  {report['bytes_per_block']:,} B ({human_bytes(report['bytes_per_block'])}), {bs} tokens per block",
        f"KV bytes per full-length request: {report['bytes_per_full_length_request']:,} B "
        f"({human_bytes(report['bytes_per_full_length_request'])}), {max_len} tokens = "
        f"{report['blocks_per_full_length_request']} blocks",
    ]
    lines += [
        "",
        f"Budget {budget['budget_bytes']:,} B ({human_bytes(budget['budget_bytes'])}): "
        f"{budget['blocks']:,} blocks = {budget['tokens']:,} tokens = "
        f"{budget['full_length_requests']:,} full-length ({max_len}-token) request"
        f"{'' if budget['full_length_requests'] == 1 else 's'}"
        f" ({budget['unused_bytes']:,} B left over)",
        "",
        "Attention variants (same layers, heads, head_dim and dtype; CLA: Brandon et al. 2024, arXiv 2405.12981):",
    ]
    headers = ["variant", "kv_heads", "kv_layers", "bytes/token", "vs MHA", "blocks", "tokens", "full-len reqs", ""]
    rows = []
    for v in report["variants"]:
        rows.append([
            v["name"], str(v["kv_heads"]), str(v["kv_layers"]),
            f"{v['bytes_per_token']:,} ({human_bytes(v['bytes_per_token'])})",
            f"1/{1 / v['vs_mha']:.3g}" if v["vs_mha"] < 1 else "1",
            f"{v['fit']['blocks']:,}", f"{v['fit']['tokens']:,}", f"{v['fit']['full_length_requests']:,}",
            "<- configured" if v["configured"] else "",
        ])
    widths = [max(len(r[i]) for r in [headers, *rows]) for i in range(len(headers))]
    for n, row in enumerate([headers, *rows]):
        lines.append("  " + "  ".join(c.ljust(w) if i in (0, 8) else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))).rstrip())
        if n == 0:
            lines.append("  " + "  ".join("-" * w for w in widths[:-1]))
    lines.append(f"  (blocks/tokens/full-len reqs: what the {human_bytes(budget['budget_bytes'])} budget holds under each variant)")
    h = report.get("hybrid")
    if h is not None:
        lines += [
            "",
            f"Window-aware KV cache (sliding windows {h['windows']}; {h['num_groups']} groups of {h['group_size']} layers, "
            f"{h['num_sliding_groups']} sliding"
            + (f", {h['num_padding_positions']} padding positions" if h["num_padding_positions"] else "") + "):",
            f"  a pool block is a page of {h['group_size']} layers: {h['bytes_per_page']:,} B; the budget holds "
            f"{h['pool_blocks']:,} pages",
            f"  per full-length ({max_len}-token) request while decoding: {h['pages_per_full_length_request']:,} pages = "
            f"{h['bytes_per_full_length_request']:,} B ({human_bytes(h['bytes_per_full_length_request'])}) vs keep-all "
            f"{h['bytes_per_full_length_request_keep_all']:,} B ({human_bytes(h['bytes_per_full_length_request_keep_all'])}),"
            f" {h['saving']:.1%} less",
            f"  full-length requests that fit at once: {h['full_length_requests']:,} (keep-all: "
            f"{budget['full_length_requests']:,})",
        ]
    return "\n".join(lines)


# ---------------------------------------------------------------------------- reading configs
def load_kv_spec(model: str, cache_dir: str | os.PathLike[str] | None = None) -> KVSpec:
    """The KV numbers of ``model`` without loading any weight.

    - an HF folder (or a ``config.json`` path): ``config.json`` is read as JSON;
    - a ``.gguf`` file: its header is read with ``GGUFMetadata.from_file`` (no tensor and no
      vocabulary string is read) into the same config the converter would write
      (``kvflow.model.resolve._build_config``);
    - a packaged short name: the same, on the package's GGUF file when it is one file; a
      model split across packages goes through ``resolve_model`` + ``load_config`` (which
      assembles and converts it once, cached).

    Raises:
        FileNotFoundError: a path that does not exist, or a folder without config.json.
        ValueError: unknown short name, or a config lacking the needed fields.
        ModuleNotFoundError: a packaged model whose package is not installed.
    """
    path = Path(model).expanduser()
    if path.is_dir() or path.name == "config.json":
        config_file = path / "config.json" if path.is_dir() else path
        if not config_file.is_file():
            raise FileNotFoundError(f"{path} has no config.json")
        return KVSpec.from_config(json.loads(config_file.read_text()), source=str(path))
    if path.suffix.lower() == ".gguf" or path.exists():
        if not path.is_file():
            raise FileNotFoundError(f"Model path {model!r} does not exist")
        return KVSpec.from_config(_gguf_config(path), source=str(path))
    if os.sep in model or model.startswith(("~", ".")):
        raise FileNotFoundError(f"Model path {model!r} does not exist")
    from kvflow.model import packages

    entry = packages.lookup(model)
    parts = packages.locate_parts(entry)
    if len(parts) == 1:
        return KVSpec.from_config(_gguf_config(parts[0]), source=f"{model} ({parts[0].name})")
    from kvflow.model.resolve import load_config, resolve_model

    model_dir = resolve_model(model, cache_dir=cache_dir)
    return KVSpec.from_config(load_config(model_dir), source=f"{model} ({model_dir})")


def _gguf_config(path: Path) -> Any:
    from kvflow.model.arch import GGUFMetadata
    from kvflow.model.resolve import _build_config

    return _build_config(GGUFMetadata.from_file(path))


# ---------------------------------------------------------------------------- weights
def weight_report(model: str, cache_dir: str | os.PathLike[str] | None = None) -> dict[str, Any] | None:
    """The bytes ``model``'s weights take as stored, by storage type, from the file's tensor
    table alone (no tensor is read).

    - a ``.gguf`` file or a packaged short name: the GGUF tensor table
      (``kvflow.model.gguf_file.read_tensor_infos``; GGUF spec, "tensor info"): per ``GGMLQuantizationType`` the tensor count,
      elements and bytes. kvflow computes these blocks as stored on the CPU by default
      (``quantization="gguf"``), so ``stored_bytes`` is what the weights occupy in memory;
      ``float32_bytes`` / ``bfloat16_bytes`` are what a dequantized model
      (``quantization="none"``) would hold;
    - an HF folder: the ``*.safetensors`` headers (dtype, shape, byte offsets), per dtype.

    Returns:
        ``{"format": "gguf" | "safetensors", "files": [...], "stored_bytes": int,
        "elements": int, "float32_bytes": int, "bfloat16_bytes": int,
        "by_type": {type name: {"tensors", "elements", "bytes"}}}``, or None where no weight
        file is found (a ``config.json`` alone).

    Raises:
        ValueError: a GGUF or safetensors file that cannot be read (truncated or corrupt).
    """
    files = _weight_files(model, cache_dir)
    if not files:
        return None
    by_type: dict[str, dict[str, int]] = {}

    def add(name: str, elements: int, nbytes: int) -> None:
        entry = by_type.setdefault(name, {"tensors": 0, "elements": 0, "bytes": 0})
        entry["tensors"] += 1
        entry["elements"] += elements
        entry["bytes"] += nbytes

    fmt = "gguf" if files[0].suffix.lower() == ".gguf" else "safetensors"
    for file in files:
        if fmt == "gguf":  # raises its own ValueError naming the file
            from kvflow.model.gguf_file import read_tensor_infos

            for t in read_tensor_infos(file):
                add(t.tensor_type.name, t.n_elements, t.n_bytes)
            continue
        try:
            for name, dtype, elements, nbytes in _safetensors_table(file):
                add(dtype, elements, nbytes)
        except (ValueError, OSError, KeyError, TypeError, json.JSONDecodeError) as exc:
            raise ValueError(f"{file} is not a readable safetensors file (truncated or corrupt?): {exc}") from exc
    elements = sum(e["elements"] for e in by_type.values())
    return {
        "format": fmt,
        "files": [str(f) for f in files],
        "stored_bytes": sum(e["bytes"] for e in by_type.values()),
        "elements": elements,
        "float32_bytes": 4 * elements,
        "bfloat16_bytes": 2 * elements,
        "by_type": dict(sorted(by_type.items(), key=lambda kv: -kv[1]["bytes"])),
    }


def _weight_files(model: str, cache_dir: str | os.PathLike[str] | None) -> list[Path]:
    path = Path(model).expanduser()
    if path.name == "config.json":
        path = path.parent
    if path.is_dir():
        from kvflow.model.resolve import gguf_source

        source = gguf_source(path)  # a GGUF model's cached folder points at its file
        return [source] if source is not None else sorted(path.glob("*.safetensors"))
    if path.is_file():
        return [path]
    if os.sep in model or model.startswith(("~", ".")):
        raise FileNotFoundError(f"Model path {model!r} does not exist")
    from kvflow.model import packages

    parts = packages.locate_parts(packages.lookup(model))
    if len(parts) == 1:
        return [parts[0]]
    from kvflow.model.resolve import resolve_model

    return _weight_files(str(resolve_model(model, cache_dir=cache_dir)), cache_dir)


_SAFETENSORS_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                      "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8}


def _safetensors_table(file: Path) -> list[tuple[str, str, int, int]]:
    """(name, dtype, elements, bytes) of each tensor in a safetensors header (8-byte
    little-endian header length, then a JSON table; the safetensors format spec)."""
    with open(file, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        if size <= 0 or size > 100 * 1024**2:
            raise ValueError(f"header length {size}")
        header = json.loads(f.read(size))
    rows = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        elements = 1
        for d in info["shape"]:
            elements *= int(d)
        begin, end = info["data_offsets"]
        rows.append((name, info["dtype"], elements, int(end) - int(begin)))
    return rows


def format_weights(weights: dict[str, Any]) -> str:
    """The text block of ``weight_report`` for ``kvflow memory``."""
    stored = weights["stored_bytes"]
    lines = [f"Weights as stored ({weights['format']}): {stored:,} B ({human_bytes(stored)}), "
             f"{weights['elements']:,} parameters"]
    for name, e in weights["by_type"].items():
        lines.append(f"  {name:<6} {e['tensors']:>4} tensors  {e['bytes']:>14,} B ({human_bytes(e['bytes'])}), "
                     f"{8 * e['bytes'] / max(e['elements'], 1):.2f} bits/weight")
    if weights["format"] == "gguf":
        lines.append(f"  computed as stored on the CPU by default (--quantization gguf); dequantized "
                     f"(--quantization none) they would take {human_bytes(weights['bfloat16_bytes'])} in bfloat16, "
                     f"{human_bytes(weights['float32_bytes'])} in float32")
    return "\n".join(lines)
