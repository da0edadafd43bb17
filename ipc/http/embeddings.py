"""Embeddings: OpenAI's /v1/embeddings (one pooled vector per input) and llama.cpp's
/embeddings (each input's vectors: one pooled, or one per token), over the inputs'
embedding every dialect shares (`embed_inputs`). An input may hold images, as
llama-server takes them: {prompt_string, multimodal_data} or {"content": [OpenAI parts
with image_url]} (media_inputs.media_prompt); the target's vision projector encodes
them and their rows go through the model as a completion's do."""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
from aiohttp import web

from specd.daemon.serving.facade import Embeddings, ServiceFacade
from specd.daemon.spec.media import PromptImage
from specd.daemon.text.tokenizer import Tokenizer

from ..jsonout import json_response
from ..security import IDENTITY, is_own_user
from ..validation import BadRequest, get, json_body
from .media_inputs import image_prompt, media_prompt
from .parsing import check_model, check_prompt_bytes, prompt_item_tokens, prompt_items
from .state import off_loop, served

Prompt = tuple[list[int], tuple[PromptImage, ...]]  # an input's tokens and its images


async def embeddings_oai(request: web.Request) -> web.StreamResponse:
    return await _embed(request, openai=True)


async def embeddings(request: web.Request) -> web.StreamResponse:
    return await _embed(request, openai=False)


def embedding_model(svc: ServiceFacade, status: int = 501) -> Embeddings:
    """The model that embeds; where embeddings are off, an error (`status`) naming the
    option that turns them on."""
    emb = svc.embeddings
    if emb is None:
        raise BadRequest("this daemon does not compute embeddings: start it with "
                         "--embeddings", status=status, code="not_supported")
    return emb


async def embed_inputs(request: web.Request, svc: ServiceFacade, emb: Embeddings, value: Any,
                       field: str, *, normalize: int = 2, truncate: bool = False,
                       keep_alive: float | None = None
                       ) -> tuple[list[list[int]], list[np.ndarray]]:
    """(each input's tokens, its vectors) for `value` (`prompt_items`' forms, images
    among them: `read_inputs`). An input longer than the context is a 400, or with
    `truncate` (text only) cut to what it holds; the model stays loaded for
    `keep_alive` once idle after it (None: the daemon's --keep-alive)."""
    read = await off_loop(request, read_inputs, svc, value, field, emb.tokenizer,
                          is_own_user(request.get(IDENTITY, "")))
    inputs = [tokens for tokens, _ in read]
    room = emb.n_ctx - 1
    for i, (tokens, held) in enumerate(read):
        if len(tokens) > room:
            if not truncate or held:
                raise BadRequest(f"input is too large to process: {len(tokens)} tokens, the "
                                 f"context holds {room}", param=field)
            inputs[i] = tokens[:room]
    images = [ims for _, ims in read] if any(ims for _, ims in read) else []
    return inputs, await svc.embed(inputs, normalize, keep_alive=keep_alive, images=images)


def read_inputs(svc: ServiceFacade, value: Any, field: str, tok: Tokenizer,
                own_user: bool) -> list[Prompt]:
    """Each input's tokens and images: a text input tokenized by `tok` (an empty one:
    its start alone, as llama.cpp embeds the BOS it adds), one holding images
    (media_prompt) made a prompt by the target's vision projector (a 400 for a model
    without one). Runs the encoder: off the event loop."""
    start = [tok.bos_id if tok.bos_id is not None else (tok.eos_id or 0)]
    out: list[Prompt] = []
    for item in prompt_items(value, field):
        media = media_prompt(svc, item, field, own_user=own_user)
        if media is None:
            out.append((prompt_item_tokens(svc, item, field, tok) or start, ()))
        else:
            check_prompt_bytes(svc, media[0], field)
            out.append(image_prompt(svc, *media, field))
    return out


async def _embed(request: web.Request, *, openai: bool) -> web.Response:
    body = await json_body(request)
    svc = await served(request, body)
    emb = embedding_model(svc)
    if openai:
        check_model(request, body)
        if emb.pooling == "none":
            raise BadRequest("pooling 'none' gives a vector per token, which "
                             "/v1/embeddings cannot return (use /embeddings)", param="input")
    fmt = get(body, "encoding_format", str, "float")
    if fmt not in ("float", "base64"):
        raise BadRequest(f"'encoding_format' must be 'float' or 'base64', got {fmt!r}",
                         param="encoding_format")
    field = "input" if "input" in body or openai else "content"
    if field not in body:
        raise BadRequest(f"'{field}' is required", param=field)
    inputs, vectors = await embed_inputs(request, svc, emb, body[field], field,
                                         normalize=get(body, "embd_normalize", int, 2, lo=-1))

    def encoded(v: np.ndarray) -> Any:
        if fmt == "base64":  # as OpenAI sends it: float32, little-endian
            return base64.b64encode(np.asarray(v, dtype="<f4").tobytes()).decode("ascii")
        return np.asarray(v, dtype=np.float32).tolist()

    if not openai:  # llama.cpp's: each input's vectors (one, pooled; or one per token)
        return json_response([{"index": i, "embedding": encoded(np.atleast_2d(v))}
                              for i, v in enumerate(vectors)])
    n = sum(len(t) for t in inputs)
    return json_response({
        "model": svc.model_name, "object": "list",
        "data": [{"object": "embedding", "index": i, "embedding": encoded(v)}
                 for i, v in enumerate(vectors)],
        "usage": {"prompt_tokens": n, "total_tokens": n}})
