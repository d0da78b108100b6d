"""RejectionSampler: speculative verification keeps the target distribution.

Unit tests drive ``RejectionSampler`` on synthetic logits (greedy acceptance, one-hot drafts,
the first-token distribution for a draft q != p). The statistical end-to-end test runs the
whole engine with a deliberately poor draft model over a 16-token vocabulary and compares
the empirical distribution of output positions 1 to 4 with the exact marginals of the
target, computed by enumerating every prefix with the target model (temperature 0.7,
top_p 0.9, through the same ``processed_probs`` the engine uses). It also checks the
acceptance counts against their exact expectation (which involves q), so that a draft
distribution reported wrongly to the verifier would be caught.
"""

from __future__ import annotations

import itertools
import sys

import pytest
import torch

from conftest import draft_runner, make_engine, tiny_model, tiny_model_config
from kvflow.config import CacheConfig, SchedulerConfig
from kvflow.engine.llm_engine import LLMEngine
from kvflow.attention.torch_backend import TORCH_BACKEND, AttentionGroup, GroupedMetadata
from kvflow.request import Request
from kvflow.sample.rejection_sampler import RejectionSampler, processed_probs
from kvflow.sampling_params import SamplingParams
from kvflow.spec_decode.draft_model import DraftModelProposer
from kvflow.attention.cache_engine import CacheEngine

try:
    from scipy import stats as scipy_stats
except ImportError:  # pragma: no cover - scipy is optional
    scipy_stats = None

CPU = torch.device("cpu")


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models gain nothing from intra-op threads on a shared 2-core machine."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


def gen(seed: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def make_request(params: SamplingParams, drafts: list[int], q: torch.Tensor | None = None) -> Request:
    r = Request("r", [1, 2, 3], params, eos_token_id=None)
    r.spec_token_ids = list(drafts)
    r.spec_draft_probs = q
    return r


def chi_square(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> tuple[float, int]:
    """Pearson chi-square statistic and degrees of freedom of ``counts`` against ``probs``;
    cells with expected count < ``min_expected`` are pooled into one cell."""
    counts = counts.double()
    n = float(counts.sum())
    expected = probs.double() * n
    big = expected >= min_expected
    obs = counts[big].tolist()
    exp = expected[big].tolist()
    small_obs, small_exp = float(counts[~big].sum()), float(expected[~big].sum())
    if small_exp > 0 or small_obs > 0:
        obs.append(small_obs)
        exp.append(small_exp)
    scale = sum(obs) / sum(exp)  # guard float drift in sum(probs)
    stat = sum((o - e * scale) ** 2 / (e * scale) if e > 0 else (float("inf") if o else 0.0) for o, e in zip(obs, exp))
    return stat, len(obs) - 1


def fits(counts: torch.Tensor, probs: torch.Tensor, alpha: float = 1e-3) -> bool:
    """Chi-square goodness of fit at level ``alpha`` (scipy's p-value when installed, else
    the Wilson-Hilferty approximation of the critical value for alpha = 1e-3)."""
    stat, df = chi_square(counts, probs)
    if df < 1:
        return stat == 0.0
    if scipy_stats is not None:
        return float(scipy_stats.chi2.sf(stat, df)) > alpha
    assert alpha == 1e-3
    z = 3.0902  # upper 1e-3 quantile of N(0, 1)
    critical = df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3
    return stat < critical


def test_fits_helper(monkeypatch):
    probs = torch.tensor([0.5, 0.3, 0.2])
    good, bad = torch.tensor([5020, 2990, 1990]), torch.tensor([5300, 2800, 1900])
    assert fits(good, probs) and not fits(bad, probs)
    monkeypatch.setattr(sys.modules[__name__], "scipy_stats", None)  # the fallback path
    assert fits(good, probs) and not fits(bad, probs)


# ---------------------------------------------------------------------------- unit tests
GREEDY = SamplingParams(temperature=0.0, max_tokens=16)


def logits_with_argmax(argmaxes: list[int], vocab: int = 10, seed: int = 0) -> torch.Tensor:
    """Random logits whose row i has its maximum (by a margin of 1) at argmaxes[i]."""
    logits = torch.randn(len(argmaxes), vocab, generator=gen(seed))
    for i, a in enumerate(argmaxes):
        logits[i, a] = logits[i].max() + 1.0
    return logits


@pytest.mark.parametrize("with_q", [False, True])
def test_greedy_accepts_while_draft_is_argmax(with_q):
    argmax = [3, 7, 1, 4, 9]  # target argmax at the last real token and after each of 4 drafts
    logits = logits_with_argmax(argmax)
    for num_match in range(5):
        drafts = argmax[:4]
        if num_match < 4:
            drafts = list(drafts)
            drafts[num_match] = (argmax[num_match] + 1) % 10  # first mismatch here
        q = None
        if with_q:  # a greedy draft model reports one-hot q at its own argmax
            q = torch.zeros(4, 10).scatter_(1, torch.tensor(drafts).view(-1, 1), 1.0)
        for trial in range(20):
            out = RejectionSampler(gen(trial))(make_request(GREEDY, drafts, q), drafts, logits)
            if num_match < 4:
                assert out == argmax[:num_match] + [argmax[num_match]]
            else:
                assert out == argmax  # all four drafts and the bonus argmax


def test_greedy_ignores_draft_probabilities_of_target_argmax():
    """A greedy request accepts a draft equal to the argmax even when q spread its mass."""
    logits = logits_with_argmax([2, 5])
    q = torch.full((1, 10), 0.1)
    for trial in range(50):
        out = RejectionSampler(gen(trial))(make_request(GREEDY, [2], q), [2], logits)
        assert out == [2, 5]


def test_one_hot_draft_with_p_one_is_always_accepted():
    # logits where x dominates by 1000 nats: p(x) == 1 exactly in float32
    params = SamplingParams(temperature=1.0, max_tokens=16)
    vocab = 10
    logits = torch.full((3, vocab), -1000.0)
    logits[0, 4] = 0.0
    logits[1, 6] = 0.0
    logits[2] = torch.randn(vocab, generator=gen(1))
    p = processed_probs(logits, [make_request(params, [])] * 3, vocab)
    assert float(p[0, 4]) == 1.0 and float(p[1, 6]) == 1.0
    for trial in range(200):
        out = RejectionSampler(gen(trial))(make_request(params, [4, 6]), [4, 6], logits)
        assert out[:2] == [4, 6] and len(out) == 3


def test_one_hot_draft_with_p_zero_is_always_rejected():
    params = SamplingParams(temperature=0.8, top_k=3, max_tokens=16)
    vocab = 10
    logits = torch.randn(2, vocab, generator=gen(2))
    x = int(logits[0].argmin())  # outside the top 3: p(x) = 0
    p = processed_probs(logits, [make_request(params, [])] * 2, vocab)
    assert float(p[0, x]) == 0.0
    seen = set()
    for trial in range(300):
        out = RejectionSampler(gen(trial))(make_request(params, [x]), [x], logits)
        assert len(out) == 1 and out[0] != x
        assert float(p[0, out[0]]) > 0
        seen.add(out[0])
    assert len(seen) == 3  # the replacement is drawn from p (renormalized without x)


def test_draft_model_token_with_p_zero_is_rejected():
    """q puts mass on x but the target filtered x away: never accepted, never emitted."""
    params = SamplingParams(temperature=1.0, top_p=0.5, max_tokens=16)
    vocab = 8
    logits = torch.tensor([[4.0, 3.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0], [0.0] * 8])
    q = torch.full((1, vocab), 1.0 / vocab)
    for trial in range(200):
        out = RejectionSampler(gen(trial))(make_request(params, [5], q), [5], logits)
        assert out == [0]  # top_p 0.5 keeps only token 0


def _first_token_counts(params, logits, q, num_draws: int, seed: int) -> tuple[torch.Tensor, int]:
    """Draw a draft x ~ q (or use the fixed ``q`` token when q is an int), verify, and count
    the first emitted token; ``num_draws`` times. Also returns how many drafts were accepted."""
    vocab = logits.shape[-1]
    draft_gen = gen(seed + 1)
    rs = RejectionSampler(gen(seed))
    counts = torch.zeros(vocab, dtype=torch.int64)
    accepted = 0
    for _ in range(num_draws):
        if isinstance(q, int):
            x, q_rows = q, None
        else:
            x = int(torch.multinomial(q[0], 1, generator=draft_gen))
            q_rows = q
        out = rs(make_request(params, [x], q_rows), [x], logits)
        counts[out[0]] += 1
        accepted += len(out) == 2
    return counts, accepted


def test_first_token_follows_p_for_draft_q():
    """The classic property: with x ~ q and verification, the first emitted token ~ p, and
    a draft is accepted with probability sum_x min(p(x), q(x)) (Leviathan et al. 2023,
    section 3.3)."""
    params = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=16)
    vocab = 12
    logits = torch.randn(2, vocab, generator=gen(3)) * 1.5
    q_logits = torch.randn(1, vocab, generator=gen(4)) * 1.5  # unrelated to p
    views = [make_request(params, [])]
    p = processed_probs(logits[:1], views, vocab)[0]
    q = processed_probs(q_logits, views, vocab)
    overlap = float(torch.minimum(p, q[0]).sum())
    assert 0.05 < overlap < 0.95, overlap  # drafts are often rejected and often accepted
    n = 20_000
    counts, accepted = _first_token_counts(params, logits, q, n, seed=11)
    assert fits(counts, p)
    assert 0.5 * float((counts / n - p).abs().sum()) < 0.02  # E[TV] <= 0.5 * sqrt(12 / n) = 0.012
    assert abs(accepted / n - overlap) < 5 * (overlap * (1 - overlap) / n) ** 0.5


def test_first_token_follows_p_for_one_hot_draft():
    """n-gram drafts (q one-hot at x): the first emitted token ~ p whatever x is."""
    params = SamplingParams(temperature=0.9, max_tokens=16)
    vocab = 12
    logits = torch.randn(2, vocab, generator=gen(5)) * 1.5
    p = processed_probs(logits[:1], [make_request(params, [])], vocab)[0]
    x = int(p.argsort()[vocab // 2])  # a middling token
    counts, accepted = _first_token_counts(params, logits, x, 20_000, seed=12)
    assert fits(counts, p)
    assert abs(accepted / 20_000 - float(p[x])) < 5 * (float(p[x] * (1 - p[x])) / 20_000) ** 0.5


def test_seeded_request_is_reproducible():
    params = SamplingParams(temperature=1.0, seed=42, max_tokens=16)
    logits = torch.randn(4, 10, generator=gen(8))
    q = torch.softmax(torch.randn(3, 10, generator=gen(9)), dim=-1)
    outs = []
    for engine_seed in (0, 1):
        r = make_request(params, [1, 2, 3], q)
        outs.append([RejectionSampler(gen(engine_seed))(r, [1, 2, 3], logits) for _ in range(20)])
    assert outs[0] == outs[1]  # only the request's own generator is used


# ---------------------------------------------------------------------- end to end (engine)
VOCAB = 16
PROMPT = [5, 9, 2, 6]
MAX_TOKENS = 4
TEMPERATURE, TOP_P = 0.7, 0.9
NUM_REQUESTS = 20_000


def _perturbed(model, scale: float, seed: int):
    """The model with Gaussian noise of std ``scale`` added to every weight matrix."""
    g = gen(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.add_(torch.randn(p.shape, generator=g) * scale)
    return model


@torch.inference_mode()
def enumerate_logits(model, prompt: list[int], depth: int, vocab: int) -> list[torch.Tensor]:
    """Raw next-token logits after every output prefix of length 0..depth.

    One batched paged forward over all ``vocab**depth`` continuations of the prompt.

    Returns:
        [logits after 0 tokens: [V], after 1: [V, V], ..., after depth: [V]*depth + [V]].
    """
    seqs = torch.tensor(list(itertools.product(range(vocab), repeat=depth)), dtype=torch.int64)
    n, length = seqs.shape[0], len(prompt) + depth
    tokens = torch.cat([torch.tensor(prompt).expand(n, -1), seqs], dim=1)
    bs = length
    cache = CacheEngine(model.kv_cache_spec, CacheConfig(bs, n, torch.float32), CPU)
    positions = torch.arange(length).repeat(n)
    slots = torch.arange(n * length)  # sequence i in block i
    group = AttentionGroup.build(0, [length] * n, [length] * n, [[i] for i in range(n)], bs, CPU)
    hidden = model(tokens.reshape(-1), positions, cache.kv_caches, GroupedMetadata(slots, [group]))
    logits = model.compute_logits(hidden).reshape([vocab] * depth + [length, vocab]).float()
    out = []
    for j in range(depth + 1):
        index = (slice(None),) * j + (0,) * (depth - j) + (len(prompt) - 1 + j,)
        out.append(logits[index])
    return out


def probs_tree(logits_tree: list[torch.Tensor], params: SamplingParams) -> list[torch.Tensor]:
    view = Request("v", PROMPT, params, eos_token_id=None)
    tree = []
    for logits in logits_tree:
        flat = logits.reshape(-1, VOCAB)
        tree.append(processed_probs(flat, [view] * flat.shape[0], VOCAB).double().reshape(logits.shape))
    return tree


def near_top_p_boundary_mass(logits_tree: list[torch.Tensor], p: list[torch.Tensor], tol: float = 1e-4) -> float:
    """Probability (under the target) of reaching a context whose nucleus is within ``tol``
    of flipping a token in or out (the mass before some token within ``tol`` of top_p).

    The engine's logits and these enumerated ones differ by ~1e-6 (other batch shapes), so
    only such contexts could sample from a slightly different nucleus than computed here.
    """
    mass, joint = 0.0, torch.ones((), dtype=torch.float64)
    for j, logits in enumerate(logits_tree):
        probs = torch.softmax(logits.double() / TEMPERATURE, dim=-1)
        sorted_probs = probs.sort(dim=-1, descending=True).values
        before = sorted_probs.cumsum(-1) - sorted_probs
        near = ((before - TOP_P).abs() < tol).any(-1)
        mass += float((joint * near).sum())
        joint = joint.unsqueeze(-1) * p[j]
    return mass


def exact_marginals(p: list[torch.Tensor]) -> list[torch.Tensor]:
    """Marginal distribution of output positions 1..len(p) under the target."""
    marginals, joint = [], torch.ones(())
    for j, p_j in enumerate(p):
        step = joint.unsqueeze(-1) * p_j  # joint of the first j + 1 tokens
        marginals.append(step.reshape(-1, VOCAB).sum(0))
        joint = step
    return marginals


def expected_acceptance(p: list[torch.Tensor], q: list[torch.Tensor]) -> tuple[float, float, float]:
    """Exact per-request probabilities, for prompt + max_tokens=4 and k >= 2 drafts:

    the first verification drafts 2 tokens (capped by max_tokens); if it accepts none, a
    second one drafts 1 token; otherwise the rest are plain decodes. Returns
    (P[first draft rejected], P[a draft at position 1 accepted], P[both drafts of the first
    verification accepted]); each is the mean of a per-request 0/1 variable.
    """
    p0, p1, p2 = p[0], p[1], p[2]
    q1, q2 = q[1], q[2]
    beta1 = torch.minimum(p1, q1).sum(-1)  # [V]: P(accept d1 | o1)
    beta2 = torch.minimum(p2, q2).sum(-1)  # [V, V]: P(accept d | o1, x)
    p_first = float((p0 * beta1).sum())
    p_both = float((p0.unsqueeze(-1) * torch.minimum(p1, q1) * beta2).sum())
    residual = (p1 - q1).clamp(min=0)  # P(reject d1, emit o2 | o1)
    p_second = float((p0.unsqueeze(-1) * residual * beta2).sum())
    return 1.0 - p_first, p_first + p_second, p_both


def test_speculative_sampling_preserves_target_distribution():
    cfg = tiny_model_config(vocab_size=VOCAB)
    target = tiny_model(cfg, seed=0)
    draft = _perturbed(tiny_model(cfg, seed=0), scale=0.04, seed=5)  # a poor copy of the target
    params = SamplingParams(temperature=TEMPERATURE, top_p=TOP_P, max_tokens=MAX_TOKENS)

    target_logits = enumerate_logits(target, PROMPT, MAX_TOKENS - 1, VOCAB)
    p = probs_tree(target_logits, params)
    assert near_top_p_boundary_mass(target_logits, p) < 1e-3  # negligible next to the TV bound
    q = probs_tree(enumerate_logits(draft, PROMPT, MAX_TOKENS - 1, VOCAB), params)
    marginals = exact_marginals(p)

    batch, bs = 512, 8
    draft_cache = CacheConfig(bs, 2 * batch, torch.float32, enable_prefix_caching=False)
    proposer = DraftModelProposer(draft_runner(draft, cfg, draft_cache, seed=1), cfg.vocab_size,
                                  draft_cache, 3, 64)
    engine = make_engine(
        target, cfg, CacheConfig(bs, 2 * batch, torch.float32), SchedulerConfig(1 << 20, batch, 64), None, CPU,
        seed=0, proposer=proposer,
    )
    counts = torch.zeros(MAX_TOKENS, VOCAB, dtype=torch.int64)
    finished = added = 0
    while added < NUM_REQUESTS or engine.has_unfinished_requests():
        # Keep ~2 batches waiting (queue insertion is linear in the queue length).
        while added < NUM_REQUESTS and engine.scheduler.num_waiting < 2 * batch:
            engine.add_request(str(added), PROMPT, params)
            added += 1
        for out in engine.step():
            if out.finished:
                tokens = out.outputs[0].token_ids
                assert len(tokens) == MAX_TOKENS
                counts[torch.arange(MAX_TOKENS), torch.tensor(tokens)] += 1
                finished += 1
    assert finished == NUM_REQUESTS

    # Distribution of each output position: chi-square (p > 1e-3; 4 tests, fixed seeds) and
    # total variation. With n = 20k draws over <= 16 cells, E[TV] <= 0.5 * sqrt(16 / n) =
    # 0.014; TV < 0.025 leaves ~5 standard deviations of TV's own fluctuation.
    for pos in range(MAX_TOKENS):
        tv = 0.5 * float((counts[pos].double() / NUM_REQUESTS - marginals[pos]).abs().sum())
        assert fits(counts[pos], marginals[pos]), (
            pos + 1, chi_square(counts[pos], marginals[pos]), counts[pos].tolist(),
            (marginals[pos] * NUM_REQUESTS).tolist(),
        )
        assert tv < 0.025, (pos + 1, tv)

    # The drafts were rejected often and accepted often, and at the exact expected rates.
    stats = engine.get_stats()
    assert 0.05 < stats["spec_acceptance_rate"] < 0.95, stats
    p_reject_first, p_accept_pos1, p_accept_both = expected_acceptance(p, q)
    spec = engine.spec_stats
    n = NUM_REQUESTS

    def close(observed: int, prob: float) -> bool:
        return abs(observed - n * prob) < 5 * (n * prob * (1 - prob)) ** 0.5 + 1

    assert spec.drafted_at[1] == n and spec.drafted_at[2] == 0  # max_tokens=4 caps drafts at 2
    assert close(spec.drafted_at[0] - n, p_reject_first), (spec.drafted_at, p_reject_first)
    assert close(spec.accepted_at[0], p_accept_pos1), (spec.accepted_at, p_accept_pos1)
    assert close(spec.accepted_at[1], p_accept_both), (spec.accepted_at, p_accept_both)
    assert proposer.kv.num_free_blocks == proposer.kv.num_total_blocks
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_an_accepted_draft_after_which_no_token_is_allowed_fails_the_request(temperature):
    """allowed_token_ids [4, 5] with bad words [4, 5] and [4, 4]: after token 4 nothing is
    allowed. Once the draft 4 is accepted, the next row has every token masked: the request
    fails with the ValueError naming the fields (it emitted token 0 greedily, which
    allowed_token_ids forbids, or a sampled row of NaN), while a rejected draft 4 leaves the
    first row, which allows 5."""
    params = SamplingParams(temperature=temperature, max_tokens=16, allowed_token_ids=[4, 5])
    logits = torch.zeros(3, 12)
    logits[:, 4] = 5.0  # the target prefers 4: the draft 4 is accepted
    request = make_request(params, [4, 5])
    request.bad_words_token_ids = [[4, 5], [4, 4]]
    with pytest.raises(ValueError, match="no token can be sampled: allowed_token_ids, bad_words"):
        RejectionSampler(gen(0))(request, [4, 5], logits)
    if temperature == 0:
        logits[:, 4], logits[:, 5] = 0.0, 5.0  # the target prefers 5: the draft 4 is rejected
        assert RejectionSampler(gen(0))(request, [4, 5], logits) == [5]


@pytest.mark.parametrize("with_q", [False, True])
def test_greedy_verification_draws_no_random_numbers(with_q):
    """Greedy verification is an argmax per row: the generator is left as plain greedy
    decoding leaves it (a seeded neighbour's stream does not depend on speculation)."""
    logits = logits_with_argmax([3, 7, 1])
    q = torch.full((2, 10), 0.1) if with_q else None
    g = gen(5)
    state = g.get_state()
    assert RejectionSampler(g)(make_request(GREEDY, [3, 2], q), [3, 2], logits) == [3, 7]
    assert torch.equal(g.get_state(), state)


def test_greedy_verification_applies_the_penalties_of_the_drafts_before_each_row():
    """A repetition penalty counts the accepted drafts before a row: token 5 (not in the
    prompt), drafted and accepted at row 0, is penalized at row 1, whose argmax then moves
    to the runner-up."""
    params = SamplingParams(temperature=0.0, max_tokens=16, repetition_penalty=2.0)
    logits = torch.zeros(3, 10)
    logits[:, 5], logits[:, 6] = 4.0, 3.0  # row 1 unpenalized would pick 5 again
    out = RejectionSampler(gen(0))(make_request(params, [5, 5]), [5, 5], logits)
    assert out == [5, 6]
