"""What the daemon serves and how it runs: /health, /v1/models, /props, /slots, /metrics;
llama-server's router routes that load and unload it, /models/load and /models/unload;
and /cache/clear, which forgets what the caller's requests left behind."""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from specd.daemon.serving.facade import ServiceFacade
from specd.daemon.serving.served_models import ModelUnavailable

from ..jsonout import json_response
from ..metrics import render_metrics
from ..security import IDENTITY
from ..validation import BadRequest, get, json_body
from .parsing import known_model
from .reporting import generation_settings
from .state import MEMORY_PLAN, RATES, SYSTEM_FINGERPRINT, service


async def health(request: web.Request) -> web.Response:
    return json_response({"status": "ok"})


def _model_card(svc: ServiceFacade) -> dict[str, Any]:
    """A built local model; its status, loaded or unloaded while idle, as llama-server's
    router lists a model's, and the modalities it takes and gives."""
    loaded = svc.residency().loaded
    return {"id": svc.model_name, "aliases": svc.aliases, "tags": svc.tags,
            "object": "model", "created": int(svc.started), "owned_by": "specd",
            "status": {"value": "loaded" if loaded else "unloaded"},
            "architecture": {
                "input_modalities": ["text", "image"] if svc.takes_images else ["text"],
                "output_modalities": ["text"]}}


def _capability_entry(name: str, takes_images: bool) -> dict[str, Any]:
    """A model as llama-server's `models` array lists it beside `data` (its fields, the
    ones it leaves empty empty too): "completion", and "multimodal" where a vision
    projector is loaded."""
    return {"name": name, "model": name, "modified_at": "", "size": "", "digest": "",
            "type": "model", "description": "", "tags": [""],
            "capabilities": ["completion", "multimodal"] if takes_images else ["completion"],
            "parameters": "",
            "details": {"parent_model": "", "format": "gguf", "family": "",
                        "families": [""], "parameter_size": "", "quantization_level": ""}}


def _unbuilt_card(svc: ServiceFacade, name: str) -> dict[str, Any]:
    """A local model of `--models` no request has named yet (it loads on the first)."""
    return {"id": name, "aliases": [], "tags": [], "object": "model",
            "created": int(svc.started), "owned_by": "specd",
            "status": {"value": "unloaded"}}


def _upstream_card(svc: ServiceFacade, name: str) -> dict[str, Any]:
    """A model served by forwarding (`--upstream`; its address is not told)."""
    return {"id": name, "aliases": [], "tags": ["upstream"], "object": "model",
            "created": int(svc.started), "owned_by": "upstream"}


def _local_card(svc: ServiceFacade, name: str, facade: ServiceFacade | None) -> dict[str, Any]:
    return _unbuilt_card(svc, name) if facade is None else _model_card(facade)


async def models(request: web.Request) -> web.Response:
    """GET /v1/models and /models: OpenAI's `data` (llama-server's router's cards) and
    llama-server's `models` (each model's capabilities); `?reload=1` reads the preset
    file again first (llama-server's router), a 500 naming the file's error where it is
    bad."""
    svc = service(request)
    if request.query.get("reload"):
        try:
            await asyncio.to_thread(svc.reload_models)
        except ValueError as exc:
            raise BadRequest(f"the models preset could not be read: {exc}",
                             status=500) from None
    local = svc.local_models()
    # a model not built yet is listed without "multimodal": its projector is not read
    # until it is built
    return json_response({
        "models": [*(_capability_entry(n, f is not None and f.takes_images)
                     for n, f in local),
                   *(_capability_entry(n, False) for n in svc.upstream_names)],
        "object": "list",
        "data": [*(_local_card(svc, n, f) for n, f in local),
                 *(_upstream_card(svc, n) for n in svc.upstream_names)]})


async def model(request: web.Request) -> web.Response:
    """GET /v1/models/{id}: a local model under any name it answers to, or an
    upstream's, else a 404 (a lookup says what is there, whatever a completion request
    would accept)."""
    svc = service(request)
    name = request.match_info["model_id"]
    if name in svc.upstream_names:
        return json_response(_upstream_card(svc, name))
    known_model(svc, name)
    found = svc.local_model(name)
    assert found is not None  # (known_model: a local model answers to it)
    return json_response(_local_card(svc, *found))


async def _named_local_model(request: web.Request, *, build: bool) -> ServiceFacade | None:
    """The local model the body's `model` names (none or "": the first), as
    llama-server's router routes take it, built and made room for where `build` (else
    None where it is not built); an upstream's is not this daemon's to load."""
    svc = service(request)
    body = await json_body(request)
    name = get(body, "model", str, "") or svc.model_name
    if name in svc.upstream_names:
        raise BadRequest(f"model {name!r} is served by an upstream server (--upstream): it "
                         "is loaded and unloaded there")
    known_model(svc, name)
    if not build:
        found = svc.local_model(name)
        return None if found is None else found[1]
    try:
        return await svc.local_model_ready(name)
    except ModelUnavailable as exc:
        raise BadRequest(str(exc), status=503) from None


async def load_model(request: web.Request) -> web.Response:
    """POST /models/load: load the model now (kept for the daemon's --keep-alive once
    idle); a 400 where it is loaded already, as llama-server's router answers."""
    built = await _named_local_model(request, build=False)
    if built is not None and built.residency().loaded:
        raise BadRequest("model is already running")
    loaded = await _named_local_model(request, build=True)
    assert loaded is not None
    try:
        await loaded.load()
    except RuntimeError as exc:
        raise BadRequest(f"the model could not load: {exc}", status=500) from None
    return json_response({"success": True})


async def unload_model(request: web.Request) -> web.Response:
    """POST /models/unload: unload the model as soon as nothing runs (at once where
    nothing does); a 400 where it is not loaded."""
    svc = await _named_local_model(request, build=False)
    if svc is None or not svc.residency().loaded:
        raise BadRequest("model is not running")
    svc.unload()
    return json_response({"success": True})


async def clear_cache(request: web.Request) -> web.Response:
    """POST /cache/clear (`specd cache clear`): forget the caller's history (every cache
    key of theirs) and the prompts idle slots cache for them; another user's stay."""
    history, slots = service(request).clear_cache(request.get(IDENTITY, ""))
    return json_response({"success": True, "history_tokens": history, "slots": slots})


async def props(request: web.Request) -> web.Response:
    """GET /props: the first model's, with llama-server's router fields where several are
    served; there `?model=NAME` answers NAME's own props (as the router's child for it
    would), loading it unless models load only when asked (`?autoload=` overrides)."""
    svc = service(request)
    name = request.query.get("model", "")
    router = len(svc.local_models()) > 1  # llama-server's router: several models by name
    if name and router:
        return json_response(_props_of(request, await _props_model(request, svc, name)))
    info = _props_of(request, svc)
    if router:
        most, autoload = svc.loading_rules
        info.update({"role": "router", "max_instances": most, "models_autoload": autoload})
    return json_response(info)


async def _props_model(request: web.Request, svc: ServiceFacade, name: str) -> ServiceFacade:
    """The local model /props?model= names, as llama-server's router validates it: a 400
    where no model answers to `name` or where it is not loaded and may not be loaded."""
    if name in svc.upstream_names:
        raise BadRequest(f"model {name!r} is served by an upstream server (--upstream): "
                         "ask it for its props")
    found = svc.local_model(name)
    if found is None:
        raise BadRequest(f"model '{name}' not found")
    query = request.query.get("autoload", "")
    autoload = query in ("true", "1") if query else svc.loading_rules[1]
    if not autoload:
        if found[1] is None or not found[1].residency().loaded:
            raise BadRequest("model is not loaded")
        return found[1]
    try:
        return await svc.local_model_ready(name)
    except ModelUnavailable as exc:
        raise BadRequest(str(exc), status=503) from None


def _props_of(request: web.Request, svc: ServiceFacade) -> dict[str, Any]:
    """One model's props, as llama-server reports them (and specd's own fields)."""
    info = svc.describe()
    d = svc.defaults
    tok = svc.tokenizer
    info.update({"total_slots": svc.n_slots, "n_ctx": svc.n_ctx,
                 # unloaded after --keep-alive idle (llama-server's sleeping)
                 "is_sleeping": not info["loaded"],
                 "memory_plan": request.app.get(MEMORY_PLAN),
                 # llama-server's: the model's path and name, its template and tokens
                 "model_path": str(svc.model_path),
                 "model_alias": svc.model_name,
                 "chat_template": svc.chat_template,
                 "bos_token": "" if tok.bos_id is None else tok.token_text(tok.bos_id),
                 "eos_token": "" if tok.eos_id is None else tok.token_text(tok.eos_id),
                 "modalities": {"vision": svc.takes_images, "video": False, "audio": False},
                 "build_info": SYSTEM_FINGERPRINT,
                 "default_generation_settings": {
                     "n_ctx": svc.n_ctx, "params": generation_settings(svc, d),
                     "n_predict": d.max_tokens, "speculative.n_max": d.draft.n_max,
                     "speculative.n_min": d.draft.n_min, "speculative.p_min": d.draft.p_min}})
    return info


async def slots(request: web.Request) -> web.Response:
    return json_response(service(request).slot_info())


async def metrics(request: web.Request) -> web.Response:
    svc = service(request)
    # llama-server's header: scrapers tell a restart from a counter reset by it
    return web.Response(text=render_metrics(svc, request.app[RATES]), content_type="text/plain",
                        charset="utf-8",
                        headers={"Process-Start-Time-Unix": str(int(svc.started))})
