"""The engine: target model, drafter, tokenizer and chat template, ready to generate.

Owns the models (ORT runners and their KV caches); a `Generation` per request owns
that request's samplers and position. The scheduler (server) and `specd generate` both
go through `Engine.start()`.
"""

from __future__ import annotations

import functools
import gc
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from specd.daemon.drafters.history import DEFAULT_MAX_TOKENS, HistoryDrafter, HistoryStore
from specd.daemon.drafters.registry import (
    MODEL_SPEC_TYPES,
    DrafterInputs,
    SpecTypeError,
    check_spec_type,
    make_drafter,
    resolve_spec_type,
)
from specd.daemon.models.building import (
    DRAFT_VOCAB_ROWS,
    BuildError,
    build_options,
    embedding_options,
    image_options,
    resolve_draft_quant,
)
from specd.daemon.models.compat import draft_incompatibilities, head_incompatibilities
from specd.daemon.models.mmproj import NO_MMPROJ, find_mmproj
from specd.daemon.models.store import resolve_model
from specd.daemon.spec.drafter import Drafter
from specd.daemon.spec.generation import (
    Generation,
    GenerationParams,
    PromptProgress,
    RequestError,
)
from specd.daemon.spec.media import PromptImage
from specd.daemon.spec.policy import PolicyMemory
from specd.daemon.spec.sampling import SamplerVocab
from specd.daemon.text.chat_formats import chat_format
from specd.daemon.text.chat_template import render_chat
from specd.daemon.text.grammar import GrammarState
from specd.daemon.text.tokenizer import Tokenizer
from specd.memory_fit.rss import rss_bytes, trim_heap
from specd.ort_models import native_ops
from specd.ort_models.arch import read_hparams
from specd.ort_models.gguf_file import GGUFFile
from specd.ort_models.head_runner import HeadRunner, load_or_build_head
from specd.ort_models.heads import HeadFormatError, HeadParams, head_kind, read_head
from specd.ort_models.model_cache import load_or_build
from specd.ort_models.providers import RuntimeChoice, choose_runtime, session_providers
from specd.ort_models.runner import ModelRunner
from specd.ort_models.shared_initializers import same_named, share_with_target, shares_on
from specd.ort_models.vision import load_vision_encoder
from specd.ort_models.vision.encoder import read_checked

from .embeddings import Embedder, EmbeddingHead
from .history_file import HistoryFile, HistoryFileError
from .image_prompts import ImagePrompter
from .loaded_model import LoadedModel

log = logging.getLogger("specd.engine")

Progress = Callable[[int, int, str], None]


class EngineError(Exception):
    """A configuration that cannot be loaded (message for the user)."""


def _what_draft(kind: str | None) -> str:
    """A draft file's kind, for messages: a draft model (None), or a head of its kind."""
    return "a draft model" if kind is None else f"a {kind} head"


DEFAULT_N_CTX = 4096  # per sequence, capped at the model's trained context


@dataclass
class EngineConfig:
    target: str
    draft: str | None = None
    # a second draft file: a head beside a draft model (`draft` the other), each round
    # drafting with the one predicted faster (spec type head+draft)
    also_draft: str | None = None
    spec_type: str = "auto"
    n_ctx: int = DEFAULT_N_CTX
    slots: int = 1
    threads: int | None = None
    device: str = "auto"
    ngram_min: int = 2
    ngram_max: int = 4
    synthetic_rates: list[float] | None = None
    synthetic_mean: float | None = None
    synthetic_seed: int = 0
    draft_quant: str = "auto"  # a key of DRAFT_QUANTS
    draft_vocab: int = DRAFT_VOCAB_ROWS  # a draft proposes only ids below this; 0: all
    spin: bool = False  # CPU pool threads spin during a run (faster only on an idle machine)
    # embeddings: the target's graph also outputs its last layer's hidden state
    embeddings: bool = False
    pooling: str | None = None  # None: the GGUF's pooling type, else "mean"
    # embeddings from this model instead of the target (a GGUF path or catalog name)
    embedding_model: str | None = None
    # the target takes images: its graph taking embeddings is built beside its text graph
    # (an image's rows come from the vision projector, `mmproj`; set where one is found)
    images: bool = False
    # the vision projector (mmproj GGUF: a path or catalog name) encoding images for the
    # target; "auto": the catalog's for the model, else one beside its file that fits
    # (models/mmproj.py); None or "none": no images from files
    mmproj: str | None = None
    fetch: bool = True
    defaults: GenerationParams = field(default_factory=GenerationParams)
    # the names the served model answers to and is listed as (llama-server's --alias:
    # the first in sorted order is its id), and its --tags; none: the GGUF's name
    aliases: list[str] = field(default_factory=list)
    tags: list[str] = field(default_factory=list)
    # the chat template instead of the GGUF's (--chat-template-file), and variables every
    # chat render gets unless its request sets them (--chat-template-kwargs, --reasoning)
    chat_template: str | None = None
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    # how a reply's think tags are read, unless its request says (--reasoning-format:
    # text/reasoning.py's REASONING_FORMATS)
    reasoning_format: str = "auto"
    # the reasoning's budget in tokens, unless a request's says (--reasoning-budget; -1:
    # none, 0: the reasoning closed at once)
    reasoning_budget: int = -1
    reasoning_budget_message: str = ""  # forced before the end tag (--reasoning-budget-message)
    # speculation from each identity's history (drafters/history.py): its bound in tokens
    # per principal, and the 0600 file under the state dir it is kept in (None: memory)
    history: bool = False
    history_tokens: int = DEFAULT_MAX_TOKENS
    history_file: str | None = None


# variables a chat render sets itself: template kwargs may not replace them
RENDER_VARIABLES = frozenset({"messages", "tools", "add_generation_prompt",
                              "continue_final_message", "bos_token", "eos_token"})


def template_defaults() -> dict[str, Any]:
    """The variables llama-server gives every chat template: thinking on (templates
    that close the thinking block unless told so, as llama.cpp's copies of DeepSeek-R1's
    and QwQ's do, then open it), and today's date as Llama 3's and firefunction's
    templates read it."""
    now = datetime.now()
    return {"enable_thinking": True, "date_string": now.strftime("%d %b %Y"),
            "datetime": now.strftime("%b %d %Y")}


class Engine:
    def __init__(self, cfg: EngineConfig, *, progress: Progress | None = None,
                 build_progress: Callable[[str], Progress | None] | None = None):
        self.cfg = cfg
        try:
            self.runtime: RuntimeChoice = choose_runtime(cfg.device)
        except (RuntimeError, ValueError) as exc:  # no such device, or no CUDA EP
            raise EngineError(str(exc)) from None
        log.debug("%s", self.runtime.describe())  # the CLI commands print it themselves
        if self.runtime.device == "cpu":
            why = native_ops.unavailable_reason()
            log.info("specd kernels (GgufMatMul, CachedAttention): %s",
                     f"off, using ONNX Runtime's ops: {why}" if why else "on")
        try:
            check_spec_type(cfg.spec_type, cfg.draft)
        except SpecTypeError as exc:
            raise EngineError(str(exc)) from None
        target_path = self._resolve(cfg.target, progress)
        loads_draft = cfg.draft is not None and (cfg.spec_type == "auto"
                                                 or cfg.spec_type in MODEL_SPEC_TYPES)
        tgt_file = GGUFFile(target_path)
        drafts = self._draft_files(progress) if loads_draft else []
        # the draft file's kind, the head's beside a draft model (None: a draft model)
        self.draft_kind = draft_kind = drafts[0][2] if drafts else None
        pair = len(drafts) == 2  # a head and a draft model
        try:  # the head's file named where there are two
            self.spec_type = resolve_spec_type(cfg.spec_type,
                                               drafts[0][0].name if pair else cfg.draft,
                                               draft_kind, head_and_model=pair)
        except SpecTypeError as exc:
            raise EngineError(str(exc)) from None
        head = None  # a head's parameters
        head_path: Path | None = None
        draft_path: Path | None = None  # a draft model
        d_file: GGUFFile | None = None
        for path, f, kind in drafts:
            checked = self._check_draft(tgt_file, f, kind)
            if checked is None:
                draft_path, d_file = path, f
            else:
                head, head_path = checked, path
        # what the draft file is and the speculation it runs, said at start
        self.draft_choice = "" if head is None or head_path is None else (
            f"{head_path.name} is a {head.kind} head ({head.arch} architecture, "
            f"{head.n_layer} layers, reading target layers {list(head.target_layers)})"
            + ("" if draft_path is None else f", beside the draft model {draft_path.name}")
            + f": speculation {self.spec_type}"
            + (" (chosen by --spec-type auto)" if cfg.spec_type == "auto" else ""))
        before_tokenizer = rss_bytes()
        self.tokenizer = Tokenizer.from_metadata(tgt_file.metadata)
        self.chat_template: str | None = (cfg.chat_template
                                          or tgt_file.get("tokenizer.chat_template"))
        # a template with a reply format of its own: its control tokens stay in the text
        self.chat_format = chat_format(self.chat_template)
        self.preserved_ids = frozenset() if self.chat_format is None else frozenset(
            i for t in self.chat_format.preserved_tokens
            if (i := self.tokenizer.token_to_id(t)) is not None)
        tokenizer_bytes = rss_bytes() - before_tokenizer
        bp = build_progress or (lambda label: None)
        try:
            target_options = build_options("target", device=self.runtime.device, head=head)
            draft_options = (build_options("draft", cfg.draft_quant, self.runtime.device,
                                           cfg.draft_vocab)
                             if draft_path is not None else None)
        except BuildError as exc:
            raise EngineError(str(exc)) from None
        # embeddings from the target: its graph also outputs the layer they read
        target_head = None
        if cfg.embeddings and cfg.embedding_model is None:
            target_head = self._embedding_head(tgt_file)
            target_options = replace(target_options, hidden_layers=tuple(sorted(
                {*target_options.hidden_layers, target_head.layer})))
        built_head = None  # a head's graphs, built first: they share the target's weights
        if head_path is not None:
            try:
                built_head = load_or_build_head(head_path, target_path, bp("draft head"),
                                                device=self.runtime.device)
            except ValueError as exc:  # a head kind or feature not built yet
                raise EngineError(str(exc)) from None
        self._built_head = built_head
        self.target = LoadedModel(target_path, tgt_file,
                                  load_or_build(target_path, target_options, bp("target")),
                                  n_seq=cfg.slots)
        # the vision projector encoding images, checked against the target (None: none)
        self.mmproj_path = self._mmproj(target_path, tgt_file)
        self.images: ImagePrompter | None = None  # its encoder's session, while loaded
        self._images_lock = threading.Lock()
        # the target's graph taking an image's rows (None: the model takes no images)
        self._built_images = (load_or_build(target_path, image_options(
            self.target.built.options, tgt_file.arch), bp("target (images)"))
            if cfg.images or self.mmproj_path is not None else None)
        self.draft: LoadedModel | None = None
        if draft_path is not None and d_file is not None and draft_options is not None:
            self.draft = LoadedModel(draft_path, d_file, load_or_build(
                draft_path, draft_options, bp("draft")), exact=False, n_seq=cfg.slots)
        # the sessions below are there while the engine is loaded (load / unload)
        self.head: HeadRunner | None = None
        self.drafter: Drafter | None = None
        self.history, self.history_file = self._history()
        self._history_source: HistoryDrafter | None = None  # the drafter's, while loaded
        # each request's draft policy starts from the last finished one's estimates
        self.policy_memory = PolicyMemory()
        self.embedding: LoadedModel | None = None  # a model of its own for embeddings
        self.embedder: Embedder | None = None
        if target_head is not None:
            self.embedder = Embedder(self.target, self.tokenizer, target_head, False)
        elif cfg.embedding_model is not None:
            self.embedder = self._embedding_model(cfg.embedding_model, progress, bp)
        self.loaded = False
        self.load()
        self.target.resident_bytes += max(tokenizer_bytes, 0)
        self.n_ctx = self.target.n_ctx
        if cfg.n_ctx > self.n_ctx:  # said out loud when the context was asked for
            say = log.info if cfg.n_ctx == DEFAULT_N_CTX else log.warning
            say("warning: a context of %d tokens was asked for; %s was trained for %d, so "
                "each sequence gets %d", cfg.n_ctx, target_path.name,
                self.target.built.hparams.n_ctx_train, self.n_ctx)
        # what the drafter is called and whether it drafts, known while unloaded too
        self.drafter_name = None if self.drafter is None else self.drafter.name
        self.copies_prefixes = self.drafter is None or not self.drafter.target_layers

    # -- loading and unloading ------------------------------------------------------------
    def load(self) -> None:
        """Open the models' sessions from their built graphs (no rebuild) and make the
        drafter: the same configuration every time, so output is the same after an
        unload. On failure nothing stays open."""
        if self.loaded:
            return
        try:
            head = self._built_head
            shared = (None if head is None or not shares_on(self.runtime.device) else
                      share_with_target(((g, head.model_path(g)) for g in head.graphs),
                                        self.target.built.model_path))
            self._open(self.target, None if shared is None else shared.arrays)
            if self._built_images is not None:
                images = self._built_images
                self.target.runner.attach_embeddings(images, same_named(
                    images.model_path, self.target.built.model_path)
                    if shares_on(self.runtime.device) else None)
            if self.draft is not None:
                self._open(self.draft)
            if head is not None:
                self.head = HeadRunner(head, n_ctx=self.target.n_ctx, n_seq=self.cfg.slots,
                                       threads=self.cfg.threads, runtime=self.runtime,
                                       shared=shared)
            inputs = self.drafter_inputs()
            self.drafter = make_drafter(self.spec_type, inputs)
            self._history_source = inputs.history if self.drafter is not None else None
            if self.embedding is not None:
                self._open(self.embedding)
            if self.mmproj_path is not None:
                self._image_prompter()
        except BaseException:
            self.unload()
            raise
        self.loaded = True

    def unload(self) -> None:
        """Drop every session, KV cache and the drafter (its per-sequence state with
        them), and give the freed memory back to the system. Only while no request
        runs: the caller (the scheduler's worker) makes sure of that."""
        self.drafter, self.head, self._history_source = None, None, None
        self.images = None
        for m in (self.target, self.draft, self.embedding):
            if m is not None:
                m.session = None
        self.loaded = False
        gc.collect()  # sessions caught in reference cycles go now, not at some later pass
        trim_heap()

    def _draft_files(self, progress: Progress | None
                     ) -> list[tuple[Path, GGUFFile, str | None]]:
        """The draft files (-md, up to two), each with its kind: a drafter head's (from its
        metadata), None for a draft model; two must be a head and a model, the head first."""
        drafts = []
        for name in (self.cfg.draft, self.cfg.also_draft):
            if name is not None:
                path = self._resolve(name, progress)
                f = GGUFFile(path)
                drafts.append((path, f, head_kind(f.metadata, f.tensors)))
        if len(drafts) == 2 and sum(kind is not None for _, _, kind in drafts) != 1:
            raise EngineError("two draft files run side by side must be a drafter head and "
                              "a draft model; -md names " + " and ".join(
                                  f"{path.name} ({_what_draft(kind)})"
                                  for path, _, kind in drafts))
        return sorted(drafts, key=lambda d: d[2] is None)

    def _check_draft(self, tgt_file: GGUFFile, d_file: GGUFFile, kind: str | None
                     ) -> HeadParams | None:
        """Refuse a draft file that cannot draft for the target, before anything is built;
        a head's parameters (None for a draft model: `kind` None)."""
        name, target = Path(d_file.path).name, Path(tgt_file.path).name
        if kind is None:
            problems = draft_incompatibilities(tgt_file.metadata, d_file.metadata)
            head = None
        else:
            try:
                head = read_head(d_file)
            except HeadFormatError as exc:
                raise EngineError(str(exc)) from None
            problems = head_incompatibilities(head, read_hparams(tgt_file), tgt_file.metadata,
                                              d_file.metadata)
        if problems:
            raise EngineError(f"draft {name} cannot draft for {target}: " + "; ".join(problems))
        return head

    def drafter_inputs(self) -> DrafterInputs:
        """What this engine's drafters are built from (its draft model, if loaded)."""
        cfg = self.cfg
        return DrafterInputs(
            draft_runner=None if self.draft is None else self.draft.runner,
            head_runner=self.head,
            target_vocab=self.target.built.hparams.n_vocab, ngram_min=cfg.ngram_min,
            ngram_max=cfg.ngram_max, synthetic_rates=cfg.synthetic_rates,
            synthetic_mean=cfg.synthetic_mean, synthetic_seed=cfg.synthetic_seed,
            n_max=cfg.defaults.draft.n_max,
            history=HistoryDrafter(self.history) if cfg.history else None)

    def _history(self) -> tuple[HistoryStore, HistoryFile | None]:
        """The identities' history (with history off, empty for good: nothing is added to
        it), and the file it is kept in, loaded."""
        cfg = self.cfg
        if not cfg.history:
            if cfg.history_file is not None:
                raise EngineError("--history-file keeps the history, which --no-history "
                                  "turns off")
            return HistoryStore(), None
        try:
            store = HistoryStore(cfg.history_tokens)
            if cfg.history_file is None:
                return store, None
            kept = HistoryFile(cfg.history_file)
            n = kept.load(store)
        except (HistoryFileError, ValueError) as exc:
            raise EngineError(str(exc)) from None
        log.info("history: %d tokens read from %s", n, kept.path)
        return store, kept

    def remember(self, identity: str, tokens: Sequence[int]) -> None:
        """A finished request's tokens (prompt and output) join its identity's history
        (nothing where history is off)."""
        if self.cfg.history and tokens:
            self.history.add(identity, tokens)

    def save_history(self, *, only_if_due: bool = False) -> None:
        """Write the history to its file (where it has one): now, or if a periodic save
        is due."""
        if self.history_file is None:
            return
        try:
            if only_if_due:
                self.history_file.save_if_due(self.history)
            else:
                self.history_file.save(self.history)
        except OSError as exc:
            log.error("history: could not save %s: %s", self.history_file.path, exc)

    def _mmproj(self, target_path: Path, tgt_file: GGUFFile) -> Path | None:
        """The vision projector of cfg.mmproj, read and checked, its projection the
        target's width (EngineError naming the problem); None where there is none."""
        asked = self.cfg.mmproj
        if asked is None or asked == NO_MMPROJ:
            return None
        try:
            path = find_mmproj(self.cfg.target, target_path,
                               None if asked == "auto" else asked, fetch=self.cfg.fetch)
            if path is None:
                return None
            _, family, hp = read_checked(path)
        except Exception as exc:  # store and GGUF errors name the file and the problem
            raise EngineError(f"--mmproj: {exc}") from None
        width = read_hparams(tgt_file).n_embd
        if hp.projection_dim != width:
            raise EngineError(f"--mmproj {path.name} projects to {hp.projection_dim} "
                              f"dimensions, {target_path.name} embeds {width}: it is not "
                              "this model's projector")
        log.info("vision: %s (%s projector)", path.name, family.projector)
        return path

    def _resolve(self, name: str | None, progress: Progress | None) -> Path:
        assert name is not None
        try:
            return resolve_model(name, fetch=self.cfg.fetch, progress=progress, to_run=True)
        except Exception as exc:  # store errors are user-facing already
            raise EngineError(str(exc)) from None

    def _embedding_head(self, f: GGUFFile) -> EmbeddingHead:
        try:
            return EmbeddingHead.of(f, self.cfg.pooling)
        except ValueError as exc:
            raise EngineError(str(exc)) from None

    def _embedding_model(self, name: str, progress: Progress | None,
                         bp: Callable[[str], Progress | None]) -> Embedder:
        """The embedding model of its own: its graph with its last hidden state out, one
        sequence, and its tokenizer (its session opens with the others: load)."""
        path = self._resolve(name, progress)
        f = GGUFFile(path)
        head = self._embedding_head(f)
        try:
            options = embedding_options(self.runtime.device, head.layer)
        except BuildError as exc:
            raise EngineError(str(exc)) from None
        self.embedding = LoadedModel(path, f, load_or_build(path, options,
                                                            bp("embedding model")))
        return Embedder(self.embedding, Tokenizer.from_metadata(f.metadata), head, True)

    @property
    def pooling(self) -> str | None:
        """How embeddings pool the tokens' states (None: embeddings are off)."""
        return None if self.embedder is None else self.embedder.pooling

    def _open(self, m: LoadedModel,
              initializers: dict[str, np.ndarray] | None = None) -> None:
        """The model's runner from its built graph. exact: a verified row must equal a
        single step bit for bit (the target's runner makes its calls' shapes so); a
        draft's rows need not, and run their own shapes. initializers: weights its session
        shares with a head's (shared_initializers.py)."""
        before = rss_bytes()  # after any build: its freed scratch is not the model's
        first = m.min_rows is None
        m.opened(ModelRunner(m.built, n_ctx=self.cfg.n_ctx, n_seq=m.n_seq,
                             threads=self.cfg.threads, runtime=self.runtime,
                             spinning=self.cfg.spin, row_block=None if m.exact else 1,
                             min_rows=m.min_rows if not first else None if m.exact else 1,
                             initializers=initializers))
        if first:
            m.resident_bytes = max(rss_bytes() - before, 0)

    # -- requests -------------------------------------------------------------------------
    @property
    def model_name(self) -> str:
        """What responses call the served model: its first alias, else the GGUF's name."""
        return min(self.cfg.aliases) if self.cfg.aliases else self.target.name

    @property
    def eog_ids(self) -> set[int]:
        return set(self.tokenizer.eot_ids)

    @functools.cached_property
    def sampler_vocab(self) -> SamplerVocab:
        """The vocabulary the infill and DRY samplers read (DRY's breakers cached in it)."""
        return SamplerVocab.from_tokenizer(self.tokenizer)

    def _bos_text(self) -> str:
        tok = self.tokenizer
        return tok.token_text(tok.bos_id) if tok.bos_id is not None else ""

    def render_chat(self, messages: list[dict[str, Any]],
                    tools: list[dict[str, Any]] | None = None, *,
                    add_generation_prompt: bool = True,
                    continue_final_message: bool = False,
                    template_kwargs: dict[str, Any] | None = None) -> str:
        """The chat as the model's template writes it: a new assistant turn opened (by
        default), or the final message continued (assistant prefill). `template_kwargs`:
        more variables for the template (`enable_thinking`, ...) over the served ones, which
        are over llama-server's defaults (`template_defaults`)."""
        tok = self.tokenizer
        given = {**template_defaults(), **self.cfg.template_kwargs, **(template_kwargs or {})}
        extra = {k: v for k, v in given.items() if k not in RENDER_VARIABLES}
        return render_chat(self.chat_template or "", messages,
                           add_generation_prompt=add_generation_prompt,
                           continue_final_message=continue_final_message,
                           bos_token=self._bos_text(),
                           eos_token=tok.token_text(tok.eos_id)
                           if tok.eos_id is not None else "", tools=tools, **extra)

    def _add_bos(self, text: str) -> bool | None:
        """BOS before `text` as the file says (None), unless the text (a template that
        writes `{{ bos_token }}` itself) begins with it already (False)."""
        bos = self._bos_text()
        return None if not (bos and text.startswith(bos)) else False

    def chat_tokens(self, messages: list[dict[str, Any]],
                    tools: list[dict[str, Any]] | None = None, *,
                    add_generation_prompt: bool = True,
                    continue_final_message: bool = False,
                    template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """The rendered chat as token ids, with one BOS: templates that write
        `{{ bos_token }}` themselves get no second one from the tokenizer."""
        text = self.render_chat(messages, tools, add_generation_prompt=add_generation_prompt,
                                continue_final_message=continue_final_message,
                                template_kwargs=template_kwargs)
        return self.tokenizer.encode(text, add_bos=self._add_bos(text), parse_special=True)

    def image_prompt(self, text: str, images: Sequence[bytes]
                     ) -> tuple[list[int], tuple[PromptImage, ...]]:
        """A prompt's text (a rendered chat or a raw prompt) holding a media marker per
        image, and the images' file bytes: its tokens and image chunks (ImagePrompter;
        RequestError for a bad image or a marker count that does not match). Runs the
        vision encoder: call it off the event loop."""
        if self.mmproj_path is None:
            raise RequestError(f"{self.model_name} takes no images: start it with "
                               "--mmproj, the vision projector of its family")
        return self._image_prompter().prompt(text, images, add_bos=self._add_bos(text))

    def _image_prompter(self) -> ImagePrompter:
        """The vision encoder's prompter, its session opened if it is not (at load, or
        for a request's images while the engine is unloaded; unload drops it)."""
        assert self.mmproj_path is not None
        with self._images_lock:
            if self.images is None:
                self.images = ImagePrompter(self.tokenizer, load_vision_encoder(
                    self.mmproj_path, session_providers(self.runtime.device)))
            return self.images

    def encode_prompt(self, text: str, *, chat: bool = False) -> list[int]:
        """Raw text (BOS as the file says, specials parsed) or a rendered chat prompt."""
        if chat:
            return self.chat_tokens([{"role": "user", "content": text}])
        return self.tokenizer.encode(text, parse_special=True)

    @property
    def takes_images(self) -> bool:
        """Whether prompts may hold images (the target's graph taking them is built)."""
        return self._built_images is not None

    @property
    def reads_image_files(self) -> bool:
        """Whether images may come as files: a vision projector encodes them."""
        return self.mmproj_path is not None

    def start(self, seq: int, prompt: Sequence[int], params: GenerationParams,
              reuse: int = 0, grammar: GrammarState | None = None,
              on_prompt_progress: PromptProgress | None = None,
              images: Sequence[PromptImage] = (),
              identity: str | None = None) -> Generation:
        """A request's generation on slot `seq`, its prompt holding `images`; `identity`:
        whose history it drafts from (None: the request's own tokens only)."""
        if self._history_source is not None:
            self._history_source.bind(seq, identity)
        return Generation(self.target.runner, seq, prompt, params, eog=self.eog_ids,
                          drafter=self.drafter, reuse=reuse, grammar=grammar,
                          on_prompt_progress=on_prompt_progress, memory=self.policy_memory,
                          images=images, vocab=self.sampler_vocab)

    def embed(self, seq: int, tokens: Sequence[int], normalize_p: int = 2,
              images: Sequence[PromptImage] = ()) -> np.ndarray:
        """The embedding of `tokens`, holding `images` (Embedder.embed; `seq`: the
        target's slot, where the target embeds, else the embedding model's sequence 0)."""
        if self.embedder is None:
            raise EngineError("embeddings are off (serve with --embeddings)")
        return self.embedder.embed(seq if not self.embedder.own else 0, list(tokens),
                                   normalize_p, images)

    def describe(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "runtime": self.runtime.describe(),
            "target": {"name": self.target.name, "path": str(self.target.path),
                       "arch": self.target.built.hparams.arch,
                       "kernels": self.target.built.options.kernels,
                       "attention": self.target.built.options.attention},
            "spec_type": self.spec_type,
            "n_ctx": self.n_ctx,
            "slots": self.cfg.slots,
            "loaded": self.loaded,
            "history": None if not self.cfg.history else {
                "max_tokens": self.history.max_tokens,
                "file": None if self.history_file is None else str(self.history_file.path)},
        }
        if self.draft is not None:
            d["draft"] = {"name": self.draft.name, "path": str(self.draft.path),
                          "arch": self.draft.built.hparams.arch, "n_ctx": self.draft.n_ctx,
                          "quant": resolve_draft_quant(self.cfg.draft_quant,
                                                       self.runtime.device),
                          "vocab": self.draft.built.options.logits_width(
                              self.draft.built.hparams.n_vocab)}
        if self._built_head is not None:
            built = self._built_head
            head = built.head
            d["head" if self.draft is not None else "draft"] = {
                "name": built.head_path.name,
                "path": str(built.head_path), "arch": head.arch,
                "kind": head.kind, "n_layer": head.n_layer,
                "target_layers": list(head.target_layers),
                "block_size": head.block_size,
                "n_ctx": min(self.n_ctx, built.target.n_ctx_train)}
        return d
