"""The request models: strict types, unsupported fields by name, defaults of unset fields."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from kvflow.entrypoints.openai.protocol import BUILTIN_DEFAULTS, MAX_TOOLS, ChatCompletionRequest, CompletionRequest

MSG = [{"role": "user", "content": "Hi"}]


@pytest.mark.parametrize(
    "field,value",
    [("temperature", True), ("temperature", "0.5"), ("temperature", float("inf")), ("top_p", float("nan")),
     ("n", 2.0), ("n", "2"), ("max_tokens", True), ("seed", 1e20), ("top_k", "5"), ("stream", "true"),
     ("logit_bias", {"5": True}), ("stop", 5)],
)  # fmt: skip
def test_types_are_strict(field, value):
    with pytest.raises(ValidationError) as exc:
        CompletionRequest.model_validate({"prompt": "x", field: value})
    assert exc.value.errors()[0]["loc"][0] == field


@pytest.mark.parametrize(
    "metadata",
    [{f"k{i}": "v" for i in range(17)}, {"k" * 65: "v"}, {"k": "v" * 513}, {"k": 5}],
)  # fmt: skip
def test_metadata_is_bounded_as_openais(metadata):
    with pytest.raises(ValidationError) as exc:
        ChatCompletionRequest.model_validate({"messages": MSG, "metadata": metadata})
    assert exc.value.errors()[0]["loc"][0] == "metadata"
    ok = {f"k{i}": "v" * 512 for i in range(16)} | {"k" * 64: "v"}
    assert ChatCompletionRequest.model_validate({"messages": MSG, "metadata": dict(list(ok.items())[-16:])}).metadata


def _tools(n: int) -> list[dict]:
    return [{"type": "function", "function": {"name": f"f{i}", "parameters": {"type": "object"}}} for i in range(n)]


def test_tools_are_bounded_at_openais_128():
    """2,000 tools reached llguidance, whose refusal of the grammar came back as the 400."""
    assert MAX_TOOLS == 128
    for n in (MAX_TOOLS + 1, 2000):
        with pytest.raises(ValidationError) as exc:
            ChatCompletionRequest.model_validate({"messages": MSG, "tools": _tools(n)})
        error = exc.value.errors()[0]
        assert error["loc"] == ("tools",) and f"tools holds {n} tools; at most 128" in error["msg"], error
    assert len(ChatCompletionRequest.model_validate({"messages": MSG, "tools": _tools(MAX_TOOLS)}).tools) == 128


_CALLS = {"role": "assistant", "content": None,
          "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}


def _answer(call_id: str) -> dict:
    return {"role": "tool", "tool_call_id": call_id, "content": "18 C"}


@pytest.mark.parametrize("messages,where,why", [
    ([*MSG, _answer("call_1")], "messages[1]", "no assistant message before it has tool_calls"),
    ([*MSG, _CALLS, _answer("call_nope")], "messages[2]", "no tool_calls entry of an earlier assistant message"),
    ([*MSG, _CALLS, _answer("call_1"), _answer("call_2")], "messages[3]", "no tool_calls entry"),
], ids=["no-assistant-call", "unknown-id", "second-answer-unknown"])  # fmt: skip
def test_a_tool_message_that_answers_no_call_is_refused_naming_it_and_the_id(messages, where, why):
    """OpenAI refuses a tool message whose tool_call_id is no earlier assistant call's id;
    kvflow rendered it as an answer to no call."""
    with pytest.raises(ValidationError) as exc:
        ChatCompletionRequest.model_validate({"messages": messages})
    error = exc.value.errors()[0]
    bad = messages[int(where[9:-1])]["tool_call_id"]
    assert error["loc"] == ("messages",) and f"{where}.tool_call_id {bad!r} answers no tool call" in error["msg"], error
    assert why in error["msg"], error


@pytest.mark.parametrize("after", [[MSG[0]], [_answer("call_1"), MSG[0]]], ids=["user-next", "one-of-two-answered"])
def test_calls_the_conversation_goes_on_from_must_be_answered(after):
    """OpenAI's rule (and /v1/messages' here): calls followed by anything but their answers
    are refused, naming the ids; a final assistant message with calls is taken."""
    two = {**_CALLS, "tool_calls": [*_CALLS["tool_calls"], {**_CALLS["tool_calls"][0], "id": "call_2"}]}
    with pytest.raises(ValidationError, match=r"messages\[1\]: an assistant message with 'tool_calls' must be "
                                              r"followed by tool messages.*'call_2'"):
        ChatCompletionRequest.model_validate({"messages": [*MSG, two, *after]})
    assert len(ChatCompletionRequest.model_validate({"messages": [*MSG, two]}).messages) == 2


@pytest.mark.parametrize("between", [MSG[0], {"role": "assistant", "content": "18 C."}, {"role": "system", "content": "x"}],
                         ids=["user", "plain-assistant", "system"])
def test_a_tool_message_that_follows_no_assistant_calls_is_refused_naming_it(between):
    """OpenAI refuses a tool message that does not follow an assistant message with
    tool_calls ("messages with role 'tool' must be a response to a preceding message with
    'tool_calls'"); kvflow took one after a user (or a plain assistant) message, answering a
    call of an earlier turn out of its turn."""
    messages = [*MSG, _CALLS, _answer("call_1"), between, _answer("call_1")]
    with pytest.raises(ValidationError) as exc:
        ChatCompletionRequest.model_validate({"messages": messages})
    error = exc.value.errors()[0]
    assert error["loc"] == ("messages",), error
    assert (f"messages[4]: a tool message must follow an assistant message with tool_calls (or that message's other "
            f"tool messages); it follows a {between['role']} message") in error["msg"], error


def test_tool_messages_answering_earlier_calls_are_taken():
    later = {**_CALLS, "tool_calls": [{**_CALLS["tool_calls"][0], "id": "call_2"}]}
    messages = [*MSG, _CALLS, _answer("call_1"), later, _answer("call_2"), _answer("call_1")]
    assert len(ChatCompletionRequest.model_validate({"messages": messages}).messages) == 6


def test_json_numbers_fill_float_fields():
    req = CompletionRequest.model_validate({"prompt": "x", "temperature": 1, "top_p": 0, "presence_penalty": -2})
    assert (req.temperature, req.top_p, req.presence_penalty) == (1.0, 0.0, -2.0)


@pytest.mark.parametrize(
    "body,field",
    [({"functions": [{"name": "f"}]}, "functions"), ({"function_call": {"name": "f"}}, "function_call"),
     ({"modalities": ["audio"]}, "modalities"), ({"echo": True}, "echo"),
     ({"chat_template": "{{ messages }}"}, "chat_template"),
     ({"messages": [{"role": "assistant", "content": "x", "function_call": {"name": "f"}}]}, "messages"),
     ({"messages": [{"role": "user", "content": "x", "audio": {"id": "a"}}]}, "messages")],
)  # fmt: skip
def test_chat_fields_kvflow_lacks_are_named(body, field):
    req = ChatCompletionRequest.model_validate({"messages": MSG, **body})
    name, message = req.unsupported_field()
    assert name == field and "not supported" in message


@pytest.mark.parametrize(
    "body",
    [{}, {"tools": []}, {"tool_choice": "none"}, {"tool_choice": "auto"}, {"modalities": ["text"]},
     {"parallel_tool_calls": True}, {"add_generation_prompt": True}, {"user": "u", "store": True}],
)  # fmt: skip
def test_values_that_change_nothing_pass(body):
    assert ChatCompletionRequest.model_validate({"messages": MSG, **body}).unsupported_field() is None


@pytest.mark.parametrize("body,field", [({"best_of": 3}, "best_of"), ({"suffix": "z"}, "suffix"),
                                        ({"prompt_logprobs": 5}, "prompt_logprobs")])
def test_completion_fields_kvflow_lacks_are_named(body, field):
    assert CompletionRequest.model_validate({"prompt": "x", **body}).unsupported_field()[0] == field
    assert CompletionRequest.model_validate({"prompt": "x", "best_of": 1, "suffix": ""}).unsupported_field() is None


@pytest.mark.parametrize(
    "part",
    [{"type": "image_url", "image_url": {"url": "u"}}, {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}},
     {"type": "file"}, {"text": "untyped"}],
)  # fmt: skip
def test_content_parts_other_than_text_are_refused(part):
    with pytest.raises(ValidationError, match=f"parts of type {part.get('type')!r} are not supported"):
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": [part]}]})


def test_chat_template_kwargs_may_not_set_the_servers_variables():
    ChatCompletionRequest.model_validate({"messages": MSG, "chat_template_kwargs": {"enable_thinking": False}})
    for key in ("tools", "add_generation_prompt", "messages", "tokenize"):
        with pytest.raises(ValidationError, match=f"may not set '{key}'"):
            ChatCompletionRequest.model_validate({"messages": MSG, "chat_template_kwargs": {key: 1}})


def test_unset_fields_take_the_generation_config_then_the_builtin_defaults():
    req = CompletionRequest.model_validate({"prompt": "x", "top_p": 0.5})
    params = req.sampling_params(4, None, defaults={"temperature": 0.2, "top_p": 0.9, "top_k": 7})
    assert (params.temperature, params.top_p, params.top_k) == (0.2, 0.5, 7)  # the request's top_p wins
    assert (params.min_p, params.repetition_penalty) == (BUILTIN_DEFAULTS["min_p"], BUILTIN_DEFAULTS["repetition_penalty"])
    assert CompletionRequest.model_validate({"prompt": "x"}).sampling_params(4, None).temperature == 1.0


def test_json_schema_response_format_is_the_guided_schema():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    req = ChatCompletionRequest.model_validate(
        {"messages": MSG, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}
    )
    assert req.sampling_params(4, None).guided_json == schema
    with pytest.raises(ValueError, match="json_schema.schema"):
        ChatCompletionRequest.model_validate(
            {"messages": MSG, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}
        ).sampling_params(4, None)


@pytest.mark.parametrize(
    "body,field",
    [({"best_of": 2}, "best_of"), ({"suffix": "x"}, "suffix"), ({"add_special_tokens": True}, "add_special_tokens"),
     ({"typical_p": 0.5}, "typical_p"), ({"mirostat": 2}, "mirostat"), ({"dry_multiplier": 0.8}, "dry_multiplier"),
     ({"top_a": 0.1}, "top_a"), ({"cache_salt": "s"}, "cache_salt"), ({"vllm_xargs": {"k": 1}}, "vllm_xargs"),
     ({"spaces_between_special_tokens": False}, "spaces_between_special_tokens"),
     ({"detokenize": False}, "detokenize"),  # (it was dropped: the text came back)
     ({"detokenize": "garbage"}, "detokenize"),
     ({"return_token_ids": True}, "return_token_ids"),
     ({"include_reasoning": False}, "include_reasoning"), ({"max_new_tokens": 3}, "max_new_tokens"),
     ({"do_sample": False}, "do_sample"), ({"thinking": {"type": "enabled", "budget_tokens": 64}}, "thinking"),
     ({"smoothing_factor": 0.3}, "smoothing_factor"), ({"temperature_last": True}, "temperature_last"),
     ({"penalty_last_n": 64}, "penalty_last_n"), ({"guided_decoding_backend": "xgrammar"}, "guided_decoding_backend"),
     ({"stream": True, "stream_options": {"continuous_usage_stats": True}}, "stream_options"),
     ({"lora_path": "a"}, "lora_path"), ({"no_stop_trim": True}, "no_stop_trim"),
     ({"return_hidden_states": True}, "return_hidden_states"), ({"stop_regex": ["x+"]}, "stop_regex"),
     ({"separate_reasoning": False}, "separate_reasoning"), ({"input_ids": [1, 2]}, "input_ids")],
)  # fmt: skip
def test_other_servers_fields_that_change_the_output_are_refused_on_chat(body, field):
    name, message = ChatCompletionRequest.model_validate({"messages": MSG, **body}).unsupported_field()
    assert name == field and "not supported" in message


@pytest.mark.parametrize(
    "body",
    [{"typical_p": 1.0}, {"mirostat": 0}, {"dry_multiplier": 0}, {"best_of": 1}, {"add_special_tokens": False},
     {"spaces_between_special_tokens": True}, {"request_id": "r1"}, {"guided_decoding_backend": "auto"},
     {"return_token_ids": False}, {"include_reasoning": True}, {"do_sample": True}, {"thinking": {"type": "disabled"}},
     {"guided_decoding_backend": "llguidance"},
     {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": False}}],
)  # fmt: skip
def test_their_neutral_values_and_bookkeeping_fields_pass(body):
    assert ChatCompletionRequest.model_validate({"messages": MSG, **body}).unsupported_field() is None


LLAMA_CPP_FIELDS = [
    ({"return_tokens": True}, "return_tokens"), ({"samplers": ["top_k", "temperature"]}, "samplers"),
    ({"samplers": "kt"}, "samplers"), ({"t_max_predict_ms": 10}, "t_max_predict_ms"),
    ({"t_max_prompt_ms": 10}, "t_max_prompt_ms"), ({"timings_per_token": True}, "timings_per_token"),
    ({"post_sampling_probs": True}, "post_sampling_probs"), ({"return_progress": True}, "return_progress"),
    ({"response_fields": ["content"]}, "response_fields"), ({"n_indent": 4}, "n_indent"),
    ({"min_keep": 5}, "min_keep"), ({"repeat_last_n": 64}, "repeat_last_n"),
    ({"lora": [{"id": 0, "scale": 0.5}]}, "lora"), ({"image_data": [{"data": "eA==", "id": 1}]}, "image_data"),
    ({"multimodal_data": ["eA=="]}, "multimodal_data"),
]  # fmt: skip


@pytest.mark.parametrize("cls,base", [(CompletionRequest, {"prompt": "x"}), (ChatCompletionRequest, {"messages": MSG})])
@pytest.mark.parametrize("body,field", LLAMA_CPP_FIELDS)
def test_llama_servers_fields_that_change_the_answer_are_refused(cls, base, body, field):
    """llama-server's request fields that change the output (``samplers``, ``t_max_predict_ms``,
    ``lora``...) or the answer's shape (``return_tokens``, ``timings_per_token``...) were
    logged as unknown and dropped: a client got a 200 without what it asked for."""
    name, message = cls.model_validate({**base, **body}).unsupported_field()
    assert name == field and "not supported" in message


@pytest.mark.parametrize(
    "body",
    [{"return_tokens": False}, {"timings_per_token": False}, {"post_sampling_probs": False}, {"t_max_predict_ms": -1},
     {"min_keep": 0}, {"n_indent": 0}, {"lora": []}, {"image_data": []}, {"response_fields": []},
     {"cache_prompt": True}, {"id_slot": 0}, {"n_keep": 4}, {"dry_base": 1.75}, {"mirostat_tau": 5.0}],
)  # fmt: skip
def test_llama_servers_neutral_values_and_bookkeeping_fields_pass(body):
    assert CompletionRequest.model_validate({"prompt": "x", **body}).unsupported_field() is None


NEWER_VLLM_FIELDS = [
    ({"thinking_token_budget": 16}, "thinking_token_budget"),
    ({"truncate_prompt_tokens": 4, "truncation_side": "right"}, "truncation_side"),
    ({"logprobs": True, "logprob_token_ids": [1, 2]}, "logprob_token_ids"),
    ({"repetition_detection": {"max_pattern_size": 3}}, "repetition_detection"),
    ({"return_prompt_text": True}, "return_prompt_text"), ({"watermarking": True}, "watermarking"),
    ({"ec_transfer_params": {"a": 1}}, "ec_transfer_params"),
]  # fmt: skip


@pytest.mark.parametrize("cls,base", [(CompletionRequest, {"prompt": "x"}), (ChatCompletionRequest, {"messages": MSG})])
@pytest.mark.parametrize("body,field", NEWER_VLLM_FIELDS)
def test_newer_vllm_fields_that_change_the_answer_are_refused(cls, base, body, field):
    """vLLM's newer request fields (its 0.32 protocol) were logged as unknown and dropped: a
    200 with the prompt truncated on the other side (truncation_side "right"), no
    thinking budget, no repetition stop, no logprobs of the ids asked for."""
    if cls is CompletionRequest and "logprobs" in body:
        body = {**body, "logprobs": 1}
    name, message = cls.model_validate({**base, **body}).unsupported_field()
    assert name == field and "not supported" in message


@pytest.mark.parametrize("body", [{"truncation_side": "left"}, {"logprob_token_ids": []}, {"watermarking": False},
                                  {"return_prompt_text": False}, {"thinking_token_budget": None},
                                  {"session_id": "s"}, {"stream_interval": 2}, {"return_token_offsets": True}])
def test_newer_vllm_fields_neutral_values_pass(body):
    assert ChatCompletionRequest.model_validate({"messages": MSG, **body}).unsupported_field() is None


def test_return_token_ids_is_refused_on_completions_too():
    """vLLM's ``return_token_ids`` (``prompt_token_ids`` / ``token_ids`` in its answer, which
    RL trainers read) was logged as unknown and dropped: the answer came without them."""
    assert CompletionRequest.model_validate({"prompt": "x", "return_token_ids": True}).unsupported_field()[0] == (
        "return_token_ids")
    assert CompletionRequest.model_validate({"prompt": "x", "return_token_ids": False}).unsupported_field() is None


def test_add_special_tokens_is_served_at_each_endpoints_vllm_default():
    assert CompletionRequest.model_validate({"prompt": "x", "add_special_tokens": True}).unsupported_field() is None
    assert CompletionRequest.model_validate({"prompt": "x", "add_special_tokens": False}).unsupported_field()[0] == (
        "add_special_tokens")


def test_a_bool_is_not_taken_for_a_neutral_number():
    assert ChatCompletionRequest.model_validate({"messages": MSG, "mirostat": False}).unsupported_field()[0] == "mirostat"


def test_completions_take_response_format_like_chat():
    assert CompletionRequest.model_validate(
        {"prompt": "x", "response_format": {"type": "json_object"}}).sampling_params(4, None).guided_json == {
        "type": "object"}
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    req = CompletionRequest.model_validate(
        {"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}})
    assert req.sampling_params(4, None).guided_json == schema
    assert CompletionRequest.model_validate({"prompt": "x", "response_format": {"type": "text"}}).sampling_params(
        4, None).guided_json is None


@pytest.mark.parametrize("cls,base", [(CompletionRequest, {"prompt": "x"}), (ChatCompletionRequest, {"messages": MSG})])
def test_llama_servers_json_object_schema_constrains_the_output(cls, base):
    """llama-server's ``{"type": "json_object", "schema": {...}}``: the schema was dropped
    (``response_format`` keeps unknown keys) and the output held any JSON object."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    req = cls.model_validate({**base, "response_format": {"type": "json_object", "schema": schema}})
    assert req.sampling_params(4, None).guided_json == schema
    for kind in ("text", "json_schema"):
        fmt = {"type": kind, "schema": schema, **({"json_schema": {"name": "x", "schema": schema}} if kind != "text"
                                                  else {})}
        with pytest.raises(ValueError, match=r"^response_format\.schema .*json_object"):
            cls.model_validate({**base, "response_format": fmt}).sampling_params(4, None)
    with pytest.raises(ValidationError, match="schema"):
        cls.model_validate({**base, "response_format": {"type": "json_object", "schema": "{}"}})


@pytest.mark.parametrize("body,field", [({"n": 2}, "n"), ({"seed": 3}, "seed"), ({"stop": ["x"]}, "stop")])
def test_chat_sampling_fields_sent_to_responses_or_messages_are_refused(body, field):
    from kvflow.entrypoints.anthropic.protocol import MessagesRequest
    from kvflow.entrypoints.openai.serving_responses import ResponsesRequest

    assert ResponsesRequest.model_validate({"input": "hi", **body}).unsupported_field()[0] == field
    messages = MessagesRequest.model_validate({"model": "m", "max_tokens": 5, "messages": MSG, **body})
    assert messages.unsupported_field()[0] == field
    assert ResponsesRequest.model_validate({"input": "hi", "n": 1}).unsupported_field() is None


@pytest.mark.parametrize(
    "message,param",
    [("stop: an entry of 2000 characters; at most 1024", "stop"), ("guided_choice: 2000 choices; at most 1024",
     "guided_choice"), ("response_format.json_schema.schema is required", "response_format"),
     ("messages[0].content is empty", "messages"), ("2 is not a field", None)],
)  # fmt: skip
def test_a_value_error_names_its_field_in_param(message, param):
    from kvflow.entrypoints.openai.serving import _bad_request

    error = _bad_request(ValueError(message))
    assert (error.status, error.param) == (400, param)


def test_a_message_without_content_is_refused_but_an_assistants_tool_call_turn():
    with pytest.raises(ValidationError, match="a user message needs content"):
        ChatCompletionRequest.model_validate({"messages": [{"role": "user"}]})
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    ChatCompletionRequest.model_validate({"messages": [*MSG, {"role": "assistant", "tool_calls": [call]}]})


@pytest.mark.parametrize("role", ["user", "system", "assistant"])
def test_a_message_with_an_empty_list_of_parts_is_refused(role):
    """``content: []`` is no content (OpenAI answers 400: an array of at least one part); it
    used to be rendered as an empty message."""
    with pytest.raises(ValidationError, match="content is an empty list of parts"):
        ChatCompletionRequest.model_validate({"messages": [*MSG, {"role": role, "content": []}]})
    ChatCompletionRequest.model_validate({"messages": [*MSG, {"role": role, "content": ""}]})


def test_anthropic_server_tools_and_empty_user_content_are_refused():
    from kvflow.entrypoints.anthropic.protocol import MessagesRequest, to_chat_fields

    base = {"model": "m", "max_tokens": 5, "messages": MSG}
    with pytest.raises(ValidationError, match="server tools \\(type 'web_search_20250305'\\) are not supported"):
        MessagesRequest.model_validate({**base, "tools": [{"type": "web_search_20250305", "name": "web_search"}]})
    with pytest.raises(ValueError, match=r"messages\[0\]: all messages must have non-empty content"):
        to_chat_fields(MessagesRequest.model_validate({**base, "messages": [{"role": "user", "content": []}]}))
    tool = {"type": "custom", "name": "f", "input_schema": {"type": "object"}}
    prefill = [*MSG, {"role": "assistant", "content": []}]  # a final assistant turn may be empty
    MessagesRequest.model_validate({**base, "messages": prefill, "tools": [tool]})


def test_tokenize_refuses_a_prompt_sent_with_messages():
    from kvflow.entrypoints.openai.serving_tokenization import TokenizeChatRequest

    req = TokenizeChatRequest.model_validate({"messages": MSG, "prompt": "ignored?"})
    assert req.unsupported_field() == ("prompt", "prompt and messages are exclusive: send one of them")
    assert TokenizeChatRequest.model_validate({"messages": MSG}).unsupported_field() is None


@pytest.mark.parametrize("other", [{"guided_choice": ["a", "b"]}, {"guided_json": {"type": "object"}},
                                   {"structured_outputs": {"regex": "a+"}}])
def test_response_format_with_another_constraint_is_refused_naming_response_format(other):
    for req in (CompletionRequest.model_validate({"prompt": "x", "response_format": {"type": "json_object"}, **other}),
                ChatCompletionRequest.model_validate({"messages": MSG, "response_format": {"type": "json_object"}, **other})):
        with pytest.raises(ValueError, match="^response_format cannot be combined with"):
            req.sampling_params(4, None)


def test_a_refused_foreign_field_is_not_logged_as_ignored(monkeypatch, caplog):
    """``mirostat`` (another server's field) is refused by name; the log said "ignoring the
    unknown field 'mirostat'" for it all the same. A truly unknown field is still logged."""
    import logging

    from kvflow.entrypoints.openai import protocol

    monkeypatch.setattr(protocol, "_warned_fields", set())
    with caplog.at_level(logging.WARNING, logger=protocol.__name__):
        req = ChatCompletionRequest.model_validate({"messages": MSG, "mirostat": 2, "made_up_field": 1})
    assert req.unsupported_field()[0] == "mirostat"
    assert "'mirostat'" not in caplog.text, caplog.text
    assert "'made_up_field'" in caplog.text, caplog.text


@pytest.mark.parametrize("cls,body", [(CompletionRequest, {"prompt": "x"}), (ChatCompletionRequest, {"messages": MSG})])
def test_sglangs_regex_and_ebnf_are_the_guided_regex_and_grammar(cls, body):
    """SGLang's ``regex`` / ``ebnf`` (sglang-router's clients send them) were logged as unknown
    and dropped: the output was unconstrained."""
    params = cls.model_validate({**body, "regex": "[0-9]{3}"}).sampling_params(4, None)
    assert params.guided_regex == "[0-9]{3}"
    params = cls.model_validate({**body, "ebnf": 'root ::= "yes" | "no"'}).sampling_params(4, None)
    assert params.guided_grammar == 'root ::= "yes" | "no"'
    assert cls.model_validate({**body, "regex": "a"}).output_constraint() == "regex"
    with pytest.raises(ValueError, match="^regex cannot be combined with guided_regex"):
        cls.model_validate({**body, "regex": "a", "guided_regex": "b"}).sampling_params(4, None)
    with pytest.raises(ValueError, match="^response_format cannot be combined with ebnf"):
        cls.model_validate({**body, "ebnf": 'root ::= "a"', "response_format": {"type": "json_object"}}
                           ).sampling_params(4, None)


def test_sglangs_constraint_fields_are_refused_on_responses_and_messages():
    from kvflow.entrypoints.anthropic.protocol import MessagesRequest
    from kvflow.entrypoints.openai.serving_responses import ResponsesRequest

    assert ResponsesRequest.model_validate({"input": "hi", "regex": "a"}).unsupported_field()[0] == "regex"
    messages = MessagesRequest.model_validate({"model": "m", "max_tokens": 5, "messages": MSG, "ebnf": "root ::= \"a\""})
    assert messages.unsupported_field()[0] == "ebnf"
