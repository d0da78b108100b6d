"""``_merge`` (kvflow/entrypoints/openai/serving.py): one stream is read without a pump task,
and closing the merged stream closes every source (which aborts its request)."""

from __future__ import annotations

import asyncio

import pytest

from kvflow.entrypoints.openai.serving import _merge


def _source(items: list[int], closed: list[str], name: str):
    async def gen():
        try:
            for x in items:
                await asyncio.sleep(0)
                yield x
        finally:
            closed.append(name)

    return gen()


def test_one_stream_is_read_directly_and_closed_with_the_merge():
    async def main():
        closed: list[str] = []
        merged = _merge([_source([1, 2, 3], closed, "a")])
        tasks_before = len(asyncio.all_tasks())
        assert await anext(merged) == (0, 1)
        assert len(asyncio.all_tasks()) == tasks_before  # no pump task between source and consumer
        await merged.aclose()
        assert closed == ["a"]
        merged = _merge([_source([4, 5], closed, "b")])
        assert [x async for x in merged] == [(0, 4), (0, 5)]
        assert closed == ["a", "b"]

    asyncio.run(main())


def test_several_streams_are_interleaved_and_all_closed():
    async def main():
        closed: list[str] = []
        merged = _merge([_source([1, 2], closed, "a"), _source([3], closed, "b")])
        got = [x async for x in merged]
        assert sorted(got) == [(0, 1), (0, 2), (1, 3)]
        assert sorted(closed) == ["a", "b"]

    asyncio.run(main())


def test_text_chunk_is_byte_identical_to_the_whole_chunk_serialized():
    """The streamed chunks whose only varying part is the text (completions) or the content
    (chat) are built from a payload serialized once; every event must be byte for byte the
    one ``json.dumps`` of the whole chunk gives."""
    from kvflow.entrypoints.openai.serving import _sse, _TextChunk

    base = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": 'a "quoted"\\ model ""'}
    texts = ["", "hello", ' "quotes" and \\ backslash', "line\nbreak\ttab\r", "\x00\x1f control", "é 漢字 🙂",
             "\u2028\u2029", "}]}", '""']
    for index in (0, 3):
        completion = _TextChunk({**base, "choices": [{"index": index, "text": ""}]})
        chat = _TextChunk({**base, "object": "chat.completion.chunk",
                           "choices": [{"index": index, "delta": {"content": ""}}]})
        for text in texts:
            assert completion(text) == _sse({**base, "choices": [{"index": index, "text": text}]})
            assert chat(text) == _sse({**base, "object": "chat.completion.chunk",
                                       "choices": [{"index": index, "delta": {"content": text}}]})
    with pytest.raises(ValueError, match="empty string field"):
        _TextChunk({**base, "choices": [{"index": 0, "text": "x"}]})
