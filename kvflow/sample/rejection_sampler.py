"""Verification of draft tokens by rejection sampling, preserving the target distribution.

Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding" (arXiv
2211.17192), Algorithm 1; Chen et al. 2023, "Accelerating Large Language Model Decoding with
Speculative Sampling" (arXiv 2302.01318), Algorithm 2. For draft token x_i drawn from the
draft distribution q_i, accept it with probability min(1, p_i(x_i) / q_i(x_i)); at the first
rejection emit a token drawn from norm(max(0, p_i - q_i)) and stop; when all k drafts are
accepted, emit a bonus token drawn from p_k. The emitted tokens are distributed exactly as
sampling from the target alone. A deterministic proposer (n-gram lookup) has q_i = one-hot
at x_i. Greedy requests accept exactly while the draft equals the target's argmax.

p and q are the distributions after the request's own processing (penalties over the
output so far including the earlier drafts, temperature, top-k, top-p, min-p): the same
function (``processed_probs``) computes both.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvflow.request import Request
from kvflow.sample.logits_processor import apply_logits_processors, no_token_error
from kvflow.sample.sampler import Sampler, SamplingTensors, row_argmax


@dataclass
class DraftPositionView:
    """A request as it would look after its first ``num_drafts`` draft tokens: what the
    logits processors read (prompt, output so far, parameters)."""

    request: Request
    num_drafts: int

    @property
    def sampling_params(self):
        return self.request.sampling_params

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.request.prompt_token_ids

    @property
    def output_token_ids(self) -> list[int]:
        return self.request.output_token_ids + self.request.spec_token_ids[: self.num_drafts]

    @property
    def num_output_tokens(self) -> int:
        return self.request.num_output_tokens + self.num_drafts

    @property
    def eos_token_id(self) -> int | None:
        return self.request.eos_token_id

    @property
    def bad_words_token_ids(self) -> list[list[int]]:
        return self.request.bad_words_token_ids

    @property
    def generator(self) -> torch.Generator | None:
        return self.request.generator

    grammar = None


def processed_probs(logits: torch.Tensor, views: list, vocab_size: int, dead: list | None = None) -> torch.Tensor:
    """The distributions a request samples from at each row.

    Args:
        logits: float32 [M, vocab_size] raw logits.
        views: M objects with the processor-facing attributes of a Request.
        vocab_size: columns of the logits.
        dead: when given, filled with M bools: the rows whose masks leave no token.

    Returns:
        float32 [M, vocab_size] probabilities (for greedy rows: one-hot at the argmax of
        the processed logits).
    """
    processed = apply_logits_processors(logits, views)
    if dead is not None:
        dead.extend((processed != float("-inf")).any(dim=1).logical_not().tolist())
    st = SamplingTensors.from_requests(views, vocab_size, logits.device)
    probs = Sampler.filtered_probs(processed, st)
    greedy = st.temperature == 0
    if bool(greedy.any()):
        one_hot = torch.zeros_like(probs).scatter_(1, row_argmax(processed).unsqueeze(1), 1.0)
        probs = torch.where(greedy.unsqueeze(1), one_hot, probs)
    return probs


class RejectionSampler:
    """Verifies each request's drafts against the target logits of one forward pass.

    Args:
        generator: the engine generator for requests without a seed.
    """

    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator

    def __call__(self, request: Request, drafts: list[int], target_logits: torch.Tensor) -> list[int]:
        """Emit the accepted drafts and one more token.

        Args:
            request: the request (its ``spec_token_ids`` start with ``drafts`` and its
                ``spec_draft_probs`` hold q, or None for a one-hot draft).
            drafts: the k draft tokens verified this step.
            target_logits: float32 [k + 1, vocab_size] raw target logits at the positions
                of the last real token and each draft.

        Returns:
            Between 1 and k + 1 token ids.
        """
        k = len(drafts)
        vocab = target_logits.shape[-1]
        views = [DraftPositionView(request, i) for i in range(k + 1)]
        if request.sampling_params.greedy:
            return self._greedy(views, drafts, target_logits)
        dead: list[bool] = []
        p = processed_probs(target_logits, views, vocab, dead)
        q = request.spec_draft_probs
        gen = request.generator or self.generator
        emitted: list[int] = []
        for i, x in enumerate(drafts):
            if dead[i]:  # (reached: the drafts before it were accepted) no token may follow
                raise no_token_error(views[i])
            p_x = float(p[i, x])
            q_x = 1.0 if q is None else float(q[i, x])
            u = float(torch.rand((), generator=gen, device=gen.device))
            if q_x > 0 and u < min(1.0, p_x / q_x):
                emitted.append(x)
                continue
            residual = p[i].clone()
            if q is None:
                residual[x] = 0.0
            else:
                residual = (residual - q[i].to(residual.device)).clamp_(min=0.0)
            if float(residual.sum()) <= 0.0:  # p == q: rejection had probability 0
                residual = p[i]
            emitted.append(_draw(residual, gen))
            return emitted
        if dead[k]:
            raise no_token_error(views[k])
        emitted.append(_draw(p[k], gen))
        return emitted

    @staticmethod
    def _greedy(views: list, drafts: list[int], target_logits: torch.Tensor) -> list[int]:
        """``__call__`` for a greedy request: p is one-hot at each row's argmax, so a draft
        is accepted exactly when it is that argmax (p_x / q_x >= 1 for any q that proposed
        it), and the first rejected one is replaced by the argmax (all the residual
        max(p - q, 0) holds), as is the bonus token. No softmax, no random numbers: the
        tokens plain greedy decoding picks, at the cost of one argmax per row.

        Args:
            views: the k + 1 ``DraftPositionView`` of the request (its processors' view).
            drafts: the k draft token ids.
            target_logits: float32 [k + 1, vocab_size] raw target logits.

        Returns:
            Between 1 and k + 1 token ids.

        Raises:
            ValueError: ``no_token_error`` naming the fields, when a row reached (its drafts
                before it accepted) has every token masked."""
        processed = apply_logits_processors(target_logits, views)
        best = row_argmax(processed).tolist()
        if processed is not target_logits:  # (masks: a row may leave no token)
            dead = (processed == float("-inf")).all(dim=1).tolist()
        else:
            dead = [False] * len(best)
        emitted: list[int] = []
        for i, x in enumerate(drafts + [None]):
            if dead[i]:  # (reached: the drafts before it were accepted) no token may follow
                raise no_token_error(views[i])
            emitted.append(best[i])
            if x != best[i]:
                break
        return emitted


def _draw(weights: torch.Tensor, generator: torch.Generator) -> int:
    """One token from the (unnormalized) weights [vocab_size]."""
    if generator.device != weights.device:
        weights = weights.to(generator.device)
    return int(torch.multinomial(weights, 1, generator=generator))
