"""Activation-aware weight quantization (AWQ; Lin et al. 2024, "AWQ: Activation-aware Weight
Quantization for LLM Compression and Acceleration", MLSys, section 3).

Input channels that see large activations matter most. AWQ multiplies those weight columns
by a per-channel scale s > 1 before round-to-nearest INT4 quantization and divides the
activations by s, folded into the operation that produces them, so the float model is
unchanged. s = mean|x|^alpha (normalized), with alpha chosen per linear layer from a grid to
minimize the output error || X Q(W diag(s)) diag(s)^-1 ^T - X W^T || on calibration data
(section 3.3). Folds, per decoder layer:

- qkv_proj input = input_layernorm(x): the norm's weight is divided by s;
- gate_up_proj input = post_attention_layernorm(x) (Gemma 3: pre_feedforward_layernorm(x)): likewise;
- down_proj input = silu(gate) * up: the up rows of gate_up_proj are divided by s.

o_proj is left to plain round-to-nearest (with grouped-query attention its input channels
cannot be rescaled through the value projection without changing the model).
"""

from __future__ import annotations

import torch
from torch import nn

from kvflow.quantization.base import FusedMoEMethodBase
from kvflow.quantization.int4 import Int4Config, group_size_for
from kvflow.quantization.schemes import dequantize_int4, quantize_int4

ALPHA_GRID = [i / 10 for i in range(11)]
MAX_SEARCH_ROWS = 128  # calibration rows used in the per-alpha error (CPU cost)


@torch.inference_mode()
def collect_linear_inputs(model: nn.Module, token_ids: list[int], names: list[str]) -> dict[str, torch.Tensor]:
    """Run the float model over ``token_ids`` and keep the inputs of the named linears.

    Returns:
        name -> float32 [len(token_ids), in_features].
    """
    captured: dict[str, torch.Tensor] = {}
    modules = dict(model.named_modules())
    hooks = [
        modules[name].register_forward_hook(lambda mod, args, out, name=name: captured.__setitem__(name, args[0].float()))
        for name in names
    ]
    try:
        model.forward_prompt(token_ids)
    finally:
        for hook in hooks:
            hook.remove()
    return captured


def search_scale(weight: torch.Tensor, x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, float]:
    """The AWQ per-input-channel scale for one linear.

    Args:
        weight: float [N, K].
        x: float32 [T, K] calibration inputs.
        group_size: INT4 group size.

    Returns:
        s float32 [K] and the chosen alpha.
    """
    w = weight.float()
    x_mean = x.abs().mean(dim=0).clamp(min=1e-6)
    if x.shape[0] > MAX_SEARCH_ROWS:
        x = x[:: -(-x.shape[0] // MAX_SEARCH_ROWS)]
    reference = x @ w.t()
    best = (float("inf"), torch.ones_like(x_mean), 0.0)
    for alpha in ALPHA_GRID:
        s = x_mean.pow(alpha)
        s = s / (s.max() * s.min()).sqrt()
        q, scale, zero = quantize_int4(w * s, group_size)
        w_hat = dequantize_int4(q, scale, zero) / s
        error = (x @ w_hat.t() - reference).pow(2).mean().item()
        if error < best[0]:
            best = (error, s, alpha)
    return best[1], best[2]


@torch.inference_mode()
def apply_awq(model: nn.Module, calibration_ids: list[int], group_size: int) -> dict[str, float]:
    """Rescale a Llama-shaped float model's weights in place (float-equivalent) so that a
    following INT4 round-to-nearest quantization loses less (its decoder layers must have
    ``self_attn.qkv_proj``, ``mlp.gate_up_proj`` / ``down_proj`` and the two RMSNorms).
    Returns the chosen alpha per linear.

    Calibration runs as one prompt, so only its first ``config.context_len`` tokens are used
    (the default text is 512 tokens, more than a small model's context; positions past it
    have no RoPE table entry)."""
    calibration_ids = calibration_ids[: model.config.context_len]
    names = []
    for i in range(len(model.layers)):
        names += [f"layers.{i}.self_attn.qkv_proj", f"layers.{i}.mlp.gate_up_proj", f"layers.{i}.mlp.down_proj"]
    inputs = collect_linear_inputs(model, calibration_ids, names)
    alphas = {}
    for i, layer in enumerate(model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        # The norm whose output is the MLP's input: Gemma 3's pre_feedforward_layernorm (its
        # post_attention_layernorm normalizes the attention output, before the residual).
        mlp_norm = getattr(layer, "pre_feedforward_layernorm", layer.post_attention_layernorm)
        for name, linear, fold in (
            (f"layers.{i}.self_attn.qkv_proj", attn.qkv_proj, layer.input_layernorm.weight),
            (f"layers.{i}.mlp.gate_up_proj", mlp.gate_up_proj, mlp_norm.weight),
        ):
            s, alphas[name] = search_scale(linear.weight, inputs[name], group_size_for(linear.in_features, group_size))
            _scale_columns(linear, s)
            fold.data.div_(s.to(fold.dtype))
        name = f"layers.{i}.mlp.down_proj"
        inter = mlp.gate_up_proj.part_sizes[0]
        s, alphas[name] = search_scale(mlp.down_proj.weight, inputs[name], group_size_for(inter, group_size))
        _scale_columns(mlp.down_proj, s)
        mlp.gate_up_proj.weight.data[inter:].div_(s.to(mlp.gate_up_proj.weight.dtype)[:, None])
        if mlp.gate_up_proj.bias is not None:
            mlp.gate_up_proj.bias.data[inter:].div_(s.to(mlp.gate_up_proj.bias.dtype))
    return alphas


def _scale_columns(linear: nn.Module, s: torch.Tensor) -> None:
    linear.weight.data.mul_(s.to(linear.weight.dtype)[None, :])


def calibration_tokenizer(load):
    """``load()``: the model's tokenizer, which AWQ's calibration text needs.

    Raises:
        ValueError: saying so, where it cannot be loaded (a model without tokenizer files:
            transformers' own error named in it).
    """
    try:
        return load()
    except (OSError, ValueError) as exc:
        raise ValueError(f"int4-awq calibrates on real text, which needs the model's tokenizer, and it could not be "
                         f"loaded ({type(exc).__name__}: {exc}); a model without tokenizer files can use "
                         "int4 (round-to-nearest)") from None


def default_calibration_ids(tokenizer, num_tokens: int = 512) -> list[int]:
    """Token ids of real English text for AWQ calibration (the GPL-3 license text that
    Debian ships; a different text can be given to ``kvflow quantize --calibration``).

    Raises:
        ValueError: when the file is not there, or when the tokenizer has no vocabulary (what
            transformers builds for a Qwen2 or Gemma folder without tokenizer files: the
            text encodes to no tokens, or to the unknown token only), which would leave AWQ
            nothing, or one meaningless token, to calibrate on.
    """
    from pathlib import Path

    path = Path("/usr/share/common-licenses/GPL-3")
    if not path.exists():
        raise ValueError("int4-awq needs calibration text: pass calibration_ids / --calibration FILE")
    ids = tokenizer.encode(path.read_text())[:num_tokens]
    unk = getattr(tokenizer, "unk_token_id", None)
    if not any(i != unk for i in ids):
        raise ValueError(f"int4-awq calibrates on real text, which needs the model's tokenizer, and the one loaded "
                         f"has no vocabulary (the calibration text encodes to {len(ids)} token(s), none but the "
                         "unknown token); a model without tokenizer files can use int4 (round-to-nearest)")
    return ids


class AWQConfig(Int4Config):
    """INT4 after AWQ's activation-aware rescaling (Lin et al. 2024; ``apply_awq``),
    calibrated on ``context["calibration_ids"]`` or, without them, the default text. The LM
    head (``quantize_lm_head``) takes plain round-to-nearest INT4: AWQ's scaling is per
    decoder linear."""

    name = "int4-awq"

    def prepare_model(self, model, context) -> None:
        if self.serialized:
            return
        ids = context.get("calibration_ids")
        if not ids:
            if context.get("load_tokenizer") is None:
                raise ValueError("int4-awq needs calibration_ids (token ids of real text)")
            ids = default_calibration_ids(calibration_tokenizer(context["load_tokenizer"]))
        apply_awq(model, ids, self.group_size)

    def get_moe_method(self, layer, prefix) -> FusedMoEMethodBase:
        """Refused: AWQ's scale folding is written for dense Llama-shaped MLPs (``apply_awq``).

        Raises:
            ValueError: always.
        """
        raise ValueError(f"quantization='int4-awq' does not support mixture-of-experts layers ({prefix}): "
                         "its scale search is written for dense MLPs; use quantization='int4'")

    def lm_head_method(self) -> str:
        return "int4"
