"""Sampling features on the real SmolLM2-135M-Instruct model (float32, CPU).

Stop strings ending inside a token, penalties (presence/frequency on output tokens only,
repetition on the prompt too), raw-distribution logprobs and prompt_logprobs, seeds that do
not depend on the batch, top_k, structured output (JSON schema, regex), streaming abort,
min_tokens, bad_words, stop_token_ids, skip_special_tokens and logit_bias.

All generations are short (few tokens) and share the session's ``smollm2_llm``.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from conftest import prefill_logits, requires_smollm2
from kvflow import SamplingParams
from kvflow.request import Request
from kvflow.sample.logits_processor import apply_logits_processors

pytestmark = [requires_smollm2, pytest.mark.integration]

CAPITAL = "The capital of France is"
DOGS = "The dog dog dog dog dog dog dog dog"  # greedy continues " dog dog dog ..."
DOG_ID = 2767  # " dog"


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """A shared 2-core machine: one intra-op thread avoids spinning OpenMP workers."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


def generate(llm, prompt, **params):
    """The single CompletionOutput of one prompt."""
    (out,) = llm.generate(prompt, SamplingParams(**params), use_tqdm=False)
    return out.outputs[0]


def generate_many(llm, prompt, params: list[dict]):
    """One CompletionOutput per parameter set, all for ``prompt``, in one batch (greedy and
    seeded outputs do not depend on the batch)."""
    outs = llm.generate([prompt] * len(params), [SamplingParams(**p) for p in params], use_tqdm=False)
    return [o.outputs[0] for o in outs]


def chat_prompt(llm, question: str) -> dict:
    return {"prompt_token_ids": llm.apply_chat_template([{"role": "user", "content": question}])}


def raw_logits(llm, token_ids: list[int]) -> torch.Tensor:
    """float32 [len(token_ids), vocab]: the model's logits at every position (one prefill)."""
    return prefill_logits(llm.engine.model_runner.model, token_ids, chunk=len(token_ids), block_size=16)


def assert_all_blocks_free(llm):
    stats = llm.get_stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"], stats
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0, stats
    assert not llm.engine.has_unfinished_requests()


@pytest.fixture(scope="module")
def capital_greedy(smollm2_llm):
    """The greedy 16-token continuation of CAPITAL (EOS ignored): (token ids, text)."""
    out = generate(smollm2_llm, CAPITAL, temperature=0.0, max_tokens=16, ignore_eos=True)
    return out.token_ids, out.text


@pytest.fixture(scope="module")
def inner_stop(smollm2_llm, capital_greedy):
    """A stop string of CAPITAL's greedy text that starts two characters into the token before
    token i and ends one character into token i (strictly inside it): (stop, i, start)."""
    tok = smollm2_llm.tokenizer
    tokens, text = capital_greedy
    ends = [len(tok.decode(tokens[: i + 1])) for i in range(len(tokens))]
    # Token i covers text[ends[i-1]:ends[i]]; pick one of >= 2 characters, a stop string that
    # starts in the previous token and ends one character into token i (strictly inside).
    stop = None
    for i in range(1, len(tokens)):
        begin = ends[i - 1]
        if ends[i] - begin >= 2 and begin >= 2 and text[: ends[i]] == tok.decode(tokens[: i + 1]):
            candidate = text[begin - 2 : begin + 1]
            if text.find(candidate) == begin - 2:  # its first occurrence
                stop, stop_token, start = candidate, i, begin - 2
                break
    assert stop is not None, f"no token of {text!r} suits the test"
    return stop, stop_token, start


# ------------------------------------------------------------------ stop strings
def test_stop_string_ending_inside_a_token(smollm2_llm, capital_greedy, inner_stop):
    tokens, text = capital_greedy
    stop, stop_token, start = inner_stop
    base = dict(temperature=0.0, max_tokens=16, ignore_eos=True, stop=[stop])
    cut, kept = generate_many(smollm2_llm, CAPITAL, [base, dict(base, include_stop_str_in_output=True)])
    assert cut.text == text[:start]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.token_ids == tokens[: stop_token + 1]  # generation ended with the token completing it
    assert kept.text == text[: start + len(stop)] and kept.text.endswith(stop)
    assert kept.finish_reason == "stop" and kept.stop_reason == stop
    assert kept.token_ids == cut.token_ids


def test_streamed_text_with_stop_string_never_shows_it(smollm2_llm, capital_greedy, inner_stop):
    """The stop string's first characters arrive a token before it completes: they are held
    back, so no streamed text is ever taken back."""
    tokens, text = capital_greedy
    stop, _, start = inner_stop
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, stop=[stop])
    texts = [o.outputs[0].text for o in smollm2_llm.generate_stream(CAPITAL, params)]
    assert texts[-1] == text[:start]
    for a, b in zip(texts, texts[1:]):
        assert b.startswith(a)
    assert all(stop not in t and text.startswith(t) for t in texts)
    assert_all_blocks_free(smollm2_llm)


def test_stop_token_ids(smollm2_llm, capital_greedy):
    tokens, _ = capital_greedy
    target = tokens[4]
    first = tokens.index(target)
    out = generate(smollm2_llm, CAPITAL, temperature=0.0, max_tokens=16, ignore_eos=True, stop_token_ids=[target])
    assert out.token_ids == tokens[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == target


# ------------------------------------------------------------------ penalties
def test_presence_and_frequency_leave_step_zero_alone_repetition_does_not(smollm2_llm):
    tok = smollm2_llm.tokenizer
    prompt = tok.encode(DOGS)
    assert prompt.count(DOG_ID) >= 8
    step0 = raw_logits(smollm2_llm, prompt)[-1:]
    base = dict(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=5)
    penalties = [dict(presence_penalty=2.0), dict(frequency_penalty=2.0), dict(repetition_penalty=1.3)]
    plain, presence, frequency, repetition = generate_many(
        smollm2_llm, DOGS, [base] + [dict(base, **p) for p in penalties]
    )
    assert plain.token_ids == [DOG_ID] * 8

    for penalty, out in zip(penalties[:2], (presence, frequency)):
        # The processed distribution at step 0 is the raw one: the prompt's dogs don't count.
        req = Request("x", prompt, SamplingParams(**penalty), eos_token_id=tok.eos_token_id)
        assert torch.equal(apply_logits_processors(step0, [req]), step0)
        assert out.token_ids[0] == DOG_ID, penalty
        assert out.logprobs[0] == pytest.approx(plain.logprobs[0], abs=1e-4)
        # ... but a generated dog does.
        req.append_output_token(DOG_ID)
        after = apply_logits_processors(step0, [req])[0]
        assert after[DOG_ID].item() == pytest.approx(step0[0, DOG_ID].item() - 2.0)
    # The dogs it generates count, more with every one: the output stops repeating them.
    assert frequency.token_ids.count(DOG_ID) < 8

    req = Request("x", prompt, SamplingParams(repetition_penalty=1.3), eos_token_id=tok.eos_token_id)
    processed = apply_logits_processors(step0, [req])[0]
    raw = step0[0]
    assert raw[DOG_ID] > 0 and processed[DOG_ID].item() == pytest.approx(raw[DOG_ID].item() / 1.3)
    assert int(processed.argmax()) != DOG_ID
    assert repetition.token_ids[0] == int(processed.argmax()) != DOG_ID
    # logprobs stay those of the raw distribution
    assert repetition.logprobs[0] == pytest.approx(plain.logprobs[0], abs=1e-4)


def test_presence_penalty_changes_later_steps(smollm2_llm, capital_greedy):
    """CAPITAL's greedy output repeats tokens ("\\n\\n", digits): a presence penalty changes the
    output from the first repeat on, not before."""
    tokens, _ = capital_greedy
    first_repeat = next(i for i, t in enumerate(tokens) if t in tokens[:i])
    out = generate(smollm2_llm, CAPITAL, temperature=0.0, max_tokens=first_repeat + 2, ignore_eos=True, presence_penalty=2.0)
    assert out.token_ids[:first_repeat] == tokens[:first_repeat]
    assert out.token_ids != tokens[: first_repeat + 2]


# ------------------------------------------------------------------ logprobs
def test_logprobs_are_the_raw_distribution(smollm2_llm):
    tok = smollm2_llm.tokenizer
    prompt = tok.encode(CAPITAL)
    k = 4
    out = generate(
        smollm2_llm, CAPITAL, temperature=0.3, top_p=0.5, seed=11, max_tokens=6, ignore_eos=True, logprobs=k,
        repetition_penalty=1.2, presence_penalty=0.5,
    )
    assert len(out.logprobs) == len(out.token_ids) == 6
    logits = raw_logits(smollm2_llm, prompt + out.token_ids)
    reference = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
    cumulative = 0.0
    for step, (entry, token) in enumerate(zip(out.logprobs, out.token_ids)):
        assert token in entry and k <= len(entry) <= k + 1
        top = reference[step].topk(k)
        assert set(top.indices.tolist()) <= set(entry)
        for t, lp in entry.items():
            assert lp == pytest.approx(reference[step, t].item(), abs=1e-4), (step, t)
        cumulative += entry[token]
    assert out.cumulative_logprob == pytest.approx(cumulative, abs=1e-4)


def test_logprobs_do_not_depend_on_temperature_or_top_p(smollm2_llm, capital_greedy):
    """Same context (prompt + greedy tokens): the reported top-k is the same for any sampling
    settings, and so is the entry of any token both runs report."""
    tokens, _ = capital_greedy
    context = smollm2_llm.tokenizer.encode(CAPITAL) + tokens[:3]
    cold, hot, greedy = generate_many(
        smollm2_llm,
        {"prompt_token_ids": context},
        [
            dict(temperature=0.3, top_p=0.5, seed=1, max_tokens=1, logprobs=5),
            dict(temperature=1.5, seed=2, max_tokens=1, logprobs=5),
            dict(temperature=0.0, max_tokens=1, logprobs=5),
        ],
    )
    assert greedy.token_ids == [tokens[3]]
    for a, b in ((cold, hot), (cold, greedy)):
        shared = set(a.logprobs[0]) & set(b.logprobs[0])
        assert len(shared) >= 5
        for t in shared:
            assert a.logprobs[0][t] == pytest.approx(b.logprobs[0][t], abs=1e-5)


def test_prompt_logprobs(smollm2_llm):
    tok = smollm2_llm.tokenizer
    text = "PagedAttention stores keys and values in fixed-size blocks of the GPU memory, like pages."
    prompt = tok.encode(text)
    reference = torch.log_softmax(raw_logits(smollm2_llm, prompt), dim=-1)
    # Twice: the second run finds the prompt in the prefix cache and must still compute it.
    for _ in range(2):
        (out,) = smollm2_llm.generate(text, SamplingParams(max_tokens=1, prompt_logprobs=2), use_tqdm=False)
        # vLLM's shape: one entry per prompt token, None for the first.
        assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
        for i, entry in enumerate(out.prompt_logprobs[1:]):
            actual = prompt[i + 1]
            assert actual in entry and len(entry) <= 3
            for t, lp in entry.items():
                assert lp == pytest.approx(reference[i, t].item(), abs=1e-4)
                assert lp.logprob == float(lp) and lp.decoded_token == tok.decode([t])
                # rank: 1 + the tokens strictly more likely (no exact ties here)
                assert lp.rank == int((reference[i] > reference[i, t]).sum()) + 1
            assert set(reference[i].topk(2).indices.tolist()) <= set(entry)
    assert_all_blocks_free(smollm2_llm)


# ------------------------------------------------------------------ seeds and top_k
def test_seeded_request_does_not_depend_on_the_batch(smollm2_llm):
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=8, ignore_eos=True)
    others = ["Once upon a time", "def fibonacci(n):", "The three primary colors are"]
    alone = smollm2_llm.generate(CAPITAL, seeded, use_tqdm=False)[0].outputs[0].token_ids
    prompts = [others[0], CAPITAL, others[1], others[2]]
    params = [SamplingParams(temperature=1.0, max_tokens=3 + i, ignore_eos=True) for i in range(4)]
    params[1] = seeded
    batched = smollm2_llm.generate(prompts, params, use_tqdm=False)[1].outputs[0].token_ids
    prompts.reverse()
    params.reverse()
    params[0] = SamplingParams(temperature=0.8, seed=99, max_tokens=5, ignore_eos=True)
    params.append(SamplingParams(temperature=1.0, seed=4321, max_tokens=8, ignore_eos=True))
    prompts.append(CAPITAL)
    reordered = smollm2_llm.generate(prompts, params, use_tqdm=False)
    assert alone == batched == reordered[2].outputs[0].token_ids
    assert reordered[4].outputs[0].token_ids != alone  # another seed, another draw


def test_top_k_one_is_greedy(smollm2_llm, capital_greedy):
    tokens, _ = capital_greedy
    outs = generate_many(
        smollm2_llm, CAPITAL, [dict(temperature=t, top_k=1, max_tokens=10, ignore_eos=True) for t in (1.0, 2.0)]
    )
    assert [o.token_ids for o in outs] == [tokens[:10]] * 2


def test_top_k_zero_and_minus_one_are_both_off(smollm2_llm):
    params = [dict(temperature=1.2, top_k=k, seed=5, max_tokens=8, ignore_eos=True) for k in (0, -1, 50)]
    outs = [o.token_ids for o in generate_many(smollm2_llm, CAPITAL, params)]
    assert outs[0] == outs[1]
    assert outs[2] != outs[0]  # a real top_k changes the same seeded draw


# ------------------------------------------------------------------ structured output
PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer"},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


def test_guided_json_output_parses_and_validates(smollm2_llm):
    prompt = chat_prompt(smollm2_llm, "Describe a person as JSON with a name and an age.")
    outs = generate_many(
        smollm2_llm,
        prompt,
        [
            dict(temperature=0.0, max_tokens=64, guided_json=PERSON_SCHEMA),
            dict(temperature=0.0, max_tokens=64, guided_json=json.dumps(PERSON_SCHEMA)),
            # sampled (seeded, hot) output is constrained just as well
            dict(temperature=1.5, seed=3, max_tokens=64, guided_json=PERSON_SCHEMA),
        ],
    )
    for out in outs:
        assert out.finish_reason == "stop", out.text
        value = json.loads(out.text)
        assert set(value) == {"name", "age"}
        assert isinstance(value["name"], str) and len(value["name"]) <= 12
        assert isinstance(value["age"], int) and not isinstance(value["age"], bool)
    assert outs[0].text == outs[1].text  # dict or JSON string: the same grammar
    assert_all_blocks_free(smollm2_llm)


def test_guided_regex_output_fullmatches(smollm2_llm):
    pattern = r"(yes|no), because [a-z ]{1,20}\."
    prompt = chat_prompt(smollm2_llm, "Is the sky blue? Answer yes or no and say why.")
    params = [dict(temperature=0.0), dict(temperature=1.3, seed=8)]
    for out in generate_many(smollm2_llm, prompt, [dict(p, max_tokens=32, guided_regex=pattern) for p in params]):
        assert re.fullmatch(pattern, out.text), out.text
        assert out.finish_reason == "stop"


@pytest.mark.parametrize(
    "bad, field",
    [
        (dict(guided_json="{not json"), "guided_json"),
        (dict(guided_json={"type": "nonsense"}), "guided_json"),
        (dict(guided_regex="(unclosed"), "guided_regex"),
    ],
)
def test_invalid_grammar_raises_value_error_and_queues_nothing(smollm2_llm, bad, field):
    with pytest.raises(ValueError, match=field):
        smollm2_llm.generate(
            [CAPITAL, "Hello"], [SamplingParams(max_tokens=4), SamplingParams(max_tokens=4, **bad)], use_tqdm=False
        )
    assert_all_blocks_free(smollm2_llm)
    # the LLM still serves
    assert len(generate(smollm2_llm, "Hello", temperature=0.0, max_tokens=2, ignore_eos=True).token_ids) == 2


# ------------------------------------------------------------------ streaming and abort
def test_closing_generate_stream_early_frees_all_blocks(smollm2_llm):
    stream = smollm2_llm.generate_stream(CAPITAL, SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True))
    for _ in range(3):
        out = next(stream)
    assert not out.finished
    assert smollm2_llm.get_stats()["num_free_blocks"] < smollm2_llm.get_stats()["num_total_blocks"]
    stream.close()
    assert_all_blocks_free(smollm2_llm)


def test_abort_request_frees_blocks_at_once_and_others_continue(smollm2_llm, capital_greedy):
    engine = smollm2_llm.engine
    tok = smollm2_llm.tokenizer
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    engine.add_request("keep", tok.encode(CAPITAL), params)
    engine.add_request("drop", tok.encode("Once upon a time " * 8), params)
    for _ in range(3):
        engine.step()
    used_before = engine.get_stats()["num_total_blocks"] - engine.get_stats()["num_free_blocks"]
    drop_blocks = len(next(r for r in engine.scheduler.running if r.request_id == "drop").block_ids[0])
    assert drop_blocks > 0
    assert engine.abort_request("drop")
    used_after = engine.get_stats()["num_total_blocks"] - engine.get_stats()["num_free_blocks"]
    assert used_after == used_before - drop_blocks
    assert not engine.abort_request("drop")
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id == "keep"
            if out.finished:
                finished[out.request_id] = out.outputs[0].token_ids
    assert finished == {"keep": capital_greedy[0][:8]}
    assert_all_blocks_free(smollm2_llm)


# ------------------------------------------------------------------ min_tokens, bad_words, ...
def test_min_tokens_forces_tokens_before_eos(smollm2_llm):
    eos = smollm2_llm.tokenizer.eos_token_id
    prompt = chat_prompt(smollm2_llm, "What is 2+2? Answer with one number.")
    short = generate(smollm2_llm, prompt, temperature=0.0, max_tokens=12)
    assert short.finish_reason == "stop" and short.token_ids[-1] == eos and len(short.token_ids) < 10
    n = len(short.token_ids) - 1  # EOS comes at index n
    forced, just = generate_many(
        smollm2_llm,
        prompt,
        [dict(temperature=0.0, max_tokens=12, min_tokens=10), dict(temperature=0.0, max_tokens=12, min_tokens=n + 1)],
    )
    # min_tokens = n + 1: EOS is masked at index n exactly, and allowed from n + 1 on.
    assert just.token_ids[:n] == short.token_ids[:n] and just.token_ids[n] != eos and len(just.token_ids) > n + 1
    assert len(forced.token_ids) >= 10
    assert eos not in forced.token_ids[:10]
    assert forced.token_ids[:n] == short.token_ids[:n]  # only EOS was masked


def test_bad_words_are_never_generated(smollm2_llm, capital_greedy):
    tokens, text = capital_greedy
    assert "Paris" in text
    out = generate(smollm2_llm, CAPITAL, temperature=0.0, max_tokens=10, ignore_eos=True, bad_words=["Paris"])
    assert "Paris" not in out.text
    assert len(out.token_ids) == 10
    paris_ids = [smollm2_llm.tokenizer.encode(w, add_special_tokens=False) for w in ("Paris", " Paris")]
    for ids in paris_ids:
        assert not any(out.token_ids[i : i + len(ids)] == ids for i in range(len(out.token_ids)))


def test_logit_bias_forces_a_token(smollm2_llm):
    target = smollm2_llm.tokenizer.encode(" banana", add_special_tokens=False)[0]
    out = generate(smollm2_llm, CAPITAL, temperature=0.0, max_tokens=4, ignore_eos=True, logit_bias={target: 100.0})
    assert out.token_ids == [target] * 4


def test_allowed_token_ids_are_the_only_tokens_sampled(smollm2_llm):
    """Greedy: each token is the raw logits' argmax among the allowed ids (their logprobs
    are the raw distribution's); sampled: only allowed ids."""
    tok = smollm2_llm.tokenizer
    allowed = sorted({tok.encode(w, add_special_tokens=False)[0] for w in (" banana", " apple", " cherry", ".")})
    greedy = generate(smollm2_llm, CAPITAL, temperature=0.0, max_tokens=6, ignore_eos=True, allowed_token_ids=allowed,
                      logprobs=len(allowed) + 20)
    assert len(greedy.token_ids) == 6
    for token, top in zip(greedy.token_ids, greedy.logprobs):
        assert token in allowed
        # no allowed token the raw top list holds is more likely than the chosen one
        assert all(top[t].logprob <= top[token].logprob for t in top if t in allowed)
    sampled = generate(smollm2_llm, CAPITAL, temperature=1.0, seed=3, max_tokens=24, ignore_eos=True,
                       allowed_token_ids=allowed)
    assert set(sampled.token_ids) <= set(allowed) and len(set(sampled.token_ids)) > 1


def test_skip_special_tokens(smollm2_llm):
    tok = smollm2_llm.tokenizer
    prompt = chat_prompt(smollm2_llm, "What is 2+2? Answer with one number.")
    params = dict(temperature=0.0, max_tokens=12, ignore_eos=True)
    kept, skipped = generate_many(smollm2_llm, prompt, [dict(params, skip_special_tokens=False), params])
    assert kept.token_ids == skipped.token_ids and tok.eos_token_id in kept.token_ids
    assert tok.eos_token in kept.text and tok.eos_token not in skipped.text
    assert kept.text == tok.decode(kept.token_ids, skip_special_tokens=False)
    assert skipped.text == tok.decode(skipped.token_ids, skip_special_tokens=True)
