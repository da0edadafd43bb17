"""Requests as the protocols see them: text in, a stream of text pieces out.

`Service.generate()` submits a request to the scheduler and yields `Piece`s (new text,
token ids) and a final `Result`, applying stop strings and streaming-safe detokenization.
Protocol layers (ipc/) only format these.
"""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from specd.daemon.spec.generation import GenerationParams, RequestError, check_prompt_fits
from specd.daemon.spec.media import PromptImage
from specd.daemon.spec.sampling import TokenLogprob
from specd.daemon.spec.stats import SpecStats
from specd.daemon.text.detokenize import IncrementalDetokenizer
from specd.daemon.text.grammar import Grammar, compile_constraint
from specd.daemon.text.stop_strings import StopMatcher

from .engine import Engine
from .scheduler import Request, Scheduler


@dataclass
class Piece:
    text: str
    tokens: list[int]
    # per token: the text that became final with it (joined: `text`; the flushed tail has
    # no token), and its logprobs where the request asked for them
    texts: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    timings: dict[str, Any] | None = None  # the request's so far (timings_per_token)


@dataclass
class ProgressEvent:
    """Prompt processing so far (llama.cpp's `prompt_progress`): tokens in the prompt,
    taken from the cache, and evaluated or cached by now; ms since the request came."""

    total: int
    cache: int
    processed: int
    time_ms: int
    timings: dict[str, Any] | None = None  # the request's so far (timings_per_token)

    def as_json(self) -> dict[str, int]:
        return {"total": self.total, "cache": self.cache, "processed": self.processed,
                "time_ms": self.time_ms}


@dataclass
class Result:
    text: str
    finish_reason: str  # stop | length | cancelled | time_limit | error
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    stats: SpecStats
    stopping_word: str = ""
    error: str | None = None
    # the HTTP status a failure is answered with: 500, specd's own; an upstream's failure
    # after its answer began, 502 (504: it stopped answering)
    error_status: int = 500
    timings: dict[str, Any] = field(default_factory=dict)
    slot: int | None = None  # the slot that ran it
    # per generated token (the counted ones), where the request asked for logprobs
    tokens: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)


class TextStream(Protocol):
    """A submitted request's output as the protocol layers take it: iterated once for
    Pieces (and ProgressEvents) and one final Result; `cancel()` stops it. A Stream (the
    local engine) or an upstream server's answer (upstream.UpstreamStream)."""

    @property
    def slot(self) -> int | None:
        """The slot that runs it (None: none yet, or not run here)."""
        ...

    async def started(self) -> None:
        """Wait until the generation has begun: a failure to begin raises here, while a
        response can still say so with its status."""
        ...

    def cancel(self) -> None: ...

    def __aiter__(self) -> AsyncIterator[Piece | ProgressEvent | Result]: ...


class IndentLimit:
    """llama.cpp's n_indent (editor completions): once a line after the first starts with
    a non-blank character at an indentation below n_indent, the completion ends just
    before that character (a blank line counts as indentation 0)."""

    def __init__(self, n_indent: int):
        self.n_indent = n_indent
        self._text = ""
        self._line = -1  # where the current line starts, once a newline has come out

    def feed(self, text: str) -> tuple[str, bool]:
        """New text -> (the part to keep, whether the completion ends here)."""
        start = len(self._text)
        self._text += text
        if self._line < 0:
            nl = self._text.find("\n")
            if nl < 0:
                return text, False
            self._line = nl + 1
        while True:
            pos = self._line
            while pos < len(self._text) and self._text[pos] in " \t":
                pos += 1
            if pos == len(self._text):
                return text, False  # the line's indentation is not complete yet
            if pos - self._line < self.n_indent:
                return text[: max(pos - start, 0)], True
            nl = self._text.find("\n", pos)
            if nl < 0:
                return text, False
            self._line = nl + 1


class Service:
    def __init__(self, engine: Engine, scheduler: Scheduler):
        self.engine = engine
        self.scheduler = scheduler
        self.started = time.time()
        self._embedding = threading.Lock()  # an embedding model of its own: one at a time

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    async def compile_constraint(self, kind: str, spec: Any, *,
                                 bound_numbers: bool | None = None) -> Grammar:
        """Compile off the event loop (the first use builds llguidance's tokenizer)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, functools.partial(
            compile_constraint, kind, spec, self.tokenizer, bound_numbers=bound_numbers))

    def check_prompt(self, prompt: list[int]) -> None:
        """RequestError unless the prompt fits the context (before queueing it)."""
        check_prompt_fits(prompt, self.engine.n_ctx)

    def submit(self, prompt: list[int], params: GenerationParams, *,
               stop: list[str] | None = None, cache_prompt: bool = True,
               t_max_ms: float | None = None, grammar: Grammar | None = None,
               n_indent: int = 0, progress: bool = False, timings: bool = False,
               keep_alive: float | None = None, images: Sequence[PromptImage] = ()
               ) -> Stream:
        """Queue a request (RequestError if the prompt does not fit, QueueFull if the queue
        is), before anything is sent to the client; iterate the Stream for its output
        (with `progress`, ProgressEvents as the prompt is evaluated; with `timings`, each
        event carries the request's timings so far). keep_alive: how long the model stays
        loaded once idle after it (Request.keep_alive)."""
        self.check_prompt(prompt)
        if images and not self.engine.takes_images:
            raise RequestError(f"{self.engine.model_name} takes no images: start it with "
                               "--mmproj, the vision projector of its family")
        return Stream(self, prompt, params, stop=stop, cache_prompt=cache_prompt,
                      t_max_ms=t_max_ms, grammar=grammar, n_indent=n_indent,
                      progress=progress, timings=timings, keep_alive=keep_alive,
                      images=tuple(images))

    async def load(self, keep_alive: float | None = None) -> None:
        """Load the model if it is not (a request with nothing to generate), and keep it
        for `keep_alive` once idle; RuntimeError if it cannot be loaded."""
        def wait() -> None:
            with self.scheduler.hold(keep_alive):
                pass

        await asyncio.to_thread(wait)

    async def embed(self, inputs: list[list[int]], normalize_p: int = 2, *,
                    keep_alive: float | None = None,
                    images: Sequence[Sequence[PromptImage]] = ()) -> list[np.ndarray]:
        """Each input's embedding (Engine.embed): from the target, computed on the
        scheduler's worker in a slot it takes like a request (QueueFull when the queue is
        full); from an embedding model of its own, on a thread, one request at a time,
        the models kept loaded meanwhile. `images`: each input's images (none: text
        only), which only the target takes (RequestError for a model of its own)."""
        if not inputs or not all(inputs):
            raise ValueError("nothing to embed")
        if images and len(images) != len(inputs):
            raise ValueError(f"{len(images)} inputs' images for {len(inputs)} inputs")
        held = list(images) or [() for _ in inputs]
        embedder = self.engine.embedder
        if embedder is not None and embedder.own and any(held):
            raise RequestError("the embedding model (--embedding-model) takes no images: "
                               "only the target's vision projector encodes them")
        if embedder is not None and embedder.own:  # a model of its own: no slot to take
            for tokens in inputs:
                check_prompt_fits(tokens, embedder.n_ctx)

            def run() -> list[np.ndarray]:
                with self.scheduler.hold(keep_alive), self._embedding:
                    t0 = time.perf_counter()
                    out = [self.engine.embed(0, tokens, normalize_p) for tokens in inputs]
                    self.scheduler.count_prompts([len(t) for t in inputs],
                                                 time.perf_counter() - t0)
                    return out

            return await asyncio.to_thread(run)
        for tokens in inputs:
            self.check_prompt(tokens)
        loop = asyncio.get_running_loop()
        done: asyncio.Future[Request] = loop.create_future()

        def task(seq: int) -> tuple[object, list[int]]:
            t0 = time.perf_counter()
            out = [self.engine.embed(seq, tokens, normalize_p, ims)
                   for tokens, ims in zip(inputs, held, strict=True)]
            self.scheduler.count_prompts([len(t) for t in inputs], time.perf_counter() - t0)
            return out, list(inputs[-1])  # the slot's KV holds the last input

        def settle(r: Request) -> None:
            if not done.done():  # (cancelled when the client went away)
                done.set_result(r)

        def finished(r: Request) -> None:
            loop.call_soon_threadsafe(settle, r)

        req = Request(prompt=list(inputs[0]), params=GenerationParams(max_tokens=0),
                      on_tokens=lambda tokens: None, on_done=finished, cache_prompt=False,
                      task=task, keep_alive=keep_alive)
        self.scheduler.submit(req)
        try:
            r = await done
        except BaseException:
            req.cancel()
            raise
        if r.error:
            raise RuntimeError(r.error)
        assert isinstance(r.result, list)
        return r.result

    async def generate(self, prompt: list[int], params: GenerationParams,
                       **kw: Any) -> AsyncIterator[Piece | ProgressEvent | Result]:
        """submit(), then its events. Cancel by closing."""
        async for ev in self.submit(prompt, params, **kw):
            yield ev


class Stream:
    """One submitted request's output: Pieces as text becomes final, then one Result.

    Stop strings end the request at the token that completes one (later tokens a round
    produced are neither streamed nor counted). `t_max_ms` limits generation, as
    llama.cpp's t_max_predict_ms: timed from the first generated token, and applied once a
    newline has come out (so a completion has at least its first line). Both are decided
    on the scheduler's worker thread as the tokens come out (`_on_tokens`), so the
    request ends in the round that met them, not whenever the event loop gets to them.
    Iterate once; `cancel()` (or closing the iteration) stops the request.
    """

    def __init__(self, svc: Service, prompt: list[int], params: GenerationParams, *,
                 stop: list[str] | None, cache_prompt: bool, t_max_ms: float | None,
                 grammar: Grammar | None, n_indent: int = 0, progress: bool = False,
                 timings: bool = False, keep_alive: float | None = None,
                 images: tuple[PromptImage, ...] = ()):
        self.svc, self.prompt = svc, prompt
        self._timings = timings
        self._loop = asyncio.get_running_loop()
        self._events: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self._t_submit = time.perf_counter()
        self._t_max = t_max_ms / 1000.0 if t_max_ms else None
        # the worker thread's, until the "done" event (after which only the loop reads)
        # control tokens (<|im_start|>, <|fim_middle|>, ...) add no text, as in llama.cpp's
        # server; user-defined ones such as Qwen's <tool_call> stay
        # (but a chat format's preserved tokens, which its reply parser reads)
        self._detok = IncrementalDetokenizer(svc.tokenizer, skip_special=True,
                                             keep=svc.engine.preserved_ids)
        self._matcher = StopMatcher(stop or [])
        self._eog = svc.engine.eog_ids
        self._n_out = 0  # tokens streamed: all of them, or up to the one ending a stop string
        self._t_first: float | None = None
        self._newline = self._timed_out = self._indented = False
        self._indent = IndentLimit(n_indent) if n_indent > 0 else None
        self.req = Request(
            prompt=prompt, params=params, cache_prompt=cache_prompt, grammar=grammar,
            on_tokens=self._on_tokens, keep_alive=keep_alive, images=images,
            on_prompt_progress=self._on_progress if progress else None,
            on_done=lambda r: self._send(("done", r)),
        )
        svc.scheduler.submit(self.req)

    def cancel(self) -> None:
        self.req.cancel()

    @property
    def slot(self) -> int | None:
        return self.req.slot

    async def started(self) -> None:
        """(queued already: a local request's failures come in its Result)"""

    def _send(self, event: tuple[str, Any]) -> None:
        """The event, to the reader: from the scheduler's worker, woken once its next
        step is planned (outbox.py); from any other thread, at once."""
        self.svc.scheduler.outbox.post(
            lambda: self._loop.call_soon_threadsafe(self._events.put_nowait, event))

    def _on_progress(self, cache: int, processed: int, total: int) -> None:
        """(worker thread) Prompt processing reached `processed` of `total` tokens."""
        ms = int((time.perf_counter() - self._t_submit) * 1000)
        self._send(("progress", ProgressEvent(total, cache, processed, ms,
                                              self._timings_now(processed - cache))))

    def _timings_now(self, prompt_n: int | None = None) -> dict[str, Any] | None:
        """The request's timings so far, where asked for (on the worker thread, or once
        the request ended): `prompt_n` prompt tokens evaluated by now (None: all)."""
        gen = self.req.gen
        if not self._timings or gen is None:
            return None
        stats = gen.stats
        done = len(self.prompt) - stats.cached_tokens if prompt_n is None else prompt_n
        return llama_timings(stats, done, self._n_out)

    @property
    def _ended(self) -> bool:
        """A stop string completed, time is up, or a line fell below the indentation."""
        return self._matcher.hit is not None or self._timed_out or self._indented

    def _on_tokens(self, tokens: list[int]) -> bool:
        """(worker thread) Tokens a round produced: stream the text that is final; True
        when the request must end here."""
        if self._ended:
            return True
        out, used = [], []
        for t in tokens:
            used.append(t)
            raw = "" if t in self._eog else self._detok.push(t)
            if self._indent is not None:
                raw, self._indented = self._indent.feed(raw)
            self._newline = self._newline or "\n" in raw
            out.append(self._matcher.feed(raw))
            if self._matcher.hit is not None or self._indented:
                break
        self._n_out += len(used)
        piece = "".join(out)
        gen = self.req.gen
        # the round's tokens are the generation's last ones; their logprobs likewise
        logprobs = [] if gen is None or gen.params.logprobs is None else (
            gen.token_logprobs[len(gen.token_logprobs) - len(tokens):][:len(used)])
        if piece or used:
            self._send(("piece", Piece(piece, used, out, logprobs, self._timings_now())))
        now = time.monotonic()
        self._t_first = now if self._t_first is None else self._t_first
        if (self._t_max is not None and self._newline and self._matcher.hit is None
                and now - self._t_first > self._t_max):
            self._timed_out = True
        return self._ended

    def __aiter__(self) -> AsyncIterator[Piece | ProgressEvent | Result]:
        return self._run()

    async def _run(self) -> AsyncIterator[Piece | ProgressEvent | Result]:
        req, matcher = self.req, self._matcher
        text: list[str] = []
        tokens: list[int] = []
        texts: list[str] = []
        logprobs: list[TokenLogprob] = []
        t0 = time.perf_counter()
        try:
            while True:
                kind, value = await self._events.get()
                if kind == "done":
                    break
                if kind == "progress":
                    yield value
                    continue
                text.append(value.text)
                tokens += value.tokens
                texts += value.texts
                logprobs += value.logprobs
                yield value
            # (after an indentation cut, text the detokenizer holds lies past the cut)
            tail = matcher.feed("" if self._indented else self._detok.flush()) + matcher.flush()
            if tail:
                text.append(tail)
                if texts:  # the last token's text, held back until now
                    texts[-1] += tail
                yield Piece(tail, [], timings=self._timings_now())
        except BaseException:
            req.cancel()
            raise
        n_out, timed_out = self._n_out, self._timed_out
        gen = req.gen
        stats = gen.stats if gen is not None else SpecStats(prompt_tokens=len(self.prompt))
        reason = "stop" if matcher.hit is not None else "time_limit" if timed_out else (
            "length" if self._indented else
            gen.finish_reason if gen is not None and gen.finish_reason else "error")
        if req.error:
            reason = "error"
        elapsed = time.perf_counter() - t0
        yield Result(
            text="".join(text), finish_reason=reason, prompt_tokens=len(self.prompt),
            completion_tokens=n_out,
            cached_tokens=stats.cached_tokens, stats=stats, stopping_word=matcher.hit or "",
            error=req.error, slot=req.slot, tokens=tokens, texts=texts, logprobs=logprobs,
            timings={**llama_timings(stats, len(self.prompt) - stats.cached_tokens, n_out),
                     "total_ms": round(elapsed * 1000, 3)})


def llama_timings(stats: SpecStats, prompt_n: int, predicted_n: int) -> dict[str, Any]:
    """llama-server's `timings` of a request so far: `prompt_n` prompt tokens evaluated
    (not those from the cache), `predicted_n` generated. The rates are llama.cpp's: over
    the milliseconds reported, generation's over the tokens after the first (which comes
    out of the prompt's last pass)."""
    prompt_ms = round(stats.prefill_s * 1000, 3)
    predicted_ms = round(stats.decode_s * 1000, 3)
    steps = max(predicted_n - 1, 0)
    return {
        "cache_n": stats.cached_tokens, "prompt_n": prompt_n, "prompt_ms": prompt_ms,
        "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n > 0 else 0.0,
        "prompt_per_second": 1e3 / prompt_ms * prompt_n if prompt_ms > 0 else 0.0,
        "predicted_n": predicted_n, "predicted_ms": predicted_ms,
        "predicted_per_token_ms": predicted_ms / steps if steps > 0 else 0.0,
        "predicted_per_second": 1e3 / predicted_ms * steps if predicted_ms > 0 else 0.0,
        "draft_n": stats.drafted, "draft_n_accepted": stats.accepted,
    }
