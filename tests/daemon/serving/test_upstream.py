"""The forwarding engine (daemon/serving/upstream.py): server-sent events read as they
arrive, chunks into text and tool calls, the upstream's errors as specd's statuses, and a
request to a small aiohttp server standing in for the upstream."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from aiohttp import web

from specd.daemon.serving.service import Piece, Result
from specd.daemon.serving.upstream import (
    NEUTRAL,
    ChatPrompt,
    ChunkReader,
    OutputFormat,
    SSEParser,
    UpstreamClient,
    UpstreamError,
    UpstreamSpec,
    UpstreamStream,
    error_for,
    request_body,
)
from specd.daemon.spec.generation import GenerationParams
from specd.daemon.spec.sampling import SamplerParams
from specd.daemon.text.tool_calls import parse_tool_calls

TOKEN = "s3cret-upstream-token"
SEEN = web.AppKey("seen", list)


def test_sse_events_split_anywhere() -> None:
    wire = (b": keep-alive\r\n\r\ndata: {\"a\": 1}\r\n\r\nevent: x\ndata: line1\n"
            b"data: line2\n\ndata: \xc3\xa9t\xc3\xa9\n\ndata: [DONE]")
    for size in (1, 2, 5, len(wire)):  # the same events, whatever the chunks
        p = SSEParser()
        out = [d for i in range(0, len(wire), size) for d in p.feed(wire[i:i + size])]
        assert out + p.close() == ['{"a": 1}', "line1\nline2", "été", "[DONE]"]


def test_sse_event_too_big() -> None:
    p = SSEParser()
    with pytest.raises(ValueError, match="MiB"):
        p.feed(b"data: " + b"x" * (17 << 20))


def _chunk(content: str | None = None, **delta: Any) -> dict[str, Any]:
    if content is not None:
        delta["content"] = content
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": None}]}


def test_chunks_text_usage_and_tool_calls() -> None:
    r = ChunkReader("big")
    assert r.feed(_chunk("", role="assistant")) == ""
    assert r.feed(_chunk("Hel")) == "Hel" and r.feed(_chunk("lo")) == "lo"
    # a call's name and arguments in parts, as vLLM streams them
    r.feed(_chunk(tool_calls=[{"index": 0, "id": "c1", "type": "function",
                               "function": {"name": "get_time", "arguments": ""}}]))
    r.feed(_chunk(tool_calls=[{"index": 0, "function": {"arguments": '{"city": '}}]))
    r.feed(_chunk(tool_calls=[{"index": 0, "function": {"arguments": '"Oslo"}'}}]))
    r.feed({"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]})
    r.feed({"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 4}})
    text = r.calls_text()
    content, calls = parse_tool_calls("Hello" + text, {"get_time"})
    assert content == "Hello"
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_time", {"city": "Oslo"})]
    assert r.usage["prompt_tokens"] == 9 and r.finish == "tool_calls"


def test_error_chunk_raises() -> None:
    with pytest.raises(UpstreamError, match="'big' failed: boom"):
        ChunkReader("big").feed({"error": {"message": "boom", "code": 500}})


@pytest.mark.parametrize(("status", "body", "want", "says"), [
    (400, '{"error": {"message": "bad temperature"}}', 400, "'big': bad temperature"),
    (404, '{"object": "error", "message": "no model x"}', 404, "no model x"),  # vLLM's
    (422, '{"detail": "field required"}', 422, "field required"),
    (401, '{"error": {"message": "Invalid API Key"}}', 502, "refused specd's credentials"),
    (500, "Internal Server Error", 502, "failed (HTTP 500): Internal Server Error"),
    (503, "", 502, "no message"),
    (504, "gateway timeout", 504, "HTTP 504"),
])
def test_error_mapping(status: int, body: str, want: int, says: str) -> None:
    err = error_for("big", status, body)
    assert err.status == want and says in str(err)


def test_request_body_sends_only_what_was_asked() -> None:
    prompt = ChatPrompt([{"role": "assistant", "content": "x", "tool_calls": [
        {"function": {"name": "f", "arguments": {"a": 1}}}]}], tools=[{"type": "function"}],
        tool_choice="required", parallel_tool_calls=False,
        render={"continue_final_message": True})
    body = request_body("big", prompt, NEUTRAL, None, None)
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert not {"max_tokens", "temperature", "top_k", "seed", "stop"} & body.keys()
    assert body["tool_choice"] == "required" and body["parallel_tool_calls"] is False
    assert body["continue_final_message"] is True
    call = body["messages"][0]["tool_calls"][0]
    assert call["function"]["arguments"] == '{"a": 1}' and call["id"].startswith("call_")
    asked = GenerationParams(max_tokens=7, sampling=SamplerParams(temperature=0.0, top_k=5,
                                                                  seed=3))
    body = request_body("big", ChatPrompt([]), asked, ["\n"],
                        OutputFormat("json_schema", {"type": "object"}))
    assert (body["max_tokens"], body["temperature"], body["top_k"], body["seed"],
            body["stop"]) == (7, 0.0, 5, 3, ["\n"])
    assert body["response_format"]["json_schema"]["schema"] == {"type": "object"}


def test_spec_parse_keeps_token_out_of_repr() -> None:
    u = UpstreamSpec.parse("big=http://gpu:8000/v1/", TOKEN)
    assert u.endpoint == "http://gpu:8000/v1/chat/completions" and TOKEN not in repr(u)
    assert UpstreamSpec.parse("a=https://h").endpoint == "https://h/v1/chat/completions"
    for bad in ("big", "=http://h", "big=ftp://h", "big=gpu:8000"):
        with pytest.raises(ValueError, match="NAME=URL"):
            UpstreamSpec.parse(bad)


# -- against a stand-in upstream ----------------------------------------------------------
async def _fake_upstream(request: web.Request) -> web.StreamResponse:
    """Streams "Hello world" with usage, or fails as the request's first message says."""
    body = await request.json()
    request.app[SEEN].append((request.headers.get("Authorization"), body))
    how = body["messages"][0]["content"]
    if how == "reject":
        return web.json_response({"error": {"message": f"bad key {TOKEN}"}}, status=400)
    if how == "crash":
        return web.Response(status=500, text="kaput")
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for piece in ("Hello", " world"):
        await resp.write(f"data: {json.dumps(_chunk(piece))}\n\n".encode())
    if how == "cut":
        await resp.write(b"data: {not json\n\n")
    await resp.write(b'data: {"choices": [{"index": 0, "delta": {}, '
                     b'"finish_reason": "length"}]}\n\n')
    await resp.write(b'data: {"choices": [], "usage": {"prompt_tokens": 12, '
                     b'"completion_tokens": 2}}\n\ndata: [DONE]\n\n')
    return resp


async def _run(client: UpstreamClient, first: str) -> list[Piece | Result]:
    body = request_body(client.name, ChatPrompt([{"role": "user", "content": first}]),
                        NEUTRAL, None, None)
    return [ev async for ev in UpstreamStream(client, body)]  # type: ignore[misc]


def test_stream_against_a_stand_in(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        app = web.Application()
        app[SEEN] = []
        app.router.add_post("/v1/chat/completions", _fake_upstream)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        client = UpstreamClient(UpstreamSpec("big", f"http://127.0.0.1:{port}", TOKEN))
        try:
            *pieces, result = await _run(client, "hi")
            assert [p.text for p in pieces if isinstance(p, Piece)] == ["Hello", " world"]
            assert isinstance(result, Result) and result.error is None
            assert (result.text, result.finish_reason, result.prompt_tokens,
                    result.completion_tokens) == ("Hello world", "length", 12, 2)
            auth, sent = app[SEEN][-1]
            assert auth == f"Bearer {TOKEN}" and sent["model"] == "big"
            with pytest.raises(UpstreamError) as err:  # its 400, its message, no token
                await _run(client, "reject")
            assert err.value.status == 400 and TOKEN not in str(err.value)
            with pytest.raises(UpstreamError, match="HTTP 500") as err:
                await _run(client, "crash")
            assert err.value.status == 502
            *_, cut = await _run(client, "cut")  # a failure once the answer began
            assert isinstance(cut, Result) and cut.finish_reason == "error"
            assert "not JSON" in (cut.error or "")
        finally:
            await client.close()
            await runner.cleanup()
        down = UpstreamClient(UpstreamSpec("big", f"http://127.0.0.1:{port}", TOKEN))
        with pytest.raises(UpstreamError, match="'big' cannot be reached") as err:
            await _run(down, "hi")
        assert err.value.status == 502
        await down.close()

    with caplog.at_level("DEBUG"):
        asyncio.run(main())
    assert "cannot be reached" in caplog.text and TOKEN not in caplog.text
