"""Request-dependent logits processing before temperature and filtering.

Order (as vLLM): ``allowed_token_ids``, grammar mask (structured output), bad words, ``min_tokens`` (which leaves
EOS and the stop tokens to a grammar that allows nothing else), logit bias,
then the penalties — repetition (Keskar et al. 2019, "CTRL", section 4.1: positive logits
divided, negative multiplied, for tokens seen in prompt or output), frequency and presence
(OpenAI: ``logit -= frequency_penalty * count + presence_penalty * (count > 0)`` over the
output tokens). Penalties are vectorized over the batch with one scatter of the token ids.
"""

from __future__ import annotations

import torch

from kvflow.request import Request


def apply_logits_processors(logits: torch.Tensor, requests: list[Request],
                            fail_when_all_masked: bool = False) -> torch.Tensor:
    """Apply every request's processors to its row.

    Args:
        logits: float32 [N, vocab_size] raw logits, one row per request (not modified).
        requests: the N requests, in row order.
        fail_when_all_masked: raise ``no_token_error`` for a row whose masks leave no token
            (the rows a request samples from now; a speculative draft position's row matters
            only once the drafts before it are accepted: ``RejectionSampler`` checks those).

    Returns:
        float32 [N, vocab_size] processed logits (a new tensor when anything applied).
    """
    masked = [i for i, r in enumerate(requests) if _needs_mask(r)]
    penalized = [i for i, r in enumerate(requests) if r.sampling_params.has_penalties]
    if not masked and not penalized:
        return logits
    logits = logits.clone()
    for i in masked:
        _apply_masks(logits[i], requests[i])
        if fail_when_all_masked and not bool((logits[i] != float("-inf")).any()):
            raise no_token_error(requests[i])
    if penalized:
        rows = torch.tensor(penalized, device=logits.device)
        logits[rows] = apply_penalties(logits[rows], [requests[i] for i in penalized])
    return logits


def _needs_mask(request: Request) -> bool:
    p = request.sampling_params
    return (
        p.allowed_token_ids is not None
        or request.grammar is not None
        or bool(request.bad_words_token_ids)
        or request.num_output_tokens < p.min_tokens
        or bool(p.logit_bias)
    )


def _apply_masks(row: torch.Tensor, request: Request) -> None:
    p = request.sampling_params
    if p.allowed_token_ids is not None:
        allowed = _allowed_index(p, row.device)
        kept = row[allowed]
        row.fill_(float("-inf"))
        row[allowed] = kept
    if request.grammar is not None:
        request.grammar.mask_logits(row)
    output = request.output_token_ids
    for word in request.bad_words_token_ids:
        prefix = word[:-1]
        if len(output) >= len(prefix) and (not prefix or output[len(output) - len(prefix) :] == prefix):
            row[word[-1]] = float("-inf")
    if request.num_output_tokens < p.min_tokens:
        _mask_stop_tokens(row, request)
    if p.logit_bias:
        vocab = row.shape[0]
        bias = [(t, b) for t, b in p.logit_bias.items() if t < vocab]
        if bias:
            tokens, values = zip(*bias)
            row.index_add_(0, torch.tensor(tokens, dtype=torch.int64, device=row.device),
                           torch.tensor(values, dtype=row.dtype, device=row.device))


def no_token_error(request) -> ValueError:
    """The failure of a request whose masks leave no token to sample (e.g. allowed_token_ids
    all among the bad words, or only EOS allowed while min_tokens masks it): argmax or
    multinomial would emit a token its settings forbid (token 0), so the engine fails it
    alone, naming what it set."""
    p = request.sampling_params
    grammar = getattr(request, "grammar", None)
    fields = [name for name, on in (
        ("allowed_token_ids", p.allowed_token_ids is not None),
        (getattr(grammar, "field", "the output constraint"), grammar is not None),
        ("bad_words", bool(request.bad_words_token_ids)),
        ("min_tokens (which masks EOS and stop_token_ids)", request.num_output_tokens < p.min_tokens)) if on]
    return ValueError(f"no token can be sampled: {', '.join(fields) or 'its settings'} together exclude every "
                      "token of the vocabulary")


def _allowed_index(params, device: torch.device) -> torch.Tensor:
    """int64 [k]: ``params.allowed_token_ids`` as an index tensor, made once per parameters
    object (kept on it: a large set is not rebuilt at every step of every sample)."""
    cached = params.__dict__.get("_allowed_index")
    if cached is None or cached[0] is not params.allowed_token_ids or cached[1].device != device:
        cached = (params.allowed_token_ids, torch.tensor(params.allowed_token_ids, dtype=torch.int64, device=device))
        params.__dict__["_allowed_index"] = cached
    return cached[1]


def _mask_stop_tokens(row: torch.Tensor, request: Request) -> None:
    """``min_tokens``: mask EOS and the ``stop_token_ids`` (the output is still short).

    With a grammar, as vLLM (vllm-project/vllm#54218): when the grammar (and bad words)
    leave no token but these, masking them would leave no token at all, so they stay and
    the grammar ends the output before ``min_tokens``. A grammar that allows any other
    token keeps them masked.
    """
    p = request.sampling_params
    banned = list(p.stop_token_ids)
    if request.eos_token_id is not None:
        banned.append(request.eos_token_id)
    vocab = row.shape[0]
    banned = [t for t in banned if t < vocab]
    if not banned:
        return
    if request.grammar is not None:
        others = row != float("-inf")
        others[banned] = False
        if not bool(others.any()):
            return  # the grammar allows only stop tokens: it wins
    row[banned] = float("-inf")


def apply_penalties(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """Repetition, frequency and presence penalties.

    Args:
        logits: float32 [M, vocab_size].
        requests: the M requests (each with at least one penalty set).

    Returns:
        float32 [M, vocab_size] penalized logits.
    """
    m, vocab = logits.shape
    device = logits.device
    outputs = [r.output_token_ids for r in requests]
    prompts = [r.prompt_token_ids for r in requests]
    counts = _token_counts(outputs, m, vocab, device)
    params = [r.sampling_params for r in requests]
    # float32 whatever the Python types: a batch of int penalties made an int64 tensor, which
    # overflowed for a valid int past 2**63 (repetition_penalty=2**70) alone, not in a batch
    rep = torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32, device=device).unsqueeze(1)
    freq = torch.tensor([p.frequency_penalty for p in params], dtype=torch.float32, device=device).unsqueeze(1)
    pres = torch.tensor([p.presence_penalty for p in params], dtype=torch.float32, device=device).unsqueeze(1)
    seen = (counts + _token_counts(prompts, m, vocab, device)) > 0
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalized, logits)
    return logits - freq * counts - pres * (counts > 0).float()


def _token_counts(token_lists: list[list[int]], m: int, vocab: int, device: torch.device) -> torch.Tensor:
    """float32 [m, vocab]: occurrences of each token id in each row's list."""
    counts = torch.zeros(m, vocab + 1, device=device)
    longest = max((len(t) for t in token_lists), default=0)
    if longest:
        ids = torch.full((m, longest), vocab, dtype=torch.int64)  # pads land in column `vocab`
        for i, tokens in enumerate(token_lists):
            ids[i, : len(tokens)] = torch.tensor(tokens, dtype=torch.int64)
        counts.scatter_add_(1, ids.to(device), torch.ones(m, longest, device=device))
    return counts[:, :vocab]
