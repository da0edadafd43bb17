"""The streaming core the dialects share: a request's choices collected whole, or
streamed in the dialect's shape (as server-sent events, or Ollama's NDJSON lines), every
generation cancelled once its response ends (finished, failed, or the client went away)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from aiohttp import web

from specd.daemon.serving.facade import ServiceFacade
from specd.daemon.serving.service import Piece, ProgressEvent, Result, TextStream
from specd.daemon.spec.generation import GenerationParams

from ..jsonout import dumps
from ..validation import BadRequest
from .state import SHUTDOWN_MESSAGE, shutting_down


@dataclass(frozen=True)
class Named:
    """A payload sent under an SSE event name (an `event:` line before its data), as
    the Responses API's typed events are."""

    event: str
    data: Any


class EventWriter(Protocol):
    """A dialect's streamed events: the payloads each of the streams' events becomes
    (a str is sent as it is, a Named under its name, anything else as JSON).

    A writer may also define `error(message, code) -> list[Any]`: a failure's events in
    its dialect's shape (else its framing's error payload)."""

    def opening(self) -> list[Any]:
        """Sent before any stream's event."""
        ...

    def event(self, index: int, ev: Piece | ProgressEvent) -> list[Any]:
        """For stream `index`'s text or progress."""
        ...

    def finished(self, index: int, result: Result) -> list[Any]:
        """For stream `index`'s end."""
        ...

    def failing(self, index: int) -> list[Any]:
        """What stream `index` held back, sent before the error event ends the response."""
        ...

    def closing(self) -> list[Any]:
        """Sent after every stream finished (OpenAI's "[DONE]")."""
        ...


@dataclass(frozen=True)
class Framing:
    """How a stream's payloads go on the wire: its content type, one payload's bytes
    (its data as text, and its event name if it has one), and the payload that reports an
    error (message, HTTP-like code) mid-stream."""

    content_type: str
    frame: Callable[[str, str | None], bytes]
    error: Callable[[str, int], Any]

    async def start(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": self.content_type,
                                           "Cache-Control": "no-cache"})
        await resp.prepare(request)
        return resp

    async def send(self, resp: web.StreamResponse, payloads: list[Any]) -> None:
        """Each payload (a str is sent as it is, a Named under its name, anything else as
        JSON)."""
        for payload in payloads:
            event = None
            if isinstance(payload, Named):
                event, payload = payload.event, payload.data
            await resp.write(self.frame(payload if isinstance(payload, str) else dumps(payload),
                                        event))


def _sse_frame(data: str, event: str | None) -> bytes:
    head = "" if event is None else f"event: {event}\n"
    return f"{head}data: {data}\n\n".encode()


def _sse_error(message: str, code: int) -> dict[str, Any]:
    """An error event, as llama.cpp's server and OpenAI's send one."""
    etype = "unavailable_error" if code == 503 else "server_error"
    return {"error": {"code": code, "message": message, "type": etype}}


# server-sent events (OpenAI's and llama.cpp's streams)
SSE = Framing("text/event-stream", _sse_frame, _sse_error)
# one JSON object a line (Ollama's streams), an error as Ollama's {"error": message}
NDJSON = Framing("application/x-ndjson", lambda data, event: f"{data}\n".encode(),
                 lambda message, code: {"error": message})


async def collect(request: web.Request, svc: ServiceFacade, prompt: list[int],
                  choices: list[GenerationParams], **kw: Any) -> list[Result]:
    """Each choice's whole result (`kw`: Service.submit's options); an error raises (an
    upstream's failure with its status), a generation the shutdown cancelled is a
    503."""
    return list(await asyncio.gather(*(_collect_one(request, svc, prompt, p, **kw)
                                       for p in choices)))


async def _collect_one(request: web.Request, svc: ServiceFacade, prompt: list[int],
                       params: GenerationParams, **kw: Any) -> Result:
    result: Result | None = None
    async for ev in svc.generate(prompt, params, **kw):
        if isinstance(ev, Result):
            result = ev
    assert result is not None
    if result.error and result.error_status != 500:  # an upstream's, with its status
        raise BadRequest(result.error, status=result.error_status, code="upstream_error")
    if result.error:
        raise RuntimeError(result.error)
    if shutting_down(request, result):
        raise BadRequest(SHUTDOWN_MESSAGE, status=503, code="unavailable")
    return result


def submit_all(svc: ServiceFacade, prompt: list[int], choices: list[GenerationParams],
               **kw: Any) -> list[TextStream]:
    """Each choice queued before the response starts, so that a full queue is still a
    503 the client can retry; should one fail, those queued are cancelled."""
    streams: list[TextStream] = []
    try:
        for params in choices:
            streams.append(svc.submit(prompt, params, **kw))
    except BaseException:
        for stream in streams:
            stream.cancel()
        raise
    return streams


async def stream_events(request: web.Request, streams: list[TextStream], writer: EventWriter,
                        framing: Framing = SSE) -> web.StreamResponse:
    """The streams' events, shaped by `writer`, framed by `framing`. A failure after the
    stream began is an error event, never a normal finish; the streams are cancelled when
    this ends (a no-op for those finished)."""
    try:
        for stream in streams:  # (an upstream that cannot answer is still a status)
            await stream.started()
        resp = await framing.start(request)
        send = framing.send
        await send(resp, writer.opening())
        async for i, ev in _merged(streams):
            if not isinstance(ev, Result):
                await send(resp, writer.event(i, ev))
            elif ev.error or shutting_down(request, ev):
                await send(resp, writer.failing(i))
                message, code = ((ev.error, ev.error_status) if ev.error
                                 else (SHUTDOWN_MESSAGE, 503))
                shaped = getattr(writer, "error", None)  # the dialect's own error events
                await send(resp, shaped(message, code) if shaped is not None
                           else [framing.error(message, code)])
                break
            else:
                await send(resp, writer.finished(i, ev))
        else:
            await send(resp, writer.closing())
        await resp.write_eof()
        return resp
    finally:
        for stream in streams:
            stream.cancel()


def timed(timings: dict[str, Any] | None) -> dict[str, Any]:
    """An event's "timings" field, where the request asked for them per token."""
    return {} if timings is None else {"timings": timings}


async def _merged(streams: list[TextStream]
                  ) -> AsyncIterator[tuple[int, Piece | ProgressEvent | Result]]:
    """(index, event) of several streams as the events come."""
    if len(streams) == 1:
        async for ev in streams[0]:
            yield 0, ev
        return
    queue: asyncio.Queue[tuple[int, Piece | ProgressEvent | Result | None]] = asyncio.Queue()

    async def pump(i: int, stream: TextStream) -> None:
        try:
            async for ev in stream:
                await queue.put((i, ev))
        finally:
            await queue.put((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            i, item = await queue.get()
            if item is None:
                running -= 1
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
