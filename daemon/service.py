"""Requests as the protocols see them: text in, a stream of text pieces out.

`Service.generate()` submits a request to the scheduler and yields `Piece`s (new text,
token ids) and a final `Result`, applying stop strings and streaming-safe detokenization.
Protocol layers (ipc/) only format these.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from .detokenize import IncrementalDetokenizer
from .engine import Engine
from .generation import GenerationParams, check_prompt_fits
from .grammar import Grammar, compile_constraint
from .scheduler import Request, Scheduler
from .stats import SpecStats


@dataclass
class Piece:
    text: str
    tokens: list[int]


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
    timings: dict[str, Any] = field(default_factory=dict)


class StopMatcher:
    """Finds stop strings in streamed text, holding back a tail that may start one."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self._held = ""
        self.hit: str | None = None

    def feed(self, text: str) -> str:
        """New text -> the part safe to emit now (everything before any stop string)."""
        if self.hit is not None:
            return ""
        buf = self._held + text
        best = None
        for s in self.stops:
            i = buf.find(s)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is not None:
            self.hit = best[1]
            self._held = ""
            return buf[: best[0]]
        keep = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(buf)), 0, -1):
                if buf.endswith(s[:n]):
                    keep = max(keep, n)
                    break
        self._held = buf[len(buf) - keep:] if keep else ""
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        out, self._held = ("" if self.hit else self._held), ""
        return out


class Service:
    def __init__(self, engine: Engine, scheduler: Scheduler):
        self.engine = engine
        self.scheduler = scheduler
        self.started = time.time()

    @property
    def tokenizer(self):  # noqa: ANN201
        return self.engine.tokenizer

    async def compile_constraint(self, kind: str, spec: Any) -> Grammar:
        """Compile off the event loop (the first use builds llguidance's tokenizer)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, compile_constraint, kind, spec, self.tokenizer)

    def check_prompt(self, prompt: list[int]) -> None:
        """RequestError unless the prompt fits the context (before queueing it)."""
        check_prompt_fits(prompt, self.engine.n_ctx)

    async def generate(self, prompt: list[int], params: GenerationParams, *,
                       stop: list[str] | None = None, cache_prompt: bool = True,
                       t_max_ms: float | None = None,
                       grammar: Grammar | None = None) -> AsyncIterator[Piece | Result]:
        """Yields Pieces as text becomes final, then one Result. Cancel by closing."""
        self.check_prompt(prompt)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        req = Request(
            prompt=prompt, params=params, cache_prompt=cache_prompt, grammar=grammar,
            deadline=None if not t_max_ms else time.monotonic() + t_max_ms / 1000.0,
            on_tokens=lambda toks: loop.call_soon_threadsafe(events.put_nowait, ("tok", toks)),
            on_done=lambda r: loop.call_soon_threadsafe(events.put_nowait, ("done", r)),
        )
        self.scheduler.submit(req)
        detok = IncrementalDetokenizer(self.tokenizer)
        matcher = StopMatcher(stop or [])
        eog = self.engine.eog_ids
        text: list[str] = []
        t0 = time.perf_counter()
        try:
            while True:
                kind, value = await events.get()
                if kind == "done":
                    break
                raw = "".join(detok.push(t) for t in value if t not in eog)
                out = matcher.feed(raw)
                if matcher.hit is not None:
                    req.cancel()
                if out or value:
                    text.append(out)
                    yield Piece(out, list(value))
            tail = matcher.feed(detok.flush()) + matcher.flush()
            if tail:
                text.append(tail)
                yield Piece(tail, [])
        except BaseException:
            req.cancel()
            raise
        gen = req.gen
        stats = gen.stats if gen is not None else SpecStats(prompt_tokens=len(prompt))
        reason = "stop" if matcher.hit is not None else (
            gen.finish_reason if gen is not None and gen.finish_reason else "error")
        if req.error:
            reason = "error"
        elapsed = time.perf_counter() - t0
        yield Result(
            text="".join(text), finish_reason=reason, prompt_tokens=len(prompt),
            completion_tokens=len(gen.tokens) if gen is not None else 0,
            cached_tokens=stats.cached_tokens, stats=stats, stopping_word=matcher.hit or "",
            error=req.error,
            timings={
                "prompt_n": len(prompt) - stats.cached_tokens,
                "prompt_ms": round(stats.prefill_s * 1000, 3),
                "prompt_per_second": round(stats.prefill_tps, 3),
                "predicted_n": stats.generated_tokens,
                "predicted_ms": round(stats.decode_s * 1000, 3),
                "predicted_per_second": round(stats.decode_tps, 3),
                "draft_n": stats.drafted, "draft_n_accepted": stats.accepted,
                "total_ms": round(elapsed * 1000, 3),
            })
