"""GGUF models computed as stored (``quantization="gguf"``, the default for a GGUF model on the CPU).

A GGUF file's quantized matrices (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K: ggml's
``ggml-quants.c``, the ``gguf`` package's ``quants.py``) load into kvflow as they are stored:
``kvflow.model.resolve.iter_gguf_weights`` hands each one over as a
``kvflow.layers.gguf_kernels.GGUFWeight`` (the file's blocks, rows = output features), and
the layers keep it:

- every decoder linear (``GGUFLinearMethod``): its checkpoint parts (Q, K, V; gate, up)
  arrive as row *segments*, possibly of different types (a Q4_K_M file stores ``attn_v`` and
  ``ffn_down`` in Q6_K and the rest in Q4_K); after loading, adjacent segments of one type
  are joined, and ``apply`` runs one ``gguf_linear`` per segment into its columns of the
  output (the C++ kernel: activations quantized per block to int8, integer dot products on
  the rows repacked 16 at a time, ``GGUFWeight.pack``, which then replace the stored rows;
  PyTorch's dequantize + matmul where the kernel is not built);
- the experts of a mixture-of-experts layer (``GGUFMoEMethod``): each expert's rows of the
  stacked ``ffn_*_exps`` tensors as two GGUF linears (gate/up, down);
- the token embedding (rows dequantized at lookup) and the LM head (tied: the embedding's
  blocks; else ``output.weight``) in ``kvflow.layers.embed_head``; the loader packs the
  head's blocks when the kernel is built (``pack_lm_head``), in row chunks whose mapped
  stored pages go back to the system as they are packed (``pack_in_chunks``), so that the
  largest matrix of a small model is not held twice for the length of its pack.

No float copy of a quantized matrix is made or written anywhere. Tensors the file stores as
float (norms, biases, F32 / F16 / BF16 matrices) load as float tensors in the serving dtype
(a float segment of a linear computes with ``F.linear``).

Tensor parallelism shards a GGUF matrix along N (whole rows: column-parallel linears, the
vocabulary) or along K in whole blocks (row-parallel linears); a split that cuts a block
raises ``ValueError`` naming the tensor and the sizes.
"""

from __future__ import annotations

import ctypes
import mmap
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kvflow import huge_pages, ops
from kvflow.layers.gguf_kernels import GGUFWeight, gguf_linear, kernel_available, packed_shape
from kvflow.ops.build import join_background_builds
from kvflow.quantization.base import FusedMoEMethodBase, LinearMethodBase, QuantizationConfig


@dataclass
class Segment:
    """Rows [offset, offset + weight.n) of a linear's output, stored as ``weight`` (a
    ``GGUFWeight``, or a float tensor [rows, in_features] for a tensor the file stores as
    float)."""

    offset: int
    weight: GGUFWeight | torch.Tensor

    @property
    def rows(self) -> int:
        return self.weight.n if isinstance(self.weight, GGUFWeight) else int(self.weight.shape[0])


class GGUFLinearMethod(LinearMethodBase):
    """A linear over a GGUF file's stored blocks (see the module docstring).

    The layer's ``weight`` parameter is an empty float placeholder (it keeps the checkpoint
    name resolvable and follows ``Module.to``'s dtype); the rows live in
    ``layer.gguf_segments`` (list of ``Segment``), filled by ``load_segment``.
    """

    quantized = True

    def create_weights(self, layer, input_size, output_size, bias, dtype) -> None:
        layer.weight = nn.Parameter(torch.empty(0, dtype=dtype), requires_grad=False)
        layer.gguf_segments = []
        if bias:
            layer.bias = nn.Parameter(torch.zeros(output_size, dtype=dtype), requires_grad=False)

    def load_segment(self, layer, offset: int, weight: GGUFWeight | torch.Tensor) -> None:
        """Take rows [offset, offset + rows) of the layer's (this rank's) weight.

        Raises:
            ValueError: when the part's shape does not fit the layer (the sizes named).
        """
        rows, cols = (weight.n, weight.k) if isinstance(weight, GGUFWeight) else tuple(weight.shape)
        if cols != layer.in_features or offset < 0 or offset + rows > layer.out_features:
            raise ValueError(f"shape ({rows}, {cols}) at row {offset}, expected rows within {layer.out_features} "
                             f"and {layer.in_features} columns")
        if not isinstance(weight, GGUFWeight):
            weight = weight.detach().to(layer.weight.dtype).contiguous()
        layer.gguf_segments.append(Segment(offset, weight))

    def process_weights_after_loading(self, layer) -> None:
        segments = sorted(layer.gguf_segments, key=lambda s: s.offset)
        covered = 0
        for s in segments:
            if s.offset != covered:
                raise ValueError(f"{layer.prefix or 'linear'}: GGUF rows {covered}..{s.offset} of {layer.out_features} "
                                 "were never loaded (or overlap)")
            covered += s.rows
        if covered != layer.out_features:
            raise ValueError(f"{layer.prefix or 'linear'}: GGUF rows cover {covered} of {layer.out_features}")
        runs: list[list[Segment]] = []
        for s in segments:  # one kernel call for adjacent parts of one type (Q, K, V all Q4_K)
            last = runs[-1][-1].weight if runs else None
            if ((isinstance(last, GGUFWeight) and isinstance(s.weight, GGUFWeight) and last.qtype == s.weight.qtype)
                    or (isinstance(last, torch.Tensor) and isinstance(s.weight, torch.Tensor))):
                runs[-1].append(s)
            else:
                runs.append([s])
        # The kernel joins the engine's background builds where it has them (the PyTorch
        # path serves until the engine publishes it between two steps), else it builds here.
        join_background_builds(ops.GGUF_MATMUL)
        joined: list[Segment] = []
        for run in runs:  # held once: packed for the kernel (now if it is built, else at its first use)
            parts = [s.weight for s in run]
            if isinstance(parts[0], torch.Tensor):
                weight = parts[0] if len(parts) == 1 else torch.cat(parts)
            elif kernel_available(parts[0].qtype):
                weight = GGUFWeight.packed_cat_rows(parts)  # each part packed in place: no joined copy
            else:
                weight = parts[0] if len(parts) == 1 else GGUFWeight.cat_rows(parts)
                weight.release_raw_on_pack = True
            joined.append(Segment(run[0].offset, weight))
        layer.gguf_segments = joined

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        segments = layer.gguf_segments
        bias = layer.bias
        if len(segments) == 1:
            return _segment_matmul(x, segments[0].weight, bias)
        out = x.new_empty(x.shape[0], layer.out_features)
        for s in segments:
            part = out.narrow(1, s.offset, s.rows)
            part_bias = bias.narrow(0, s.offset, s.rows) if bias is not None else None
            if isinstance(s.weight, GGUFWeight):
                gguf_linear(x, s.weight, part_bias, out=part)
            else:
                part.copy_(F.linear(x, s.weight.to(x.dtype), part_bias))
        return out

    def dense_weight(self, layer) -> torch.Tensor:
        return torch.cat([s.weight.dequantize(torch.float32) if isinstance(s.weight, GGUFWeight) else s.weight.float()
                          for s in layer.gguf_segments])

    def saves_dense_weight(self, layer) -> bool:
        """False: ``state_dict`` never dequantizes the stored rows (``weight`` is the empty
        placeholder; ``kvflow.quantization.checkpoint.weight_bytes`` counts the stored bytes)."""
        return False

    @staticmethod
    def nbytes(layer) -> int:
        """Bytes the layer's weight rows hold (stored blocks and float segments)."""
        return sum(s.weight.nbytes if isinstance(s.weight, GGUFWeight) else s.weight.numel() * s.weight.element_size()
                   for s in layer.gguf_segments)


def _segment_matmul(x: torch.Tensor, weight: GGUFWeight | torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if isinstance(weight, GGUFWeight):
        return gguf_linear(x, weight, bias)
    return F.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))


class GGUFConfig(QuantizationConfig):
    """``quantization="gguf"``: serve a GGUF file's quantized tensors as stored (the module
    docstring). Chosen by default for a GGUF model on the CPU unless ``dtype="float32"`` is
    asked for explicitly or ``quantization="none"`` (``EngineArgs.resolved_quantization``)."""

    name = "gguf"
    #: The loader hands this scheme the file's stored blocks (``iter_weights(..., native=True)``).
    native_gguf = True

    def get_linear_method(self, layer, prefix) -> LinearMethodBase:
        return GGUFLinearMethod()

    def build_dtype(self) -> torch.dtype | None:
        """None: build in the serving dtype (nothing is quantized from float weights)."""
        return None

    def get_moe_method(self, layer, prefix):
        """The experts' stored blocks, one GGUF linear per expert matrix (``GGUFMoEMethod``)."""
        return GGUFMoEMethod()

    def lm_head_method(self) -> str:
        """INT8 for a head the file stores as float; a head stored quantized already computes
        in its stored GGUF type (``ParallelLMHead.quantize`` keeps it)."""
        return "int8"


class GGUFMoEMethod(FusedMoEMethodBase):
    """A mixture-of-experts layer over a GGUF file's stacked expert tensors, computed as stored.

    llama.cpp stores each projection of all experts as one tensor ``blk.N.ffn_{gate,up,down}_exps``
    [n_expert, out, in] (ggml's ``ffn_*_exps``); ``iter_gguf_weights`` hands every expert's
    rows over as its own ``GGUFWeight`` (a view of the tensor's mapped blocks). Each expert
    keeps two GGUF linears (``GGUFLinearMethod``): gate/up [2 I, hidden] (gate rows, then up;
    one packed matrix when both have one type) and down [hidden, I]. ``apply`` groups the
    (token, expert) pairs by expert (``group_by_expert``) and runs each expert with tokens
    through its two linears with its rows at once (``kvflow.layers.moe.experts_through_linears``,
    as for the weight-only schemes). Under tensor parallelism each rank keeps its rows of gate/up and its
    columns of down (whole blocks, else a ``ValueError`` naming the sizes). The layer's
    ``w13_weight`` / ``w2_weight`` are empty placeholders that name the checkpoint parts.
    """

    quantized = True

    def create_weights(self, layer, num_experts, hidden_size, intermediate_size, dtype) -> None:
        from kvflow.layers.linear import LinearBase

        layer.w13_weight = nn.Parameter(torch.empty(0, dtype=dtype), requires_grad=False)
        layer.w2_weight = nn.Parameter(torch.empty(0, dtype=dtype), requires_grad=False)
        config = GGUFConfig()
        with torch.device("cpu"):  # (placeholders only: the rows arrive as GGUF blocks)
            layer.gguf_experts = {
                "w13": [LinearBase(hidden_size, 2 * intermediate_size, False, config, f"{layer.prefix}.{e}.w13")
                        for e in range(num_experts)],
                "w2": [LinearBase(intermediate_size, hidden_size, False, config, f"{layer.prefix}.{e}.w2")
                       for e in range(num_experts)],
            }
        for linears in layer.gguf_experts.values():
            for linear in linears:
                linear.weight.data = linear.weight.data.to(dtype)

    def load_expert(self, layer, e: int, part: str, weight) -> None:
        """Take this rank's part of one expert's matrix: ``part`` "w1" (gate) / "w3" (up)
        [I_local, hidden] or "w2" (down) [hidden, I_local], a ``GGUFWeight`` or a float
        tensor (a type the kernels lack, dequantized by the loader).

        Raises:
            ValueError: a shape that does not fit (the sizes named).
        """
        local = layer.intermediate_size_per_partition
        if part == "w2":
            linear, offset, rows = layer.gguf_experts["w2"][e], 0, layer.hidden_size
        else:
            linear, rows = layer.gguf_experts["w13"][e], local
            offset = 0 if part == "w1" else local
        linear._load_rows(linear.weight, offset, rows, weight)

    def process_weights_after_loading(self, layer) -> None:
        for linears in layer.gguf_experts.values():
            for linear in linears:
                linear.quant_method.process_weights_after_loading(linear)

    def apply(self, layer, x, topk_weights, topk_ids) -> torch.Tensor:
        from kvflow.layers.moe import experts_through_linears

        return experts_through_linears(x, topk_weights, topk_ids, layer.hidden_size, layer.gguf_experts["w13"],
                                       layer.gguf_experts["w2"])

    def dense_weights(self, layer) -> tuple[torch.Tensor, torch.Tensor]:
        return tuple(torch.stack([linear.dense_weight() for linear in layer.gguf_experts[which]])
                     for which in ("w13", "w2"))

    @staticmethod
    def nbytes(layer) -> int:
        """Bytes the experts' rows hold (stored or packed blocks, float segments)."""
        return sum(GGUFLinearMethod.nbytes(linear) for linears in layer.gguf_experts.values() for linear in linears)


# Rows per chunk of ``pack_in_chunks`` (a multiple of the packed layout's 16-row groups):
# ~1-4 MB of stored blocks at a time for the LM heads of the packaged models.
PACK_CHUNK_ROWS = 4096
_MADV_DONTNEED = 4  # Linux <sys/mman.h>


def pack_in_chunks(weight: GGUFWeight, chunk_rows: int = PACK_CHUNK_ROWS) -> torch.Tensor:
    """``weight.pack(release_raw=True)`` with the stored rows read ``chunk_rows`` at a time:
    each chunk is packed (``GGUFWeight.pack`` of those rows) straight into its row groups of
    one buffer (huge-page memory: ``kvflow.huge_pages``), and where the stored rows are a private mapping of the file
    (``GGUFTensorInfo.map``) the pages read so far are handed back to the system
    (``madvise(MADV_DONTNEED)``: unmodified private file pages, which a later read maps from
    the file again). So the stored and the packed matrix are never both resident: a whole
    pack held both for its duration (Qwen2.5-Coder-0.5B's Q8_0 LM head: 2 x 138 MiB). The
    result is byte-identical to one ``pack`` of all rows (the layout's groups are 16 rows
    each: ``kvflow/ops/csrc/gguf_matmul.cpp``).

    Args:
        weight: a weight whose ``packed`` is None (else it is returned as is).
        chunk_rows: rows per chunk, a multiple of the layout's group (16).

    Returns:
        ``weight.packed``, uint8 [ceil(n / 16), group bytes].

    Raises:
        RuntimeError: when the C++ kernel is not available.
        ValueError: ``chunk_rows`` not a positive multiple of the group.
    """
    if weight.packed is not None:
        return weight.pack(release_raw=True)
    group = int(ops.GGUF_MATMUL.require().gguf_pack_rows())
    if chunk_rows < group or chunk_rows % group:
        raise ValueError(f"chunk_rows: {chunk_rows}, expected a positive multiple of {group}")
    raw = weight.raw
    if weight.n <= chunk_rows or not raw.is_contiguous():
        return weight.pack(release_raw=True)
    release = _page_releaser(raw)
    packed = huge_pages.empty(packed_shape(weight.qtype, weight.n, weight.k))
    for start in range(0, weight.n, chunk_rows):
        rows = min(chunk_rows, weight.n - start)
        GGUFWeight(raw[start:start + rows], weight.qtype, rows, weight.k).pack(
            out=packed[start // group:start // group + -(-rows // group)])
        release(start + rows)
    weight.packed = packed
    del raw
    return weight.pack(release_raw=True)  # drops the stored rows (the mapping goes with them)


def _page_releaser(raw: torch.Tensor):
    """A function ``release(row)`` that hands the whole pages of ``raw``'s rows before ``row``
    back to the system, when ``raw`` lies in a private file mapping (never anonymous memory,
    whose pages ``MADV_DONTNEED`` would zero); a no-op elsewhere or off Linux."""
    base = raw.data_ptr()
    row_bytes = raw.shape[1]
    if not sys.platform.startswith("linux") or not _in_file_mapping(base, base + raw.numel()):
        return lambda row: None
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return lambda row: None
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    page = mmap.PAGESIZE
    # Whole pages inside the tensor only: a page it shares with the tensor before it could
    # hold that tensor's bytes written in place (a private mapping's copied page), which
    # MADV_DONTNEED would revert to the file's.
    done = [base + (-base) % page]

    def release(row: int) -> None:
        end = base + row * row_bytes
        end -= end % page
        if end > done[0]:
            madvise(done[0], end - done[0], _MADV_DONTNEED)
            done[0] = end

    return release


def _in_file_mapping(start: int, end: int) -> bool:
    """Whether [start, end) lies in one mapping of a file (``/proc/self/maps``: an inode)."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split()
                low, high = (int(v, 16) for v in fields[0].split("-"))
                if low <= start < high:
                    return end <= high and len(fields) >= 6 and fields[4] != "0" and fields[1][3] == "p"
    except (OSError, ValueError, IndexError):
        return False
    return False


def pack_lm_head(model: nn.Module) -> None:
    """Pack the blocks the LM head computes with (its own ``output.weight``, or the tied
    embedding's) at load, chunk by chunk (``pack_in_chunks``), when the kernel is built;
    otherwise the first forward packs them whole. An untied embedding stays as stored (its
    lookups touch only the rows they read)."""
    head = getattr(model, "lm_head", None)
    stored = getattr(head, "stored_gguf", None)
    if isinstance(stored, GGUFWeight) and stored.packed is None and kernel_available(stored.qtype):
        pack_in_chunks(stored)


def gguf_report(model) -> dict[str, str]:
    """Module path -> the GGUF types of each decoder linear's rows (e.g. "Q4_K+Q6_K"; "F32" for
    a float segment) after loading with ``quantization="gguf"``; for a mixture-of-experts
    layer ``<path>.w13`` (gate/up) and ``<path>.w2`` (down), the types of its first expert."""
    report = {}
    for name, module in model.named_modules():
        if isinstance(module.__dict__.get("quant_method"), GGUFLinearMethod):
            report[name] = _segment_types(module)
        elif isinstance(module.__dict__.get("quant_method"), GGUFMoEMethod):  # (expert 0's; llama.cpp types all alike)
            for which, linears in module.gguf_experts.items():
                report[f"{name}.{which}"] = _segment_types(linears[0])
    return report


def _segment_types(linear) -> str:
    return "+".join(s.weight.qtype.name if isinstance(s.weight, GGUFWeight)
                    else str(s.weight.dtype).replace("torch.", "") for s in linear.gguf_segments)


def gguf_stored_bytes(model: nn.Module) -> int:
    """Bytes of GGUF blocks (and float segments) held outside ``state_dict``: the linears'
    segments, the embedding's and an untied LM head's stored rows."""
    total = 0
    for module in model.modules():
        if isinstance(module.__dict__.get("quant_method"), GGUFLinearMethod):
            total += GGUFLinearMethod.nbytes(module)
        elif isinstance(module.__dict__.get("quant_method"), GGUFMoEMethod):
            total += GGUFMoEMethod.nbytes(module)
        elif module.__dict__.get("gguf") is not None:
            total += module.__dict__["gguf"].nbytes
    return total
