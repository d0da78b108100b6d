"""Sampler: greedy rows, filtering (top-k, top-p, min-p), the sampled distribution, seeds."""

from __future__ import annotations

import math

import pytest
import torch

from kvflow.request import Request
from kvflow.sample.sampler import Sampler, SamplingTensors
from kvflow.sampling_params import SamplingParams


def tensors(n: int, vocab: int, temperature=1.0, top_k=None, top_p=1.0, min_p=0.0, generators=None) -> SamplingTensors:
    """SamplingTensors with per-row values (a scalar applies to every row)."""

    def col(v, dtype):
        values = v if isinstance(v, (list, tuple)) else [v] * n
        return torch.tensor(values, dtype=dtype)

    return SamplingTensors(
        temperature=col(temperature, torch.float32),
        top_k=col(vocab if top_k is None else top_k, torch.int64),
        top_p=col(top_p, torch.float32),
        min_p=col(min_p, torch.float32),
        generators=generators if generators is not None else [None] * n,
    )


def sampler(seed: int = 0) -> Sampler:
    g = torch.Generator()
    g.manual_seed(seed)
    return Sampler(g)


def gen(seed: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed)
    return g


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny tensors: extra intra-op threads only contend on a shared 2-core machine."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


PROBS = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])
LOGITS = PROBS.log().unsqueeze(0)


# ---------------------------------------------------------------------------- greedy
def test_greedy_rows_equal_argmax():
    torch.manual_seed(0)
    logits = torch.randn(8, 50)
    temps = [0.0, 1.0, 0.0, 0.7, 0.0, 1.3, 0.0, 0.0]
    tokens = sampler()(logits, tensors(8, 50, temperature=temps))
    argmax = logits.argmax(dim=-1)
    assert tokens.dtype == torch.int64 and tokens.shape == (8,)
    for row, t in enumerate(temps):
        if t == 0.0:
            assert tokens[row].item() == argmax[row].item()


def test_all_greedy_batch_is_argmax_and_draws_no_noise():
    torch.manual_seed(1)
    logits = torch.randn(5, 30)
    s = sampler(3)
    state = s.generator.get_state()
    own = gen(11)
    own_state = own.get_state()
    gens = [None, own, None, None, None]
    assert torch.equal(s(logits, tensors(5, 30, temperature=0.0, generators=gens)), logits.argmax(dim=-1))
    assert torch.equal(s.generator.get_state(), state)
    assert torch.equal(own.get_state(), own_state)


def test_top_k_one_equals_greedy():
    torch.manual_seed(2)
    logits = torch.randn(4, 40)
    argmax = logits.argmax(dim=-1)
    s = sampler(5)
    st = tensors(4, 40, temperature=1.5, top_k=1)
    for _ in range(50):
        assert torch.equal(s(logits, st), argmax)
    # And SamplingParams(top_k=1) is treated as greedy when building the tensors.
    assert SamplingParams(temperature=0.9, top_k=1).greedy
    req = Request("a", [1], SamplingParams(temperature=0.9, top_k=1), None)
    st = SamplingTensors.from_requests([req], 40, torch.device("cpu"))
    assert st.temperature.tolist() == [0.0]


def test_from_requests_maps_params_to_rows():
    reqs = [
        Request("a", [1], SamplingParams(temperature=0), None),
        Request("b", [1], SamplingParams(temperature=0.5, top_k=7, top_p=0.9, min_p=0.1, seed=3), None),
        Request("c", [1], SamplingParams(temperature=1.2, top_k=-1), None),
    ]
    st = SamplingTensors.from_requests(reqs, 100, torch.device("cpu"))
    assert st.temperature.tolist() == pytest.approx([0.0, 0.5, 1.2])
    assert st.top_k.tolist() == [100, 7, 100]
    assert st.top_p.tolist() == pytest.approx([1.0, 0.9, 1.0])
    assert st.min_p.tolist() == pytest.approx([0.0, 0.1, 0.0])
    assert st.generators[0] is None and st.generators[2] is None
    assert st.generators[1] is reqs[1].generator and st.generators[1] is not None


@pytest.mark.parametrize("top_k", [100, 101, 2**63 - 1, 2**63, 10**20])
def test_top_k_at_or_above_the_vocabulary_keeps_every_token(top_k):
    """A top_k the vocabulary cannot reach means "off": it is clamped (2**63 does not even fit
    the int64 tensor) and samples exactly as top_k=0."""
    req = Request("a", [1], SamplingParams(temperature=0.8, top_k=top_k, seed=1), None)
    st = SamplingTensors.from_requests([req], 100, torch.device("cpu"))
    assert st.top_k.tolist() == [100]
    torch.manual_seed(5)
    logits = torch.randn(1, 100)
    off = SamplingTensors.from_requests([Request("b", [1], SamplingParams(temperature=0.8, seed=1), None)], 100,
                                        torch.device("cpu"))
    torch.testing.assert_close(Sampler.filtered_probs(logits, st), Sampler.filtered_probs(logits, off))


# ---------------------------------------------------------------------------- filtering
def test_no_filter_is_softmax_of_scaled_logits():
    torch.manual_seed(3)
    logits = torch.randn(3, 20)
    probs = Sampler.filtered_probs(logits, tensors(3, 20, temperature=[1.0, 0.5, 2.0]))
    for row, t in enumerate([1.0, 0.5, 2.0]):
        torch.testing.assert_close(probs[row], (logits[row] / t).softmax(-1))


@pytest.mark.parametrize("k", [1, 2, 5, 19, 20])
def test_top_k_keeps_exactly_k(k):
    torch.manual_seed(4)
    logits = torch.randn(3, 20)
    probs = Sampler.filtered_probs(logits, tensors(3, 20, top_k=k))
    for row in range(3):
        kept = (probs[row] > 0).nonzero().flatten()
        assert len(kept) == k
        assert set(kept.tolist()) == set(logits[row].topk(k).indices.tolist())
        expected = torch.zeros(20)
        expected[kept] = logits[row, kept].softmax(-1)
        torch.testing.assert_close(probs[row], expected)


def test_top_k_per_row():
    torch.manual_seed(5)
    logits = torch.randn(3, 10)
    probs = Sampler.filtered_probs(logits, tensors(3, 10, top_k=[2, 10, 4]))
    assert (probs > 0).sum(-1).tolist() == [2, 10, 4]


@pytest.mark.parametrize(
    ("top_p", "kept"),
    [(0.3, 1), (0.45, 1), (0.55, 2), (0.69, 2), (0.71, 3), (0.8, 3), (0.86, 4), (0.94, 4), (0.96, 5), (1.0, 5)],
)
def test_top_p_keeps_smallest_prefix_with_mass_at_least_p(top_p, kept):
    # probs 0.5, 0.2, 0.15, 0.1, 0.05: cumulative 0.5, 0.7, 0.85, 0.95, 1.0
    probs = Sampler.filtered_probs(LOGITS, tensors(1, 5, top_p=top_p))[0]
    expected = torch.zeros(5)
    expected[:kept] = PROBS[:kept] / PROBS[:kept].sum()
    torch.testing.assert_close(probs, expected)


def test_top_p_order_independent_of_vocab_position():
    perm = torch.tensor([3, 0, 4, 1, 2])
    logits = LOGITS[:, perm]
    probs = Sampler.filtered_probs(logits, tensors(1, 5, top_p=0.8))[0]
    expected = torch.zeros(5)
    expected[:3] = PROBS[:3] / PROBS[:3].sum()
    torch.testing.assert_close(probs, expected[perm])


def test_top_p_always_keeps_the_top_token():
    logits = torch.tensor([[10.0, 0.0, 0.0, 0.0]])
    probs = Sampler.filtered_probs(logits, tensors(1, 4, top_p=1e-6))[0]
    assert probs.tolist() == [1.0, 0.0, 0.0, 0.0]


@pytest.mark.parametrize(("min_p", "kept"), [(0.05, 5), (0.15, 4), (0.25, 3), (0.35, 2), (0.5, 1), (1.0, 1)])
def test_min_p_threshold(min_p, kept):
    # threshold = min_p * 0.5
    probs = Sampler.filtered_probs(LOGITS, tensors(1, 5, min_p=min_p))[0]
    expected = torch.zeros(5)
    expected[:kept] = PROBS[:kept] / PROBS[:kept].sum()
    torch.testing.assert_close(probs, expected)


def test_filters_apply_after_temperature_in_order():
    # At T=2 the tempered probs are proportional to sqrt(PROBS).
    tempered = PROBS.sqrt() / PROBS.sqrt().sum()  # ~ .330 .209 .181 .148 .104 (cum .330 .539 .720 .868)
    probs = Sampler.filtered_probs(LOGITS, tensors(1, 5, temperature=2.0, top_p=0.7))[0]
    expected = torch.zeros(5)
    expected[:3] = tempered[:3] / tempered[:3].sum()
    torch.testing.assert_close(probs, expected)
    # top-k first, then top-p on the renormalized top-k distribution: top-2 -> (.625, .375).
    probs = Sampler.filtered_probs(LOGITS, tensors(1, 5, top_k=2, top_p=0.6))[0]
    torch.testing.assert_close(probs, torch.tensor([1.0, 0.0, 0.0, 0.0, 0.0]))
    probs = Sampler.filtered_probs(LOGITS, tensors(1, 5, top_k=3, top_p=0.65))[0]
    expected = torch.zeros(5)
    expected[:2] = PROBS[:2] / PROBS[:2].sum()  # top-3 renorm: .588 .235 .176 -> .588 < .65, keep 2
    torch.testing.assert_close(probs, expected)


def test_filter_rows_are_independent():
    logits = LOGITS.repeat(3, 1)
    probs = Sampler.filtered_probs(logits, tensors(3, 5, top_k=[2, 5, 5], top_p=[1.0, 0.6, 1.0], min_p=[0.0, 0.0, 0.25]))
    assert (probs > 0).sum(-1).tolist() == [2, 2, 3]
    torch.testing.assert_close(probs.sum(-1), torch.ones(3))


# ---------------------------------------------------------------------------- distribution
def expected_distribution(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float) -> list[float]:
    """Independent reference in plain Python: softmax(logits / T), then top-k, top-p, min-p."""
    vals = [x / temperature for x in logits.tolist()]
    m = max(vals)
    w = [math.exp(v - m) for v in vals]
    p = [x / sum(w) for x in w]
    order = sorted(range(len(p)), key=lambda i: -p[i])
    keep = set(order[:top_k])
    mass = sum(p[i] for i in keep)
    cum, kept_p = 0.0, set()
    for i in order:
        if i not in keep:
            continue
        if cum >= top_p * mass and kept_p:
            break
        kept_p.add(i)
        cum += p[i]
    keep = kept_p
    z = sum(p[i] for i in keep)
    q = [p[i] / z if i in keep else 0.0 for i in range(len(p))]
    top = max(q)
    q = [x if x >= min_p * top else 0.0 for x in q]
    return [x / sum(q) for x in q]


# Upper 0.1% points of the chi-square distribution, by degrees of freedom.
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47}


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p", "min_p"),
    [(1.0, 5, 1.0, 0.0), (0.7, 5, 1.0, 0.0), (1.8, 4, 1.0, 0.0), (1.0, 5, 0.8, 0.0), (1.3, 5, 1.0, 0.3), (0.9, 4, 0.9, 0.1)],
)
def test_sampling_follows_filtered_softmax(temperature, top_k, top_p, min_p):
    n = 20000
    logits = torch.tensor([1.2, 0.3, -0.4, 0.9, -1.5])
    expected = expected_distribution(logits, temperature, top_k, top_p, min_p)
    st = tensors(n, 5, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    torch.testing.assert_close(Sampler.filtered_probs(logits.unsqueeze(0), tensors(1, 5, temperature, top_k, top_p, min_p))[0], torch.tensor(expected))
    tokens = sampler(1234)(logits.expand(n, 5).contiguous(), st)
    counts = torch.bincount(tokens, minlength=5).tolist()
    support = [i for i in range(5) if expected[i] > 0]
    assert all(counts[i] == 0 for i in range(5) if expected[i] == 0), (counts, expected)
    chi2 = sum((counts[i] - n * expected[i]) ** 2 / (n * expected[i]) for i in support)
    assert chi2 < CHI2_999[len(support) - 1], (chi2, counts, expected)
    tv = 0.5 * sum(abs(counts[i] / n - expected[i]) for i in range(5))
    assert tv < 0.02


def test_sampling_is_not_greedy():
    # A guard against a sampler that ignores its noise: a flat distribution must spread out.
    n = 5000
    tokens = sampler(7)(torch.zeros(n, 4), tensors(n, 4))
    counts = torch.bincount(tokens, minlength=4)
    assert counts.min().item() > 1000


# ---------------------------------------------------------------------------- seeds
def draw_sequence(seed: int, row: int, batch: int, engine_seed: int, steps: int = 20) -> list[int]:
    """Sample ``steps`` tokens for a seeded row placed at ``row`` in a batch of random others."""
    torch.manual_seed(100 + batch + row)
    s = sampler(engine_seed)
    own = gen(seed)
    target = torch.linspace(-1.0, 1.0, 30)
    out = []
    for _ in range(steps):
        logits = torch.randn(batch, 30) * 3
        logits[row] = target
        gens = [None] * batch
        gens[row] = own
        temps = [1.0] * batch
        top_p = [1.0] * batch
        top_p[row] = 0.95
        out.append(int(s(logits, tensors(batch, 30, temperature=temps, top_p=top_p, generators=gens))[row]))
    return out


def test_seeded_row_reproduces_regardless_of_batch_and_position():
    alone = draw_sequence(seed=42, row=0, batch=1, engine_seed=0)
    assert draw_sequence(seed=42, row=3, batch=5, engine_seed=9) == alone
    assert draw_sequence(seed=42, row=0, batch=8, engine_seed=1) == alone
    assert draw_sequence(seed=42, row=6, batch=7, engine_seed=2) == alone
    assert draw_sequence(seed=43, row=0, batch=1, engine_seed=0) != alone
    assert len(set(alone)) > 5  # really sampled


def test_batch_draw_reproducible_and_seeded_row_matches_alone():
    logits = torch.randn(4, 30, generator=gen(0))
    st_a = tensors(4, 30, generators=[gen(1), None, gen(2), None])
    st_b = tensors(4, 30, generators=[gen(1), None, gen(2), None])
    a = sampler(5)(logits, st_a)
    b = sampler(5)(logits, st_b)
    assert torch.equal(a, b)
    # Row 2 seeded with 2 alone gives the same token.
    alone = sampler(77)(logits[2:3], tensors(1, 30, generators=[gen(2)]))
    assert alone.item() == a[2].item()


def test_row_argmax_takes_the_first_of_tied_maxima():
    from kvflow.sample.sampler import row_argmax

    x = torch.tensor([[1.0, 3.0, 3.0, 0.0], [5.0, 5.0, 5.0, 5.0], [-1.0, -2.0, -0.5, -0.5]])
    assert row_argmax(x).tolist() == [1, 0, 2]
    y = torch.randn(32, 49152)
    y[:, 100] = y.max() + 1  # a tie far from the first position too
    y[:, 40000] = y[:, 100]
    assert torch.equal(row_argmax(y), y.argmax(dim=-1))


@pytest.mark.parametrize("vocab", [1024, 4096 + 77, 49152, 151936])
def test_row_argmax_two_pass_equals_argmax(vocab):
    """The chunked search gives ``argmax``'s index (the first of tied maxima) for every row:
    ties inside a chunk, across chunks and in the partial last chunk, a maximum only in the
    last chunk, rows of -inf, a NaN, bfloat16, and a non-contiguous batch of rows."""
    from kvflow.sample.sampler import ARGMAX_CHUNK, row_argmax

    gen = torch.Generator().manual_seed(vocab)
    x = torch.randn(40, vocab, generator=gen)
    top = x.max() + 1
    x[0, 5], x[0, 6] = top, top  # a tie inside one chunk
    x[1, 3 * ARGMAX_CHUNK + 1], x[1, vocab - 1] = top, top  # across chunks, one in the last
    x[2, vocab - 1] = top  # only in the last (partial) chunk
    x[3] = float("-inf")
    x[5, ARGMAX_CHUNK - 1], x[5, ARGMAX_CHUNK] = top, top  # at a chunk boundary
    with_nan = x.clone()
    with_nan[4, 9] = float("nan")  # (its batch takes max(dim): checked apart)
    for batch in (x, x[::2], x.to(torch.bfloat16), with_nan):
        assert torch.equal(row_argmax(batch), batch.argmax(dim=-1))
    # probabilities over exponential noise (the exponential race: rows of many near ties)
    probs = torch.softmax(x[6:], dim=-1) / torch.empty_like(x[6:]).exponential_(generator=gen)
    assert torch.equal(row_argmax(probs), probs.argmax(dim=-1))


def test_a_temperature_past_float32_keeps_masked_tokens_out():
    """temperature=1e300 is valid (uniform over the allowed tokens) but is inf in float32, and
    -inf (a grammar's or min_tokens' mask) / inf is NaN: the NaN row then sampled token 0,
    outside a guided_choice. Capped at float32's largest value, masked tokens stay at 0."""
    req = Request("a", [1], SamplingParams(temperature=1e300, seed=1), None)
    st = SamplingTensors.from_requests([req], 5, torch.device("cpu"))
    assert math.isfinite(st.temperature.item())
    logits = torch.tensor([[-math.inf, 2.0, -math.inf, 0.5, -1.0]])
    probs = Sampler.filtered_probs(logits, st)
    assert not probs.isnan().any()
    assert probs[0, 0] == 0 and probs[0, 2] == 0
    torch.testing.assert_close(probs[0, [1, 3, 4]], torch.full((3,), 1 / 3))


# ---------------------------------------------------------------------------- large vocabularies
def sorted_reference(logits: torch.Tensor, st) -> torch.Tensor:
    """The filtered distributions over a full sort of every row's tempered logits (the
    definition, written out in PyTorch)."""
    temperature = torch.where(st.temperature == 0, torch.ones_like(st.temperature), st.temperature)
    x = logits / temperature.unsqueeze(1)
    vocab = x.shape[-1]
    sorted_logits, sorted_idx = x.sort(dim=-1, descending=True)
    sorted_logits = sorted_logits.masked_fill(torch.arange(vocab) >= st.top_k.unsqueeze(1), float("-inf"))
    sorted_probs = sorted_logits.softmax(dim=-1)
    remove = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= st.top_p.unsqueeze(1)
    remove[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(x).scatter_(1, sorted_idx, sorted_logits).softmax(dim=-1)


def test_top_k_top_p_from_the_largest_logits_equal_a_full_sort():
    """Rows of a 151,936-token vocabulary: a peaked row whose nucleus lies in the first
    ``TOP_CANDIDATES`` logits, a top_k row (top_k above and below the candidate count), a
    flatter row whose nucleus needs 16 times as many candidates, a flat row that falls back
    to the full sort, and rows without any filter between them: each equals the full sort's
    distribution."""
    from kvflow.sample.sampler import TOP_CANDIDATES

    vocab = 151936
    g = torch.Generator().manual_seed(0)
    zipf = -1.1 * torch.log(torch.arange(1, vocab + 1, dtype=torch.float32))  # a language model's tail
    rows = [zipf[torch.randperm(vocab, generator=g)] for _ in range(3)]
    rows.append(torch.randn(vocab, generator=g) * 0.5)  # flat: nucleus beyond 16 x the candidates
    rows.append((1.3 / 1.1) * zipf[torch.randperm(vocab, generator=g)])  # nucleus of ~650 tokens at top_p 0.9
    rows.append(torch.randn(vocab, generator=g))
    logits = torch.stack(rows)
    st = tensors(6, vocab, temperature=[0.7, 1.0, 1.3, 1.0, 1.0, 0.8],
                 top_k=[vocab, 40, 3 * TOP_CANDIDATES, vocab, vocab, vocab],
                 top_p=[0.9, 1.0, 0.95, 0.9, 0.9, 1.0])
    probs = Sampler.filtered_probs(logits, st)
    ref = sorted_reference(logits, st)
    ref[5] = (logits[5] / 0.8).softmax(-1)  # no filter
    kept = (probs > 0).sum(-1).tolist()
    assert kept[0] <= TOP_CANDIDATES < kept[4] <= 16 * TOP_CANDIDATES < kept[3]  # every path taken
    assert kept[1] == 40 and TOP_CANDIDATES < kept[2] < 3 * TOP_CANDIDATES  # top-k, then top-p inside it
    # The supports agree but for a token whose mass before it is within float rounding of
    # top_p (the sums run in another order): at most one such token a row, of tiny probability.
    boundary = (probs > 0) != (ref > 0)
    assert int(boundary.sum(-1).max()) <= 1 and all(float(x) < 1e-4 for x in (probs + ref)[boundary])
    torch.testing.assert_close(probs.masked_fill(boundary, 0), ref.masked_fill(boundary, 0), rtol=1e-4, atol=1e-7)
    # the same rows alone (no batch) and in another order give the same distributions
    for i in range(6):
        one = tensors(1, vocab, temperature=st.temperature[i].item(), top_k=int(st.top_k[i]), top_p=st.top_p[i].item())
        torch.testing.assert_close(Sampler.filtered_probs(logits[i : i + 1], one)[0], probs[i], rtol=1e-4, atol=1e-7)


def test_inverse_cdf_draw_never_takes_a_zero_weight_token():
    from kvflow.sample.sampler import inverse_cdf_draw

    probs = torch.tensor([[0.0, 0.3, 0.0, 0.7, 0.0]] * 4)
    u = torch.tensor([0.0, 0.29, 0.31, 1.0 - 2.0**-24])
    assert inverse_cdf_draw(probs, u).tolist() == [1, 1, 3, 3]
    # the largest u below 1 against totals just above a power of two (the product rounds to
    # nearest, never up to the total): the last positive token, not the zero weights after it
    top = 1.0 - 2.0**-24
    for total in (1.0, 1.0000001, 1.9999999, 3.0000002, 0.50000006):
        w = torch.tensor([[0.0, total / 4, 0.0, 3 * total / 4, 0.0, 0.0]])
        assert inverse_cdf_draw(w, torch.tensor([top])).tolist() == [3]
    nan = torch.full((1, 5), float("nan"))
    assert 0 <= inverse_cdf_draw(nan, torch.tensor([0.5])).item() < 5


def test_inverse_cdf_draw_reaches_a_rare_token_in_a_large_vocabulary():
    """A token of probability 1e-8 after half the mass: a float32 running sum (a quantum of
    6e-8 at 0.5) never moves past it, so it could never be drawn; the float64 block sums
    give it its interval [0.5, 0.5 + 1e-8) of the total."""
    from kvflow.sample.sampler import inverse_cdf_draw

    vocab = 151936
    w = torch.zeros(3, vocab)
    w[:, 0], w[:, 70000], w[:, vocab - 1] = 0.5, 1e-8, 0.5
    total = 0.5 + float(torch.tensor(1e-8)) + 0.5
    u = torch.tensor([(0.5 + 0.5e-8) / total, 0.4 / total, 0.6 / total], dtype=torch.float64)
    assert inverse_cdf_draw(w, u).tolist() == [70000, 0, vocab - 1]
    weights = torch.tensor([[0.0, 2.0, 0.0, 6.0]])  # unnormalized weights
    assert inverse_cdf_draw(weights, torch.tensor([0.2])).tolist() == [1]
    assert inverse_cdf_draw(weights, torch.tensor([0.3])).tolist() == [3]


def test_large_logits_give_finite_probabilities():
    """The in-place softmax subtracts each row's maximum first: logits of 1000 do not overflow."""
    logits = torch.tensor([[1000.0, 999.0, -1000.0], [-5000.0, -5001.0, -5002.0]])
    probs = Sampler.filtered_probs(logits, tensors(2, 3, top_p=[1.0, 0.6]))
    e = math.exp(-1.0)
    torch.testing.assert_close(probs, torch.tensor([[1 / (1 + e), e / (1 + e), 0.0], [1.0, 0.0, 0.0]]))
