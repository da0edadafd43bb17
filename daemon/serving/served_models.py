"""The local models a daemon serves by name: the one it starts with, those of `--models`
and the store's, each built into a Service of its own (engine, scheduler, slots) on the
first request that names it.

At most `max_loaded` of them are loaded at once: before one loads, the one used longest
ago unloads (once its running requests finish), so their memory plans never overlap.
A built model that unloaded (this, or its keep-alive) reloads from the graph cache on its
next request, as the one model does today.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from .service import Service

log = logging.getLogger("specd.serving")

# how long a request waits for another model's generations to end so that it unloads
RELEASE_WAIT_S = 600.0


class ModelUnavailable(RuntimeError):
    """A model named by a request could not be built or made room for."""


@dataclass
class ServedModel:
    """One local model: the name it is given by (a catalog name or a GGUF path) and,
    once built, its Service."""

    ref: str
    service: Service | None = None
    last_used: float = field(default_factory=time.monotonic)
    building: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def listed_name(self) -> str:
        """What listings call it: the target's name once built, else the name given."""
        if self.service is not None:
            return self.service.engine.model_name
        return Path(self.ref).name.removesuffix(".gguf")

    def answers_to(self) -> frozenset[str]:
        """The names a request may give it by (before it is built: the ref, and a path's
        file name and stem; once built, the target's own names too)."""
        file = Path(self.ref).name
        names = {self.ref, file, file.removesuffix(".gguf")}
        if self.service is not None:
            engine = self.service.engine
            t = engine.target
            names |= {t.name, t.path.name, t.path.stem, *engine.cfg.aliases}
        return frozenset(names)

    @property
    def loaded(self) -> bool:
        return self.service is not None and self.service.engine.loaded


class ServedModels:
    """The daemon's local models (see the module's docstring). `build(ref)` makes a
    model's Service (its memory plan fitted to what is free then); it runs on a thread."""

    def __init__(self, first: Service, others: Iterable[str],
                 build: Callable[[str], Service] | None, max_loaded: int = 1):
        if max_loaded < 1:
            raise ValueError("--models-max: at least 1")
        self.first = ServedModel(first.engine.cfg.target, first)
        self.models = [self.first, *(ServedModel(ref) for ref in others)]
        self._build = build
        self.max_loaded = max_loaded
        seen: dict[str, str] = {}
        for m in self.models:
            for name in m.answers_to():
                if seen.setdefault(name, m.ref) != m.ref:
                    raise ValueError(f"--models: {name!r} names both {seen[name]} and {m.ref}")
        if len(self.models) > 1 and build is None:
            raise ValueError("more than one model and nothing to build them with")

    def add_missing(self, refs: Iterable[str]) -> None:
        """Serve `refs` too, but those a model already answers to."""
        for ref in refs:
            if self.find(ref) is None:
                self.models.append(ServedModel(ref))

    def find(self, name: str) -> ServedModel | None:
        """The model `name` (with or without Ollama's ":latest") names, if one does."""
        for candidate in (name, name.removesuffix(":latest")):
            for m in self.models:
                if candidate in m.answers_to():
                    return m
        return None

    def names(self) -> frozenset[str]:
        """Every name any of the models answers to."""
        return frozenset().union(*(m.answers_to() for m in self.models))

    def built(self) -> list[Service]:
        return [m.service for m in self.models if m.service is not None]

    async def ready(self, model: ServedModel) -> Service:
        """`model`'s Service, built if it is not yet, after making room for it to load;
        ModelUnavailable saying why it cannot be."""
        model.last_used = time.monotonic()
        async with model.building:
            if not model.loaded:
                await self._make_room(model)
            if model.service is None:
                assert self._build is not None
                log.info("building model %s for its first request", model.ref)
                try:
                    model.service = await asyncio.to_thread(self._build, model.ref)
                except Exception as exc:  # a missing file, a plan that does not fit, ...
                    log.exception("model %s could not be built", model.ref)
                    raise ModelUnavailable(
                        f"model {model.ref!r} could not be loaded: {exc}") from None
        return model.service

    async def _make_room(self, model: ServedModel) -> None:
        """Unload the models used longest ago until `model` may load beside the rest."""
        while True:
            others = [m for m in self.models if m is not model and m.loaded]
            if len(others) < self.max_loaded:
                return
            oldest = min(others, key=lambda m: m.last_used)
            assert oldest.service is not None
            log.info("unloading %s to make room for %s (--models-max %d)",
                     oldest.listed_name, model.listed_name, self.max_loaded)
            scheduler = oldest.service.scheduler
            if not await asyncio.to_thread(scheduler.release, RELEASE_WAIT_S):
                raise ModelUnavailable(
                    f"model {model.listed_name!r} cannot load: {oldest.listed_name!r} is "
                    f"still busy and at most {self.max_loaded} model(s) load at once "
                    "(--models-max)")

    def stop(self) -> None:
        """Stop every built model's scheduler."""
        for service in self.built():
            service.scheduler.stop()
