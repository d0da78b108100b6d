"""The grammar engine's faults are visible: a constraint no output can satisfy is a
ValueError naming its field when it is compiled, and one that dead-ends during generation
(or is handed a token it forbids) raises rather than letting EOS end the output silently
(it answered 200 with empty text before)."""

from __future__ import annotations

import pytest
import torch

from conftest import TINY_TEXT_VOCAB, tiny_engine, tiny_model_config, tiny_tokenizer
from kvflow.sample.guided import GrammarCompiler, GrammarMatcher
from kvflow.sampling_params import SamplingParams

EOS = TINY_TEXT_VOCAB - 1
TOKENIZER = tiny_tokenizer()


def _id(char: str) -> int:
    (token,) = TOKENIZER.encode(char, add_special_tokens=False)
    return token


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    return GrammarCompiler(TOKENIZER, TINY_TEXT_VOCAB, EOS)


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"guided_regex": "a[^\\s\\S]"}, "guided_regex"),
        ({"guided_regex": "[^\\s\\S]"}, "guided_regex"),
        ({"guided_grammar": 'start: /[^\\s\\S]/'}, "guided_grammar"),
        ({"guided_json": {"type": "integer", "minimum": 5, "maximum": 2}}, "guided_json"),
    ],
    ids=["regex-after-a", "regex-empty-class", "lark-empty", "json-min-over-max"],
)
def test_an_unsatisfiable_constraint_is_refused_at_compile_naming_its_field(compiler, kwargs, field):
    with pytest.raises(ValueError) as exc:
        compiler.compile(SamplingParams(**kwargs))
    assert str(exc.value).startswith(f"{field} "), exc.value


def test_a_satisfiable_constraint_compiles_and_allows_its_first_token(compiler):
    matcher = compiler.compile(SamplingParams(guided_regex="ab"))
    row = torch.zeros(TINY_TEXT_VOCAB)
    matcher.mask_logits(row)
    assert torch.isfinite(row).nonzero().flatten().tolist() == [_id("a")]


def test_a_grammar_that_dead_ends_after_a_token_raises_naming_its_field(compiler):
    # "a" then a rule that only recurses: llguidance compiles it, and after "a" no token fits
    matcher = compiler.compile(SamplingParams(guided_grammar='start: "a" b\nb: b "x"'))
    matcher.accept(_id("a"))
    with pytest.raises(ValueError, match=r"^guided_grammar: no output satisfies"):
        matcher.mask_logits(torch.zeros(TINY_TEXT_VOCAB))


def test_a_token_the_grammar_forbids_raises_naming_its_field(compiler):
    matcher = compiler.compile(SamplingParams(guided_choice=["red", "green"]))
    with pytest.raises(ValueError, match=r"^guided_choice: token \d+ does not satisfy"):
        matcher.accept(_id("x"))


def test_an_unsatisfiable_constraint_queues_nothing_offline():
    engine = tiny_engine(tokenizer=tiny_tokenizer(), config=tiny_model_config(vocab_size=TINY_TEXT_VOCAB))
    with pytest.raises(ValueError, match=r"^guided_regex is unsatisfiable"):
        engine.add_request("r", [_id("x")], SamplingParams(guided_regex="a[^\\s\\S]", max_tokens=4))
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize("regex", ["a{1000000}", "(a{1000}){1000}", "ab{1000000}"])
def test_a_regex_too_complex_for_the_grammar_engine_is_refused_at_compile_naming_it(compiler, regex):
    """llguidance compiles it and masks its first token, then gives up on the first token
    consumed ("too many expressions constructed"): it failed the request during generation
    before, with "token 64 does not satisfy the constraint"."""
    with pytest.raises(ValueError, match=r"^guided_regex is too complex for the grammar engine"):
        compiler.compile(SamplingParams(guided_regex=regex))


def test_a_regex_too_complex_queues_nothing_offline_and_the_engine_goes_on():
    engine = tiny_engine(tokenizer=TOKENIZER, config=tiny_model_config(vocab_size=TINY_TEXT_VOCAB))
    with pytest.raises(ValueError, match=r"^guided_regex is too complex"):
        engine.add_request("r", [_id("x")], SamplingParams(guided_regex="a{1000000}", max_tokens=4))
    assert not engine.has_unfinished_requests()
    engine.add_request("ok", [_id("x")], SamplingParams(guided_regex="[ab]+", max_tokens=4, temperature=0))
    done = _run(engine)
    assert done["ok"].error is None and done["ok"].outputs[0].token_ids, done["ok"]


def test_the_grammar_engine_giving_up_during_generation_names_the_field(compiler):
    """Past the compile-time probe (a matcher built without it), a token the mask allowed
    but the engine then gave up on is reported as a constraint too complex, naming the
    field, not as a token the grammar forbids."""
    import llguidance

    llm = llguidance.LLMatcher(compiler._lltokenizer, llguidance.LLMatcher.grammar_from_regex("a{1000000}"),
                               log_level=0)
    matcher = GrammarMatcher(llm, TINY_TEXT_VOCAB, "guided_regex")
    matcher.mask_logits(torch.zeros(TINY_TEXT_VOCAB))
    with pytest.raises(ValueError, match=r"^guided_regex is too complex for the grammar engine: it gave up"):
        matcher.accept(_id("a"))


def test_a_grammar_compile_error_is_one_clean_line_naming_the_field(compiler):
    """llguidance appends a listing of the grammar to its error (thousands of lines of
    generated grammar for a structural tag of many tools): the message keeps what is wrong."""
    with pytest.raises(ValueError) as exc:
        compiler.compile(SamplingParams(guided_grammar='start: a\na: "x"\n' + 'q: "y"\n' * 20))
    message = str(exc.value)
    assert message.startswith("guided_grammar is not a usable grammar: ") and "duplicate rule" in message, message
    assert "\n" not in message and " | " not in message, message
    with pytest.raises(ValueError) as exc:
        compiler.compile(SamplingParams(guided_regex="("))
    assert str(exc.value).startswith("guided_regex is not a usable grammar: ") and "unclosed group" in str(exc.value)
    assert "\n" not in str(exc.value)


def _run(engine) -> dict[str, object]:
    """Step until idle: request_id -> its final RequestOutput."""
    done: dict[str, object] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


def test_a_grammar_that_dead_ends_fails_its_request_alone_with_an_error():
    """It ended with "stop" and a cut output before (llguidance let only EOS through)."""
    engine = tiny_engine(tokenizer=TOKENIZER, config=tiny_model_config(vocab_size=TINY_TEXT_VOCAB))
    engine.add_request("dead", [_id("x")], SamplingParams(guided_grammar='start: "a" b\nb: b "x"', max_tokens=4))
    engine.add_request("plain", [_id("y")], SamplingParams(temperature=0, max_tokens=4))
    done = _run(engine)
    assert done["dead"].error is not None and done["dead"].error.is_invalid_request, done["dead"]
    assert "guided_grammar: no output satisfies" in done["dead"].error.message
    assert done["plain"].error is None and len(done["plain"].outputs[0].token_ids) == 4
    stats = engine.get_stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_ignore_eos_keeps_a_structural_tag_generating_past_eos():
    """A structural tag (tool calls under tool_choice "auto") leaves the text free, so
    ignore_eos holds: EOS no longer ends the grammar (and with it the output)."""
    engine = tiny_engine(tokenizer=TOKENIZER, config=tiny_model_config(vocab_size=TINY_TEXT_VOCAB))
    tag = {"structures": [{"begin": "<f>", "schema": {"type": "object"}, "end": "</f>"}], "triggers": ["<f>"]}
    params = SamplingParams(structural_tag=tag, ignore_eos=True, logit_bias={EOS: 100}, max_tokens=6)
    engine.add_request("r", [_id("x")], params)
    out = _run(engine)["r"].outputs[0]
    assert out.token_ids == [EOS] * 6 and out.finish_reason == "length", out


# ------------------------------------------------------------------ min_tokens (vLLM #54218)
def _text(out) -> str:
    return TOKENIZER.decode([t for t in out.token_ids if t != EOS])


def test_min_tokens_holds_with_a_regex_while_the_grammar_allows_more():
    """EOS is masked until min_tokens although the model wants it (logit_bias), and the
    output still matches the regex (a ValueError before)."""
    engine = tiny_engine(tokenizer=TOKENIZER, config=tiny_model_config(vocab_size=TINY_TEXT_VOCAB))
    params = SamplingParams(guided_regex="[a-z]+", min_tokens=6, max_tokens=10, temperature=0, logit_bias={EOS: 100})
    engine.add_request("r", [_id("x")], params)
    out = _run(engine)["r"].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] == EOS, out
    assert len(out.token_ids) - 1 >= 6, out
    text = _text(out)
    assert text.isascii() and text.isalpha() and text.islower(), out


@pytest.mark.parametrize("params", [
    dict(guided_choice=["yes", "no"]),
    dict(guided_json={"type": "boolean"}),
], ids=["choice", "json-boolean"])
def test_a_grammar_that_completes_before_min_tokens_ends_the_output(params):
    """The grammar wins: the complete value ends the output with "stop", no error."""
    engine = tiny_engine(tokenizer=TOKENIZER, config=tiny_model_config(vocab_size=TINY_TEXT_VOCAB))
    engine.add_request("r", [_id("x")], SamplingParams(**params, min_tokens=8, max_tokens=12, temperature=0))
    done = _run(engine)["r"]
    assert done.error is None, done
    out = done.outputs[0]
    assert out.finish_reason == "stop", out
    assert _text(out) in ("yes", "no", "true", "false"), out
    assert len(out.token_ids) < 8, out


def test_a_grammar_that_allows_only_stop_tokens_under_min_tokens_ends_on_one():
    """After "a" the regex allows only "b" or "c", both stop tokens that min_tokens masks: the
    row would be all -inf (the grammar then refused the token sampled, an error); the
    grammar wins and the stop token ends the output."""
    engine = tiny_engine(tokenizer=TOKENIZER, config=tiny_model_config(vocab_size=TINY_TEXT_VOCAB))
    stops = [_id("b"), _id("c")]
    params = SamplingParams(guided_regex="a[bc]", stop_token_ids=stops, min_tokens=5, max_tokens=8, temperature=0)
    engine.add_request("r", [_id("x")], params)
    done = _run(engine)["r"]
    assert done.error is None, done
    out = done.outputs[0]
    assert out.finish_reason == "stop" and out.token_ids[0] == _id("a") and out.token_ids[1] in stops, out
    assert len(out.token_ids) == 2, out



def test_a_constraint_assigned_after_construction_is_enforced():
    """``params.structured_outputs = StructuredOutputsParams(choice=...)`` after construction
    was silently ignored (unconstrained text), and a replaced one ran the old choices."""
    from kvflow.sampling_params import StructuredOutputsParams

    engine = tiny_engine(tokenizer=TOKENIZER, config=tiny_model_config(vocab_size=TINY_TEXT_VOCAB))
    assigned = SamplingParams(temperature=0, max_tokens=8)
    assigned.structured_outputs = StructuredOutputsParams(choice=["yes", "no"])
    replaced = SamplingParams(temperature=0, max_tokens=8, structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    replaced.structured_outputs = StructuredOutputsParams(choice=["maybe"])
    engine.add_request("assigned", [_id("x")], assigned)
    engine.add_request("replaced", [_id("x")], replaced)
    done = _run(engine)
    assert _text(done["assigned"].outputs[0]) in ("yes", "no"), done["assigned"]
    assert _text(done["replaced"].outputs[0]) == "maybe", done["replaced"]
