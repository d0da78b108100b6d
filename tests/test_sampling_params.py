"""SamplingParams validation: every invalid field raises a ValueError naming the field."""

from __future__ import annotations

import math

import pytest

from kvflow import sampling_params as sp
from kvflow.sampling_params import SamplingParams

NAN = math.nan


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": -1}, "temperature"),
        ({"temperature": NAN}, "temperature"),
        ({"temperature": "1.0"}, "temperature"),
        ({"temperature": None}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": -0.5}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": 1.0000001}, "top_p"),
        ({"top_p": NAN}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": -100}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"top_k": True}, "top_k"),
        ({"min_p": -0.01}, "min_p"),
        ({"min_p": 1.01}, "min_p"),
        ({"min_p": NAN}, "min_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -5}, "max_tokens"),
        ({"max_tokens": 3.0}, "max_tokens"),
        ({"max_tokens": "8"}, "max_tokens"),
        ({"seed": 1.5}, "seed"),
        ({"seed": "7"}, "seed"),
        ({"seed": True}, "seed"),
        ({"seed": NAN}, "seed"),
        ({"seed": 2**63}, "seed"),
        ({"seed": 2**64}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"n": 0}, "n"),
        ({"n": -1}, "n"),
        ({"n": 1.0}, "n"),
        ({"n": True}, "n"),
        ({"n": "2"}, "n"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": 1.5}, "logprobs"),
        ({"logprobs": True}, "logprobs"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop_token_ids": [3, -7]}, "stop_token_ids"),
        ({"stop_token_ids": [1.5]}, "stop_token_ids"),
        ({"stop_token_ids": ["2"]}, "stop_token_ids"),
        ({"temperature": math.inf}, "temperature"),
        ({"temperature": -math.inf}, "temperature"),
        ({"temperature": True}, "temperature"),
        ({"top_p": math.inf}, "top_p"),
        ({"min_p": math.inf}, "min_p"),
        ({"presence_penalty": math.inf}, "presence_penalty"),
        ({"frequency_penalty": -math.inf}, "frequency_penalty"),
        ({"repetition_penalty": math.inf}, "repetition_penalty"),
        ({"repetition_penalty": NAN}, "repetition_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"logit_bias": {"1.5": 1}}, "logit_bias"),
        ({"logit_bias": {"1e3": 1}}, "logit_bias"),
        ({"logit_bias": {"\u00b2": 1}}, "logit_bias"),  # a Unicode digit int() refuses
        ({"logit_bias": {True: 1}}, "logit_bias"),
        ({"logit_bias": {"-1": 1}}, "logit_bias"),
        ({"logit_bias": {5: True}}, "logit_bias"),
        ({"logit_bias": {5: "1"}}, "logit_bias"),
        ({"logit_bias": {5: NAN}}, "logit_bias"),
        ({"logit_bias": {5: math.inf}}, "logit_bias"),
        ({"logit_bias": {5: 100.5}}, "logit_bias"),
        ({"logit_bias": [5]}, "logit_bias"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"repetition_penalty": 1e300}, "repetition_penalty"),
        ({"repetition_penalty": 1e-300}, "repetition_penalty"),  # 0 in float32: a division by zero
        # ints past float's range: math.isfinite raised OverflowError, naming nothing
        ({"temperature": 10**400}, "temperature"),
        ({"temperature": -(10**400)}, "temperature"),
        ({"repetition_penalty": 10**400}, "repetition_penalty"),
        ({"repetition_penalty": -(10**5000)}, "repetition_penalty"),  # (str() refuses its 5,001 digits)
        ({"stop": 5}, "stop"),
        ({"stop_token_ids": 5}, "stop_token_ids"),
        ({"bad_words": 5}, "bad_words"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
        ({"skip_special_tokens": None}, "skip_special_tokens"),
        ({"include_stop_str_in_output": 1}, "include_stop_str_in_output"),
    ],
)
def test_invalid_field_raises_value_error_naming_it(kwargs, field):
    with pytest.raises(ValueError) as exc:
        SamplingParams(**kwargs)
    message = str(exc.value)
    assert message.startswith(f"{field} "), message


def test_defaults():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert p.seed is None and p.max_tokens == 16
    assert p.stop_token_ids == []
    assert p.ignore_eos is False and p.skip_special_tokens is True
    assert p.logprobs is None
    assert p.greedy is False


def test_default_stop_token_ids_not_shared():
    a, b = SamplingParams(), SamplingParams()
    a.stop_token_ids.append(5)
    assert b.stop_token_ids == []


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": 0},
        {"temperature": 0.0, "top_p": 1.0},
        {"temperature": 2.5},
        {"top_p": 1e-9},
        {"top_p": 1},
        {"top_k": -1},
        {"top_k": 0},
        {"top_k": 1},
        {"top_k": 10**6},
        {"min_p": 0},
        {"min_p": 1},
        {"min_p": 0.5},
        {"max_tokens": 1},
        {"seed": 0},
        {"seed": -3},
        {"seed": 2**63 - 1},
        {"seed": -(2**63)},
        {"stop_token_ids": [0, 2, 2]},
        {"stop_token_ids": None},
        {"ignore_eos": True},
        {"n": 1},
        {"n": 4},
        {"logprobs": 0},
        {"logprobs": 5},
        {"logprobs": None},
        {"top_k": 2**63},  # above the vocabulary: every token is kept (the sampler clamps it)
        {"top_k": 10**20},
        {"temperature": 1e300},
        {"repetition_penalty": 1e-3},
    ],
)
def test_valid_values_construct(kwargs):
    p = SamplingParams(**kwargs)
    for name, value in kwargs.items():
        if name == "stop_token_ids":
            assert p.stop_token_ids == list(value or [])
        else:
            assert getattr(p, name) == value


def test_stop_token_ids_tuple_becomes_list():
    p = SamplingParams(stop_token_ids=(4, 5))
    assert p.stop_token_ids == [4, 5] and isinstance(p.stop_token_ids, list)


@pytest.mark.parametrize(
    ("kwargs", "greedy"),
    [({"temperature": 0}, True), ({"temperature": 1e-6}, True), ({"top_k": 1}, True), ({"temperature": 0.01}, False), ({}, False), ({"top_k": 2}, False)],
)
def test_greedy_property(kwargs, greedy):
    assert SamplingParams(**kwargs).greedy is greedy


@pytest.mark.parametrize(
    ("value", "message"),
    [([], "must not be empty"), ([1, -2], "non-negative integers"), ([1, 2.0], "non-negative integers"),
     ([True], "non-negative integers"), (7, "must be a list"), ([0] * (sp.MAX_ALLOWED_TOKEN_IDS + 1), "at most")],
)
def test_allowed_token_ids_are_checked(value, message):
    with pytest.raises(ValueError, match=f"allowed_token_ids.*{message}|{message}.*allowed_token_ids"):
        SamplingParams(allowed_token_ids=value)


def test_allowed_token_ids_become_a_list_of_ints():
    import numpy as np

    p = SamplingParams(allowed_token_ids=(np.int64(4), 9, 4))
    assert p.allowed_token_ids == [4, 9] and all(type(t) is int for t in p.allowed_token_ids)  # (deduplicated)
    p.allowed_token_ids = [-1]
    with pytest.raises(ValueError, match="allowed_token_ids"):
        p.verify()


@pytest.mark.parametrize("value", [0, -2, 1.5, True, "4"])
def test_truncate_prompt_tokens_is_minus_one_or_positive(value):
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        SamplingParams(truncate_prompt_tokens=value)
    from kvflow.pooling_params import PoolingParams

    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        PoolingParams(truncate_prompt_tokens=value)


def test_logit_bias_keys_become_ints():
    p = SamplingParams(logit_bias={"5": 1, 7: -2.5, "0": 100})
    assert p.logit_bias == {5: 1.0, 7: -2.5, 0: 100.0}


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("stop", ["s"] * (sp.MAX_STOP_STRINGS + 1), "stop holds"),
        ("bad_words", ["w"] * (sp.MAX_BAD_WORDS + 1), "bad_words holds"),
        ("stop_token_ids", [1] * (sp.MAX_STOP_TOKEN_IDS + 1), "stop_token_ids holds"),
        ("logit_bias", {i: 1.0 for i in range(sp.MAX_LOGIT_BIAS + 1)}, "logit_bias holds"),
        ("stop", "x" * (sp.MAX_STRING_CHARS + 1), "stop: an entry of"),
        ("bad_words", ["x" * (sp.MAX_STRING_CHARS + 1)], "bad_words: an entry of"),
    ],
)
def test_list_fields_are_bounded(field, value, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**{field: value})


def test_list_fields_at_their_bounds_are_accepted():
    p = SamplingParams(stop=["s" * sp.MAX_STRING_CHARS] * sp.MAX_STOP_STRINGS, bad_words=["w"] * sp.MAX_BAD_WORDS,
                       stop_token_ids=[1] * sp.MAX_STOP_TOKEN_IDS)
    assert len(p.stop) == sp.MAX_STOP_STRINGS and len(p.bad_words) == sp.MAX_BAD_WORDS


def test_guided_choice_is_bounded():
    with pytest.raises(ValueError, match="guided_choice: 1025 choices; at most 1024"):
        SamplingParams(guided_choice=[f"o{i}" for i in range(sp.MAX_GUIDED_CHOICES + 1)])
    with pytest.raises(ValueError, match="guided_choice: a choice of 1025 characters"):
        SamplingParams(guided_choice=["a", "x" * (sp.MAX_STRING_CHARS + 1)])
    assert len(SamplingParams(guided_choice=[f"o{i}" for i in range(sp.MAX_GUIDED_CHOICES)]).guided_choice) == 1024


def test_max_tokens_none_means_until_the_context_is_full():
    # vLLM's SamplingParams(max_tokens=None): the engine turns it into the request's room
    p = SamplingParams(max_tokens=None)
    assert p.max_tokens is None
    assert SamplingParams(max_tokens=None, min_tokens=5).min_tokens == 5


CONSTRAINTS = [
    ({"guided_json": {"type": "object"}}, "guided_json"),
    ({"guided_regex": "[a-z]+"}, "guided_regex"),
    ({"guided_choice": ["yes", "no"]}, "guided_choice"),
    ({"guided_grammar": 'start: "a"+'}, "guided_grammar"),
    ({"structured_outputs": sp.StructuredOutputsParams(json_object=True)}, "guided_json"),
]


@pytest.mark.parametrize("constraint,name", CONSTRAINTS, ids=[c[1] + str(i) for i, c in enumerate(CONSTRAINTS)])
def test_an_output_constraint_refuses_ignore_eos(constraint, name):
    """The constraint's grammar ends the output once it is complete (it ignored ignore_eos
    silently before): the combination is a ValueError naming the field and the constraint."""
    with pytest.raises(ValueError) as exc:
        SamplingParams(max_tokens=8, **constraint, ignore_eos=True)
    assert str(exc.value).startswith(f"ignore_eos cannot be combined with {name}"), exc.value


@pytest.mark.parametrize("constraint,name", CONSTRAINTS, ids=[c[1] + str(i) for i, c in enumerate(CONSTRAINTS)])
def test_an_output_constraint_takes_min_tokens(constraint, name):
    """As vLLM (vllm-project/vllm#54218): min_tokens holds until the grammar allows only EOS
    (it was a ValueError before)."""
    assert SamplingParams(max_tokens=8, **constraint, min_tokens=3).min_tokens == 3


def test_a_structural_tag_takes_ignore_eos_and_min_tokens():
    """A structural tag leaves the text free (tool calls under tool_choice "auto")."""
    tag = {"structures": [{"begin": "<f>", "schema": {"type": "object"}, "end": "</f>"}], "triggers": ["<f>"]}
    SamplingParams(max_tokens=8, structural_tag=tag, ignore_eos=True, min_tokens=3)


@pytest.mark.parametrize("name", ["structured_outputs", "guided_decoding"])
def test_verify_takes_a_constraint_assigned_replaced_or_removed_after_construction(name):
    """``params.structured_outputs = StructuredOutputsParams(...)`` after construction was
    ignored: only ``__post_init__`` set ``guided_choice`` from it, and the engine ran the
    request unconstrained; a replaced one ran the old constraint. ``verify`` (the engine
    calls it on every request) takes the one set now."""
    cls = sp.StructuredOutputsParams if name == "structured_outputs" else sp.GuidedDecodingParams
    params = SamplingParams(max_tokens=3)
    setattr(params, name, cls(choice=["yes", "no"]))
    params.verify()
    assert params.guided_kind == "choice" and params.guided_choice == ["yes", "no"]
    setattr(params, name, cls(regex="a+"))  # replaced
    params.verify()
    assert params.guided_kind == "regex" and params.guided_regex == "a+" and params.guided_choice is None
    params.verify()  # (again: nothing changes)
    assert params.guided_regex == "a+"
    setattr(params, name, None)  # removed
    params.verify()
    assert params.guided_kind is None and params.guided_regex is None
    # one given to the constructor and replaced
    params = SamplingParams(max_tokens=3, **{name: cls(json_object=True)})
    setattr(params, name, {"choice": ["maybe"]})  # (as the server's JSON gives it)
    params.verify()
    assert params.guided_kind == "choice" and params.guided_choice == ["maybe"] and params.guided_json is None
    # a guided_* field set beside it still conflicts with it
    params.guided_choice = ["other"]
    with pytest.raises(ValueError, match="^guided_choice and structured_outputs"):
        params.verify()
    # a guided_* field given directly is left alone
    params = SamplingParams(max_tokens=3, guided_choice=["x"])
    params.verify()
    assert params.guided_choice == ["x"]


@pytest.mark.parametrize(
    ("field", "value"),
    [("temperature", -5.0), ("top_p", NAN), ("max_tokens", 0), ("n", 0), ("top_k", -7), ("stop", "abc"),
     ("stop_token_ids", [-1]), ("logit_bias", {"1": 5.0}), ("logit_bias", {1: 500.0}), ("ignore_eos", "yes")],
)
def test_verify_refuses_a_field_set_after_construction(field, value):
    """A dataclass field assigned after construction skipped ``__post_init__``'s checks (the
    engine then sampled with top_p=NaN, or ran max_tokens=0 as 1 token); ``verify`` refuses
    it naming the field."""
    params = SamplingParams(max_tokens=3)
    params.verify()
    setattr(params, field, value)
    with pytest.raises(ValueError) as exc:
        params.verify()
    assert str(exc.value).startswith(field), str(exc.value)


def test_numpy_scalars_are_accepted_as_python_numbers():
    np = pytest.importorskip("numpy")
    params = SamplingParams(temperature=np.float32(0.7), max_tokens=np.int64(16), seed=np.int64(3), n=np.int32(2),
                            top_p=np.float64(0.9), top_k=np.int16(5), min_p=np.float16(0.0), logprobs=np.uint8(2),
                            presence_penalty=np.float32(0.5), repetition_penalty=np.float32(1.1),
                            min_tokens=np.int64(1), stop_token_ids=[np.int64(7)],
                            logit_bias={np.int64(4): np.float32(1.5)})
    for name in ("max_tokens", "seed", "n", "top_k", "logprobs", "min_tokens"):
        assert type(getattr(params, name)) is int, name
    for name in ("temperature", "min_p", "presence_penalty", "repetition_penalty"):
        assert type(getattr(params, name)) is float, name
    assert params.temperature == pytest.approx(0.7)
    assert params.max_tokens == 16 and params.seed == 3
    assert [type(t) for t in params.stop_token_ids] == [int]
    assert {type(k): type(v) for k, v in params.logit_bias.items()} == {int: float}
    params.temperature = np.float32(0.2)  # assigned after construction: verify normalises it too
    params.verify()
    assert type(params.temperature) is float


@pytest.mark.parametrize("kwargs,field", [
    ({"max_tokens": 16.0}, "max_tokens"),
    ({"seed": True}, "seed"),
    ({"temperature": True}, "temperature"),
    ({"temperature": "0.7"}, "temperature"),
    ({"n": 2.5}, "n"),
])
def test_wrong_types_are_still_refused_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field} "):
        SamplingParams(**kwargs)


def test_seed_minus_one_is_no_seed_as_in_vllm_and_llama_cpp():
    """``seed: -1`` (llama.cpp's "random seed", vLLM's ``SamplingParams`` takes it as None) was
    a fixed seed: every request sent with it drew the same tokens."""
    assert SamplingParams(seed=-1).seed is None
    assert SamplingParams(seed=-2).seed == -2 and SamplingParams(seed=0).seed == 0
    with pytest.raises(ValueError, match="^seed "):
        SamplingParams(seed=-1.0)


def test_seed_minus_one_is_no_seed_also_as_numpy_or_set_after_construction():
    """numpy's -1 (an int only once normalised) and a -1 assigned after construction (which
    only ``verify`` sees) stayed the fixed seed -1: every such request drew the same tokens."""
    import numpy as np

    assert SamplingParams(seed=np.int64(-1)).seed is None
    params = SamplingParams(seed=7)
    params.seed = -1
    params.verify()
    assert params.seed is None


def test_seeds_that_agree_in_their_low_32_bits_draw_different_numbers():
    """PyTorch's CPU generator keeps a seed's low 32 bits: seeds s and s + 2**32, or -1 and
    2**63 - 1, drew the same samples (found serving with seed -1 and 2**63 - 1). Seeds in
    [0, 2**32) keep their numbers; the others are mixed first, into [0, 2**32)."""
    import torch

    from kvflow.request import Request
    from kvflow.sampling_params import generator_seed

    def draws(seed: int) -> list[float]:
        request = Request("r", [1, 2], SamplingParams(temperature=1.0, seed=seed), None)
        return torch.rand(4, generator=request.generator).tolist()

    for seed in (0, 1, 12345, 2**32 - 1):
        assert generator_seed(seed) == seed
        assert draws(seed) == torch.rand(4, generator=torch.Generator().manual_seed(seed)).tolist()
    pairs = [(0, 2**32), (1, 2**32 + 1), (-2, 2**63 - 2), (0, -(2**63)), (5, 5 + 2**40), (-2, 2**32 - 2)]
    for a, b in pairs:
        assert draws(a) != draws(b), (a, b)
    extremes = [-(2**63), -(2**32), -1, -2, 2**32, 2**40 + 3, 2**63 - 1]
    mapped = [generator_seed(s) for s in extremes]
    assert all(0 <= m < 2**32 for m in mapped) and len(set(mapped)) == len(extremes)


@pytest.mark.parametrize("options,field", [({"structural_tag": "{}"}, "structural_tag"),
                                           ({"json": {}, "whitespace_pattern": " "}, "whitespace_pattern")])
def test_structured_outputs_options_kvflow_lacks_are_named_even_alone(options, field):
    """``StructuredOutputsParams(structural_tag=...)`` alone answered "got none" (no
    constraint set) instead of naming the option kvflow does not take."""
    with pytest.raises(ValueError, match=f"StructuredOutputsParams.{field} is not supported"):
        sp.StructuredOutputsParams(**options)


# ---------------------------------------------------------------- vLLM's other fields
def test_vllms_fields_are_taken_at_their_defaults():
    """detokenize, spaces_between_special_tokens, extra_args (vLLM 0.32's), best_of and
    logits_processors (older vLLM's) were TypeErrors even at their defaults."""
    params = SamplingParams(detokenize=True, spaces_between_special_tokens=True, logits_processors=None,
                            extra_args={"a": 1, "nested": [1, 2]}, best_of=None)
    assert params.extra_args == {"a": 1, "nested": [1, 2]} and params.detokenize
    assert SamplingParams(n=3, best_of=3, temperature=1.0).best_of == 3  # best_of == n: n samples, as before
    assert SamplingParams(logits_processors=[]).logits_processors == []
    # with skip_special_tokens (the default) special tokens are not in the text: vLLM ignores it too
    assert SamplingParams(spaces_between_special_tokens=False).spaces_between_special_tokens is False
    assert SamplingParams(detokenize=False, stop_token_ids=[3]).detokenize is False


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"best_of": 2}, "best_of=2 is not supported by kvflow"),
    ({"best_of": 1.0}, "best_of=1.0 is not supported by kvflow"),  # (a float equal to n passed)
    ({"n": 2, "best_of": 4, "temperature": 1.0}, "best_of=4 is not supported"),
    ({"best_of": True}, "best_of=True is not supported"),
    ({"logits_processors": [lambda ids, logits: logits]}, "logits_processors is not supported by kvflow"),
    ({"logits_processors": "x"}, "logits_processors is not supported"),
    ({"spaces_between_special_tokens": False, "skip_special_tokens": False},
     "spaces_between_special_tokens=False is not supported by kvflow"),
    ({"detokenize": False, "stop": ["x"]}, "stop strings need detokenize=True"),
    ({"detokenize": "no"}, "detokenize must be a boolean"),
    ({"spaces_between_special_tokens": 0}, "spaces_between_special_tokens must be a boolean"),
    ({"extra_args": "x"}, "extra_args must be a dict or None"),
])  # fmt: skip
def test_vllms_fields_kvflow_does_not_implement_are_refused_by_name(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_clone_is_a_deep_copy():
    params = SamplingParams(temperature=0.5, stop=["a"], extra_args={"k": [1]}, logit_bias={3: 1.0})
    copy = params.clone()
    assert copy == params and copy is not params
    copy.stop.append("b")
    copy.extra_args["k"].append(2)
    copy.logit_bias[4] = 2.0
    assert params.stop == ["a"] and params.extra_args == {"k": [1]} and params.logit_bias == {3: 1.0}


def test_from_optional_takes_none_as_the_default():
    """vLLM's from_optional: None for n / the penalties / temperature / top_p is the
    default; logit_bias keys become ints and the values are clamped to [-100, 100]."""
    params = SamplingParams.from_optional(n=None, temperature=None, top_p=None, presence_penalty=None,
                                          frequency_penalty=None, repetition_penalty=None, max_tokens=5,
                                          logit_bias={"7": 500, 8: -1000.0}, extra_args={"x": 1})
    assert (params.n, params.temperature, params.top_p, params.max_tokens) == (1, 1.0, 1.0, 5)
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (0.0, 0.0, 1.0)
    assert params.logit_bias == {7: 100.0, 8: -100.0} and params.extra_args == {"x": 1}
    assert SamplingParams.from_optional(temperature=0.3, guided_regex="a+").guided_regex == "a+"  # kvflow's fields
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams.from_optional(logit_bias={"x": 1.0})
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams.from_optional(temperature=-1.0)


@pytest.mark.parametrize("bias", [{1: NAN}, {1.5: 3.0}, {True: 3.0}, {1: True}, {1: "5"}, [1]],
                         ids=["nan-value", "float-key", "bool-key", "bool-value", "str-value", "list"])
def test_from_optional_refuses_a_logit_bias_the_constructor_refuses(bias):
    """from_optional's clamp turned a NaN bias into -100 (the token banned, where the
    constructor refuses NaN) and its int(key) made the keys 1.5 and True token 1."""
    with pytest.raises(ValueError, match="^logit_bias "):
        SamplingParams.from_optional(logit_bias=bias)
    with pytest.raises(ValueError, match="^logit_bias "):
        SamplingParams(logit_bias=bias)


@pytest.mark.parametrize("value", [10**400, -(10**400), math.inf, NAN], ids=["huge-int", "huge-negative-int", "inf", "nan"])
def test_beam_search_length_penalty_must_be_finite(value):
    """An int past float's range raised OverflowError from math.isfinite, naming nothing."""
    with pytest.raises(ValueError, match="^length_penalty "):
        sp.BeamSearchParams(beam_width=2, max_tokens=3, length_penalty=value)


@pytest.mark.parametrize("name", ["ignore_eos", "include_stop_str_in_output"])
@pytest.mark.parametrize("value", ["false", "yes", 1, None])
def test_beam_search_switches_must_be_booleans(name, value):
    """BeamSearchParams(ignore_eos="false") was accepted and, truthy, extended the beams past
    EOS; as SamplingParams' switches, these take True or False only."""
    with pytest.raises(ValueError, match=f"^{name} must be a boolean"):
        sp.BeamSearchParams(beam_width=2, max_tokens=3, **{name: value})
    sp.BeamSearchParams(beam_width=2, max_tokens=3, **{name: True})


@pytest.mark.parametrize("field, neutral, other", [
    ("thinking_token_budget", None, 16), ("repetition_detection", None, {"max_pattern_size": 3}),
    ("logprob_token_ids", [], [1, 2]), ("prompt_logprob_token_ids", [], [1]), ("prompt_logprob_start", 0, 2),
    ("watermarking", False, True), ("flat_logprobs", False, True), ("stream_interval", 1, 4),
    ("skip_reading_prefix_cache", False, True), ("routed_experts_prompt_start", 0, 3),
])  # fmt: skip
def test_vllms_newer_fields_pass_at_neutral_values_and_are_refused_by_name(field, neutral, other):
    """vLLM 0.32's SamplingParams fields kvflow does not implement were TypeErrors (an unknown
    keyword): now their neutral values pass and any other is a ValueError naming the field."""
    assert getattr(SamplingParams(**{field: neutral}), field) == neutral
    with pytest.raises(ValueError, match=f"^{field}=.* is not supported by kvflow"):
        SamplingParams(**{field: other})


def test_skip_clone_is_accepted_as_vllms_copy_hint():
    assert SamplingParams(skip_clone=True).clone().skip_clone is True
    with pytest.raises(ValueError, match="skip_clone must be a bool"):
        SamplingParams(skip_clone="yes")
