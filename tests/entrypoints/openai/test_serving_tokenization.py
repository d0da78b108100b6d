"""``/tokenize``, ``/detokenize``, ``/version`` and the ``priority`` field on the tiny
in-process server (``test_server_tiny.TinyServer``)."""

from __future__ import annotations

import importlib.metadata

import httpx
import pytest
import torch
from test_server_tiny import TinyServer, _assert_error, _wait_idle

from conftest import tiny_tokenizer

MSG = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


@pytest.fixture(scope="module")
def server():
    s = TinyServer()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def priority_http():
    s = TinyServer(engine_kwargs={"scheduling_policy": "priority"})
    with httpx.Client(base_url=s.url, timeout=60) as c:
        yield c
    s.stop()


def _ok(r: httpx.Response) -> dict:
    assert r.status_code == 200, r.text
    return r.json()


def test_tokenize_prompt(http):
    tok = tiny_tokenizer()
    out = _ok(http.post("/tokenize", json={"prompt": "Hello there", "model": "tiny"}))
    assert out == {"count": 11, "max_model_len": 256, "tokens": tok.encode("Hello there")}
    strs = _ok(http.post("/tokenize", json={"prompt": "Hi", "return_token_strs": True}))
    assert strs["token_strs"] == tok.convert_ids_to_tokens(tok.encode("Hi"))


def test_a_prompt_takes_the_messages_forms_fields_at_their_neutral_values(http):
    tok = tiny_tokenizer()
    body = {"prompt": "Hi", "tools": [], "chat_template_kwargs": {}, "add_generation_prompt": False,
            "continue_final_message": None}
    assert _ok(http.post("/tokenize", json=body))["tokens"] == tok.encode("Hi")


@pytest.mark.parametrize("field,value", [("with_pieces", True), ("add_special", False), ("parse_special", False)])
def test_llama_servers_tokenize_fields_are_refused_by_name(http, field, value):
    """llama-server's ``/tokenize`` fields were dropped: ``with_pieces`` answered without
    pieces, ``parse_special: false`` still read ``<|im_start|>`` as one special token."""
    r = http.post("/tokenize", json={"prompt": "Hi", field: value})
    _assert_error(r, 400, field)
    assert field in r.json()["error"]["message"]
    assert _ok(http.post("/tokenize", json={"prompt": "Hi", "with_pieces": False, "parse_special": True}))["tokens"]


def test_tokenize_messages_counts_what_chat_completions_sends(http):
    out = _ok(http.post("/tokenize", json={"messages": MSG}))
    chat = _ok(http.post("/v1/chat/completions", json={"messages": MSG, "max_tokens": 1}))
    assert out["count"] == len(out["tokens"]) == chat["usage"]["prompt_tokens"]
    text = "<system>Be brief.\n<user>Hi\n"
    assert tiny_tokenizer().decode(out["tokens"]) == text + "<assistant>"
    no_prompt = _ok(http.post("/tokenize", json={"messages": MSG, "add_generation_prompt": False}))
    assert tiny_tokenizer().decode(no_prompt["tokens"]) == text


def test_tokenize_messages_renders_chat_template_kwargs_as_chat_completions_does():
    """``chat_template_kwargs`` (``{"enable_thinking": false}``) reach the template on
    /tokenize as on /v1/chat/completions, so the count is the chat prompt's; /tokenize
    refused them (its comment said the chat endpoint did too, which takes them)."""
    template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                "{% if add_generation_prompt %}<assistant>{% if enable_thinking is false %}<no-think>{% endif %}{% endif %}")
    s = TinyServer(chat_template=template)
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            for kwargs, tail in [({"enable_thinking": False}, "<assistant><no-think>"), ({}, "<assistant>")]:
                out = _ok(c.post("/tokenize", json={"messages": MSG, "chat_template_kwargs": kwargs}))
                assert tiny_tokenizer().decode(out["tokens"]) == "<system>Be brief.\n<user>Hi\n" + tail
                chat = _ok(c.post("/v1/chat/completions",
                                  json={"messages": MSG, "max_tokens": 1, "chat_template_kwargs": kwargs}))
                assert out["count"] == chat["usage"]["prompt_tokens"]
    finally:
        s.stop()


def test_detokenize_round_trips(http):
    tokens = _ok(http.post("/tokenize", json={"prompt": "Grüße, 世界"}))["tokens"]
    assert _ok(http.post("/detokenize", json={"tokens": tokens, "model": "tiny"})) == {"prompt": "Grüße, 世界"}
    assert _ok(http.post("/detokenize", json={"tokens": []})) == {"prompt": ""}


def test_detokenize_skips_special_tokens_when_asked(http):
    # skip_special_tokens: true was taken for the neutral value of the field sent to another
    # endpoint and dropped (the special token came back), and false was refused by name
    tokens = [*_ok(http.post("/tokenize", json={"prompt": "Hi"}))["tokens"], tiny_tokenizer().eos_token_id]
    assert _ok(http.post("/detokenize", json={"tokens": tokens})) == {"prompt": "Hi<|endoftext|>"}
    assert _ok(http.post("/detokenize", json={"tokens": tokens, "skip_special_tokens": False})) == {
        "prompt": "Hi<|endoftext|>"}
    assert _ok(http.post("/detokenize", json={"tokens": tokens, "skip_special_tokens": True})) == {"prompt": "Hi"}


def test_version(http):
    assert _ok(http.get("/version")) == {"version": importlib.metadata.version("kvflow")}


@pytest.mark.parametrize("path,body,param", [
    ("/detokenize", {"tokens": [72, 257]}, "tokens"),  # the tiny tokenizer has ids 0..256
    ("/detokenize", {"tokens": [-1]}, "tokens"),
    ("/detokenize", {"tokens": ["a"]}, "tokens"),
    ("/detokenize", {}, "tokens"),
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"messages": []}, "messages"),
    ("/tokenize", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}]},
     "messages"),
    ("/tokenize", {"messages": MSG, "add_generation_prompt": True, "continue_final_message": True},
     "add_generation_prompt"),
    ("/tokenize", {"messages": MSG, "chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
    ("/tokenize", {"messages": MSG, "chat_template_kwargs": ["x"]}, "chat_template_kwargs"),
    ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, "add_special_tokens"),
    # more tools than /v1/chat/completions takes: no count for a body chat refuses
    ("/tokenize", {"messages": MSG, "tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]},
     "tools"),
    # the messages form's fields with a prompt: dropped, the count silently left the tools out
    ("/tokenize", {"prompt": "x", "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ("/tokenize", {"prompt": "x", "chat_template_kwargs": {"enable_thinking": False}}, "chat_template_kwargs"),
    ("/tokenize", {"prompt": "x", "add_generation_prompt": True}, "add_generation_prompt"),
    ("/tokenize", {"prompt": "x", "continue_final_message": True}, "continue_final_message"),
])  # fmt: skip
def test_bad_tokenization_requests_are_400s(http, path, body, param):
    _assert_error(http.post(path, json=body), 400, param)


@pytest.mark.parametrize("path", ["/tokenize", "/detokenize"])
@pytest.mark.parametrize("content", [b"", b"{", b"[1]", b'"x"'])
def test_a_body_that_is_not_a_json_object_is_400(http, path, content):
    _assert_error(http.post(path, content=content, headers={"content-type": "application/json"}), 400)


def test_unknown_model_is_404(http):
    _assert_error(http.post("/tokenize", json={"prompt": "x", "model": "other"}), 404, "model")
    _assert_error(http.post("/detokenize", json={"tokens": [1], "model": "other"}), 404, "model")


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "Hello", "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": MSG, "max_tokens": 2}),
    ("/v1/embeddings", {"input": "Hello"}),
])  # fmt: skip
def test_priority_needs_the_priority_policy(server, http, priority_http, path, body):
    error = _assert_error(http.post(path, json={**body, "priority": 3}), 400, "priority")
    assert "--scheduling-policy priority" in error["message"]
    _ok(http.post(path, json={**body, "priority": 0}))  # vLLM's default: accepted under fcfs
    for priority in (-5, 3, 2**63 - 1):
        _ok(priority_http.post(path, json={**body, "priority": priority}))
    for bad in (2**63, -(2**63) - 1, 1.5, "1", True):
        _assert_error(priority_http.post(path, json={**body, "priority": bad}), 400, "priority")
    _wait_idle(server)
