"""ipc/http/streaming.py, the core both dialects stream through: the writer's payloads in
order, an error event (never a normal finish) for a failed generation, and every stream
cancelled once the response ends or could not begin."""

from __future__ import annotations

import asyncio
import json
from typing import Any, cast

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from specd.daemon.serving.facade import ServiceFacade
from specd.daemon.serving.scheduler import QueueFull
from specd.daemon.serving.service import Piece, ProgressEvent, Result, Stream
from specd.daemon.spec.generation import GenerationParams
from specd.daemon.spec.stats import SpecStats
from specd.ipc.http import streaming
from specd.ipc.http.state import LIVE
from specd.ipc.http.streaming import NDJSON, Framing, stream_events, submit_all
from specd.ipc.service_view import LiveRequests

from scripted_stream import ScriptedStream


class _Writer:
    """Names each event it is given, and holds text back to show `failing`."""

    def opening(self) -> list[Any]:
        return [{"open": True}]

    def event(self, index: int, ev: Piece | ProgressEvent) -> list[Any]:
        assert isinstance(ev, Piece)
        return [{"text": ev.text, "index": index}]

    def finished(self, index: int, result: Result) -> list[Any]:
        return [{"finish": result.finish_reason, "index": index}]

    def failing(self, index: int) -> list[Any]:
        return [{"held": index}]

    def closing(self) -> list[Any]:
        return ["[DONE]"]


def _result(error: str | None = None) -> Result:
    return Result(text="ab", finish_reason="error" if error else "stop", prompt_tokens=1,
                  completion_tokens=2, cached_tokens=0, stats=SpecStats(), error=error)


def _body(streams: list[ScriptedStream], writer: Any = None, framing: Framing | None = None
          ) -> tuple[str, str]:
    """(content type, body) of the response stream_events sends for `streams`."""
    async def handler(request: web.Request) -> web.StreamResponse:
        return await stream_events(request, cast(list[Stream], streams), writer or _Writer(),
                                   *(() if framing is None else (framing,)))

    async def run() -> tuple[str, str]:
        app = web.Application()
        app[LIVE] = LiveRequests()
        app.router.add_get("/", handler)
        async with TestClient(TestServer(app)) as client:
            resp = await client.get("/")
            return resp.headers["Content-Type"], await resp.text()

    return asyncio.run(run())


def _raw(streams: list[ScriptedStream], writer: Any) -> str:
    """The SSE response's text."""
    content_type, body = _body(streams, writer)
    assert content_type == "text/event-stream"
    return body


def _sse(streams: list[ScriptedStream]) -> list[Any]:
    """The data lines of the SSE response stream_events sends for `streams`."""
    lines = [line[len("data: "):] for line in _raw(streams, _Writer()).split("\n\n") if line]
    return [line if line == "[DONE]" else json.loads(line) for line in lines]


def test_the_writers_payloads_come_in_order_and_the_streams_end_cancelled() -> None:
    streams = [ScriptedStream([Piece("a", [1]), Piece("b", [2]), _result()])]
    assert _sse(streams) == [{"open": True}, {"text": "a", "index": 0},
                             {"text": "b", "index": 0}, {"finish": "stop", "index": 0},
                             "[DONE]"]
    assert streams[0].cancelled  # a no-op on a finished request, but always done


def test_a_failed_generation_is_an_error_event_after_what_was_held() -> None:
    streams = [ScriptedStream([Piece("a", [1]), _result("boom")]),
               ScriptedStream([Piece("x", [3])])]
    out = _sse(streams)
    assert out[-2:] == [{"held": 0}, {"error": {"code": 500, "message": "boom",
                                                "type": "server_error"}}]
    assert "[DONE]" not in out
    assert all(s.cancelled for s in streams)


def test_named_payloads_get_event_lines_and_a_writer_can_shape_its_error() -> None:
    class Named(_Writer):
        def event(self, index: int, ev: Piece | ProgressEvent) -> list[Any]:
            return [streaming.Named("delta", {"text": ev.text})]

        def error(self, message: str, code: int) -> list[Any]:
            return [streaming.Named("failed", {"why": message, "code": code})]

    ok = _raw([ScriptedStream([Piece("a", [1]), _result()])], Named())
    assert 'event: delta\ndata: {"text":"a"}\n\n' in ok
    failed = _raw([ScriptedStream([Piece("a", [1]), _result("boom")])], Named())
    assert failed.endswith('event: failed\ndata: {"why":"boom","code":500}\n\n')
    assert '"error"' not in failed


def test_a_full_queue_cancels_the_choices_already_queued() -> None:
    queued: list[ScriptedStream] = []

    class Service:
        def submit(self, prompt: list[int], params: GenerationParams, **kw: Any) -> ScriptedStream:
            if len(queued) == 2:
                raise QueueFull("the queue is full")
            queued.append(ScriptedStream([]))
            return queued[-1]

    with pytest.raises(QueueFull):
        submit_all(cast(ServiceFacade, Service()), [1], [GenerationParams()] * 3)
    assert len(queued) == 2 and all(s.cancelled for s in queued)


def test_ndjson_framing_is_one_object_a_line_and_an_error_in_ollamas_shape() -> None:
    content_type, body = _body([ScriptedStream([Piece("a", [1]), _result("boom")])],
                               framing=NDJSON)
    assert content_type == "application/x-ndjson"
    assert body.endswith("\n") and "data:" not in body
    assert [json.loads(line) for line in body.splitlines()] == [
        {"open": True}, {"text": "a", "index": 0}, {"held": 0}, {"error": "boom"}]
