"""``POST /v1/embeddings`` (OpenAI's Embeddings API, with vLLM's extra fields).

Each input becomes one embedding request of the engine (``kvflow.pooling_params``): batched
with the other requests by the scheduler, never sampled, pooled from the decoder's final
hidden states with the server's ``--pooling`` (vLLM sets pooling per model, not per request)
and L2-normalized unless ``normalize`` / ``use_activation`` is false.

Request: ``input`` (a string, a list of strings, a list of token ids, or a list of token-id
lists), ``model``, ``encoding_format`` ("float", or "base64": the little-endian float32
bytes, as OpenAI), ``dimensions`` (only the model's hidden size; 400 otherwise), ``user``;
vLLM's ``add_special_tokens``, ``priority``, ``normalize`` / ``use_activation``,
``truncate_prompt_tokens`` (embed each input's last k tokens; -1: ``max_model_len``). Response:
``{"id", "object": "list", "created", "model", "data": [{"object": "embedding", "index",
"embedding"}], "usage": {"prompt_tokens", "total_tokens"}}``.
"""

from __future__ import annotations

import base64
import time
import uuid
from typing import Any, ClassVar, Literal

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field

from kvflow.entrypoints.openai.protocol import INT64_MAX, INT64_MIN, _Body
from kvflow.entrypoints.openai.serving import MAX_PROMPTS, APIError, OpenAIServing, _bad_request
from kvflow.pooling_params import PoolingParams


class EmbeddingRequest(_Body):
    """POST /v1/embeddings."""

    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    # vLLM extras
    add_special_tokens: bool = True
    priority: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
    normalize: bool | None = None  # vLLM before 0.11; now use_activation
    use_activation: bool | None = None
    truncate_prompt_tokens: int | None = None  # the input's last k tokens (-1: max_model_len)
    # vLLM extras kvflow does not implement (refused when set to anything but a no-op)
    embed_dtype: Any = None
    endianness: Any = None
    messages: Any = None
    padding: Any = None
    truncation_side: Any = None
    # the offline API's per-request pooling (LLM.embed(pooling=...), PoolingParams.pooling_type):
    # the server pools as its --pooling says, so a request's own is refused, not dropped
    pooling: Any = None
    pooling_type: Any = None
    # llama-server's normalization (-1 none, 0 max-abs, 1 taxicab, 2 Euclidean, > 2 p-norm): only
    # its default, the L2 normalization kvflow does
    embd_normalize: Any = None

    UNSUPPORTED: ClassVar[dict[str, tuple[Any, ...]]] = {
        "embed_dtype": ("float32",), "endianness": ("little", "native"),
        "messages": (), "padding": ("do_not_pad",), "truncation_side": (), "pooling": (), "pooling_type": (),
        "embd_normalize": (2,),
    }  # fmt: skip


# Inputs per request: OpenAI's limit ("any array must be 2048 dimensions or less"); each input
# is one engine request, so one body cannot hold the engine for long (as prompts, MAX_PROMPTS).
MAX_INPUTS = MAX_PROMPTS


def _prompts(serving: OpenAIServing, req: EmbeddingRequest) -> list[tuple[list[int], str | None]]:
    """(token ids, text or None) per input, in order.

    Raises:
        APIError: 400 naming ``input`` for an empty list, more than ``MAX_INPUTS`` inputs, or
            text without a tokenizer.
    """
    given = req.input
    if isinstance(given, list) and not given:
        raise APIError(400, "input must not be empty", "BadRequestError", "input")
    if isinstance(given, list) and given and not isinstance(given[0], int) and len(given) > MAX_INPUTS:
        raise APIError(400, f"input has {len(given)} items; at most {MAX_INPUTS} inputs per request",
                       "BadRequestError", "input")
    texts = [given] if isinstance(given, str) else given if all(isinstance(x, str) for x in given) else None
    if texts is not None:
        if serving.tokenizer is None:
            raise APIError(400, "input: this model has no tokenizer; send token ids", "BadRequestError", "input")
        return [(serving.tokenizer.encode(t, add_special_tokens=req.add_special_tokens), t) for t in texts]
    if all(isinstance(x, int) for x in given):
        return [(list(given), None)]
    return [(list(ids), None) for ids in given]


def _encode(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "float":
        return vector
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")


async def create_embedding(serving: OpenAIServing, req: EmbeddingRequest, raw: Request) -> Response:
    """Embed every input; see the module docstring.

    Raises:
        APIError: 404 for an unknown model; 400 naming the field for an unsupported or bad
            value (``dimensions``, ``input`` token ids outside the vocabulary or longer than
            the context, an empty input, ``priority`` under fcfs); 429 / 503 as completions.
    """
    serving.check_request(req)
    try:
        params = PoolingParams(normalize=req.normalize, use_activation=req.use_activation, dimensions=req.dimensions,
                               truncate_prompt_tokens=req.truncate_prompt_tokens)
    except ValueError as exc:
        raise _bad_request(exc) from None
    prompts = serving.truncate(await serving.engine.run_off_loop(_prompts, serving, req), req.truncate_prompt_tokens,
                               pooling=True)
    iterators = await serving._add(prompts, params, "input", req.priority, serving.lora_for(req.model))
    finals = await serving._collect(iterators, raw)
    num_tokens = sum(len(ids) for ids, _ in prompts)
    return JSONResponse({
        "id": f"embd-{uuid.uuid4().hex}",
        "object": "list",
        "created": int(time.time()),
        "model": serving.served_name(req.model),
        "data": [
            {"object": "embedding", "index": i, "embedding": _encode(out.outputs.embedding, req.encoding_format)}
            for i, out in enumerate(finals)
        ],
        "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
    })


def attach_routes(app: FastAPI, serving: OpenAIServing) -> None:
    """Add ``POST /v1/embeddings`` to the server's app."""

    @app.post("/v1/embeddings")
    async def embeddings(req: EmbeddingRequest, raw: Request) -> Response:
        return await create_embedding(serving, req, raw)
