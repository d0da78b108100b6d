"""Logits processors on hand-built logits and fake requests (no model).

Penalties follow OpenAI (presence/frequency over the *output* tokens only) and HF / CTRL
(repetition over prompt + output, positive logits divided and negative ones multiplied, once
per distinct token). ``logit_bias`` adds, ``min_tokens`` masks EOS and the stop token ids,
``bad_words`` masks a word's last token when the output ends with the rest of it. Rows that
ask for nothing come back with exactly their input values.
"""

from __future__ import annotations

import pytest
import torch

from kvflow.request import Request
from kvflow.sample.logits_processor import apply_logits_processors, apply_penalties
from kvflow.sampling_params import SamplingParams

VOCAB = 32
EOS = 2
NEG_INF = float("-inf")


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny tensors: extra intra-op threads only contend on a shared 2-core machine."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


def make_request(
    prompt: list[int], output: list[int] = (), eos: int | None = EOS, bad_words: list[list[int]] = (), **params
) -> Request:
    req = Request("r", list(prompt), SamplingParams(**params), eos_token_id=eos)
    req.bad_words_token_ids = [list(w) for w in bad_words]
    for token in output:
        req.append_output_token(token)
    return req


def random_logits(rows: int = 1, seed: int = 0) -> torch.Tensor:
    g = torch.Generator()
    g.manual_seed(seed)
    logits = torch.randn(rows, VOCAB, generator=g) * 3
    # Make sure the tokens used below have both signs, so both branches of the
    # repetition penalty are exercised.
    logits[:, 3] = 2.5
    logits[:, 5] = -1.5
    logits[:, 7] = 4.0
    logits[:, 9] = -3.0
    logits[:, 11] = 0.75
    return logits


def hf_repetition(logits: torch.Tensor, input_ids: list[int], penalty: float) -> torch.Tensor:
    """transformers' RepetitionPenaltyLogitsProcessor, written out (one row)."""
    scores = logits.clone().unsqueeze(0)
    ids = torch.tensor([input_ids])
    score = torch.gather(scores, 1, ids)
    score = torch.where(score < 0, score * penalty, score / penalty)
    scores.scatter_(1, ids, score)
    return scores[0]


# ------------------------------------------------------------------ presence / frequency
def test_presence_and_frequency_count_output_tokens_only():
    logits = random_logits()
    prompt = [3, 3, 3, 5, 11]
    output = [7, 7, 7, 9]
    req = make_request(prompt, output, presence_penalty=0.5, frequency_penalty=0.25)
    out = apply_logits_processors(logits, [req])[0]
    expected = logits[0].clone()
    expected[7] -= 0.5 + 3 * 0.25
    expected[9] -= 0.5 + 1 * 0.25
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)
    # Prompt-only tokens are untouched, however often the prompt repeats them.
    for token in (3, 5, 11):
        assert out[token] == logits[0, token]


def test_frequency_scales_with_count_presence_does_not():
    logits = torch.zeros(1, VOCAB)
    for count in (1, 2, 5):
        freq = apply_logits_processors(logits, [make_request([1], [4] * count, frequency_penalty=0.3)])[0]
        pres = apply_logits_processors(logits, [make_request([1], [4] * count, presence_penalty=0.3)])[0]
        assert freq[4].item() == pytest.approx(-0.3 * count)
        assert pres[4].item() == pytest.approx(-0.3)
        others = torch.ones(VOCAB, dtype=torch.bool)
        others[4] = False
        assert torch.equal(freq[others], logits[0, others])
        assert torch.equal(pres[others], logits[0, others])


def test_negative_presence_and_frequency_encourage():
    logits = torch.zeros(1, VOCAB)
    out = apply_logits_processors(logits, [make_request([6], [4, 4], presence_penalty=-1.0, frequency_penalty=-0.5)])[0]
    assert out[4].item() == pytest.approx(1.0 + 2 * 0.5)
    assert out[6].item() == 0.0


def test_presence_penalty_without_output_is_a_no_op():
    logits = random_logits()
    out = apply_logits_processors(logits, [make_request([3, 5, 7, 9], [], presence_penalty=2.0, frequency_penalty=2.0)])
    assert torch.equal(out, logits)


# ------------------------------------------------------------------ repetition
@pytest.mark.parametrize("penalty", [1.3, 2.0, 0.7])
def test_repetition_matches_hf_over_prompt_and_output(penalty):
    logits = random_logits()
    prompt = [3, 5, 5, 11]
    output = [7, 9, 9, 9, 3]
    req = make_request(prompt, output, repetition_penalty=penalty)
    out = apply_logits_processors(logits, [req])[0]
    expected = hf_repetition(logits[0], prompt + output, penalty)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)
    # Hand values: positive divided, negative multiplied, once per distinct token.
    assert out[3].item() == pytest.approx(2.5 / penalty)
    assert out[5].item() == pytest.approx(-1.5 * penalty)
    assert out[7].item() == pytest.approx(4.0 / penalty)
    assert out[9].item() == pytest.approx(-3.0 * penalty)
    assert out[11].item() == pytest.approx(0.75 / penalty)
    unseen = torch.ones(VOCAB, dtype=torch.bool)
    unseen[[3, 5, 7, 9, 11]] = False
    assert torch.equal(out[unseen], logits[0, unseen])


def test_repetition_applies_to_prompt_tokens_before_any_output():
    logits = random_logits()
    out = apply_logits_processors(logits, [make_request([7, 9], [], repetition_penalty=2.0)])[0]
    assert out[7].item() == pytest.approx(2.0)
    assert out[9].item() == pytest.approx(-6.0)


def test_repetition_then_frequency_and_presence():
    logits = random_logits()
    req = make_request([7], [7, 9, 9], repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    out = apply_logits_processors(logits, [req])[0]
    assert out[7].item() == pytest.approx(4.0 / 2.0 - 0.5 * 1 - 0.25)
    assert out[9].item() == pytest.approx(-3.0 * 2.0 - 0.5 * 2 - 0.25)


def test_penalties_batched_rows_with_different_lengths_match_single_rows():
    logits = random_logits(rows=4, seed=3)
    reqs = [
        make_request([1, 2, 3], [7, 7, 9, 30, 31, 31], presence_penalty=0.4, frequency_penalty=0.1, repetition_penalty=1.2),
        make_request([5], [], repetition_penalty=1.7),
        make_request([11, 12, 13, 14, 15, 16, 17], [3], frequency_penalty=-0.6),
        make_request([0], [0, 0, 0, 0], presence_penalty=1.5, repetition_penalty=0.8),
    ]
    batched = apply_penalties(logits, reqs)
    for i, req in enumerate(reqs):
        single = apply_penalties(logits[i : i + 1], [req])
        torch.testing.assert_close(batched[i], single[0], rtol=0, atol=0)
        p = req.sampling_params
        expected = hf_repetition(logits[i], req.all_token_ids, p.repetition_penalty)
        for token in set(req.output_token_ids):
            count = req.output_token_ids.count(token)
            expected[token] -= p.frequency_penalty * count + p.presence_penalty
        torch.testing.assert_close(batched[i], expected, rtol=0, atol=1e-6)


def test_a_penalty_given_as_a_large_int_is_applied_alone_as_in_a_batch():
    """repetition_penalty=2**70 (an int within float32's range: valid) made an int64 tensor of
    the batch's penalties when every row's was an int: "Overflow when unpacking long long" for
    the request alone, while batched with a float penalty it ran."""
    logits = random_logits(rows=2, seed=5)
    big = make_request([3, 5], [7], repetition_penalty=2**70)
    other = make_request([9], [], repetition_penalty=1.5)
    alone = apply_penalties(logits[:1], [big])
    batched = apply_penalties(logits, [big, other])
    torch.testing.assert_close(alone[0], batched[0], rtol=0, atol=0)
    as_float = apply_penalties(logits[:1], [make_request([3, 5], [7], repetition_penalty=float(2**70))])
    torch.testing.assert_close(alone, as_float, rtol=0, atol=0)
    assert alone.dtype == torch.float32
    ints = make_request([3], [3, 9], repetition_penalty=2, frequency_penalty=1, presence_penalty=-2)
    floats = make_request([3], [3, 9], repetition_penalty=2.0, frequency_penalty=1.0, presence_penalty=-2.0)
    torch.testing.assert_close(apply_penalties(logits[:1], [ints]), apply_penalties(logits[:1], [floats]), rtol=0, atol=0)


# ------------------------------------------------------------------ logit bias
def test_logit_bias_adds():
    logits = random_logits()
    req = make_request([1], [4], logit_bias={3: 5.0, 9: -100.0, 20: 0.5, VOCAB + 10: 7.0})
    out = apply_logits_processors(logits, [req])[0]
    expected = logits[0].clone()
    expected[3] += 5.0
    expected[9] -= 100.0
    expected[20] += 0.5
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)


def test_logit_bias_is_applied_before_repetition_penalty():
    logits = random_logits()
    req = make_request([3], [], logit_bias={3: 3.0}, repetition_penalty=2.0)
    out = apply_logits_processors(logits, [req])[0]
    assert out[3].item() == pytest.approx((2.5 + 3.0) / 2.0)


# ------------------------------------------------------------------ allowed_token_ids
def test_allowed_token_ids_keep_only_their_logits_then_the_others_apply():
    logits = random_logits()
    req = make_request([3], [5], allowed_token_ids=[3, 5, 30], logit_bias={5: 1.0}, repetition_penalty=2.0)
    out = apply_logits_processors(logits, [req])[0]
    raw = logits[0]
    expected = torch.full_like(raw, NEG_INF)
    for t in (3, 5):  # seen: biased (5), then the repetition penalty
        v = raw[t] + (1.0 if t == 5 else 0.0)
        expected[t] = v / 2.0 if v > 0 else v * 2.0
    expected[30] = raw[30]
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)
    assert torch.equal(logits[0], raw)  # the input is not modified
    from kvflow.sample.logits_processor import _allowed_index

    index = _allowed_index(req.sampling_params, torch.device("cpu"))
    assert _allowed_index(req.sampling_params, torch.device("cpu")) is index  # made once, not every step


# ------------------------------------------------------------------ min_tokens
def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    logits = random_logits()
    params = dict(min_tokens=3, max_tokens=8, stop_token_ids=[13, 17])
    for n_out in range(5):
        out = apply_logits_processors(logits, [make_request([1, 4], [20] * n_out, **params)])[0]
        masked = {EOS, 13, 17}
        if n_out < 3:
            for token in masked:
                assert out[token] == NEG_INF, (n_out, token)
            rest = [t for t in range(VOCAB) if t not in masked]
            assert torch.equal(out[rest], logits[0, rest])
        else:
            assert torch.equal(out, logits[0])


class _OnlyGrammar:
    """A grammar stand-in that allows only ``allowed``."""

    def __init__(self, allowed: list[int]) -> None:
        self.allowed = allowed

    def mask_logits(self, row: torch.Tensor) -> None:
        keep = torch.zeros_like(row, dtype=torch.bool)
        keep[self.allowed] = True
        row.masked_fill_(~keep, NEG_INF)


@pytest.mark.parametrize("allowed", [[EOS], [13], [EOS, 13, 17]], ids=["eos", "stop-id", "eos-and-stop-ids"])
def test_min_tokens_leaves_the_stop_tokens_to_a_grammar_that_allows_nothing_else(allowed):
    """As vLLM (vllm-project/vllm#54218): when the grammar allows only EOS / stop tokens,
    min_tokens does not mask them (the row was all -inf before: no token to sample), so the
    grammar ends the output before min_tokens; with any other token allowed they stay
    masked."""
    logits = random_logits()
    params = dict(min_tokens=5, max_tokens=8, stop_token_ids=[13, 17])
    req = make_request([1, 4], [20], **params)
    req.grammar = _OnlyGrammar(allowed)
    out = apply_logits_processors(logits, [req])[0]
    assert torch.isfinite(out).nonzero().flatten().tolist() == allowed
    assert torch.equal(out[allowed], logits[0, allowed])
    req.grammar = _OnlyGrammar(sorted(allowed + [20]))
    out = apply_logits_processors(logits, [req])[0]
    assert torch.isfinite(out).nonzero().flatten().tolist() == [20]


def test_min_tokens_without_eos_masks_only_stop_ids():
    logits = random_logits()
    out = apply_logits_processors(logits, [make_request([1], [], eos=None, min_tokens=2, stop_token_ids=[13])])[0]
    assert out[13] == NEG_INF
    assert out[EOS] == logits[0, EOS]
    assert torch.isfinite(out).sum() == VOCAB - 1


# ------------------------------------------------------------------ bad words
def test_single_token_bad_word_is_always_masked():
    logits = random_logits()
    for output in ([], [4], [4, 5, 6]):
        out = apply_logits_processors(logits, [make_request([1], output, bad_words=[[9]])])[0]
        assert out[9] == NEG_INF
        rest = [t for t in range(VOCAB) if t != 9]
        assert torch.equal(out[rest], logits[0, rest])


@pytest.mark.parametrize(
    "output, masked",
    [
        ([], False),  # nothing generated yet: the prefix [20, 21] is not there
        ([20], False),  # only part of the prefix
        ([21], False),
        ([20, 21], True),
        ([4, 20, 21], True),
        ([20, 21, 4], False),  # the prefix is not at the end
        ([21, 20], False),
        ([20, 21, 22, 20, 21], True),
    ],
)
def test_multi_token_bad_word_masks_last_token_after_prefix(output, masked):
    logits = random_logits()
    out = apply_logits_processors(logits, [make_request([1], output, bad_words=[[20, 21, 22]])])[0]
    assert (out[22] == NEG_INF) == masked
    # Only the word's last token is ever masked.
    rest = [t for t in range(VOCAB) if t != 22]
    assert torch.equal(out[rest], logits[0, rest])


def test_bad_word_prefix_in_prompt_does_not_count():
    logits = random_logits()
    out = apply_logits_processors(logits, [make_request([1, 20, 21], [], bad_words=[[20, 21, 22]])])[0]
    assert out[22] == logits[0, 22]


def test_several_bad_words():
    logits = random_logits()
    req = make_request([1], [5, 6], bad_words=[[6, 8], [5, 6, 10], [12], [7, 14]])
    out = apply_logits_processors(logits, [req])[0]
    assert out[8] == NEG_INF and out[10] == NEG_INF and out[12] == NEG_INF
    assert out[14] == logits[0, 14]


# ------------------------------------------------------------------ mixed batches
class _FakeGrammar:
    """Allows only the tokens in ``allowed``."""

    def __init__(self, allowed: list[int]) -> None:
        self.allowed = allowed
        self.accepted: list[int] = []

    def mask_logits(self, row: torch.Tensor) -> None:
        keep = torch.zeros_like(row, dtype=torch.bool)
        keep[self.allowed] = True
        row.masked_fill_(~keep, NEG_INF)

    def accept(self, token_id: int) -> None:
        self.accepted.append(token_id)


def test_grammar_mask_applies_to_its_row():
    logits = random_logits(rows=2)
    grammar_req = make_request([1], [])
    grammar_req.grammar = _FakeGrammar([3, 7])
    grammar_req.append_output_token(3)
    assert grammar_req.grammar.accepted == [3]
    out = apply_logits_processors(logits, [grammar_req, make_request([1], [])])
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == [3, 7]
    assert torch.equal(out[0, [3, 7]], logits[0, [3, 7]])
    assert torch.equal(out[1], logits[1])


def test_rows_without_processors_are_untouched():
    logits = random_logits(rows=6, seed=7)
    before = logits.clone()
    reqs = [
        make_request([3, 5], [7, 9]),  # plain
        make_request([3, 5], [7, 9], presence_penalty=1.0, repetition_penalty=1.5),
        make_request([3, 5], [7, 9], temperature=0.5, top_k=3, top_p=0.9),  # sampling knobs only
        make_request([3, 5], [7], min_tokens=4, max_tokens=8, bad_words=[[11]], logit_bias={4: 1.0}),
        make_request([3, 5], [7, 9], min_tokens=2, max_tokens=8),  # min_tokens already reached
        make_request([3, 5], [7, 9], frequency_penalty=0.5),
    ]
    out = apply_logits_processors(logits, reqs)
    assert torch.equal(logits, before), "the input logits must not be modified"
    for row in (0, 2, 4):
        assert torch.equal(out[row], logits[row]), row
    for row in (1, 3, 5):
        assert not torch.equal(out[row], logits[row]), row
    # Each processed row equals the same request processed alone.
    for row in range(6):
        alone = apply_logits_processors(logits[row : row + 1], [reqs[row]])
        assert torch.equal(out[row], alone[0]), row


def test_no_processor_returns_the_values_unchanged():
    logits = random_logits(rows=3)
    reqs = [make_request([1, 2], [3]) for _ in range(3)]
    out = apply_logits_processors(logits, reqs)
    assert torch.equal(out, logits)


@pytest.mark.parametrize("vocab", [1, 31, 32, 33, 257, 49152])
def test_unpack_bitmask_reads_bits_as_llguidance_does(vocab):
    """Our eager unpacking of the token bitmask equals llguidance's own (its numpy kernel; the
    torch one is the same code under torch.compile), bit j of word i being token 32 i + j."""
    import numpy as np
    from llguidance.numpy import apply_token_bitmask_inplace

    from kvflow.sample.guided import unpack_bitmask

    g = torch.Generator().manual_seed(vocab)
    words = (vocab + 31) // 32
    mask = torch.randint(-(2**31), 2**31 - 1, (words,), dtype=torch.int64, generator=g).to(torch.int32)
    logits = np.zeros((1, vocab), dtype=np.float32)
    apply_token_bitmask_inplace(logits, mask.numpy()[None, :].copy())
    expected = torch.from_numpy(logits[0] == 0)
    assert torch.equal(unpack_bitmask(mask, vocab), expected)
    assert unpack_bitmask(torch.tensor([0b101], dtype=torch.int32), 3).tolist() == [True, False, True]


# ------------------------------------------------------------------ nothing left to sample
@pytest.mark.parametrize("params, bad_words, match", [
    (dict(allowed_token_ids=[9]), [[9]], r"allowed_token_ids, bad_words together exclude every token"),
    (dict(allowed_token_ids=[EOS, 5], stop_token_ids=[5], min_tokens=3), (),
     r"allowed_token_ids, min_tokens \(which masks EOS and stop_token_ids\) together exclude every token"),
])
def test_a_row_with_every_token_masked_fails_naming_the_fields(params, bad_words, match):
    """argmax over a row of -inf is token 0, which none of the request's settings allows: the
    request is failed instead (the engine fails it alone), naming what it set."""
    with pytest.raises(ValueError, match=match):
        apply_logits_processors(random_logits(), [make_request([1], bad_words=bad_words, **params)], fail_when_all_masked=True)
    # one allowed token left: no error
    out = apply_logits_processors(random_logits(), [make_request([1], **{**params, "allowed_token_ids": [EOS, 5, 6]})])[0]
    assert (out != NEG_INF).sum() >= 1
