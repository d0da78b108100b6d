"""A decode step in one C++ call: every Llama-family decoder layer fused.

At one stream a decode step of a small model is dominated by fixed per-call costs: SmolLM2-135M
made ~32 PyTorch dispatches per layer (956 a step), several milliseconds by themselves, about
llama.cpp's whole time per token. ``FusedDecodeStep`` runs the whole decoder of a decode-only
step in one call of the C++ ``FusedDecoder`` (``kvflow/ops/csrc/fused_decode.cpp``, switch
``KVFLOW_CPU_FUSED_DECODE``), per layer and token: RMSNorm -> QKV (+ bias: Qwen2) -> rotary
(GPT-NeoX "rotate half", partial rotary; Su et al. 2021, "RoFormer" section 3.4) -> K/V
written to the paged cache at ``slot_mapping`` -> paged decode attention over the block
tables (GQA) -> O -> residual -> RMSNorm -> gate/up -> SiLU x up (Shazeer 2020, "GLU Variants
Improve Transformer", eq. 6) -> down -> residual; then the final RMSNorm. A linear is either
GGUF-stored (``gguf_matmul.cpp``'s packed GEMV / GEMM with one int8 activation quantization,
llama.cpp's method) or a dense bfloat16 weight prepacked for oneDNN (the PyTorch path's own
``mkldnn::_linear_pointwise`` call, made from C++); the attention is ``paged_attention.cpp``'s
decode kernel. So the result equals the PyTorch path (``LlamaForCausalLM.forward``) up to the
order of float32 sums in the norms.

Which models and steps (decided once per model at its first decode step, ``bind``; the
PyTorch path stays the reference and serves every other case):

- the model: a ``LlamaForCausalLM`` whose decoder layers are the plain Llama ones (Llama,
  Mistral, SmolLM, Qwen2 with its QKV bias; not Qwen3's q/k norms, MoE blocks, cross-layer KV
  sharing or sliding windows), every decoder linear GGUF-stored (``quantization="gguf"``,
  float32 or bfloat16) or dense bfloat16 prepacked for oneDNN (a bfloat16 model without
  quantization on a CPU where oneDNN packs bfloat16: AVX-512 BW/VL/DQ or AVX-NE-CONVERT), no
  tensor parallelism, and the C++ kernels built (``KVFLOW_CPU_FUSED_DECODE`` and, for GGUF,
  ``KVFLOW_CPU_GGUF`` not ``0``); float32 dense models (the exactness reference) keep the
  PyTorch path;
- the step's generated tokens: decodes, speculative verifications, the recomputed output of a
  request preempted by recompute (each query token attends as a decode row of its own, so a
  token is computed as its plain decode step computed it, and a verified draft too), no
  LoRA, in slices of at most ``MAX_DECODE_TOKENS`` rows. Prompt tokens take the PyTorch path:
  a step holding both is split by token (``FusedDecodeStep.__call__``'s ``rest``), so a
  generated token is computed alike whatever else shares its step, and the uncached rest of a
  prefix-cache hit as a miss computes it. All this on the CPU attention backend's float cache (``CpuAttentionBackend``) or
  on an int8 / fp8 cache (``CpuQuantizedAttentionBackend``, ``kv_cache_dtype="int8"`` /
  ``"fp8"``): the new K/V are then quantized in C++ as ``kv_cache.quantize_kv`` does (the
  keys less ``LlamaAttention._key_offset`` first) and attended by ``paged_attention_quantized``'s
  pass. (A dense model with a quantized cache has batch-invariant linears, which the fused
  step does not take: the PyTorch path.) A decode token's K/V then follow the prefill path's
  up to the norms' float32 summation order (the tests' tiny GGUF models store identical codes
  and scales both ways, in float32 and bfloat16); ``KVFLOW_CPU_FUSED_DECODE=0`` keeps the
  quantized cache's bit-for-bit batch invariance where that order matters. SmolLM2-135M GGUF, 32 streams x 384-token prompts
  (``python -m benchmarks.kv_decode``): int8 56.5 -> 40.0 ms a step, fp8 60.3 -> 43.9, against
  36.3 for the bfloat16 cache.

Dense bfloat16 SmolLM2-135M (``LLM(model="smollm2-135m", dtype="bfloat16",
quantization="none")``), decode ms per step before / after, quiet 2-core Zen 4: 1 stream
20.6 -> 15.4-16.8, 16 streams 33.9 -> 28.6, 32 streams 50.8-53.7 -> 45.2.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from kvflow import ops

logger = logging.getLogger(__name__)

MAX_DECODE_TOKENS = 128
"""The fused call takes at most this many rows at once; a step with more generated tokens
runs it in slices of this many (a request's earlier tokens first). The call runs the same
packed GEMV / GEMM and decode attention as the PyTorch path, its per-row parts (norms, rotary,
SiLU) in vectors and over the rows in parallel, so it saves the per-call overhead at every
batch size measured: SmolLM2-135M on a quiet 2-core Zen 4 (``python -m benchmarks.fused_decode
--models smollm2-135m --batch-sizes 8 16 32 64 128``), fused against the PyTorch path 1.84x at
one stream, 1.41x at 8, 1.30x at 16, 1.20x at 32, 1.06x at 64, 1.09x at 128. (With its per-row
parts single-threaded it had been 1.26x at 16 and 1.12x at 32, and the limit 16.)"""

_EXTENSION = ops.FUSED_DECODE


def per_token_rows(block_tables: torch.Tensor, context_lens: torch.Tensor,
                   query_start_loc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One attention row per query token: token j of a request with L new tokens and C cached
    tokens after this step's writes attends to its first C - L + 1 + j (causal attention as
    decode rows, each with its own length).

    Args:
        block_tables: int64 [R, W], the requests' block tables.
        context_lens: int32 [R], tokens in each request's cache after this step's writes.
        query_start_loc: int32 [R + 1], request r's tokens are rows ``[r] : [r + 1]``.

    Returns:
        (int64 [T, W] block tables, int32 [T] context lengths), T = ``query_start_loc[-1]``.
    """
    starts = query_start_loc.to(torch.int64)
    q_lens = starts[1:] - starts[:-1]
    owner = torch.repeat_interleave(torch.arange(len(q_lens)), q_lens)
    offset = torch.arange(len(owner)) - starts[:-1][owner]  # j: the token's place in its request's query
    ctx = context_lens.to(torch.int64)[owner] - q_lens[owner] + 1 + offset
    return block_tables[owner], ctx.to(torch.int32)


def _starts(q_lens: torch.Tensor) -> torch.Tensor:
    """int64 [R + 1]: where each of R requests of ``q_lens`` new tokens starts, then the total."""
    return torch.cat([q_lens.new_zeros(1), q_lens.cumsum(0)]).to(torch.int64)


def _request_rows(first: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """int64: the rows ``first[r] : first[r] + counts[r]`` of each request r, in order."""
    owner_first = torch.repeat_interleave(first.to(torch.int64), counts)
    return owner_first + torch.arange(len(owner_first)) - torch.repeat_interleave(_starts(counts)[:-1], counts)


def _linear_spec(layer) -> torch.Tensor | list[tuple[torch.Tensor, int, int, int]] | None:
    """What the C++ side takes for one linear: (packed, qtype, offset, rows) of each stored part
    of a GGUF linear, or the oneDNN-prepacked bfloat16 weight of a dense one
    (``UnquantizedLinearMethod`` on the CPU); None for anything else (a float segment, another
    method, a weight left unpacked)."""
    from kvflow.layers.gguf_kernels import GGUFWeight
    from kvflow.layers.linear import UnquantizedLinearMethod
    from kvflow.quantization.gguf import GGUFLinearMethod

    method = getattr(layer, "quant_method", None)
    if type(method) is UnquantizedLinearMethod:
        packed = layer.__dict__.get("packed")
        if packed is None or layer.__dict__.get("packed_dtype") != torch.bfloat16:
            return None
        return packed
    if not isinstance(method, GGUFLinearMethod):
        return None
    out = []
    for s in layer.gguf_segments:
        if not isinstance(s.weight, GGUFWeight):
            return None
        w = s.weight
        packed = w.packed if w.packed is not None else w.pack(release_raw=w.release_raw_on_pack)
        out.append((packed, int(w.qtype), s.offset, w.n))
    return out


def _is_dense(layer) -> bool:
    from kvflow.layers.linear import UnquantizedLinearMethod

    return type(getattr(layer, "quant_method", None)) is UnquantizedLinearMethod


def refusal(model) -> str | None:
    """Why ``model`` cannot take the fused decode step (a sentence), or None when it can."""
    from kvflow.layers.norm import RMSNorm

    # (the model's own file says whether its layers are the plain Llama ones: this module
    # stands below kvflow/model and imports nothing of it)
    layout = getattr(model, "fused_decode_layout", None)
    if layout is None:
        return f"{type(model).__name__} is not a Llama-family model"
    reason = layout()
    if reason is not None:
        return reason
    if model.tp is not None:
        return "tensor parallelism"
    config = model.config
    if config.cla_share_factor != 1:
        return "cross-layer KV sharing"
    if any(w is not None for w in config.sliding_windows):
        return "sliding-window layers"
    if model.norm.weight.device.type != "cpu":
        return f"the model is on {model.norm.weight.device}, not the CPU"
    dtype = model.norm.weight.dtype
    if dtype not in (torch.float32, torch.bfloat16):
        return f"dtype {dtype}"
    for i, layer in enumerate(model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        if type(layer.input_layernorm) is not RMSNorm or type(layer.post_attention_layernorm) is not RMSNorm:
            return f"layer {i} has another norm"
        if attn.o_proj.bias is not None or mlp.gate_up_proj.bias is not None or mlp.down_proj.bias is not None:
            return f"layer {i} has an output or MLP bias"
        for name, lin in (("qkv_proj", attn.qkv_proj), ("o_proj", attn.o_proj), ("gate_up_proj", mlp.gate_up_proj),
                          ("down_proj", mlp.down_proj)):
            if _is_dense(lin):
                if dtype != torch.bfloat16 or lin.__dict__.get("packed") is None:
                    return (f"layer {i}'s {name} is a dense {dtype} weight (the fused step takes dense weights in "
                            "bfloat16 prepacked for oneDNN)")
            elif not hasattr(lin, "gguf_segments") or not all(hasattr(s.weight, "qtype") for s in lin.gguf_segments):
                return f"layer {i}'s {name} is neither GGUF-stored nor a dense bfloat16 weight"
    if type(model.norm) is not RMSNorm:
        return "the final norm is not RMSNorm"
    return None


class FusedDecodeStep:
    """The bound C++ ``FusedDecoder`` of one model (its packed weights referenced, not copied).

    Args:
        model: a ``LlamaForCausalLM`` that ``refusal`` accepts (not checked again here).
        module: the loaded ``kvflow.ops.FUSED_DECODE`` extension.

    Raises:
        RuntimeError: from the C++ side when a weight's shape or layout disagrees with the
            config (the message names the linear).
    """

    def __init__(self, model, module: Any) -> None:
        config = model.config
        first = model.layers[0]
        attn = first.self_attn
        self.model = model
        self.decoder = module.FusedDecoder(
            config.hidden_size, attn.num_heads, attn.num_kv_heads, attn.head_dim, first.mlp.intermediate_size,
            float(model.norm.eps), float(attn.attn.scale), model.norm.weight.detach())
        for layer in model.layers:
            a, m = layer.self_attn, layer.mlp
            self.decoder.add_layer(
                layer.input_layernorm.weight.detach(), _linear_spec(a.qkv_proj),
                None if a.qkv_proj.bias is None else a.qkv_proj.bias.detach(), _linear_spec(a.o_proj),
                layer.post_attention_layernorm.weight.detach(), _linear_spec(m.gate_up_proj), _linear_spec(m.down_proj))
        self.dtype = model.norm.weight.dtype
        #: One C++ call per layer instead of one for all (the same result; for measurement).
        self.per_layer = False
        self._caches: tuple[int, ...] | None = None

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list, metadata,
                 rest=None) -> torch.Tensor | None:
        """The final hidden states [T, hidden] (after the last RMSNorm, model dtype) of a step
        this call covers, else None (the caller runs the PyTorch path). Arguments as
        ``LlamaForCausalLM.forward``'s.

        ``rest``: the PyTorch path, called as ``rest(input_ids, positions, kv_caches,
        metadata)`` for a step's prompt tokens. Given, a step holding both prompt tokens and
        generated ones (decodes, verifications, a preempted request's recomputed output) is
        split: the prompt tokens through ``rest`` first (a request's generated tokens attend
        to its prompt's K/V), then the generated ones through the fused call. So a generated
        token is computed the same way whatever else shares its step; without ``rest`` such a
        step takes the PyTorch path whole (None)."""
        num_tokens = input_ids.shape[0]
        plan = self._plan(metadata, num_tokens) if num_tokens else None
        if plan is None:
            return None
        tables, context_lens, fused_rows, rest_rows, rest_metadata = plan
        if rest_rows is not None and rest is None:
            return None
        key = tuple(c[0].data_ptr() for c in kv_caches)
        if key != self._caches:
            if not self._set_caches(kv_caches):
                return None  # another dtype: the PyTorch path
            self._caches = key
        if rest_rows is None:  # (the whole step)
            return self._forward(input_ids, positions, metadata.slot_mapping, tables, context_lens)
        before = rest(input_ids[rest_rows], positions[rest_rows], kv_caches, rest_metadata)
        hidden = before.new_empty(num_tokens, before.shape[1])
        hidden[rest_rows] = before
        hidden[fused_rows] = self._forward(input_ids[fused_rows], positions[fused_rows],
                                           metadata.slot_mapping[fused_rows], tables, context_lens)
        return hidden

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                 tables: torch.Tensor, context_lens: torch.Tensor) -> torch.Tensor:
        """The fused call over these attention rows (int64 [N] each but ``tables`` int64
        [N, W] and ``context_lens`` int32 [N]); more than ``MAX_DECODE_TOKENS`` of them in
        slices of at most that many, in order, so that a request's earlier tokens are in the
        cache (all layers) before its later ones attend."""
        if len(input_ids) > MAX_DECODE_TOKENS:
            return torch.cat([self._forward(input_ids[i : i + MAX_DECODE_TOKENS], positions[i : i + MAX_DECODE_TOKENS],
                                            slot_mapping[i : i + MAX_DECODE_TOKENS], tables[i : i + MAX_DECODE_TOKENS],
                                            context_lens[i : i + MAX_DECODE_TOKENS])
                              for i in range(0, len(input_ids), MAX_DECODE_TOKENS)])
        model = self.model
        x = model.embed_tokens(input_ids).contiguous()
        cos, sin = model.rotary.cos_sin(positions, x.dtype)
        args = (cos, sin, slot_mapping, tables, context_lens)
        if not self.per_layer:
            return self.decoder.forward(x, *args)
        for i in range(len(model.layers)):
            x = self.decoder.forward(x, *args, i, i + 1)
        return x

    @staticmethod
    def _plan(metadata, num_tokens: int):
        """How a step of ``num_tokens`` runs: (block tables int64 [N, W], context lengths int32
        [N] of the fused call's N attention rows, then for a step with prompt tokens the step's
        rows of the fused call and of the PyTorch path (int64 indices) and the PyTorch path's
        metadata, else None, None, None); None when the fused call takes none of it (another
        backend or metadata, metadata built without a ``BatchLayout``, prompt tokens only)."""
        from kvflow.attention.backend import BatchLayout, FlatMetadata
        from kvflow.attention.cpu_backend import CpuAttentionBackend, CpuGroupedMetadata, CpuQuantizedAttentionBackend

        layout = getattr(metadata, "layout", None)
        if layout is None or len(metadata.slot_mapping) != num_tokens:
            return None
        num_prompt = layout.num_prompt_tokens
        if type(metadata) is CpuGroupedMetadata and type(metadata.backend) is CpuAttentionBackend:
            groups = metadata.groups
            if any(g.context_lens is None for g in groups):
                return None
            if len(groups) == 1 and groups[0].max_query_len == 1 and not num_prompt:
                return groups[0].block_tables, groups[0].context_lens, None, None, None  # (the common decode step)
        elif type(metadata) is FlatMetadata and type(metadata.backend) is CpuQuantizedAttentionBackend:
            if metadata.max_query_len == 1 and not num_prompt:
                return metadata.block_tables, metadata.context_lens, None, None, None
        else:
            return None
        q_lens, prompt = layout.query_lens, layout.prompt_lens
        starts = _starts(q_lens)
        if not num_prompt:  # (verifications: each query token a decode row of its own)
            tables, context_lens = per_token_rows(layout.block_tables, layout.context_lens, starts)
            return tables, context_lens, None, None, None
        generated = q_lens - prompt  # (after the request's prompt tokens in its query)
        fused = generated > 0
        if not bool(fused.any()):
            return None
        tables, context_lens = per_token_rows(layout.block_tables[fused], layout.context_lens[fused],
                                              _starts(generated[fused]))
        fused_rows = _request_rows(starts[:-1][fused] + prompt[fused], generated[fused])
        # The requests with prompt tokens, group by group; in a group of longer queries a request
        # with one prompt token (its prompt's last token before its drafts, or a recomputed
        # request's) goes into a group of its own ahead of it: a query of one token, attended
        # as a decode row, as that token is when it is its chunk alone (a prefill group's
        # attention sums in another order).
        parts, sizes, first = [], [], 0
        for size in layout.group_sizes:
            members = torch.arange(first, first + size)[prompt[first : first + size] > 0]
            first += size
            for part in (members[prompt[members] == 1], members[prompt[members] > 1]):
                if len(part):
                    parts.append(part)
                    sizes.append(len(part))
        split = torch.cat(parts)
        rest_rows = _request_rows(starts[:-1][split], prompt[split])
        part = BatchLayout(metadata.slot_mapping[rest_rows], prompt[split], layout.context_lens[split] - generated[split],
                           layout.block_tables[split], sizes, layout.block_size, layout.device,
                           block_table_lens=layout.block_table_lens[split], prompt_lens=prompt[split])
        return tables, context_lens, fused_rows, rest_rows, metadata.backend.build_metadata(part)

    def _set_caches(self, kv_caches: list) -> bool:
        """Hand the C++ decoder the model's caches: float ones of the model dtype, or int8 /
        fp8 ones with their scales (the keys' offsets per layer, ``LlamaAttention._key_offset``).
        False for any other cache."""
        from kvflow.attention.cpu_attention import code_table

        if all(len(c) == 2 and c[0].dtype == self.dtype for c in kv_caches):
            self.decoder.set_kv_caches([c[0] for c in kv_caches], [c[1] for c in kv_caches])
            return True
        dtypes = {c[0].dtype for c in kv_caches}
        if len(dtypes) != 1 or any(len(c) != 4 for c in kv_caches):
            return False
        lut, code_format = code_table(dtypes.pop())
        if code_format == 0:  # (codes the fused step does not convert)
            return False
        offsets = []
        for layer, c in zip(self.model.layers, kv_caches):
            offset = layer.self_attn._key_offset(c)
            offsets.append(torch.empty(0) if offset is None else offset.detach().float().contiguous().view(-1))
        self.decoder.set_quantized_kv_caches(
            [c[0].view(torch.uint8) for c in kv_caches], [c[1].view(torch.uint8) for c in kv_caches],
            [c[2] for c in kv_caches], [c[3] for c in kv_caches], lut, code_format, offsets)
        return True


_PENDING = object()
_UNCHECKED = object()


def bind(model) -> FusedDecodeStep | None | object:
    """The model's fused decode step, None when it cannot have one (the reason is logged
    once), or ``PENDING`` while a kernel it needs is still being built in the background (ask
    again at a later step: the engine publishes finished builds between steps). The model's
    ``refusal`` is checked once (its answer does not change; ~1.5 ms for SmolLM2's 30 layers,
    which a step paid while the kernel built)."""
    reason = model.__dict__.get("fused_decode_refusal", _UNCHECKED)
    if reason is _UNCHECKED:
        reason = model.__dict__["fused_decode_refusal"] = refusal(model)
    if reason is None:
        # (a GGUF model's other steps need the GGUF kernel itself: both, or neither)
        gguf = not all(_is_dense(lin) for layer in model.layers for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj))
        if _EXTENSION.pending() or (gguf and ops.GGUF_MATMUL.pending()):
            return _PENDING
        module = _EXTENSION.load()
        if module is None or (gguf and ops.GGUF_MATMUL.load() is None):
            reason = "its C++ kernels are switched off or not built"
        else:
            try:
                step = FusedDecodeStep(model, module)
            except (RuntimeError, ValueError) as exc:
                reason = f"{type(exc).__name__}: {exc}"
            else:
                logger.info("decode steps of up to %d tokens run the fused C++ decoder (one call per step)",
                            MAX_DECODE_TOKENS)
                return step
    logger.debug("no fused decode step: %s", reason)
    return None


PENDING = _PENDING
"""``bind``'s answer while a kernel builds in the background."""
