"""The local models a daemon serves by name: the one it starts with, those of `--models`
and the store's, each built into a Service of its own (engine, scheduler, slots) on the
first request that names it.

At most `max_loaded` of them are loaded at once: loads happen one at a time, in the
order asked, and before one loads, the one used longest ago unloads (once its running
requests finish), so their memory plans never overlap. A built model that unloaded (this,
or its keep-alive) reloads from the graph cache when next asked for. With `autoload`
off, only an explicit load (/models/load) loads a model; a request for one that is not
loaded is refused.

Models of a preset file (llama-server's `--models-preset`, read by the CLI) are served by
their section's name, with the options the file gives them; reading the file again
(`GET /models?reload=1`) drops the models gone from it and those whose options changed
(once their requests end: the next request builds them anew) and adds the new ones.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from .service import Service

log = logging.getLogger("specd.serving")

# how long a request waits for another model's generations to end so that it unloads
RELEASE_WAIT_S = 600.0


class ModelUnavailable(RuntimeError):
    """A model named by a request could not be built or made room for."""


class ModelNotLoaded(RuntimeError):
    """A request named a model that is not loaded, and models load only when asked to
    (autoload off)."""


@dataclass(frozen=True)
class ModelPreset:
    """One model of a preset file: served by `name` (and `aliases`); its model `model`
    (`by_name`: a name the daemon's models answer to, as llama-server finds an hf-repo in
    its cache, else taken as a GGUF path or catalog name; None: the model already served
    by `name`), its draft `draft` likewise; `flags`, the `specd serve` flags it is built
    with; `dedup`: the served models it names are listed under this name only;
    `load_on_startup`: loaded when the daemon starts."""

    name: str
    model: str | None = None
    by_name: bool = False
    draft: str | None = None
    draft_by_name: bool = False
    aliases: tuple[str, ...] = ()
    flags: tuple[str, ...] = ()
    dedup: bool = False
    load_on_startup: bool = False


@dataclass
class ServedModel:
    """One local model: the name it is given by (a catalog name or a GGUF path, and the
    alias of `--models ALIAS=MODEL`) and, once built, its Service."""

    ref: str
    alias: str | None = None
    service: Service | None = None
    last_used: float = field(default_factory=time.monotonic)
    preset: ModelPreset | None = None  # the preset section giving its options
    from_preset: bool = False  # made by a preset section (named by it), not --models
    draft: str | None = None  # its preset's draft, resolved as its model is
    hidden: bool = False  # left out of listings (a preset's dedup-cache-models)

    @classmethod
    def parse(cls, spec: str) -> ServedModel:
        """`MODEL` or `ALIAS=MODEL`."""
        alias, sep, ref = spec.partition("=")
        if not sep:
            return cls(spec)
        if not alias.strip() or not ref.strip():
            raise ValueError(f"--models {spec!r}: expected MODEL or ALIAS=MODEL")
        return cls(ref.strip(), alias.strip())

    @property
    def listed_name(self) -> str:
        """What listings call it: its alias, else the target's name once built, else the
        name given."""
        if self.alias is not None:
            return self.alias
        if self.service is not None:
            return self.service.engine.model_name
        return Path(self.ref).name.removesuffix(".gguf")

    def answers_to(self) -> frozenset[str]:
        """The names a request may give it by (before it is built: the ref, and a path's
        file name and stem; once built, the target's own names too)."""
        if self.from_preset:  # its section's name; its model may be served besides
            assert self.alias is not None and self.preset is not None
            return frozenset({self.alias, *self.preset.aliases})
        file = Path(self.ref).name
        names = {self.ref, file, file.removesuffix(".gguf")}
        if self.alias is not None:
            names.add(self.alias)
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
                 build: Callable[[ServedModel], Service] | None, max_loaded: int = 1,
                 autoload: bool = True):
        if max_loaded < 1:
            raise ValueError("--models-max: at least 1")
        self.first = ServedModel(first.engine.cfg.target, service=first)
        self.models = [self.first, *(ServedModel.parse(spec) for spec in others)]
        self._build = build
        self.max_loaded = max_loaded
        self.autoload = autoload
        self._loading = asyncio.Lock()  # requests waiting for a load, first come first served
        self._room = threading.Lock()  # held by the one engine loading (room_for)
        self._read_presets: Callable[[], list[ModelPreset]] | None = None
        self._presets_lock = threading.Lock()  # one reading of the preset file at a time
        _check_names(self.models)
        if len(self.models) > 1 and build is None:
            raise ValueError("more than one model and nothing to build them with")
        self._gate(self.first, first)

    def use_presets(self, read: Callable[[], list[ModelPreset]]) -> None:
        """Serve the models `read` gives (a preset file's), now and at each reload."""
        self._read_presets = read
        self._apply_presets(read())

    def reload_presets(self) -> None:
        """Read the preset file again (see the module's docstring); runs on a thread, as
        it waits for the requests of the models it drops. ValueError where the file is
        bad (nothing changes then)."""
        if self._read_presets is not None:
            self._apply_presets(self._read_presets())

    def startup_models(self) -> list[ServedModel]:
        """The models their preset loads when the daemon starts (load-on-startup)."""
        return [m for m in self.models if m.preset is not None and m.preset.load_on_startup]

    def _apply_presets(self, presets: list[ModelPreset]) -> None:
        """Serve `presets`' models in place of the earlier ones (see reload_presets). A
        section naming a model served already (its name, and no other model) gives that
        model its options, as llama-server's preset for a model of its cache does."""
        with self._presets_lock:
            wanted = {p.name: p for p in presets}
            keep = [m for m in self.models if not m.from_preset
                    or wanted.get(m.alias or "") == m.preset]
            base = [m for m in keep if not m.from_preset]
            made: list[ServedModel] = []
            attached: dict[int, tuple[ModelPreset, str | None]] = {}
            for p in presets:
                same = next((m for m in keep if m.from_preset and m.preset == p), None)
                if same is not None:
                    made.append(same)
                    continue
                draft = None if p.draft is None else self._resolve(base, p.draft,
                                                                   p.draft_by_name)
                served = _find_in(base, p.name)
                if served is not None and (p.model is None or served.ref == self._resolve(
                        base, p.model, p.by_name)):
                    attached[id(served)] = (p, draft)
                    if served.service is not None:
                        log.warning("preset [%s]: %s is built already: its options apply "
                                    "once the daemon restarts", p.name, served.listed_name)
                    continue
                if p.model is None:
                    raise ValueError(f"preset [{p.name}]: no model (model or hf-repo) and "
                                     "no served model of that name")
                made.append(ServedModel(self._resolve(base, p.model, p.by_name), p.name,
                                        preset=p, from_preset=True, draft=draft))
            hidden = {id(m) for p in presets if p.dedup
                      for ref, by_name in ((p.model, p.by_name), (p.draft, p.draft_by_name))
                      if ref is not None and by_name
                      for m in [_find_in(base, ref)] if m is not None}
            gone = [m for m in self.models if m.from_preset and m not in made]
            _check_names([*base, *made])
            for m in gone:
                self._retire(m)
            for m in base:
                m.preset, m.draft = attached.get(id(m), (None, None))
                m.hidden = id(m) in hidden
            self.models = [*base, *made]

    @staticmethod
    def _resolve(base: list[ServedModel], ref: str, by_name: bool) -> str:
        """What a preset's model or draft names: a served model's ref where `by_name` and
        one answers to it, else `ref` itself (a GGUF path or catalog name)."""
        found = _find_in(base, ref) if by_name else None
        return ref if found is None else found.ref

    def _retire(self, model: ServedModel) -> None:
        """Stop serving `model` (a preset's, dropped or changed): unloaded once its
        requests end."""
        log.info("preset model %s dropped (preset file read again)", model.listed_name)
        if model.service is not None:
            if model.service.scheduler.release(RELEASE_WAIT_S):
                model.service.scheduler.stop()
            else:
                log.warning("preset model %s still busy: left running until its requests "
                            "end", model.listed_name)

    def add_missing(self, refs: Iterable[str]) -> None:
        """Serve `refs` too, but those a model already answers to."""
        for ref in refs:
            if self.find(ref) is None:
                self.models.append(ServedModel(ref))

    def find(self, name: str) -> ServedModel | None:
        """The model `name` (with or without Ollama's ":latest") names, if one does."""
        return _find_in(self.models, name)

    def names(self) -> frozenset[str]:
        """Every name any of the models answers to."""
        return frozenset().union(*(m.answers_to() for m in self.models))

    def built(self) -> list[Service]:
        return [m.service for m in self.models if m.service is not None]

    async def ready(self, model: ServedModel, *, load: bool = False) -> Service:
        """`model`'s Service, loaded (built first where it is not yet), after making room
        for it; ModelUnavailable saying why it cannot be, ModelNotLoaded where it is not
        loaded and only `load` (an explicit load) may load it (autoload off)."""
        model.last_used = time.monotonic()
        if model.loaded:
            assert model.service is not None
            return model.service
        if not (load or self.autoload):
            raise ModelNotLoaded(f"model {model.listed_name!r} is not loaded; load it first "
                                 "(POST /models/load; models load only so here)")
        async with self._loading:  # waiters in the order they came
            if model.service is None:
                model.service = await asyncio.to_thread(self._build_in_room, model)
            elif not model.loaded:
                try:  # its scheduler's worker loads it, through the gate (room_for)
                    await model.service.load()
                except RuntimeError as exc:
                    raise ModelUnavailable(f"model {model.listed_name!r} could not be "
                                           f"loaded: {exc}") from None
        return model.service

    def _build_in_room(self, model: ServedModel) -> Service:
        """Build `model` (which loads it) once there is room, and gate its later loads."""
        assert self._build is not None
        with self.room_for(model):
            log.info("building model %s for its first request", model.ref)
            try:
                service = self._build(model)
            except Exception as exc:  # a missing file, a plan that does not fit, ...
                log.exception("model %s could not be built", model.ref)
                raise ModelUnavailable(
                    f"model {model.listed_name!r} could not be loaded: {exc}") from None
        self._gate(model, service)
        return service

    def _gate(self, model: ServedModel, service: Service) -> None:
        """Every load of `model`'s engine, whatever asks for it, makes room first."""
        service.scheduler.load_gate = lambda: self.room_for(model)

    @contextmanager
    def room_for(self, model: ServedModel) -> Iterator[None]:
        """Held while `model` loads (one load at a time): first the models used longest
        ago unload, once their requests end, until it fits under max_loaded.
        ModelUnavailable where one stays busy too long."""
        with self._room:
            while True:
                others = [m for m in self.models if m is not model and m.loaded]
                if len(others) < self.max_loaded:
                    break
                oldest = min(others, key=lambda m: m.last_used)
                assert oldest.service is not None
                log.info("unloading %s to make room for %s (--models-max %d)",
                         oldest.listed_name, model.listed_name, self.max_loaded)
                if not oldest.service.scheduler.release(RELEASE_WAIT_S):
                    raise ModelUnavailable(
                        f"model {model.listed_name!r} cannot load: {oldest.listed_name!r} is "
                        f"still busy and at most {self.max_loaded} model(s) load at once "
                        "(--models-max)")
            yield

    def stop(self) -> None:
        """Stop every built model's scheduler."""
        for service in self.built():
            service.scheduler.stop()


def _check_names(models: list[ServedModel]) -> None:
    """ValueError where one name names two models (two refs, or a preset's model and
    another)."""
    seen: dict[str, ServedModel] = {}
    for m in models:
        for name in m.answers_to():
            other = seen.setdefault(name, m)
            if other is not m and (other.ref != m.ref or m.from_preset or other.from_preset):
                what = "a preset" if m.from_preset or other.from_preset else "--models"
                raise ValueError(f"{what}: {name!r} names both {other.ref} and {m.ref}")


def _find_in(models: list[ServedModel], name: str) -> ServedModel | None:
    """The model of `models` that `name` names (with or without Ollama's ":latest"; a
    repo without its tag, `org/repo`, names the model answering to `org/repo:TAG`)."""
    for candidate in (name, name.removesuffix(":latest")):
        for m in models:
            if candidate in m.answers_to():
                return m
    if ":" not in name:
        for m in models:
            if any(n.startswith(name + ":") for n in m.answers_to()):
                return m
    return None
