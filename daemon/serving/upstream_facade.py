"""An upstream's model (`--upstream NAME=URL`) as the protocol layers see a model: the
facade of the local service, its requests forwarded (upstream.py) instead of queued.

A request needs the chat as messages (chat_prompt) and settings the upstream can take;
what needs the local model's tokenizer or engine (token ids, raw prompts, infill,
logit_bias, grammars, logprobs, embeddings) is a RequestError (a 400) naming it. The
slots and counters stay the local service's.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any, NoReturn

from specd.daemon.spec.generation import GenerationParams, RequestError
from specd.daemon.spec.media import PromptImage
from specd.daemon.text.grammar import Grammar
from specd.daemon.text.tokenizer import Tokenizer

from .facade import Embeddings, ModelFacts, RequestTracker, ServiceFacade
from .scheduler import Residency
from .served_models import ServedModels
from .service import Piece, ProgressEvent, Result, Service, TextStream
from .upstream import (
    NEUTRAL,
    ChatPrompt,
    OutputFormat,
    UpstreamClient,
    UpstreamStream,
    request_body,
)


class UpstreamFacade(ServiceFacade):
    """The model `client` serves, answering to its name."""

    def __init__(self, service: Service, client: UpstreamClient, models: ServedModels):
        self.client = client  # (before the base's checks, which ask for model_names)
        super().__init__(service, models=models)

    def unsupported(self, what: str) -> NoReturn:
        raise RequestError(f"model {self.client.name!r} is served by an upstream server "
                           f"(--upstream): {what} is not supported for it")

    def for_sender(self, identity: str, tracker: RequestTracker) -> ServiceFacade:
        return self  # no prompt cache here to keep apart

    # -- the model ------------------------------------------------------------------------
    @property
    def model_name(self) -> str:
        return self.client.name

    @property
    def model_names(self) -> frozenset[str]:
        return frozenset({self.client.name})

    @property
    def served_names(self) -> frozenset[str]:
        return self.model_names

    @property
    def aliases(self) -> list[str]:
        return []

    @property
    def tags(self) -> list[str]:
        return []

    @property
    def model_path(self) -> Path:
        self.unsupported("a model file")

    @property
    def chat_template(self) -> str:
        return ""

    @property
    def reasoning_format(self) -> str:
        return "auto"  # (no template here: the upstream's replies are read as they come)

    @property
    def reasoning_budget(self) -> int:
        return -1  # (the upstream's own)

    @property
    def reasoning_budget_message(self) -> str:
        return ""

    @property
    def takes_images(self) -> bool:
        return False  # the chat is forwarded as text messages

    @property
    def n_ctx(self) -> int:
        self.unsupported("a context size known here")

    @property
    def tokenizer(self) -> Tokenizer:
        self.unsupported("a prompt in token ids or raw text (infill, logit_bias, context, "
                         "a completion prompt: the tokenizer is the upstream's)")

    @property
    def eog_ids(self) -> set[int]:
        self.unsupported("a list of end tokens")

    @property
    def defaults(self) -> GenerationParams:
        return NEUTRAL

    @property
    def embeddings(self) -> Embeddings | None:
        return None

    def describe(self) -> dict[str, Any]:
        return {"target": {"name": self.client.name}, "upstream": True}

    def facts(self) -> ModelFacts:
        self.unsupported("a model file")

    def digest(self) -> str:
        self.unsupported("a model file")

    # -- requests -------------------------------------------------------------------------
    def chat_prompt(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                    tool_choice: Any, parallel: bool, render: dict[str, Any]) -> ChatPrompt:
        """The chat as it is forwarded (the upstream renders it)."""
        return ChatPrompt(messages, tools, tool_choice, parallel, render)

    def output_format(self, kind: str, spec: Any) -> OutputFormat:
        """A constraint the upstream applies (JSON, or a JSON schema)."""
        if kind not in ("json_object", "json_schema"):
            self.unsupported(f"a {kind} constraint (a JSON schema is)")
        return OutputFormat(kind, spec)

    def render_chat(self, messages: list[dict[str, Any]],
                    tools: list[dict[str, Any]] | None = None, **render: Any) -> str:
        self.unsupported("a rendered prompt")

    def chat_tokens(self, messages: list[dict[str, Any]],
                    tools: list[dict[str, Any]] | None = None, **render: Any) -> list[int]:
        self.unsupported("a prompt in token ids")

    async def compile_constraint(self, kind: str, spec: Any, *,
                                 bound_numbers: bool | None = None) -> Grammar:
        self.unsupported(f"a {kind} grammar")

    def check_prompt(self, prompt: list[int] | ChatPrompt) -> None:
        """(the upstream checks its own context)"""

    def submit(self, prompt: list[int] | ChatPrompt, params: GenerationParams, *,
               stop: list[str] | None = None, grammar: Grammar | OutputFormat | None = None,
               t_max_ms: float | None = None, n_indent: int = 0,
               **_: Any) -> TextStream:
        """The request, to be sent when its answer is awaited (UpstreamStream); progress,
        timings and cache_prompt do not apply upstream and are let go."""
        if not isinstance(prompt, ChatPrompt):
            self.unsupported("a prompt in token ids")
        if params.logprobs is not None:
            self.unsupported("logprobs")
        if t_max_ms or n_indent:
            self.unsupported("t_max_predict_ms" if t_max_ms else "n_indent")
        if isinstance(grammar, Grammar):
            self.unsupported("a grammar")
        body = request_body(self.client.name, prompt, params, stop, grammar)
        return UpstreamStream(self.client, body)

    async def generate(self, prompt: list[int] | ChatPrompt, params: GenerationParams,
                       **kw: Any) -> AsyncIterator[Piece | ProgressEvent | Result]:
        stream = self.submit(prompt, params, **kw)
        try:
            async for ev in stream:
                yield ev
        finally:
            stream.cancel()

    async def embed(self, inputs: list[list[int]], normalize_p: int = 2, *,
                    keep_alive: float | None = None,
                    images: Sequence[Sequence[PromptImage]] = ()) -> NoReturn:
        self.unsupported("embeddings")

    # the upstream's model is loaded and unloaded by the upstream, never by this daemon
    def residency(self) -> Residency:
        return Residency(loaded=True, expires_at=float("inf"))

    async def load(self, keep_alive: float | None = None) -> None:
        pass

    def unload(self) -> None:
        self.unsupported("unloading")
