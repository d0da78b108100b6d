"""Token sampling, vectorized over the batch.

The order of operations follows Hugging Face / vLLM: temperature scaling, then top-k, top-p
(Holtzman et al. 2020, section 3.1) and min-p (Nguyen et al. 2024, "Min P Sampling",
section 3) filtering, then a draw from the remaining distribution. Greedy rows take the
argmax of the raw logits.

The draw uses the exponential race (Gumbel-max in another form): with E_i ~ Exp(1) i.i.d.,
``argmax_i p_i / E_i`` is distributed as Categorical(p). This lets every row draw from one
batched noise tensor, while rows with a per-request seed take their noise from their own
``torch.Generator`` so that their tokens do not depend on the rest of the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvflow.request import Request

_FLOAT32_MAX = float(torch.finfo(torch.float32).max)


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
            int64 [N] token ids.
        """
        greedy_tokens = row_argmax(logits)
        greedy = st.temperature == 0
        if bool(greedy.all()):
            return greedy_tokens
        probs = self.filtered_probs(logits, st)
        noise = self._exponential_noise(probs, st.generators)
        sampled = row_argmax(probs / noise)
        return torch.where(greedy, greedy_tokens, sampled)

    @staticmethod
    def filtered_probs(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
        """The distribution each non-greedy row samples from: float32 [N, vocab_size].

        Temperature, then top-k, top-p and min-p; filtered tokens get probability 0.
        Greedy rows are returned as if temperature were 1 (callers ignore them).
        """
        temperature = torch.where(st.temperature == 0, torch.ones_like(st.temperature), st.temperature)
        logits = logits / temperature.unsqueeze(1)
        vocab_size = logits.shape[-1]
        need_sort = bool((st.top_k < vocab_size).any()) or bool((st.top_p < 1).any())
        if need_sort:
            sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
            ranks = torch.arange(vocab_size, device=logits.device).unsqueeze(0)
            remove = ranks >= st.top_k.unsqueeze(1)
            sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
            sorted_probs = sorted_logits.softmax(dim=-1)
            # Keep the smallest prefix whose mass reaches top_p (always at least one token).
            mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
            remove = mass_before >= st.top_p.unsqueeze(1)
            remove[:, 0] = False
            sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
            logits = torch.empty_like(logits).scatter_(1, sorted_idx, sorted_logits)
        probs = logits.softmax(dim=-1)
        if bool((st.min_p > 0).any()):
            threshold = st.min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
            probs = probs.masked_fill(probs < threshold, 0.0)
            probs = probs / probs.sum(dim=-1, keepdim=True)
        return probs

    def _exponential_noise(self, probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for row, gen in enumerate(generators):
            if gen is not None:  # the request's own CPU generator, whatever the device
                own = torch.empty(probs.shape[1], dtype=probs.dtype).exponential_(generator=gen)
                noise[row] = own.to(probs.device)
        return noise
