"""What the app holds for its handlers (the service, live requests, the preparing
threads) and how a handler reaches it."""

from __future__ import annotations

import asyncio
import functools
import importlib.metadata
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from aiohttp import web

from specd.daemon.serving.facade import ServiceFacade
from specd.daemon.serving.service import Result

from ..metrics import RateWindow
from ..security import IDENTITY, cache_identity
from ..service_view import LiveRequests
from ..validation import cache_key

# the llama.cpp build whose server API specd follows (its routes, fields and tests)
LLAMA_CPP_BUILD = 11434


def _fingerprint() -> str:
    """What OpenAI's `system_fingerprint` and llama.cpp's `build_info` say, in
    llama-server's form (`b<build>-<commit>`, which clients read the build number from):
    the llama.cpp build followed, then specd's version (`b11434-specd-0.1.0`)."""
    try:
        version = "specd-" + importlib.metadata.version("specd")
    except importlib.metadata.PackageNotFoundError:
        version = "specd"
    return f"b{LLAMA_CPP_BUILD}-{version}"


SYSTEM_FINGERPRINT = _fingerprint()
SERVICE = web.AppKey("service", ServiceFacade)
MAX_BODY = web.AppKey("max_body", int)
MEMORY_PLAN = web.AppKey("memory_plan", object)
STRICT_MODEL_NAME = web.AppKey("strict_model_name", bool)
LIVE = web.AppKey("live_requests", LiveRequests)
PREP = web.AppKey("prep_executor", ThreadPoolExecutor)
RATES = web.AppKey("metrics_rates", RateWindow)  # /metrics' rate gauges: since the last scrape
PREP_THREADS = 4  # requests prepared (tokenized, rendered) at once, off the event loop
SHUTDOWN_MESSAGE = "specd is shutting down: the generation was cancelled"
T = TypeVar("T")


def service(request: web.Request) -> ServiceFacade:
    return request.app[SERVICE]


async def served(request: web.Request, body: dict[str, Any], *,
                 wake: bool = False) -> ServiceFacade:
    """The service as this request's sender uses it, for the model it names (another
    local model's, built and made room for first, or an upstream's, where it names one;
    ModelUnavailable where that fails): its prompt cache is the sender's own (narrowed
    by the request's `cache_key`), and shutdown can cancel its generation. `wake`: the
    model loaded too, as llama-server's token counting routes wake it."""
    identity = cache_identity(request.get(IDENTITY, ""), cache_key(body))
    model = await service(request).for_model(body.get("model") or body.get("name"))
    if wake and not model.residency().loaded:
        await model.load()
    return model.for_sender(identity, request.app[LIVE])


async def off_loop(request: web.Request, fn: Callable[..., T], *args: Any, **kw: Any) -> T:
    """`fn(*args, **kw)` on a preparing thread: tokenizing or rendering a big request
    must not stall the event loop (every other client's stream, /health)."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(request.app[PREP], functools.partial(fn, *args, **kw))


def shutting_down(request: web.Request, result: Result) -> bool:
    """Whether the daemon's shutdown cancelled this generation."""
    return request.app[LIVE].draining and result.finish_reason == "cancelled"
