"""ipc/http/anthropic_routes.py: the message object, the stream's named events in
Anthropic's order (text, tool_use, stop reasons, usage), and errors in Anthropic's shape."""

from __future__ import annotations

import asyncio
import json
from typing import Any, cast

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from specd.daemon.serving.facade import ServiceFacade
from specd.daemon.serving.service import Piece, Result, Stream
from specd.daemon.spec.stats import SpecStats
from specd.ipc.http.anthropic_routes import _Reply, error_body
from specd.ipc.http.state import LIVE
from specd.ipc.http.streaming import stream_events
from specd.ipc.service_view import LiveRequests

from scripted_stream import ScriptedStream

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


class _Svc:
    model_name = "tiny"


def _result(text: str, reason: str = "stop", *, word: str = "", error: str | None = None
            ) -> Result:
    return Result(text=text, finish_reason=reason, prompt_tokens=9, completion_tokens=4,
                  cached_tokens=3, stats=SpecStats(), stopping_word=word, error=error)


def _reply(names: set[str] | None = None) -> _Reply:
    return _Reply(cast(ServiceFacade, _Svc()), names=names, prompt_tokens=9)


def _sse(pieces: list[str], result: Result, names: set[str] | None = None
         ) -> list[tuple[str, dict[str, Any]]]:
    """(event name, data) of each event the stream of `pieces` then `result` sends."""
    events: list[Piece | Result] = [Piece(p, [1]) for p in pieces] + [result]

    async def handler(request: web.Request) -> web.StreamResponse:
        return await stream_events(request, [cast(Stream, ScriptedStream(events))], _reply(names))

    async def run() -> str:
        app = web.Application()
        app[LIVE] = LiveRequests()
        app.router.add_get("/", handler)
        async with TestClient(TestServer(app)) as client:
            return await (await client.get("/")).text()

    out = []
    for chunk in asyncio.run(run()).split("\n\n"):
        if chunk:
            name, data = chunk.split("\n")
            assert name.startswith("event: ") and data.startswith("data: ")
            payload = json.loads(data[len("data: "):])
            assert payload["type"] == name[len("event: "):]
            out.append((name[len("event: "):], payload))
    return out


def test_a_text_stream_is_anthropics_event_sequence() -> None:
    events = _sse(["Hel", "lo"], _result("Hello", "length"))
    assert [name for name, _ in events] == [
        "message_start", "content_block_start", "content_block_delta",
        "content_block_delta", "content_block_stop", "message_delta", "message_stop"]
    start = events[0][1]["message"]
    assert start["id"].startswith("msg_") and start["content"] == []
    assert start["role"] == "assistant" and start["model"] == "tiny"
    assert start["usage"] == {"input_tokens": 9, "output_tokens": 0}
    assert events[1][1] == {"type": "content_block_start", "index": 0,
                            "content_block": {"type": "text", "text": ""}}
    assert [e["delta"] for _, e in events[2:4]] == [{"type": "text_delta", "text": "Hel"},
                                                    {"type": "text_delta", "text": "lo"}]
    assert events[4][1] == {"type": "content_block_stop", "index": 0}
    assert events[5][1] == {
        "type": "message_delta",
        "delta": {"stop_reason": "max_tokens", "stop_sequence": None},
        "usage": {"input_tokens": 6, "cache_creation_input_tokens": 0,
                  "cache_read_input_tokens": 3, "output_tokens": 4}}


def test_a_streamed_tool_call_is_a_tool_use_block_after_the_text() -> None:
    pieces = ["Checking.\n", CALL[:12], CALL[12:]]
    events = _sse(pieces, _result("Checking.\n" + CALL), names={"get_weather"})
    assert [(n, e.get("index")) for n, e in events] == [
        ("message_start", None), ("content_block_start", 0), ("content_block_delta", 0),
        ("content_block_stop", 0), ("content_block_start", 1), ("content_block_delta", 1),
        ("content_block_stop", 1), ("message_delta", None), ("message_stop", None)]
    assert events[2][1]["delta"]["text"] == "Checking.\n"  # the call's text held back
    block = events[4][1]["content_block"]
    assert block["type"] == "tool_use" and block["name"] == "get_weather"
    assert block["id"].startswith("toolu_") and block["input"] == {}
    delta = events[5][1]["delta"]
    assert delta["type"] == "input_json_delta"
    assert json.loads(delta["partial_json"]) == {"city": "Paris"}
    assert events[7][1]["delta"]["stop_reason"] == "tool_use"


def test_a_call_alone_opens_no_text_block_and_a_stop_sequence_is_named() -> None:
    events = _sse([CALL], _result(CALL), names={"get_weather"})
    assert [e["content_block"]["type"] for n, e in events if n == "content_block_start"] == [
        "tool_use"]
    events = _sse(["1, 2"], _result("1, 2", word="END"))
    assert events[-2][1]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "END"}
    events = _sse(["done"], _result("done"))
    assert events[-2][1]["delta"]["stop_reason"] == "end_turn"


def test_a_failed_generation_ends_with_anthropics_error_event() -> None:
    events = _sse(["partial"], _result("partial", "error", error="boom"))
    assert [n for n, _ in events] == ["message_start", "content_block_start",
                                      "content_block_delta", "content_block_stop", "error"]
    assert events[-1][1] == {"type": "error",
                             "error": {"type": "api_error", "message": "boom"}}


def test_the_whole_message() -> None:
    msg = _reply({"get_weather"}).whole(_result("Checking.\n" + CALL))
    assert msg["type"] == "message" and msg["id"].startswith("msg_")
    assert msg["content"][0] == {"type": "text", "text": "Checking."}
    use = msg["content"][1]
    assert (use["type"], use["name"], use["input"]) == ("tool_use", "get_weather",
                                                        {"city": "Paris"})
    assert use["id"].startswith("toolu_")
    assert (msg["stop_reason"], msg["stop_sequence"]) == ("tool_use", None)
    assert msg["usage"]["input_tokens"] + msg["usage"]["cache_read_input_tokens"] == 9
    plain = _reply().whole(_result(CALL, "length"))  # no tools: the text as it came
    assert plain["content"] == [{"type": "text", "text": CALL}]
    assert plain["stop_reason"] == "max_tokens"
    assert _reply().whole(_result(""))["content"] == []


def test_errors_in_anthropics_shape() -> None:
    for status, etype in ((400, "invalid_request_error"), (401, "authentication_error"),
                          (404, "not_found_error"), (408, "invalid_request_error"),
                          (413, "request_too_large"), (500, "api_error"),
                          (503, "overloaded_error")):
        assert error_body(status, "why", "code", "param") == {
            "type": "error", "error": {"type": etype, "message": "why"}}
