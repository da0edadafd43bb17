"""What the protocol layers (ipc/) ask of the service, and all they may ask.

The served model's names and sizes, the request defaults, chat rendering, constraints,
submitting and embedding, the slots and the counters /metrics shows. ipc reads nothing
of the engine or the scheduler but through this, so they can change behind it. A request
naming another local model (`--models`) or an upstream's (`--upstream`) gets that model's
facade (for_model).
"""

from __future__ import annotations

import copy
import math
from collections import Counter
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, cast

import numpy as np
from gguf import LlamaFileType

from specd.daemon.drafters.history import principal_of
from specd.daemon.spec.generation import GenerationParams
from specd.daemon.spec.media import PromptImage
from specd.daemon.spec.stats import SpecStats
from specd.daemon.text.grammar import Grammar
from specd.daemon.text.tokenizer import Tokenizer

from .scheduler import PassCounts, Request, Residency, Scheduler
from .served_models import ServedModels
from .service import Piece, ProgressEvent, Result, Service, TextStream
from .upstream import UpstreamClient

# what a model answers to besides its own names (clients send these for "the model")
GENERIC_NAMES = ("specd", "default")


@dataclass(frozen=True)
class Embeddings:
    """The model that computes embeddings: its tokenizer, context and pooling."""

    tokenizer: Tokenizer
    n_ctx: int
    pooling: str


@dataclass(frozen=True)
class ModelFacts:
    """What model listings (Ollama's /api/tags, /api/show, /api/ps) say of the served
    model: its file, architecture, size and where it runs."""

    arch: str
    parameters: int  # weights, counted in elements
    quantization: str  # llama.cpp's name for the file's type ("Q4_K_M")
    file_bytes: int  # all its files' (the parts of a split model)
    modified: float  # the (first) file's mtime (Unix time)
    resident_bytes: int  # memory the loaded models took (the target's and drafter's)
    device: str  # "cpu" / "cuda:N"
    n_ctx_train: int


@dataclass(frozen=True)
class Counters:
    """The scheduler's counters as /metrics reports them (totals and counts are live)."""

    totals: SpecStats
    passes: PassCounts
    requests_total: int
    requests_failed: int
    queue_length: int
    busy_slots: int
    n_slots: int
    drafter: str | None  # the drafter's name, if the model drafts
    # the history index (drafters/history.py), every identity's together: tokens held,
    # bytes of its arrays, and the most one user's may take (0: --no-history)
    history_tokens: int = 0
    history_bytes: int = 0
    history_bound_bytes: int = 0


class RequestTracker(Protocol):
    """Told of each request a sender submits (to cancel them all at shutdown)."""

    def track(self, req: Request) -> None: ...

    def forget(self, req: Request) -> None: ...


class ServiceFacade:
    """One Service as a protocol layer sees it."""

    def __init__(self, service: Service, upstreams: Mapping[str, UpstreamClient] | None = None,
                 models: ServedModels | None = None):
        self._service = service
        self._upstreams = dict(upstreams or {})
        self._models = models if models is not None else ServedModels(service, (), None)

    def for_sender(self, identity: str, tracker: RequestTracker) -> ServiceFacade:
        """The same service for one sender: its requests stamped with `identity` (a
        slot's cached prompt is reused only within one identity) and told to `tracker`."""
        view = copy.copy(self._service)
        view.scheduler = cast(Scheduler, _StampingScheduler(self._service.scheduler,
                                                            identity, tracker))
        return ServiceFacade(view, self._upstreams, self._models)

    async def for_model(self, name: Any) -> ServiceFacade:
        """The facade of the model a request names (with or without Ollama's ":latest"):
        an upstream's, else a local one's, built and loaded if it is not (any other name,
        or none, is the first local model's, as llama-server serves any name).
        ModelUnavailable where a local model cannot be built or made room for,
        ModelNotLoaded where it is not loaded and models load only when asked to."""
        if isinstance(name, str) and self._upstreams:
            client = self._upstreams.get(name) or self._upstreams.get(
                name.removesuffix(":latest"))
            if client is not None:
                from .upstream_facade import UpstreamFacade  # (it builds on this module)
                return UpstreamFacade(self._service, client, self._models)
        model = (self._models.find(name) if isinstance(name, str) else None) \
            or self._models.first
        if len(self._models.models) == 1:
            return self
        return ServiceFacade(await self._models.ready(model), self._upstreams, self._models)

    def local_models(self) -> list[tuple[str, ServiceFacade | None]]:
        """Each local model's name as listings give it and, where it is built, its facade
        (the first model first; `--models` adds the others, built on their first use)."""
        return [(m.listed_name, None if m.service is None
                 else ServiceFacade(m.service, self._upstreams, self._models))
                for m in self._models.models if not m.hidden]

    def startup_model_names(self) -> list[str]:
        """The models their preset loads when the daemon starts (load-on-startup)."""
        return [m.listed_name for m in self._models.startup_models()]

    def reload_models(self) -> None:
        """Read the preset file again (--models-preset; nothing without one): blocks
        while dropped models finish their requests. ValueError where the file is bad."""
        self._models.reload_presets()

    def local_model(self, name: str) -> tuple[str, ServiceFacade | None] | None:
        """The local model `name` names (this one's names included): its listed name and,
        where it is built, its facade; None where no local model answers to `name`."""
        if name in self.model_names:
            return self.model_name, self
        model = self._models.find(name)
        if model is None:
            return None
        return model.listed_name, None if model.service is None else ServiceFacade(
            model.service, self._upstreams, self._models)

    async def local_model_ready(self, name: str) -> ServiceFacade:
        """The facade of the local model `name` names, loaded (built first, room made for
        it: see for_model), as an explicit load does; KeyError where no local model
        answers to `name`."""
        model = self._models.find(name) or (
            self._models.first if name in self.model_names else None)
        if model is None:
            raise KeyError(name)
        return ServiceFacade(await self._models.ready(model, load=True), self._upstreams,
                             self._models)

    @property
    def loading_rules(self) -> tuple[int, bool]:
        """How many local models load at once (--models-max), and whether a request
        loads the model it names (not --no-models-autoload)."""
        return self._models.max_loaded, self._models.autoload

    @property
    def served_names(self) -> frozenset[str]:
        """Every name a local model answers to (model_names: this model's)."""
        return self.model_names | self._models.names()

    @property
    def upstream_names(self) -> list[str]:
        """The models served by forwarding (`--upstream`)."""
        return sorted(self._upstreams)

    async def close_upstreams(self) -> None:
        for client in self._upstreams.values():
            await client.close()

    # -- the served model -----------------------------------------------------------------
    @property
    def model_name(self) -> str:
        """What responses call the served model."""
        return self._service.engine.model_name

    @property
    def model_names(self) -> frozenset[str]:
        """Every name the served model answers to."""
        engine = self._service.engine
        t = engine.target
        return frozenset({t.name, t.path.name, t.path.stem, engine.cfg.target,
                          *GENERIC_NAMES, *engine.cfg.aliases})

    @property
    def aliases(self) -> list[str]:
        return sorted(set(self._service.engine.cfg.aliases))

    @property
    def tags(self) -> list[str]:
        return sorted(set(self._service.engine.cfg.tags))

    @property
    def model_path(self) -> Path:
        return self._service.engine.target.path

    @property
    def chat_template(self) -> str:
        return self._service.engine.chat_template or ""

    @property
    def reasoning_format(self) -> str:
        """How replies' think tags are read by default (--reasoning-format)."""
        return self._service.engine.cfg.reasoning_format

    @property
    def reasoning_budget(self) -> int:
        """The reasoning's budget in tokens by default (--reasoning-budget; -1: none)."""
        return self._service.engine.cfg.reasoning_budget

    @property
    def reasoning_budget_message(self) -> str:
        """The text forced before the end tag once a budget is spent, by default."""
        return self._service.engine.cfg.reasoning_budget_message

    @property
    def started(self) -> float:
        """When the service started (Unix time)."""
        return self._service.started

    @property
    def takes_images(self) -> bool:
        """Whether its prompts may hold images: a vision projector (--mmproj) encodes
        them into the target's graph taking embeddings."""
        return self._service.engine.reads_image_files

    @property
    def n_ctx(self) -> int:
        return self._service.engine.n_ctx

    @property
    def tokenizer(self) -> Tokenizer:
        return self._service.engine.tokenizer

    @property
    def eog_ids(self) -> set[int]:
        """The tokens that end a generation."""
        return self._service.engine.eog_ids

    @property
    def defaults(self) -> GenerationParams:
        """The settings a request starts from (`specd serve -n / --temp / ...`)."""
        return self._service.engine.cfg.defaults

    @property
    def embeddings(self) -> Embeddings | None:
        """The embedding model, or None where embeddings are off."""
        e = self._service.engine.embedder
        return None if e is None else Embeddings(e.tokenizer, e.n_ctx, e.pooling)

    def describe(self) -> dict[str, Any]:
        """The runtime and the models, as /props and `specd status` show them."""
        return self._service.engine.describe()

    def facts(self) -> ModelFacts:
        """The served model's file, size and place (see ModelFacts)."""
        engine = self._service.engine
        t = engine.target
        st = t.path.stat()
        size = t.gguf.file_bytes  # all parts of a split model
        resident = t.resident_bytes + (engine.draft.resident_bytes if engine.draft else 0)
        return ModelFacts(
            arch=t.gguf.arch,
            parameters=sum(math.prod(x.shape) for x in t.gguf.tensors.values()),
            quantization=_quantization(t.gguf.get("general.file_type"),
                                       [x.type_name for x in t.gguf.tensors.values()
                                        if len(x.shape) == 2]),
            file_bytes=size, modified=st.st_mtime,
            resident_bytes=resident if resident > 0 else size,
            device=engine.runtime.device, n_ctx_train=t.built.hparams.n_ctx_train)

    def residency(self) -> Residency:
        """Whether the model is loaded now, and until when (it unloads once idle for its
        keep-alive)."""
        return self._service.scheduler.residency()

    async def load(self, keep_alive: float | None = None) -> None:
        """Load the model if it is not, kept for `keep_alive` seconds once idle (< 0:
        forever; None: the daemon's --keep-alive); RuntimeError if it cannot load."""
        await self._service.load(keep_alive)

    def unload(self) -> None:
        """Unload the model as soon as nothing runs (at once if nothing does)."""
        self._service.scheduler.set_keep_alive(0)

    def clear_cache(self, identity: str) -> tuple[int, int]:
        """Forget what the sender `identity` (before any cache key) left behind: its
        history and its idle slots' cached prompts; (tokens of history, slots)."""
        return self._service.scheduler.clear_cache(principal_of(identity))

    def digest(self) -> str:
        """The served model file's sha256 (remembered from its load: a lookup)."""
        return self._service.engine.target.gguf.content_hash()

    # -- requests -------------------------------------------------------------------------
    def render_chat(self, messages: list[dict[str, Any]],
                    tools: list[dict[str, Any]] | None = None, **render: Any) -> str:
        """The chat as the model's template writes it (Engine.render_chat)."""
        return self._service.engine.render_chat(messages, tools, **render)

    def chat_tokens(self, messages: list[dict[str, Any]],
                    tools: list[dict[str, Any]] | None = None, **render: Any) -> list[int]:
        """The rendered chat as token ids (Engine.chat_tokens)."""
        return self._service.engine.chat_tokens(messages, tools, **render)

    def image_prompt(self, text: str, images: list[bytes]
                     ) -> tuple[list[int], tuple[PromptImage, ...]]:
        """A prompt's text with a media marker per image, and the images' bytes: its
        tokens and images (Engine.image_prompt: RequestError for a bad image). Runs the
        vision encoder: call it off the event loop."""
        return self._service.engine.image_prompt(text, images)

    async def compile_constraint(self, kind: str, spec: Any, *,
                                 bound_numbers: bool | None = None) -> Grammar:
        return await self._service.compile_constraint(kind, spec, bound_numbers=bound_numbers)

    def check_prompt(self, prompt: list[int]) -> None:
        """RequestError unless the prompt fits the context."""
        self._service.check_prompt(prompt)

    def submit(self, prompt: list[int], params: GenerationParams, **kw: Any) -> TextStream:
        """Queue a request (Service.submit): QueueFull or RequestError before any output;
        cancel the returned Stream to stop it."""
        return self._service.submit(prompt, params, **kw)

    def generate(self, prompt: list[int], params: GenerationParams,
                 **kw: Any) -> AsyncIterator[Piece | ProgressEvent | Result]:
        return self._service.generate(prompt, params, **kw)

    async def embed(self, inputs: list[list[int]], normalize_p: int = 2, *,
                    keep_alive: float | None = None,
                    images: Sequence[Sequence[PromptImage]] = ()) -> list[np.ndarray]:
        return await self._service.embed(inputs, normalize_p, keep_alive=keep_alive,
                                         images=images)

    # -- slots and counters ---------------------------------------------------------------
    @property
    def n_slots(self) -> int:
        return len(self._service.scheduler.slots)

    def slot_info(self) -> list[dict[str, object]]:
        return self._service.scheduler.slot_info()

    def counters(self) -> Counters:
        sch = self._service.scheduler
        engine = self._service.engine
        history = engine.history
        return Counters(totals=sch.totals, passes=sch.counts,
                        requests_total=sch.requests_total,
                        requests_failed=sch.requests_failed, queue_length=sch.queue_length,
                        busy_slots=sum(1 for s in sch.slots if s.request is not None),
                        n_slots=len(sch.slots),
                        drafter=engine.drafter_name, history_tokens=history.n_tokens,
                        history_bytes=history.nbytes,
                        history_bound_bytes=(history.bound_bytes(history.max_tokens)
                                             if engine.cfg.history else 0))

    def stop(self) -> None:
        """Stop the schedulers' workers, every local model's (after the last response)."""
        self._models.stop()


def _quantization(file_type: Any, matrix_types: list[str]) -> str:
    """The file's type as llama.cpp names it ("Q4_K_M"), from general.file_type, else its
    matrices' most common type."""
    try:
        return LlamaFileType(file_type).name.removeprefix("MOSTLY_").removeprefix("ALL_")
    except ValueError:
        common = Counter(matrix_types).most_common(1)
        return common[0][0].upper() if common else "unknown"


class _StampingScheduler:
    """The scheduler, stamping the sender's identity on each request it is given."""

    def __init__(self, scheduler: Scheduler, identity: str, tracker: RequestTracker):
        self._scheduler, self._identity, self._tracker = scheduler, identity, tracker

    def submit(self, req: Request) -> Request:
        req.identity = self._identity
        self._tracker.track(req)
        try:
            return self._scheduler.submit(req)
        except BaseException:
            self._tracker.forget(req)
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self._scheduler, name)
