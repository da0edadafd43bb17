"""The app: routes onto each dialect's handlers, the shared answers to a busy or
closing daemon, and the service's life with the app's."""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from aiohttp import web

from specd.daemon.serving.facade import ServiceFacade
from specd.daemon.serving.scheduler import QueueFull
from specd.daemon.serving.served_models import ModelNotLoaded, ModelUnavailable, ServedModels
from specd.daemon.serving.service import Service
from specd.daemon.serving.upstream import UpstreamClient, UpstreamError, UpstreamSpec
from specd.daemon.spec.generation import RequestError
from specd.memory_fit.rss import trim_heap

from ..metrics import RateWindow
from ..security import Access, Handler, cors_on_prepare, error_response, make_middlewares
from ..service_view import LiveRequests
from ..validation import BODY_BYTES, BODY_TIMEOUT, DEFAULT_BODY_TIMEOUT
from . import (
    anthropic_routes,
    embeddings,
    llama_routes,
    ollama_models,
    ollama_requests,
    ollama_routes,
    openai_routes,
    responses_routes,
    status,
)
from .responses_store import RESPONSES, ResponseStore
from .state import (
    LIVE,
    MAX_BODY,
    MEMORY_PLAN,
    PREP,
    PREP_THREADS,
    RATES,
    SERVICE,
    STRICT_MODEL_NAME,
)

# a request with a body this big (a huge text to tokenize, a long prompt) gives the memory
# its preparing freed back to the system before it is answered
TRIM_FROM = 1 << 20


@web.middleware
async def _give_back_memory(request: web.Request, handler: Handler) -> web.StreamResponse:
    response = await handler(request)
    if request.get(BODY_BYTES, 0) >= TRIM_FROM:
        await asyncio.get_running_loop().run_in_executor(request.app[PREP], trim_heap)
    return response


def _busy(handler: Handler) -> Handler:
    """A generating route: a 503 while the daemon closes, its queue is full or the model
    named cannot load, an upstream's failure with its status, in the request's dialect's
    error shape (make_middlewares' `error_shapes`)."""
    async def wrapped(request: web.Request) -> web.StreamResponse:
        if request.app[LIVE].draining:
            return error_response(503, "specd is shutting down", request=request)
        try:
            return await handler(request)
        except (QueueFull, ModelUnavailable) as exc:
            return error_response(503, str(exc), request=request)
        except (RequestError, ModelNotLoaded) as exc:
            return error_response(400, str(exc), request=request)
        except UpstreamError as exc:
            return error_response(exc.status, str(exc), request=request)
        except (ConnectionResetError, asyncio.CancelledError):
            raise
    return wrapped


def create_app(service: Service, *, allowed_origins: set[str] | None = None,
               token: str | None = None, access: Access | None = None,
               max_body: int = 8 << 20, body_timeout: float = DEFAULT_BODY_TIMEOUT,
               memory_plan: dict[str, Any] | None = None,
               strict_model_name: bool = False,
               upstreams: list[UpstreamSpec] | None = None,
               models: ServedModels | None = None) -> web.Application:
    """The API over `service` (and the other local models of `models`, whose first is
    `service`), and the models of `upstreams` forwarded to their servers.
    `access` says who may use TCP (`token` alone: a token every TCP client must send).
    Closing the app (its runner's cleanup) cancels the generations in flight and stops
    the service's scheduler."""
    if access is None:
        access = Access(token=token, require_token=token is not None)
    if models is not None and models.first.service is not service:
        raise ValueError("create_app: the first of `models` must be `service`")
    app = web.Application(client_max_size=max_body, middlewares=[
        _give_back_memory, *make_middlewares(
            allowed_origins=allowed_origins or set(), access=access,
            error_shapes={"/v1/messages": anthropic_routes.error_body,
                          "/api": ollama_requests.error_body})])
    app.on_response_prepare.append(cors_on_prepare(allowed_origins or set()))
    app[SERVICE] = facade = ServiceFacade(service, {u.name: UpstreamClient(u)
                                                    for u in upstreams or []}, models)
    if clash := sorted(set(facade.upstream_names) & facade.served_names):
        raise ValueError(f"--upstream {clash[0]}: the local model answers to that name")
    app[MAX_BODY] = max_body
    app[BODY_TIMEOUT] = body_timeout
    app[MEMORY_PLAN] = memory_plan
    app[STRICT_MODEL_NAME] = strict_model_name
    app[LIVE] = LiveRequests()
    app[RATES] = RateWindow()
    app[RESPONSES] = ResponseStore()
    app[PREP] = ThreadPoolExecutor(PREP_THREADS, thread_name_prefix="specd-prep")
    app.on_startup.append(_load_on_startup)
    app.on_shutdown.append(_cancel_generations)
    app.on_cleanup.append(_stop_service)
    r = app.router
    # status
    r.add_get("/health", status.health)
    r.add_get("/v1/models", status.models)
    r.add_get("/models", status.models)
    r.add_get("/v1/models/{model_id:.+}", status.model)
    r.add_get("/props", status.props)
    r.add_get("/slots", status.slots)
    r.add_get("/metrics", status.metrics)
    # OpenAI's
    r.add_post("/v1/completions", _busy(openai_routes.completions))
    r.add_post("/v1/chat/completions", _busy(openai_routes.chat_completions))
    r.add_post("/chat/completions", _busy(openai_routes.chat_completions))
    r.add_post("/v1/embeddings", _busy(embeddings.embeddings_oai))
    r.add_post("/v1/responses", _busy(responses_routes.responses))
    r.add_post("/responses", _busy(responses_routes.responses))
    r.add_post("/v1/responses/input_tokens", _busy(responses_routes.input_tokens))
    # Anthropic's (its errors in its shape: make_middlewares' error_shapes)
    r.add_post("/v1/messages", _busy(anthropic_routes.messages))
    r.add_post("/v1/messages/count_tokens", _busy(anthropic_routes.count_tokens))
    # llama.cpp's
    r.add_post("/apply-template", _busy(llama_routes.apply_template))
    r.add_post("/chat/completions/input_tokens", _busy(llama_routes.chat_input_tokens))
    r.add_post("/v1/chat/completions/input_tokens", _busy(llama_routes.chat_input_tokens))
    r.add_post("/completion", _busy(llama_routes.completion))
    r.add_post("/completions", _busy(llama_routes.completion))
    r.add_post("/infill", _busy(llama_routes.infill))
    r.add_post("/embeddings", _busy(embeddings.embeddings))
    r.add_post("/embedding", _busy(embeddings.embeddings))
    r.add_post("/models/load", status.load_model)
    r.add_post("/models/unload", status.unload_model)
    r.add_post("/cache/clear", status.clear_cache)
    r.add_post("/tokenize", _busy(llama_routes.tokenize))
    r.add_post("/detokenize", _busy(llama_routes.detokenize))
    # Ollama's
    r.add_post("/api/chat", _busy(ollama_routes.chat))
    r.add_post("/api/generate", _busy(ollama_routes.generate))
    r.add_post("/api/embed", _busy(ollama_models.embed))
    r.add_post("/api/embeddings", _busy(ollama_models.embeddings))
    r.add_get("/api/tags", ollama_models.tags)
    r.add_post("/api/show", _busy(ollama_models.show))
    r.add_get("/api/ps", ollama_models.ps)
    r.add_get("/api/version", ollama_models.version)
    r.add_post("/api/pull", ollama_models.pull)
    return app


async def _cancel_generations(app: web.Application) -> None:
    """Shutdown: every generation in flight ends now; its client gets an error event
    (or a 503), and requests still arriving are refused."""
    app[LIVE].cancel_all()


log = logging.getLogger("specd.http")
STARTUP_LOADS = web.AppKey("startup_loads", list)


async def _load_on_startup(app: web.Application) -> None:
    """Load the models their preset loads at start (load-on-startup), in the
    background: the daemon answers meanwhile."""
    svc = app[SERVICE]

    async def load(name: str) -> None:
        try:
            await svc.local_model_ready(name)
        except (ModelUnavailable, RuntimeError) as exc:
            log.warning("model %s (load-on-startup) could not load: %s", name, exc)

    app[STARTUP_LOADS] = [asyncio.create_task(load(name))
                          for name in svc.startup_model_names()]


async def _stop_service(app: web.Application) -> None:
    """After the last response: the scheduler's worker stops while the event loop still
    runs, so no callback reaches a closed loop."""
    app[PREP].shutdown(wait=False, cancel_futures=True)
    await app[SERVICE].close_upstreams()
    await asyncio.get_running_loop().run_in_executor(None, app[SERVICE].stop)
