"""Reading a PEFT LoRA adapter (``adapter_config.json`` + ``adapter_model.safetensors``) and
checking it against the base model.

LoRA (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models", arXiv
2106.09685, section 4.1): a target linear ``y = x W^T`` becomes ``y = x W^T + s (x A^T) B^T``
with A [r, in_features], B [out_features, r] and the scaling ``s = lora_alpha / r``; rsLoRA
(Kalajdzievski 2023, arXiv 2312.03732) uses ``s = lora_alpha / sqrt(r)`` (PEFT's
``use_rslora``). PEFT names the tensors ``base_model.model.<module>.lora_A.weight`` /
``lora_B.weight`` after the transformers module path; q/k/v and gate/up map onto the slices
of kvflow's fused ``qkv_proj`` / ``gate_up_proj`` (``CausalLM.map_weight_name``), and an
adapter of an already fused checkpoint module (Phi-3's ``qkv_proj``) onto the whole layer.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvflow.layers.linear import LinearBase, MergedColumnParallelLinear, QKVParallelLinear

CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
# PEFT's LoraConfig.lora_alpha default: a config without lora_alpha scales by 8 / r there
PEFT_DEFAULT_LORA_ALPHA = 8
# PEFT LoraConfig fields whose non-default values change the arithmetic kvflow implements.
_REFUSED = {
    "use_dora": (False, None),
    "fan_in_fan_out": (False, None),
    "modules_to_save": (None, []),
    "rank_pattern": (None, {}),
    "alpha_pattern": (None, {}),
    "layers_to_transform": (None, []),
    "layer_replication": (None, []),
    "bias": ("none", None),
    "use_qalora": (False, None),
    "lora_bias": (False, None),
    "alora_invocation_tokens": (None, []),
    "exclude_modules": (None, []),
    "target_parameters": (None, []),
    "trainable_token_indices": (None, [], {}),
    "lora_ga_config": (None, {}),
    # PEFT's LoRA variants whose forward is not plain LoRA (Arrow's routing, block-diagonal
    # factors, KaSA's singular values and truncated base weight)
    "arrow_config": (None, {}),
    "use_bdlora": (None, False, {}),
    "kasa_config": (None, {}),
}


def output_slices(layer: LinearBase) -> list[tuple[object, int, int]]:
    """(shard id, first output row, rows) of each part of ``layer``'s output a PEFT module
    maps to: q / k / v of a ``QKVParallelLinear``, the parts of a
    ``MergedColumnParallelLinear``, else one part (shard id None) covering every row."""
    if isinstance(layer, QKVParallelLinear):
        parts = [("q", 0, layer.q_size)]
        if layer.with_kv:
            parts += [("k", layer.q_size, layer.kv_size), ("v", layer.q_size + layer.kv_size, layer.kv_size)]
        return parts
    if isinstance(layer, MergedColumnParallelLinear):
        offsets = [sum(layer.part_sizes[:i]) for i in range(len(layer.part_sizes))]
        return [(i, off, size) for i, (off, size) in enumerate(zip(offsets, layer.part_sizes))]
    return [(None, 0, layer.out_features)]


def targeted(module: str, wanted) -> bool:
    """Whether PEFT's ``target_modules`` ``wanted`` selects the module named ``module``
    (``model.layers.0.mlp.up_proj``), as PEFT matches: a list entry selects a module whose name
    equals it or ends with ``"." + entry``; a str is a full-match regex (``"all-linear"``: every
    linear); None (unset) selects every module."""
    if wanted is None or wanted == "all-linear":
        return True
    if isinstance(wanted, str):
        return re.fullmatch(wanted, module) is not None
    return any(module == t or module.endswith("." + t) for t in wanted)


def lora_targets(model: torch.nn.Module) -> dict[str, LinearBase]:
    """The decoder linears an adapter may target, by kvflow module name
    (``layers.0.self_attn.qkv_proj``): every ``LinearBase`` under ``layers``."""
    return {name: m for name, m in model.named_modules() if isinstance(m, LinearBase) and name.startswith("layers.")}


@dataclass
class LoRAModel:
    """A validated adapter, on the CPU in the model's dtype.

    Attributes:
        name, lora_int_id, path: from its ``LoRARequest``.
        rank: the largest rank of its modules.
        modules: kvflow layer name -> [(slice index in ``output_slices`` or None for the
            whole layer, A [r, in_features], B [rows, r] with the scaling folded in)].
    """

    name: str
    lora_int_id: int
    path: str
    rank: int
    modules: dict[str, list[tuple[int | None, torch.Tensor, torch.Tensor]]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """Bytes of its A and B tensors."""
        return sum(a.nbytes + b.nbytes for parts in self.modules.values() for _, a, b in parts)


def _read_tensors(folder: Path, what: str) -> dict[str, torch.Tensor]:
    for fname in WEIGHT_FILES:
        f = folder / fname
        if f.is_file():
            try:
                if fname.endswith(".safetensors"):
                    from safetensors.torch import load_file

                    tensors = load_file(str(f))
                else:
                    tensors = torch.load(str(f), map_location="cpu", weights_only=True)
            except Exception as exc:  # a truncated or corrupt file: the adapter's fault, not the engine's
                raise ValueError(f"{what}: cannot read {fname}: {type(exc).__name__}: {exc}") from None
            if not isinstance(tensors, dict) or not all(
                    isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in tensors.items()):
                raise ValueError(f"{what}: {fname} must hold a mapping of tensor names to tensors")
            return tensors
    raise ValueError(f"LoRA adapter folder {str(folder)!r} has none of {', '.join(WEIGHT_FILES)}")


def load_peft_adapter(lora_request, model, max_lora_rank: int, dtype: torch.dtype) -> LoRAModel:
    """Read and check the PEFT adapter of ``lora_request`` against ``model``.

    Args:
        lora_request: a ``kvflow.lora.request.LoRARequest``.
        model: the base ``CausalLM`` (its ``map_weight_name`` and linears).
        max_lora_rank: the engine's largest rank.
        dtype: the model dtype the tensors are cast to.

    Raises:
        ValueError: naming the adapter, for a missing folder or file, a PEFT type other than
            LORA, a config field kvflow does not implement (``use_dora``, ``modules_to_save``,
            a ``bias``, ``rank_pattern`` ...), a rank above ``max_lora_rank``, a target module
            the model lacks (or not a decoder linear: ``lm_head``, ``embed_tokens``), or A / B
            shapes that disagree with the base layer (naming the module and the sizes).
    """
    name = lora_request.lora_name
    folder = Path(lora_request.lora_path)
    what = f"LoRA adapter {name!r}"
    if not (folder / CONFIG_FILE).is_file():
        raise ValueError(f"{what}: no {CONFIG_FILE} in {str(folder)!r} (lora_path must be a PEFT adapter folder)")
    try:
        config = json.loads((folder / CONFIG_FILE).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{what}: cannot read {CONFIG_FILE}: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{what}: {CONFIG_FILE} must hold a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{what}: peft_type {config.get('peft_type')!r} is not supported (LORA only)")
    for key, allowed in _REFUSED.items():
        if key in config and config[key] not in allowed:
            raise ValueError(f"{what}: {key}={config[key]!r} is not supported by kvflow's LoRA (allowed: "
                             f"{', '.join(repr(a) for a in allowed if a is not None) or 'unset'})")
    r_cfg, alpha = config.get("r"), config.get("lora_alpha", PEFT_DEFAULT_LORA_ALPHA)
    if isinstance(r_cfg, bool) or not isinstance(r_cfg, int) or r_cfg < 1:
        raise ValueError(f"{what}: r must be a positive integer, got {r_cfg!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise ValueError(f"{what}: lora_alpha must be a number, got {alpha!r}")
    if r_cfg > max_lora_rank:
        raise ValueError(f"{what}: rank r={r_cfg} is more than max_lora_rank={max_lora_rank}")
    scaling = alpha / math.sqrt(r_cfg) if config.get("use_rslora") else alpha / r_cfg

    targets = lora_targets(model)
    known_leaves = {n.rsplit(".", 1)[-1] for n in targets} | {theirs for _, theirs, _ in model.stacked_params_mapping}
    wanted = config.get("target_modules")
    if isinstance(wanted, list):  # entries are leaf names or module paths (PEFT matches by suffix)
        missing = sorted(t for t in wanted if not isinstance(t, str) or t.rsplit(".", 1)[-1] not in known_leaves)
        if missing:
            raise ValueError(f"{what}: target module(s) {missing} do not exist in this model's decoder linears "
                             f"(it has {sorted(known_leaves)})")

    tensors = _read_tensors(folder, what)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        if not tensor.is_floating_point():
            raise ValueError(f"{what}: tensor {key!r} is {str(tensor.dtype).replace('torch.', '')}; LoRA weights "
                             "are floating point")
        if not bool(tensor.isfinite().all()):
            raise ValueError(f"{what}: tensor {key!r} has NaN or Inf values")
        for part in ("lora_A", "lora_B"):
            marker = f".{part}."
            if marker in key:
                pairs.setdefault(key.split(marker)[0], {})[part] = tensor
                break
        else:
            raise ValueError(f"{what}: unexpected tensor {key!r} (only lora_A / lora_B weights are supported)")
    lora = LoRAModel(name, lora_request.lora_int_id, str(folder), 0)
    for peft_module, ab in sorted(pairs.items()):
        if set(ab) != {"lora_A", "lora_B"}:
            raise ValueError(f"{what}: module {peft_module!r} lacks its {({'lora_A', 'lora_B'} - set(ab)).pop()} tensor")
        if not targeted(peft_module.removeprefix("base_model.model."), wanted):
            raise ValueError(f"{what}: module {peft_module!r} has LoRA tensors but target_modules={wanted!r} does not "
                             "select it (PEFT would not apply them)")
        module = peft_module
        for prefix in ("base_model.model.", "model."):
            if module.startswith(prefix):
                module = module[len(prefix):]
        for theirs, ours in getattr(model, "renamed_prefixes", ()):
            if module.startswith(theirs):
                module = ours + module[len(theirs):]
        module = module[len("model."):] if module.startswith("model.") else module
        ours, shard_id = model.map_weight_name(module + ".weight")
        layer_name = ours[: -len(".weight")]
        layer = targets.get(layer_name)
        if layer is None:
            raise ValueError(f"{what}: target module {peft_module!r} does not exist in this model's decoder linears "
                             "(kvflow adapts q/k/v/o and gate/up/down projections, not lm_head or embed_tokens)")
        a, b = ab["lora_A"], ab["lora_B"]
        if a.dim() != 2 or b.dim() != 2:
            raise ValueError(f"{what}: module {peft_module!r} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}; "
                             "both must be matrices")
        r = a.shape[0]
        if r != r_cfg:
            raise ValueError(f"{what}: module {peft_module!r} has rank {r} (lora_A {tuple(a.shape)}) but the config's "
                             f"r is {r_cfg} (the scaling lora_alpha / r needs the tensors' rank)")
        if r > max_lora_rank:
            raise ValueError(f"{what}: module {peft_module!r} has rank {r}, more than max_lora_rank={max_lora_rank}")
        slices = output_slices(layer)
        if shard_id is None:
            index, rows = None, layer.out_features
        else:
            index = next(i for i, (sid, _, _) in enumerate(slices) if sid == shard_id)
            rows = slices[index][2]
        if a.shape[1] != layer.in_features or b.shape != (rows, r):
            raise ValueError(
                f"{what}: module {peft_module!r} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}; the base "
                f"layer needs lora_A [r, {layer.in_features}] and lora_B [{rows}, r] (in_features={layer.in_features}, "
                f"out_features={rows})")
        a, b = a.to(dtype).contiguous(), (b.double() * scaling).to(dtype).contiguous()
        for part, t in (("lora_A", a), ("lora_B", b)):
            if not bool(t.isfinite().all()):
                raise ValueError(f"{what}: module {peft_module!r}'s {part} has values beyond {dtype} once cast (with "
                                 f"the scaling {scaling:g} folded into lora_B): NaN or Inf")
        lora.rank = max(lora.rank, r)
        lora.modules.setdefault(layer_name, []).append((index, a, b))
    if not lora.modules:
        raise ValueError(f"{what}: the adapter holds no lora_A / lora_B tensors")
    return lora
