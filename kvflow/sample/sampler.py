"""Token sampling, vectorized over the batch.

The order of operations follows Hugging Face / vLLM: temperature scaling, then top-k, top-p
(Holtzman et al. 2020, section 3.1) and min-p (Nguyen et al. 2024, "Min P Sampling",
section 3) filtering, then a draw from the remaining distribution. Greedy rows take the
argmax of the raw logits.

Top-k and top-p look at each row's most likely tokens only: ``topk`` of ``TOP_CANDIDATES``
columns (or the row's top_k, when larger) replaces a sort of the whole vocabulary, and a
top-p row whose nucleus those candidates do not cover (their mass below top_p) tries 16
times as many, then a full sort. The filters work in place on the one [N, V] tensor of
probabilities a call makes. The draw is an inverse-CDF draw, one float64 uniform number per row: the first token
whose cumulative probability exceeds u times the row's total (what ``torch.multinomial``
does for one sample), found over block sums in float64, then inside one block. Rows with a per-request seed take their uniform from their own
``torch.Generator``, so that their tokens do not depend on the rest of the batch. (Sorting
151,936 columns and drawing one exponential number per column, as this module did before,
took 182 ms for 16 rows of Qwen2.5's vocabulary with top-p on the development machine.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvflow.request import Request

_FLOAT32_MAX = float(torch.finfo(torch.float32).max)

#: Columns per block of the draw's two-level search (``inverse_cdf_draw``).
DRAW_BLOCK = 256

#: Largest logits per row that top-k / top-p filtering takes first (``topk``); a top-p row
#: whose nucleus is not among them takes 16 times as many, then a full sort.
TOP_CANDIDATES = 64


@dataclass
class SamplingTensors:
    """Per-row sampling settings of a batch.

    Attributes (all of length N, the number of rows):
        temperature: float32; 0 for greedy rows.
        top_k: int64; the vocabulary size where top-k is off or at least the vocabulary.
        top_p: float32; 1 where off.
        min_p: float32; 0 where off.
        generators: per row, the request's own generator or None.
    """

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    generators: list[torch.Generator | None]

    @classmethod
    def from_requests(cls, requests: list[Request], vocab_size: int, device: torch.device) -> "SamplingTensors":
        params = [r.sampling_params for r in requests]
        return cls(
            # capped at float32's largest value: cast to inf, -inf (masked) logits / inf are NaN
            temperature=torch.tensor([0.0 if p.greedy else min(p.temperature, _FLOAT32_MAX) for p in params],
                                     dtype=torch.float32, device=device),
            # top_k off (0, -1) or at or above the vocabulary (any int: 2**63 does not fit int64)
            # keeps every token.
            top_k=torch.tensor([p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params],
                               dtype=torch.int64, device=device),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
            min_p=torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device),
            generators=[r.generator for r in requests],
        )


#: Columns per chunk of ``row_argmax``'s two-pass search.
ARGMAX_CHUNK = 256


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """Index of each row's largest value, the first on ties (as ``argmax``): int64 [N] for
    x [N, V] (any float dtype).

    PyTorch's CPU ``max(dim)`` / ``argmax`` with indices is a scalar loop: ~14 ms for a
    [256, 49152] float32 batch and ~6 ms for [32, 151936] on one core of the development
    machine, a large share of a decode step at these widths. On the CPU the search takes
    two passes instead: each row's maxima over chunks of ``ARGMAX_CHUNK`` columns by
    ``amax`` (a vectorized reduction, one read of the logits), then the index inside the
    first chunk that holds the row's maximum (~3 ms and ~0.8 ms there). Rows holding a NaN
    (whose index ``max`` reports) and small inputs take ``max(dim)`` itself; the result is
    the same index in every case.
    """
    n, v = x.shape
    c = ARGMAX_CHUNK
    if x.device.type != "cpu" or n * v < (1 << 16) or v < 4 * c or x.stride(1) != 1:
        return x.max(dim=-1).indices
    k = v // c
    body = k * c
    blocks = x[:, :body].reshape(n, k, c)  # a view for rows of stride v (logits are)
    chunk_max = blocks.amax(dim=-1)  # [N, k]
    row_max = chunk_max.amax(dim=-1)
    tail = x[:, body:] if body < v else None
    if tail is not None:
        row_max = torch.maximum(row_max, tail.amax(dim=-1))
    if bool(torch.isnan(row_max).any()):
        return x.max(dim=-1).indices
    holds = chunk_max == row_max.unsqueeze(1)
    first = holds.to(torch.uint8).argmax(dim=-1)  # the first chunk holding the maximum
    index = first * c + blocks[torch.arange(n), first].max(dim=-1).indices
    if tail is not None:
        in_tail = ~holds.any(dim=-1)  # the maximum only in the last, partial chunk
        if bool(in_tail.any()):
            index = torch.where(in_tail, body + tail.max(dim=-1).indices, index)
    return index


class Sampler:
    """Turns logits into next tokens.

    Args:
        generator: the engine's generator for rows without their own seed.
    """

    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator

    def __call__(self, logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
        """Sample one token per row.

        Args:
            logits: float32 [N, vocab_size] raw model logits.
            st: the rows' settings.

        Returns:
            int64 [N] token ids. A sampled row draws one uniform number from its own
            generator (seeded rows) or the engine's; an all-greedy batch draws none.
        """
        greedy = st.temperature == 0
        if bool(greedy.all()):
            return row_argmax(logits)
        probs = self.filtered_probs(logits, st)
        sampled = inverse_cdf_draw(probs, self._uniforms(logits.shape[0], st.generators, probs.device))
        if bool(greedy.any()):
            sampled = torch.where(greedy, row_argmax(logits), sampled)
        return sampled

    @staticmethod
    def filtered_probs(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
        """The distribution each non-greedy row samples from: float32 [N, vocab_size].

        Temperature, then top-k (the k most likely tokens; the rest get probability 0),
        top-p on the top-k distribution (the smallest prefix of the tokens in descending
        probability whose mass reaches top_p, at least one token), then min-p (tokens below
        min_p times the largest probability dropped), renormalized. Greedy rows are
        returned as if temperature were 1 (callers ignore them). The result is one new
        tensor, filtered in place (at 64 rows of a 151,936-token vocabulary every further
        [N, V] temporary cost ~10 ms of fresh pages).
        """
        temperature = torch.where(st.temperature == 0, torch.ones_like(st.temperature), st.temperature)
        probs = _softmax_(logits / temperature.unsqueeze(1))
        vocab_size = probs.shape[-1]
        needs = (st.top_k < vocab_size) | (st.top_p < 1)
        if bool(needs.all()):
            _top_k_top_p_(probs, st.top_k, st.top_p)
        elif bool(needs.any()):
            rows = needs.nonzero().flatten()
            part = probs[rows]
            _top_k_top_p_(part, st.top_k[rows], st.top_p[rows])
            probs[rows] = part
        if bool((st.min_p > 0).any()):
            threshold = st.min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
            probs.masked_fill_(probs < threshold, 0.0)
            probs.div_(probs.sum(dim=-1, keepdim=True))
        return probs

    def _uniforms(self, n: int, generators: list[torch.Generator | None], device: torch.device) -> torch.Tensor:
        """float64 [n] uniform numbers in [0, 1) (53 bits: a float32 one's 2**-24 steps would
        set a floor under the chances of rare tokens): row i's from its own generator when it
        has one (one number a step, whatever the batch), the others' from the engine's."""
        u = torch.rand(n, generator=self.generator, device=self.generator.device, dtype=torch.float64)
        for row, gen in enumerate(generators):
            if gen is not None:  # the request's own CPU generator, whatever the device
                u[row] = torch.rand((), generator=gen, device=gen.device, dtype=torch.float64).to(u.device)
        return u.to(device)


def _softmax_(x: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim of float32 ``x``, in place: exp(x - max) / sum. Returns x."""
    x.sub_(x.amax(dim=-1, keepdim=True)).exp_()
    return x.div_(x.sum(dim=-1, keepdim=True))


def _top_k_top_p_(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> None:
    """Top-k, then top-p, of each row of ``probs`` (float32 [R, V], a distribution per row), in
    place: the filtered, renormalized distributions.

    The candidates are each row's ``TOP_CANDIDATES`` (or largest top_k) most likely tokens in
    descending order (``topk``). A row with top_k <= that count has its whole top-k
    distribution among them; a row with top-p alone has its nucleus among them when their
    mass reaches top_p (every later token then has a mass before it >= top_p and is
    dropped). The rows left over try 16 times as many candidates once, then all the
    vocabulary (a sort).
    """
    vocab_size = probs.shape[-1]
    has_k = top_k < vocab_size
    k = first = max(TOP_CANDIDATES, int(top_k[has_k].max()) if bool(has_k.any()) else 0)
    rows: torch.Tensor | None = None  # the rows still to filter (None: all)
    while True:
        p, tk, tp, hk = (probs, top_k, top_p, has_k) if rows is None else \
            (probs[rows], top_k[rows], top_p[rows], has_k[rows])
        whole = k * 4 >= vocab_size or k > 16 * first  # a sort costs what more candidates would
        values, index = p.sort(dim=-1, descending=True) if whole else p.topk(k, dim=-1)  # descending
        ranks = torch.arange(values.shape[-1], device=p.device).unsqueeze(0)
        values = values.masked_fill_(ranks >= tk.unsqueeze(1), 0.0)
        # The candidates' probabilities: of the top-k distribution for a top_k row, else of
        # the whole row.
        cand = torch.where(hk.unsqueeze(1), values / values.sum(dim=-1, keepdim=True), values)
        cum = cand.cumsum(dim=-1)
        remove = (cum - cand) >= tp.unsqueeze(1)
        remove[:, 0] = False
        kept = cand.masked_fill_(remove, 0.0)
        kept.div_(kept.sum(dim=-1, keepdim=True))
        covered = hk | (cum[:, -1] >= tp)  # else: the nucleus is wider than the candidates
        if whole or bool(covered.all()):
            p.zero_().scatter_(1, index, kept)
            if rows is not None:
                probs[rows] = p
            return
        done = covered.nonzero().flatten()
        probs[done if rows is None else rows[done]] = torch.zeros(
            len(done), vocab_size, dtype=probs.dtype, device=probs.device).scatter_(1, index[done], kept[done])
        left = (~covered).nonzero().flatten()
        rows = left if rows is None else rows[left]
        k *= 16


def inverse_cdf_draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row of ``probs`` (float32 [N, V], unnormalized weights >= 0): the first
    index whose cumulative weight exceeds u times the row's total, for ``u`` float64 [N] in
    [0, 1) (the inversion method: Devroye 1986, "Non-Uniform Random Variate Generation",
    section III.2; ``torch.multinomial`` draws one sample so). Returns int64 [N]; raises
    nothing (the shapes are the caller's).

    The search has two levels: the sums of blocks of ``DRAW_BLOCK`` columns, their cumulative
    sums in float64 and the block holding the target, then the float64 cumulative sums
    inside that block. A float32 running sum over a whole row (a quantum of ~6e-8 near a total of 1)
    would give the many tokens of a large vocabulary below ~1e-7 the wrong chances, and
    this reads the row once (the block sums) instead of writing its cumulative sums. A
    token of weight 0 is never drawn; a row without a positive weight (NaN logits) gets an
    index in range.
    """
    n, v = probs.shape
    c = min(DRAW_BLOCK, v)
    full = v // c
    # (each block's sum in float32, within ~1e-6 of its own mass; a float64 reduction of the
    # whole row would first copy it to float64: 34 ms for 64 rows of 151,936 columns)
    sums = probs[:, : full * c].reshape(n, full, c).sum(dim=-1)
    if full * c < v:
        sums = torch.cat([sums, probs[:, full * c :].sum(dim=-1, keepdim=True)], dim=1)
    cdf = sums.to(torch.float64).cumsum(dim=-1)
    target = u.to(torch.float64) * cdf[:, -1]
    block = torch.searchsorted(cdf, target.unsqueeze(1), right=True).squeeze(1).clamp_(max=cdf.shape[1] - 1)
    before = torch.where(block > 0, cdf.gather(1, (block - 1).clamp(min=0).unsqueeze(1)).squeeze(1), 0.0)
    cols = block.unsqueeze(1) * c + torch.arange(c, device=probs.device)  # [N, c]
    inside = cols < v
    weights = probs.gather(1, cols.clamp(max=v - 1)).to(torch.float64).masked_fill_(~inside, 0.0)
    inner = weights.cumsum(dim=-1)
    # (the block's own sum, in another order, may differ from inner's last by an ulp)
    rest = torch.minimum(target - before, torch.nextafter(inner[:, -1], torch.zeros_like(inner[:, -1])))
    at = torch.searchsorted(inner, rest.clamp(min=0).unsqueeze(1), right=True).squeeze(1).clamp_(max=c - 1)
    return (block * c + at).clamp_(max=v - 1)
