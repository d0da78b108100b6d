"""Mixture-of-experts layer: a top-k softmax router and SwiGLU experts run grouped by expert.

Sparsely-gated MoE (Shazeer et al. 2017, "Outrageously Large Neural Networks", section 2):
each token's hidden state goes through ``top_k`` of ``num_experts`` SwiGLU MLPs chosen by a
linear router, and their outputs are summed with the router's weights. Routing follows the
Hugging Face reference code exactly (``transformers`` ``MixtralTopKRouter`` /
``Qwen3MoeTopKRouter``): softmax over all experts' logits in float32, ``torch.topk``, then
optionally the top-k weights divided by their sum (``renormalize``: always for Mixtral —
which equals a softmax over the top-k logits — and ``norm_topk_prob`` for Qwen3-MoE).

Routing weights stay float32 and the experts' outputs are summed in float32, then rounded
once to the model dtype (transformers rounds Qwen3-MoE's routing weights to the model dtype
and sums in it): the same in float32, a little more precise in bfloat16.

Experts run grouped by expert, never per token: the (token, expert) pairs are sorted by
expert, and each expert with tokens multiplies all of its rows at once; the outputs are
gathered back into token order and summed with the routing weights (``combine_pairs``). How the groups are
multiplied is the layer's ``quant_method`` (``kvflow.quantization.base.FusedMoEMethodBase``):
``UnquantizedFusedMoEMethod`` below (chosen by measurement, see ``EXPERT_IMPLS``: a gather
of the routed experts' weights and one ``bmm`` for decode-size batches, else
``torch._grouped_mm``, one grouped GEMM per projection over all experts), or a weight-only
scheme's method (``kvflow.quantization.moe``: a loop over the experts with tokens through the
scheme's kernels).

Weights are stacked per layer: ``w13_weight`` [num_experts, 2 * intermediate, hidden]
(each expert's gate rows, then its up rows) and ``w2_weight`` [num_experts, hidden,
intermediate] (down), loaded from per-expert checkpoint tensors by ``weight_loader``.

Tensor parallelism splits every expert's intermediate dimension (Megatron-style, as the
dense MLP: gate/up column-parallel, down row-parallel): each rank holds all experts' slices
[start, end) of the intermediate features, computes the routed experts' partial outputs,
and the partial sums are all-reduced once after the down projection. Routing is replicated
(the router is a ``ReplicatedLinear``), so every rank picks the same experts. Chosen over
expert parallelism (whole experts per rank) because the work per rank then does not depend
on which experts the tokens pick (no rank idles while a popular expert's rank works), and
the communication is the dense MLP's one all-reduce instead of two all-to-alls.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from kvflow.distributed.parallel_state import TensorParallel, even_partition
from kvflow.layers.activation import silu_and_mul
from kvflow.layers.gguf_kernels import GGUFWeight
from kvflow.layers.linear import MergedColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from kvflow.quantization.base import FusedMoEMethodBase, keep_storage_dtypes

if TYPE_CHECKING:
    from kvflow.quantization.base import QuantizationConfig

#: Checkpoint projections of one expert -> (stacked parameter, part): gate (w1) and up (w3)
#: fill the two halves of ``w13_weight``, down (w2) ``w2_weight``.
EXPERT_PARTS = {"w1": ("w13_weight", 0), "w3": ("w13_weight", 1), "w2": ("w2_weight", 0)}


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k softmax routing, in the order of the transformers reference routers.

    Args:
        router_logits: [T, num_experts], any float dtype.
        top_k: experts per token.
        renormalize: divide the top-k probabilities by their sum.

    Returns:
        topk_weights float32 [T, top_k] and topk_ids int64 [T, top_k] (descending weight).
    """
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def group_by_expert(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """The (token, expert) pairs sorted by expert.

    Args:
        topk_ids: int64 [T, top_k].

    Returns:
        order int64 [T * top_k] (flat pair indices, by expert, stable), tokens int64
        [T * top_k] (the token of each sorted pair) and the number of pairs per expert
        (a list of ``num_experts`` ints).
    """
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    return order, order // topk_ids.shape[1], counts


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of a [M, 2 * I] gate/up product -> [M, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def experts_through_linears(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, hidden_size: int,
                            w13: list, w2: list) -> torch.Tensor:
    """The routed experts' weighted sum with each expert's two matrices as linears
    (``LinearBase`` with a quantized method: weight-only schemes, GGUF blocks): the (token,
    expert) pairs grouped by expert (``group_by_expert``), each expert with tokens run once
    over all of its rows, gate/up -> ``swiglu`` -> down.

    Args:
        x: [T, hidden_size]; topk_weights float32 [T, top_k]; topk_ids int64 [T, top_k].
        w13: one linear per expert, [2 I, hidden_size] (gate rows, then up).
        w2: one linear per expert, [hidden_size, I].

    Returns:
        [T, hidden_size] in x's dtype.
    """
    order, tokens, counts = group_by_expert(topk_ids, len(w13))
    xs = x.index_select(0, tokens)
    h = torch.empty(xs.shape[0], hidden_size, dtype=x.dtype, device=x.device)
    start = 0
    for e, n in enumerate(counts):
        if n:
            rows = xs[start : start + n]
            h[start : start + n] = w2[e].quant_method.apply(w2[e], swiglu(w13[e].quant_method.apply(w13[e], rows)))
            start += n
    return combine_pairs(h, order, topk_weights).to(x.dtype)


def combine_pairs(h: torch.Tensor, order: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """The routed outputs summed per token: h [T * k, H] holds the (token, expert) pairs'
    outputs in ``order`` (sorted by expert, ``group_by_expert``); returns float32 [T, H] =
    sum over j of topk_weights[t, j] * output of pair (t, j).

    The pairs are put back in token order with one ``index_select`` by the inverse
    permutation and summed over k. (Scatter-adding them instead, ``index_add_``, took 6 us
    per call with one thread but 40-90 ms with two for 1-4 tokens on this shared 2-core
    machine, and index assignment up to 12 ms; ``index_select`` stayed at 12-50 us.)
    """
    t, k = topk_weights.shape
    inverse = torch.argsort(order)
    pairs = h.index_select(0, inverse).view(t, k, -1)
    return (pairs.float() * topk_weights[..., None]).sum(dim=1)


def experts_loop(x, w13, w2, topk_weights, topk_ids) -> torch.Tensor:
    """One matmul pair per expert that has tokens (its rows of the expert-sorted copy of x,
    the two projections), then ``combine_pairs``.

    Args:
        x: [T, H]; w13: [E, 2I, H]; w2: [E, H, I] (x's dtype); topk_weights float32
        [T, k]; topk_ids int64 [T, k].

    Returns:
        [T, H] in x's dtype (summed in float32).
    """
    order, tokens, counts = group_by_expert(topk_ids, w13.shape[0])
    xs = x.index_select(0, tokens)
    h = torch.empty(xs.shape[0], w2.shape[1], dtype=x.dtype, device=x.device)
    start = 0
    for e, n in enumerate(counts):
        if n:
            h[start : start + n] = F.linear(swiglu(F.linear(xs[start : start + n], w13[e])), w2[e])
            start += n
    return combine_pairs(h, order, topk_weights).to(x.dtype)


def experts_grouped_mm(x, w13, w2, topk_weights, topk_ids) -> torch.Tensor:
    """All experts' groups in one grouped GEMM per projection (``torch._grouped_mm`` over
    the rows sorted by expert, with the cumulative group sizes as offsets); same arguments
    and result as ``experts_loop``."""
    order, tokens, counts = group_by_expert(topk_ids, w13.shape[0])
    offsets = torch.tensor(counts, device=x.device).cumsum(0).to(torch.int32)
    xs = x.index_select(0, tokens)
    h = torch._grouped_mm(xs, w13.transpose(1, 2), offs=offsets)
    h = torch._grouped_mm(swiglu(h), w2.transpose(1, 2), offs=offsets)
    return combine_pairs(h, order, topk_weights).to(x.dtype)


def experts_gather_bmm(x, w13, w2, topk_weights, topk_ids) -> torch.Tensor:
    """Each (token, expert) pair as one batch entry of ``torch.bmm`` over the gathered
    expert weights (a copy of k weight matrices per token); same arguments and result as
    ``experts_loop``."""
    t, k = topk_ids.shape
    ids = topk_ids.reshape(-1)
    xs = x.repeat_interleave(k, dim=0)[:, None, :]  # [T k, 1, H]
    h = torch.bmm(xs, w13.index_select(0, ids).transpose(1, 2))  # [T k, 1, 2I]
    h = torch.bmm(swiglu(h), w2.index_select(0, ids).transpose(1, 2))  # [T k, 1, H]
    out = (h.view(t, k, -1).float() * topk_weights[..., None]).sum(dim=1)
    return out.to(x.dtype)


def experts_dense(x, w13, w2, topk_weights, topk_ids) -> torch.Tensor:
    """Every expert on every token (E / k times the routed arithmetic) in two batched
    matmuls, then the routed outputs weighted; same arguments and result as
    ``experts_loop``."""
    h = torch.matmul(x[None], w13.transpose(1, 2))  # [E, T, 2I]
    h = torch.matmul(swiglu(h), w2.transpose(1, 2))  # [E, T, H]
    dense = torch.zeros(x.shape[0], w13.shape[0], dtype=torch.float32, device=x.device)
    dense.scatter_(1, topk_ids, topk_weights)
    return torch.einsum("eth,te->th", h.float(), dense).to(x.dtype)


#: The float expert implementations, measured by ``benchmarks/micro_moe.py --threads 1
#: --quantized`` (minimum ms per call over 42 calls on two layer copies, a 2-core AMD EPYC
#: shared with other jobs; one expert's three matrices: E8 4.7 MB in bfloat16 / 9.4 MB in
#: float32, E64 0.8 / 1.6 MB):
#:
#: ==============================  =====  ==========  ==========  =====
#: shape, dtype, tokens            loop   grouped_mm  gather_bmm  dense
#: ==============================  =====  ==========  ==========  =====
#: E8 k2 H1024 I768 fp32, T=1      1.37   1.41        1.55        5.54
#: E8 k2 H1024 I768 fp32, T=32     10.4   10.3        486         19.1
#: E8 k2 H1024 I768 bf16, T=1      1.13   1.27        0.96        4.51
#: E8 k2 H1024 I768 bf16, T=2      1.30   1.32        2.14        4.47
#: E8 k2 H1024 I768 bf16, T=32     6.04   5.92        288         17.2
#: E64 k8 H512 I256 fp32, T=1      1.52   1.69        1.24        19.2
#: E64 k8 H512 I256 fp32, T=2      2.95   2.98        8.81        26.6
#: E64 k8 H512 I256 fp32, T=32     33.5   28.8        373         64.9
#: E64 k8 H512 I256 bf16, T=1      1.20   1.32        0.64        11.4
#: E64 k8 H512 I256 bf16, T=2      2.61   2.51        1.62        7.34
#: E64 k8 H512 I256 bf16, T=8      8.09   10.6        46.8        17.6
#: E64 k8 H512 I256 bf16, T=32     17.7   13.6        242         30.0
#: ==============================  =====  ==========  ==========  =====
#:
#: On 8 experts the loop and ``grouped_mm`` are equal within noise (minima and medians
#: within 11%); on 64 experts ``grouped_mm`` is faster from 16 tokens on (loop / grouped
#: 1.02-1.31 in minimum, 1.0-1.27 in median) and equal or noisy below. Gathering the weights (a copy of the k
#: experts of every token, then one ``bmm``) is up to 2x faster for decode-size batches
#: whose gathered experts total at most 12.6 MB (the E64 rows at 1-2 tokens, E8 bfloat16 at
#: one token) and slower from 18.9 MB on (E8 float32 at one token, every 8+ token batch:
#: 6-50x). Computing every expert never wins. So ``default_expert_impl`` takes
#: ``gather_bmm`` when the gathered weights fit ``GATHER_MAX_BYTES`` and ``grouped_mm``
#: otherwise (a Qwen3-30B-A3B expert is 9.4 MB in bfloat16: 8 per token take the grouped
#: GEMM). The weight-only quantized experts (``kvflow.quantization.moe``, bfloat16
#: activations) run at 0.29-0.39 ms for one token (INT8, INT4) and 4.9-10 ms for 32; FP8
#: dequantizes per call (no FP8 matmul on the CPU) and takes 20-180 ms.
EXPERT_IMPLS = {
    "loop": experts_loop,
    "grouped_mm": experts_grouped_mm,
    "gather_bmm": experts_gather_bmm,
    "dense": experts_dense,
}

#: Largest total size of the expert weights ``gather_bmm`` copies for one call (see above).
GATHER_MAX_BYTES = 16 * 2**20


def default_expert_impl(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor) -> str:
    """The measured choice (see ``EXPERT_IMPLS``): on the CPU "gather_bmm" when the
    T * top_k gathered experts' weights total at most ``GATHER_MAX_BYTES``, else
    "grouped_mm" (where this PyTorch has ``torch._grouped_mm``); elsewhere "loop" (CUDA's
    grouped GEMM has dtype and architecture limits this project does not test)."""
    if x.device.type != "cpu":
        return "loop"
    expert_bytes = (w13[0].numel() + w2[0].numel()) * w13.element_size()
    if topk_ids.numel() * expert_bytes <= GATHER_MAX_BYTES:
        return "gather_bmm"
    return "grouped_mm" if hasattr(torch, "_grouped_mm") else "loop"


class UnquantizedFusedMoEMethod(FusedMoEMethodBase):
    """Float stacked expert weights in the model dtype, multiplied by ``impl`` (a key of
    ``EXPERT_IMPLS``; None: ``default_expert_impl``).

    Raises:
        ValueError: for an unknown ``impl``.
    """

    def __init__(self, impl: str | None = None) -> None:
        if impl is not None and impl not in EXPERT_IMPLS:
            raise ValueError(f"expert implementation must be one of {list(EXPERT_IMPLS)}, got {impl!r}")
        self.impl = impl

    def create_weights(self, layer, num_experts, hidden_size, intermediate_size, dtype) -> None:
        layer.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size, dtype=dtype),
                                        requires_grad=False)
        layer.w2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size, dtype=dtype),
                                       requires_grad=False)

    def apply(self, layer, x, topk_weights, topk_ids) -> torch.Tensor:
        w13, w2 = layer.w13_weight, layer.w2_weight
        impl = self.impl or default_expert_impl(x, w13, w2, topk_ids)
        return EXPERT_IMPLS[impl](x, w13, w2, topk_weights, topk_ids)

    def dense_weights(self, layer) -> tuple[torch.Tensor, torch.Tensor]:
        return layer.w13_weight, layer.w2_weight


class FusedMoE(nn.Module):
    """The routed experts of one MoE layer: select_experts over the router logits, then the
    experts' weighted sum through ``quant_method``.

    Args:
        num_experts: experts in the layer.
        top_k: experts per token.
        hidden_size: model width.
        intermediate_size: each expert's full intermediate size (``moe_intermediate_size``);
            this rank holds [start, end) of it (``intermediate_range``).
        renormalize: divide the top-k routing weights by their sum.
        quant_config: the model's quantization scheme (its ``get_moe_method``), or None.
        prefix: module path (``layers.3.mlp.experts``).
        tp: this rank's tensor-parallel place, or None.
        reduce_results: all-reduce the output (False: the caller reduces, e.g. after adding
            a shared expert's partial sum).
        params_dtype: dtype of float weights (default: torch's default dtype).

    Shapes: forward(x [T, hidden_size], router_logits [T, num_experts]) -> [T, hidden_size]
    in x's dtype.

    Raises:
        ValueError: when ``intermediate_size`` is not divisible by the tensor-parallel world
            size, or for ``top_k`` outside [1, num_experts].
    """

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, renormalize: bool,
                 quant_config: "QuantizationConfig | None" = None, prefix: str = "", tp: TensorParallel | None = None,
                 reduce_results: bool = True, params_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be in [1, num_experts={num_experts}]")
        world, rank = (1, 0) if tp is None else (tp.world_size, tp.rank)
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.intermediate_range = even_partition(intermediate_size, world, rank,
                                                 what=f"{prefix or 'moe'} intermediate size")
        self.intermediate_size_per_partition = self.intermediate_range[1] - self.intermediate_range[0]
        self.tp, self.prefix, self.reduce_results = tp, prefix, reduce_results
        method = quant_config.get_moe_method(self, prefix) if quant_config is not None else None
        self.quant_method: FusedMoEMethodBase = method or UnquantizedFusedMoEMethod()
        self.quant_method.create_weights(self, num_experts, hidden_size, self.intermediate_size_per_partition,
                                         params_dtype or torch.get_default_dtype())
        #: The checkpoint parts each stacked parameter takes, (expert, "w1" / "w3" / "w2"):
        #: ``CausalLM.load_weights`` checks that each arrives exactly once.
        self.param_shard_ids = {
            param: tuple((e, part) for e in range(num_experts) for part, (p, _) in EXPERT_PARTS.items() if p == param)
            for param in ("w13_weight", "w2_weight")
        }

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
        """Copy this rank's slice of a checkpoint tensor into a stacked parameter.

        Args:
            param: ``w13_weight`` or ``w2_weight``.
            loaded: one expert's full tensor — gate (``shard_id`` (e, "w1")) or up ((e, "w3"))
                [intermediate_size, hidden_size], down ((e, "w2")) [hidden_size,
                intermediate_size] — or, with ``shard_id`` None, all experts stacked (the
                transformers-5 layout): gate/up [num_experts, 2 * intermediate_size,
                hidden_size] (gate rows first) or down [num_experts, hidden_size,
                intermediate_size].

        Raises:
            ValueError: when the shapes do not match or the expert index is out of range.
        """
        start, end = self.intermediate_range
        inter, local = self.intermediate_size, self.intermediate_size_per_partition
        if shard_id is None:
            is_w13 = param is self._parameters.get("w13_weight")
            if loaded.dim() != 3 or loaded.shape[0] != self.num_experts:
                raise ValueError(f"shape {tuple(loaded.shape)}, expected [{self.num_experts}, ...] stacked experts")
            for e in range(self.num_experts):
                if is_w13:
                    if loaded.shape[1] != 2 * inter:
                        raise ValueError(f"shape {tuple(loaded.shape)}, expected "
                                         f"{(self.num_experts, 2 * inter, self.hidden_size)}")
                    self.weight_loader(param, loaded[e, :inter], (e, "w1"))
                    self.weight_loader(param, loaded[e, inter:], (e, "w3"))
                else:
                    self.weight_loader(param, loaded[e], (e, "w2"))
            return
        e, part = shard_id
        if not 0 <= e < self.num_experts:
            raise ValueError(f"expert index {e} outside num_experts={self.num_experts}")
        expected = (self.hidden_size, inter) if part == "w2" else (inter, self.hidden_size)
        stored = isinstance(loaded, GGUFWeight)
        shape = (loaded.n, loaded.k) if stored else tuple(loaded.shape)
        if shape != expected:
            raise ValueError(f"shape {shape}, expected {expected}")
        load_expert = getattr(self.quant_method, "load_expert", None)
        if load_expert is not None:  # a method keeping each expert's rows as stored (GGUF)
            if part == "w2":
                rank_part = loaded.narrow_cols(start, end - start) if stored else loaded[:, start:end]
            else:
                rank_part = loaded.narrow_rows(start, end - start) if stored else loaded[start:end]
            load_expert(self, e, part, loaded if (start, end) == (0, inter) else rank_part)
            return
        if stored:
            loaded = loaded.dequantize(torch.float32)
        if part == "w2":
            param.data[e].copy_(loaded[:, start:end])
        else:
            half = EXPERT_PARTS[part][1]
            param.data[e, half * local : (half + 1) * local].copy_(loaded[start:end])

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = select_experts(router_logits, self.top_k, self.renormalize)
        out = self.quant_method.apply(self, x, topk_weights, topk_ids)
        if self.tp is not None and self.reduce_results:
            out = self.tp.all_reduce(out)
        return out

    def dense_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's (w13 [E, 2 I, H], w2 [E, H, I]) as float tensors (dequantized)."""
        return self.quant_method.dense_weights(self)

    def _apply(self, fn, recurse=True):
        if self.quant_method.quantized:
            return keep_storage_dtypes(self, fn, lambda f: super(FusedMoE, self)._apply(f, recurse))
        return super()._apply(fn, recurse)

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, top_k={self.top_k}, hidden_size={self.hidden_size}, "
                f"intermediate_size={self.intermediate_size_per_partition}/{self.intermediate_size}, "
                f"renormalize={self.renormalize}, method={type(self.quant_method).__name__}")


def moe_layers(model: nn.Module) -> list[FusedMoE]:
    """Every ``FusedMoE`` in ``model``, in module order."""
    return [m for m in model.modules() if isinstance(m, FusedMoE)]


class SparseMoeBlock(nn.Module):
    """A model's MoE feed-forward: the router ``gate`` (a float ``ReplicatedLinear``
    [num_experts, hidden_size]: routing is not quantized, it decides which weights run),
    the routed ``experts`` (``FusedMoE``) and, when ``shared_expert_intermediate_size`` > 0,
    a Qwen2-MoE shared expert: a SwiGLU MLP every token takes, scaled by
    sigmoid(``shared_expert_gate``(x)) (``transformers`` ``Qwen2MoeSparseMoeBlock``). Under
    tensor parallelism the routed and shared partial sums are added and all-reduced once.

    Shapes: x [T, hidden_size] -> [T, hidden_size], x's dtype.
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int, renormalize: bool,
                 shared_expert_intermediate_size: int = 0, quant_config: "QuantizationConfig | None" = None,
                 prefix: str = "", tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.tp = tp
        self.gate = ReplicatedLinear(hidden_size, num_experts, bias=False, prefix=f"{prefix}.gate")
        self.gate.keep_float = True  # ``kvflow.model.loader.quantize_model`` leaves it float too
        self.experts = FusedMoE(num_experts, top_k, hidden_size, intermediate_size, renormalize, quant_config,
                                f"{prefix}.experts", tp, reduce_results=False)
        self.shared_expert = None
        if shared_expert_intermediate_size:
            self.shared_expert = SharedExpertMLP(hidden_size, shared_expert_intermediate_size, quant_config,
                                                 f"{prefix}.shared_expert", tp)
            self.shared_expert_gate = ReplicatedLinear(hidden_size, 1, bias=False,
                                                       prefix=f"{prefix}.shared_expert_gate")
            self.shared_expert_gate.keep_float = True  # built without the scheme, as the router

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts(x, self.gate(x))
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        if self.tp is not None:
            out = self.tp.all_reduce(out)
        return out


class SharedExpertMLP(nn.Module):
    """SwiGLU MLP whose down projection leaves the all-reduce to the caller
    (``SparseMoeBlock``)."""

    def __init__(self, hidden_size: int, intermediate_size: int, quant_config=None, prefix: str = "",
                 tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias=False,
                                                       quant_config=quant_config, prefix=f"{prefix}.gate_up_proj",
                                                       tp=tp)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=False, quant_config=quant_config,
                                           prefix=f"{prefix}.down_proj", tp=tp, reduce_results=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))  # the C++ kernel where it applies


_EXPERT_NAME = re.compile(r"(?P<prefix>.*\.experts)\.(?P<e>\d+)\.(?P<proj>\w+)\.weight")
_STACKED_NAME = re.compile(r"(?P<prefix>.*\.experts)\.(?P<param>gate_up_proj|down_proj)")


def map_expert_weight(name: str, projections: dict[str, str]) -> tuple[str, object] | None:
    """Our stacked parameter and shard id for a checkpoint expert tensor, or None for a
    name that is not one.

    Args:
        name: a checkpoint name: ``<p>.experts.<e>.<proj>.weight`` (one expert's matrix), or
            ``<p>.experts.gate_up_proj`` / ``<p>.experts.down_proj`` (all experts stacked, the
            transformers-5 in-memory layout).
        projections: checkpoint projection name -> "w1" (gate), "w3" (up) or "w2" (down),
            e.g. {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"} for Qwen-MoE,
            {"w1": "w1", "w3": "w3", "w2": "w2"} for Mixtral.

    Returns:
        (``<p>.experts.w13_weight`` or ``w2_weight``, (e, part)), or (..., None) for a
        stacked tensor.
    """
    m = _EXPERT_NAME.fullmatch(name)
    if m and m["proj"] in projections:
        part = projections[m["proj"]]
        return f"{m['prefix']}.{EXPERT_PARTS[part][0]}", (int(m["e"]), part)
    m = _STACKED_NAME.fullmatch(name)
    if m:
        return f"{m['prefix']}.{'w13_weight' if m['param'] == 'gate_up_proj' else 'w2_weight'}", None
    return None
