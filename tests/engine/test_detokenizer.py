"""IncrementalDetokenizer: property tests with real tokenizers (hypothesis).

Tokens are fed one at a time, as the engine does, the last one with ``finished=True``.
Checked after every token:

* the visible text never moves backwards (each value starts with the previous one) and is
  always a prefix of the final text, so no character shown is ever taken back — in
  particular no U+FFFD is shown while a multi-byte character is split across tokens;
* at the end the concatenated deltas are exactly ``tokenizer.decode(output tokens)``;
* for token sequences that encode real text (CJK from the seed corpus, emoji, accented
  Latin, ASCII) no U+FFFD appears at all;
* stop strings taken from the text are found also when they span token boundaries: the final
  text is the one-shot text cut where the first stop string completes (kept with
  ``include_stop_str_in_output``); while running, no complete stop string and no character
  that is later cut is visible.

The tokenizers are SmolLM2's (byte-level BPE; skipped without the model package) and
Qwen2.5-Coder's when its package is installed.
"""

from __future__ import annotations

import glob
import os

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from kvflow.engine.detokenizer import IncrementalDetokenizer

REPLACEMENT = "\ufffd"

SETTINGS = settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize=True,
)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Keep torch (imported by the tokenizers' users) off the shared 2-core machine's other cores."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


class _Tok:
    """A tokenizer plus the facts the strategies need."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.vocab = len(tokenizer)
        self.special = sorted(set(tokenizer.all_special_ids))
        # Tokens holding an incomplete UTF-8 sequence (single bytes >= 0x80 and the like):
        # random sequences draw from them often, to split characters across tokens.
        self.partial = [i for i in range(self.vocab) if REPLACEMENT in tokenizer.decode([i])]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)


@pytest.fixture(scope="module", params=["smollm2", "qwen2.5-coder-0.5b"])
def tok(request) -> _Tok:
    from kvflow.model.resolve import load_tokenizer

    if request.param == "smollm2":
        model_dir = request.getfixturevalue("smollm2_dir")
    else:
        from kvflow.model.resolve import resolve_model

        try:
            model_dir = resolve_model(request.param)
        except (ImportError, ValueError, FileNotFoundError, OSError) as exc:
            pytest.skip(f"{request.param} not available ({type(exc).__name__})")
    return _Tok(load_tokenizer(model_dir))


# ------------------------------------------------------------------ strategies
def _seed_text() -> str:
    root = "/work/shared/seed"
    parts = [open(p, encoding="utf-8").read() for p in sorted(glob.glob(os.path.join(root, "*.txt")))]
    text = "".join(parts)
    if sum(1 for c in text if "\u4e00" <= c <= "\u9fff") < 100:
        # Fallback (no seed corpus): a fixed sample of real Chinese text.
        text = "随着大语言模型从研究走向生产部署，推理效率已成为决定产品成败的核心瓶颈。本文深入剖析推理优化的四大核心方向。"
    return text


SEED_TEXT = _seed_text()
EMOJI = [
    "😀", "🚀", "👍🏽", "❤️", "🇫🇷", "👨‍👩‍👧", "🧑‍💻", "🤖", "✨", "🐍", "🎉", "🙈", "🍣", "💡", "🏳️‍🌈",
]
ACCENTED = "àáâãäåæçèéêëìíîïñòóôõöøùúûüýÿßÀÉÎÕÜÇÑŒœłŁżśćęąőűšžčřěůĳ" + "e\u0301o\u0308"
ASCII = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,;:!?'\"()[]{}<>-_+=/*&^%$#@\n\t"

cjk_slices = st.integers(0, max(0, len(SEED_TEXT) - 1)).flatmap(
    lambda start: st.integers(1, 40).map(lambda n: SEED_TEXT[start : start + n])
)
segments = st.one_of(
    cjk_slices,
    st.lists(st.sampled_from(EMOJI), min_size=1, max_size=4).map("".join),
    st.text(alphabet=ACCENTED + " ", min_size=1, max_size=12),
    st.text(alphabet=ASCII, min_size=1, max_size=20),
    st.sampled_from([" the", " model", "hello world", "中文", "Überprüfung", "naïve café", " 🚀🚀", "日本語テキスト"]),
)
texts = st.lists(segments, min_size=1, max_size=6).map("".join)


@st.composite
def random_token_ids(draw, tok: _Tok, min_size: int, max_size: int) -> list[int]:
    pick = st.one_of(
        st.integers(0, tok.vocab - 1),
        st.sampled_from(tok.partial),
        st.sampled_from(tok.partial),
        st.sampled_from(tok.special),
    )
    return draw(st.lists(pick, min_size=min_size, max_size=max_size))


# ------------------------------------------------------------------ helpers
def run_detokenizer(tok: _Tok, prompt, output, skip_special_tokens=True, stop=None, include=False,
                    token_texts=None):
    """Feed ``output`` one token at a time; the visible texts after each token, the stop
    string that fired (if any) and the index of the token that fired it."""
    detok = IncrementalDetokenizer(tok.tokenizer, prompt, skip_special_tokens, stop, include, token_texts)
    visible: list[str] = []
    fired, fired_at = None, None
    for i, token in enumerate(output):
        finished = i == len(output) - 1
        fired = detok.update([token], finished=finished)
        visible.append(detok.text)
        if fired is not None:
            fired_at = i
            break
    assert detok.finished
    return visible, fired, fired_at


def assert_monotonic(visible: list[str], final: str) -> list[str]:
    """Each visible text extends the previous one and is a prefix of ``final``; the deltas."""
    deltas, previous = [], ""
    for i, text in enumerate(visible):
        assert text.startswith(previous), f"text moved backwards at token {i}: {previous!r} -> {text!r}"
        assert final.startswith(text), f"token {i} showed {text!r}, not a prefix of the final {final!r}"
        deltas.append(text[len(previous) :])
        previous = text
    assert "".join(deltas) == visible[-1]
    return deltas


def first_stop(text: str, stops: list[str]) -> tuple[int, int, str] | None:
    """Where scanning ``text`` left to right first completes a stop string:
    (start, end, stop); among stops ending at the same place, the longest."""
    best = None
    for stop in stops:
        index = text.find(stop)
        if index == -1:
            continue
        key = (index + len(stop), index)
        if best is None or key < (best[1], best[0]):
            best = (index, index + len(stop), stop)
    return best


# ------------------------------------------------------------------ random tokens
@SETTINGS
@given(data=st.data(), skip=st.booleans())
def test_random_tokens_deltas_concatenate_to_one_shot_decode(tok, data, skip):
    prompt_text = data.draw(texts, label="prompt_text")
    prompt = tok.encode(prompt_text)[-8:] or [tok.encode("a")[0]]
    output = data.draw(random_token_ids(tok, 1, 24), label="output")
    visible, fired, _ = run_detokenizer(tok, prompt, output, skip_special_tokens=skip)
    # a character cut by the end of the output is not text (no U+FFFD released at the finish)
    final = tok.decode(output, skip_special_tokens=skip).removesuffix(REPLACEMENT)
    assert fired is None
    assert visible[-1] == final
    assert_monotonic(visible, final)


@SETTINGS
@given(data=st.data(), skip=st.booleans())
def test_token_text_cache_changes_nothing(tok, data, skip):
    """With a one-token decode cache shared across requests (``OutputProcessor``'s), every
    step's visible text is the one without it, and the cache is used."""
    caches = {True: {}, False: {}}
    for _ in range(2):  # the second request reads what the first one cached
        prompt = data.draw(random_token_ids(tok, 1, 8), label="prompt")
        output = data.draw(random_token_ids(tok, 2, 16), label="output")
        stop = data.draw(st.lists(st.sampled_from(["e", " the", "。", "🚀", "ab"]), max_size=2), label="stop")
        plain = run_detokenizer(tok, prompt, output, skip, stop)
        cached = run_detokenizer(tok, prompt, output, skip, stop, token_texts=caches[skip])
        assert cached == plain
    for token, text in caches[skip].items():
        assert text == tok.decode([token], skip_special_tokens=skip)


def test_token_text_cache_is_read(smollm2_dir):
    """A decode step takes its first window's text from the cache (a planted wrong entry
    shows in the text, so the test fails if the cache is not consulted)."""
    from kvflow.model.resolve import load_tokenizer

    tokenizer = load_tokenizer(smollm2_dir)
    a, b, c = (tokenizer.encode(w, add_special_tokens=False)[0] for w in ("Hello", " world", " again"))
    cache: dict[int, str] = {}
    detok = IncrementalDetokenizer(tokenizer, [a], True, [], False, cache)
    detok.update([b])
    detok.update([c])
    assert detok.text == " world again" and cache == {a: "Hello", b: " world"}
    cache[c] = "X"  # a wrong text for c: the next step's first window is [c]
    detok.update([a])
    assert detok.text == " world again" + "againHello"  # (decode([c, a]) less the planted "X")


def test_token_text_cache_is_bounded(smollm2_dir, monkeypatch):
    """A full cache is read but not grown: the text stays right, the memory bounded."""
    from kvflow.engine import detokenizer as detokenizer_module
    from kvflow.model.resolve import load_tokenizer

    monkeypatch.setattr(detokenizer_module, "MAX_CACHED_TOKEN_TEXTS", 2)
    tokenizer = load_tokenizer(smollm2_dir)
    ids = [tokenizer.encode(w, add_special_tokens=False)[0] for w in ("Hello", " world", " again", " and")]
    cache: dict[int, str] = {}
    detok = IncrementalDetokenizer(tokenizer, ids[:1], True, [], False, cache)
    for t in ids[1:]:
        detok.update([t])
    assert detok.text == " world again and" and len(cache) == 2


@SETTINGS
@given(data=st.data())
def test_random_prompt_and_output_tokens(tok, data):
    """Random prompts too (possibly ending inside a character): the output text is still
    the decode of the output tokens alone."""
    prompt = data.draw(random_token_ids(tok, 1, 8), label="prompt")
    output = data.draw(random_token_ids(tok, 1, 16), label="output")
    visible, _, _ = run_detokenizer(tok, prompt, output)
    final = tok.decode(output).removesuffix(REPLACEMENT)
    assert visible[-1] == final
    assert_monotonic(visible, final)


# ------------------------------------------------------------------ real text
@SETTINGS
@given(prompt_text=texts, output_text=texts)
def test_text_tokens_never_show_replacement_char(tok, prompt_text, output_text):
    prompt = tok.encode(prompt_text) or tok.encode("a")
    output = tok.encode(output_text)
    assume(output)
    final = tok.decode(output)
    assert REPLACEMENT not in final
    visible, fired, _ = run_detokenizer(tok, prompt, output)
    assert fired is None
    assert visible[-1] == final
    deltas = assert_monotonic(visible, final)
    assert all(REPLACEMENT not in d for d in deltas)
    # Whenever the tokens so far decode to complete characters, all of it is visible.
    for i, text in enumerate(visible):
        so_far = tok.decode(output[: i + 1])
        if not so_far.endswith(REPLACEMENT):
            assert text == so_far, (i, text, so_far)


def test_split_multibyte_character_is_held_back(tok):
    """Deterministic case: a character split over byte tokens shows nothing until complete."""
    for char in ("😀", "🦩", "𝄞", "🫠", "龘", "𓀀"):
        output = tok.encode(f" {char} ok")
        if any(REPLACEMENT in tok.decode([t]) for t in output):
            break
    else:
        pytest.skip("no candidate character is split by this tokenizer")
    visible, _, _ = run_detokenizer(tok, tok.encode("Hi"), output)
    assert all(REPLACEMENT not in v for v in visible)
    assert visible[-1] == f" {char} ok"
    first_full = next(i for i, v in enumerate(visible) if char in v)
    assert first_full >= 1 and all(v in ("", " ") for v in visible[:first_full])


# ------------------------------------------------------------------ stop strings
@st.composite
def text_and_stops(draw, tok: _Tok):
    text = draw(texts)
    output = tok.encode(text)
    assume(len(output) >= 2)
    final = tok.decode(output)
    stops = []
    for _ in range(draw(st.integers(1, 3))):
        start = draw(st.integers(0, len(final) - 1))
        length = draw(st.integers(1, min(8, len(final) - start)))
        stops.append(final[start : start + length])
    if draw(st.booleans()):
        # A stop inside another one: the two can complete within the same token, and the
        # one that completes first in the text must win, however the text is tokenized.
        outer = stops[0]
        inner_start = draw(st.integers(0, len(outer) - 1))
        stops.append(outer[inner_start : inner_start + draw(st.integers(1, len(outer) - inner_start))])
    if draw(st.booleans()):
        stops.append(draw(st.sampled_from(["\u2603never\u2603", "zzzq", "。。。。"])))
    return output, final, stops


def _check_stops(tok, output, final, stops, include):
    prompt = tok.encode("Answer:")
    visible, fired, fired_at = run_detokenizer(tok, prompt, output, stop=stops, include=include)
    expected_stop = first_stop(final, stops)
    assert expected_stop is not None  # the stops were taken from the text
    start, end, stop = expected_stop
    expected = final[:end] if include else final[:start]
    assert fired == stop
    assert visible[-1] == expected
    # The stop fires on the first token whose complete text reaches the stop's end.
    def reaches(i):
        so_far = tok.decode(output[: i + 1])
        return len(so_far) >= end and (i == len(output) - 1 or not so_far.endswith(REPLACEMENT))

    assert fired_at == next(i for i in range(len(output)) if reaches(i))
    # While running: only prefixes of the final text, never a complete stop string.
    assert_monotonic(visible, expected)
    for text in visible[:-1]:
        assert not any(s in text for s in stops), (text, stops)
    return fired_at


@SETTINGS
@given(data=st.data(), include=st.booleans())
def test_stop_strings_found_across_token_boundaries(tok, data, include):
    output, final, stops = data.draw(text_and_stops(tok))
    _check_stops(tok, output, final, stops, include)


@SETTINGS
@given(data=st.data(), include=st.booleans())
def test_several_tokens_per_update(tok, data, include):
    """Speculative decoding hands the detokenizer several tokens at once: same final text,
    same stop, and still only prefixes of the final text on the way."""
    output, final, stops = data.draw(text_and_stops(tok))
    if data.draw(st.booleans(), label="no stops"):
        stops = []
    cuts = sorted(set(data.draw(st.lists(st.integers(1, len(output) - 1), max_size=len(output)), label="cuts")))
    chunks = [output[a:b] for a, b in zip([0, *cuts], [*cuts, len(output)])]
    detok = IncrementalDetokenizer(tok.tokenizer, tok.encode("Answer:"), True, stops, include)
    visible, fired = [], None
    for i, chunk in enumerate(chunks):
        fired = detok.update(chunk, finished=i == len(chunks) - 1)
        visible.append(detok.text)
        if fired is not None:
            break
    expected_stop = first_stop(final, stops)
    if expected_stop is None:
        expected, expected_fired = final, None
    else:
        start, end, expected_fired = expected_stop
        expected = final[:end] if include else final[:start]
    assert fired == expected_fired
    assert visible[-1] == expected
    assert_monotonic(visible, expected)
    assert all(REPLACEMENT not in v for v in visible)


def test_stop_string_spanning_tokens_deterministic(tok):
    """A stop string made of the end of one token and the start of the next."""
    output = tok.encode("Hello world, this is fine. The end")
    pieces = [tok.decode([t]) for t in output]
    # A stop made of the last 2 chars of one token and the first 2 of the next.
    i = next(k for k in range(len(pieces) - 1) if len(pieces[k]) >= 2 and len(pieces[k + 1]) >= 2)
    stop = pieces[i][-2:] + pieces[i + 1][:2]
    final = tok.decode(output)
    for include in (False, True):
        fired_at = _check_stops(tok, output, final, [stop], include)
        assert fired_at == i + 1


def test_partial_stop_is_held_back_then_released(tok):
    """A suffix that might grow into a stop string is hidden until resolved: released when
    the text goes on differently, and at the end of the request."""
    detok = IncrementalDetokenizer(tok.tokenizer, tok.encode("Q:"), True, ["STOP!"], False)
    texts = []
    for token in tok.encode(" go ST"):
        detok.update([token])
        texts.append(detok.text)
    assert texts[-1] == " go "
    for token in tok.encode("ay"):
        detok.update([token])
    assert detok.text == " go STay"
    for token in tok.encode(" ST"):
        detok.update([token])
    assert detok.text == " go STay "
    detok.update(tok.encode("O"), finished=True)  # the request ends (length/EOS): release
    assert detok.text == " go STay STO"


def test_no_stop_strings_means_no_hold_back(tok):
    detok = IncrementalDetokenizer(tok.tokenizer, tok.encode("Q:"), True, [], False)
    for token in tok.encode(" ST"):
        detok.update([token])
    assert detok.text == " ST"


def test_fast_decode_is_the_transformers_decode(tok):
    """The Rust decode the detokenizer calls gives the transformers decode's string (special
    tokens kept or skipped), and is refused where transformers would change that string."""
    import copy

    from kvflow.engine.detokenizer import fast_decode

    fast = fast_decode(tok.tokenizer)
    assert fast is not None
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        ids = torch.randint(0, tok.vocab, (int(torch.randint(1, 12, (1,), generator=gen)),), generator=gen).tolist()
        ids[0] = tok.special[0]
        for skip in (True, False):
            assert fast(ids, skip_special_tokens=skip) == tok.decode(ids, skip)
    cleaning = copy.copy(tok.tokenizer)
    cleaning.clean_up_tokenization_spaces = True
    assert fast_decode(cleaning) is None

    class Overriding(type(tok.tokenizer)):
        def _decode(self, token_ids, **kwargs):
            return "x"

    other = copy.copy(tok.tokenizer)
    other.__class__ = Overriding
    assert fast_decode(other) is None


def test_min_tokens_holds_stop_strings_back(tok):
    """``min_tokens`` with ``stop``: a stop string in the first ``min_tokens`` output tokens
    ended the output (stop=["b"], min_tokens=12 gave ""); as in vLLM (#22014), stop strings
    are matched only once the output has more than ``min_tokens`` tokens."""
    output = tok.encode(" the model and the model and the model")
    assert len(output) > 4
    stops = [" model"]
    detok = IncrementalDetokenizer(tok.tokenizer, tok.encode("Answer:"), True, stops, False, None, 4)
    fired_at = None
    for i, token in enumerate(output):
        if detok.update([token], finished=i == len(output) - 1) is not None:
            fired_at = i
            break
    assert fired_at is not None and fired_at >= 4, fired_at
    assert detok.text.endswith("and the"), detok.text
    assert detok.text.count(" model") >= 1  # the ones before min_tokens stay text
    plain = IncrementalDetokenizer(tok.tokenizer, tok.encode("Answer:"), True, stops, False)
    assert next(i for i, t in enumerate(output) if plain.update([t]) is not None) < 4  # (what min_tokens changes)
