"""Ollama's model routes: /api/tags, /api/show, /api/ps and /api/version describe the
served model; /api/embed (and the older /api/embeddings) embed; /api/pull pulls a catalog
model as `specd models pull` does."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np
from aiohttp import web

from specd.daemon.models.catalog import CATALOG
from specd.daemon.models.store import ModelStoreError
from specd.daemon.models.store import pull as pull_model
from specd.daemon.serving.facade import ModelFacts, ServiceFacade
from specd.daemon.text.infill import has_fim

from ..jsonout import json_response
from ..validation import BadRequest, get, json_body
from .embeddings import embed_inputs, embedding_model
from .ollama_requests import keep_alive, served_model, timestamp
from .state import SYSTEM_FINGERPRINT, off_loop, served, service
from .streaming import NDJSON

# the Ollama release whose API these routes follow: clients compare it with the least
# they need (a `think` field, tools, capabilities in /api/show)
OLLAMA_API_VERSION = "0.9.0"
# /api/ps' expires_at for a model that is never unloaded (Ollama's "forever": its
# largest duration, about 292 years, from now)
FOREVER_S = 292 * 365.25 * 86400
_PULLS: set[asyncio.Task[None]] = set()  # pulls run on when their client goes away


def _size(n: int) -> str:
    """A parameter count as Ollama writes it ("123.46K", "494.03M", "1.5B")."""
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.1f}B" if unit == "B" else f"{n / scale:.2f}{unit}"
    return str(n)


def _details(f: ModelFacts) -> dict[str, Any]:
    return {"parent_model": "", "format": "gguf", "family": f.arch, "families": [f.arch],
            "parameter_size": _size(f.parameters), "quantization_level": f.quantization}


def listed_name(svc: ServiceFacade) -> str:
    """The served model as Ollama names a model: with a tag (":latest" where its name
    has none); a request may name it with or without it."""
    name = svc.model_name
    return name if ":" in name else f"{name}:latest"


def _card(svc: ServiceFacade) -> tuple[ModelFacts, dict[str, Any]]:
    """(the facts, the model as /api/tags and /api/ps list it)."""
    f = svc.facts()
    name = listed_name(svc)
    return f, {"name": name, "model": name, "size": f.file_bytes,
               "digest": svc.digest(), "details": _details(f)}


def _bare_card(name: str, family: str, modified: float) -> dict[str, Any]:
    """A model listed by name only: an upstream's (nothing known here of its file), or a
    local model of --models not built yet."""
    listed = name if ":" in name else f"{name}:latest"
    return {"name": listed, "model": listed, "size": 0, "digest": "",
            "modified_at": timestamp(modified),
            "details": {"parent_model": "", "format": "", "family": family,
                        "families": [family], "parameter_size": "",
                        "quantization_level": ""}}


async def tags(request: web.Request) -> web.Response:
    svc = service(request)
    listed: list[dict[str, Any]] = []
    for name, facade in svc.local_models():
        if facade is None:
            listed.append(_bare_card(name, "", svc.started))
        else:
            f, card = await off_loop(request, _card, facade)
            listed.append({**card, "modified_at": timestamp(f.modified)})
    listed += [_bare_card(n, "upstream", svc.started) for n in svc.upstream_names]
    return json_response({"models": listed})


async def ps(request: web.Request) -> web.Response:
    """The loaded models: each local one unless it was unloaded (while idle, or to make
    room for another), with when its keep-alive unloads it."""
    loaded: list[dict[str, Any]] = []
    for _, facade in service(request).local_models():
        residency = None if facade is None else facade.residency()
        if facade is None or residency is None or not residency.loaded \
                or residency.expires_at is None:
            continue
        f, card = await off_loop(request, _card, facade)
        expires = min(residency.expires_at, time.time() + FOREVER_S)
        loaded.append({**card, "size": f.resident_bytes,
                       "size_vram": 0 if f.device == "cpu" else f.resident_bytes,
                       "expires_at": timestamp(expires), "context_length": facade.n_ctx})
    return json_response({"models": loaded})


async def version(request: web.Request) -> web.Response:
    return json_response({"version": OLLAMA_API_VERSION, "specd": SYSTEM_FINGERPRINT})


async def show(request: web.Request) -> web.Response:
    """The model the body names (built and loaded first, where it is one of --models
    no request has named yet)."""
    body = await json_body(request)
    served_model(service(request), body)
    svc = await served(request, body)
    f = await off_loop(request, svc.facts)
    capabilities = ["completion"]
    if "tools" in svc.chat_template:  # the template writes the tools it is given
        capabilities.append("tools")
    if has_fim(svc.tokenizer):  # /api/generate's suffix
        capabilities.append("insert")
    if svc.embeddings is not None:
        capabilities.append("embedding")
    if svc.takes_images:  # a vision projector (--mmproj): Ollama's name for it
        capabilities.append("vision")
    d = svc.defaults
    s = d.sampling
    # the request defaults, as a Modelfile's PARAMETER lines
    parameters = "\n".join(f"{k} {v}" for k, v in (
        ("num_ctx", svc.n_ctx), ("temperature", s.temperature), ("top_k", s.top_k),
        ("top_p", s.top_p), ("min_p", s.min_p), ("repeat_penalty", s.repeat_penalty),
        ("num_predict", d.max_tokens)))
    return json_response({
        "modelfile": "", "parameters": parameters, "template": svc.chat_template,
        "details": _details(f), "capabilities": capabilities,
        "modified_at": timestamp(f.modified),
        # the context this daemon serves, which may be less than the model was trained on
        "model_info": {"general.architecture": f.arch, "general.basename": svc.model_name,
                       "general.parameter_count": f.parameters,
                       f"{f.arch}.context_length": svc.n_ctx}})


# -- embeddings ---------------------------------------------------------------------------
async def embed(request: web.Request) -> web.Response:
    """/api/embed: each input's pooled vector, unit length (`dimensions`: its first ones,
    made unit length again); the model kept loaded for the request's `keep_alive`."""
    body = await json_body(request)
    svc = await served(request, body)
    name = served_model(svc, body)
    alive = keep_alive(body)
    emb = embedding_model(svc, status=400)
    if emb.pooling == "none":
        raise BadRequest("pooling 'none' gives a vector per token, which /api/embed cannot "
                         "return", param="input")
    if "input" not in body:
        raise BadRequest("'input' is required", param="input")
    dims = get(body, "dimensions", int, None, lo=1)
    t0 = time.perf_counter()
    inputs, vectors = await embed_inputs(request, svc, emb, body["input"], "input",
                                         truncate=get(body, "truncate", bool, True),
                                         keep_alive=alive)
    out = []
    for v in vectors:
        v = np.asarray(v, dtype=np.float32)[:dims]
        norm = float(np.linalg.norm(v))
        out.append((v / norm if dims and norm > 0 else v).tolist())
    return json_response({"model": name, "embeddings": out,
                          "total_duration": int((time.perf_counter() - t0) * 1e9),
                          "load_duration": 0,
                          "prompt_eval_count": sum(len(t) for t in inputs)})


async def embeddings(request: web.Request) -> web.Response:
    """/api/embeddings, the older route: one prompt's vector, not normalized; the model
    kept loaded for the request's `keep_alive`."""
    body = await json_body(request)
    svc = await served(request, body)
    served_model(svc, body)
    alive = keep_alive(body)
    emb = embedding_model(svc, status=400)
    prompt = get(body, "prompt", str, "")
    if not prompt:
        return json_response({"embedding": []})
    _, vectors = await embed_inputs(request, svc, emb, prompt, "prompt", normalize=-1,
                                    truncate=True, keep_alive=alive)
    return json_response({"embedding": np.asarray(vectors[0], dtype=np.float32).tolist()})


# -- pulling ------------------------------------------------------------------------------
async def pull(request: web.Request) -> web.StreamResponse:
    """/api/pull for a model of specd's catalog: `specd models pull NAME`'s download,
    run off the event loop, its progress as Ollama's status lines. The daemon goes on
    serving the model it serves; the one pulled is served by `specd serve NAME`."""
    body = await json_body(request)
    asked = body.get("model") or body.get("name")
    if not isinstance(asked, str) or not asked:
        raise BadRequest("model is required", param="model")
    name = asked.removesuffix(":latest")
    entry = CATALOG.get(name)
    if entry is None:
        raise BadRequest(f"model '{asked}' not found in specd's catalog (`specd models "
                         "list` names its models)", status=404, param="model")
    digest = {"digest": f"sha256:{entry.sha256}"}
    loop = asyncio.get_running_loop()
    if not get(body, "stream", bool, True):
        try:
            await loop.run_in_executor(None, pull_model, name)
        except ModelStoreError as exc:
            raise BadRequest(str(exc), status=500) from None
        return json_response({"status": "success"})
    events: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()

    def progress(done: int, total: int, label: str) -> None:
        line = {"status": f"pulling {entry.sha256[:12]}", **digest, "total": total,
                "completed": done}
        loop.call_soon_threadsafe(events.put_nowait, line)

    async def run() -> None:
        try:
            await loop.run_in_executor(None, lambda: pull_model(name, progress=progress))
            for status in ("verifying sha256 digest", "writing manifest", "success"):
                events.put_nowait({"status": status})
        except ModelStoreError as exc:
            events.put_nowait(NDJSON.error(str(exc), 500))
        finally:
            events.put_nowait(None)

    resp = await NDJSON.start(request)
    await NDJSON.send(resp, [{"status": "pulling manifest"}])
    task = asyncio.create_task(run())
    _PULLS.add(task)
    task.add_done_callback(_PULLS.discard)
    while (line := await events.get()) is not None:
        await NDJSON.send(resp, [line])
    await task
    await resp.write_eof()
    return resp
