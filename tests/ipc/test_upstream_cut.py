"""An upstream that fails after its answer began: a real aiohttp server on loopback (the
fake upstream) sends the first chunks of a streamed answer, then drops the connection
or sends an error event. specd's stream then ends with each dialect's error, as its
official client reads one (OpenAI's `error` object, Anthropic's `event: error`, the
Responses API's `response.failed`, Ollama's {"error"} line), after the text that came;
a whole answer is a 502 naming the upstream, never a 500 or a broken connection."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from aiohttp import web

from specd.daemon.serving.engine import EngineConfig
from specd.daemon.serving.upstream import UpstreamSpec

from live_server import LiveServer, free_port, live_server

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
ollama = pytest.importorskip("ollama")

ASK = [{"role": "user", "content": "Say hello"}]
SENT = ["Hello", " wor"]  # the chunks the upstream sends before it fails
HOW = web.AppKey("how", str)  # the fake upstream's failure: "drop" or "error"


def _chunk(**delta: Any) -> bytes:
    chunk = {"id": "c", "object": "chat.completion.chunk", "model": "cut",
             "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}
    return f"data: {json.dumps(chunk)}\n\n".encode()


async def _answer(request: web.Request) -> web.StreamResponse:
    """The first chunks of an answer, then the model's failure: "drop" closes the
    connection mid-answer, "error" sends an error event (as vLLM and llama-server do)."""
    how = request.app[HOW]
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    await resp.write(_chunk(role="assistant", content=""))
    for text in SENT:
        await resp.write(_chunk(content=text))
    if how == "error":
        await resp.write(b'data: {"error": {"message": "the GPU fell over", '
                         b'"type": "server_error", "code": 500}}\n\n')
        return resp
    assert request.transport is not None
    request.transport.close()  # mid-answer: no final chunk, no end of the chunked body
    return resp


class FakeUpstream:
    """The fake upstream, on its own event loop in a thread."""

    def __init__(self, how: str):
        self.port = free_port()
        self.how = how
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app[HOW] = self.how
        app.router.add_post("/v1/chat/completions", _answer)
        self._runner = web.AppRunner(app)
        self._loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, "127.0.0.1", self.port)
        self._loop.run_until_complete(site.start())
        self._ready.set()
        self._loop.run_forever()

    def __enter__(self) -> FakeUpstream:
        self._thread.start()
        assert self._ready.wait(30)
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)


@pytest.fixture(scope="module")
def server(tiny_model_factory, tmp_path_factory) -> Iterator[LiveServer]:
    with FakeUpstream("drop") as drop, FakeUpstream("error") as error:
        path = tiny_model_factory(arch="qwen2", weight_type="Q8_0", seed=5,
                                  context_length=1024)
        cfg = EngineConfig(target=str(path), spec_type="none", n_ctx=512, slots=1)
        specs = [UpstreamSpec("drop", f"http://127.0.0.1:{drop.port}"),
                 UpstreamSpec("error", f"http://127.0.0.1:{error.port}")]
        with live_server(cfg, tmp_path_factory.mktemp("cut"), upstreams=specs) as srv:
            yield srv


def _why(model: str) -> str:
    """What the error says of each failure."""
    return "the answer was cut" if model == "drop" else "the GPU fell over"


MODELS = pytest.mark.parametrize("model", ["drop", "error"])


@MODELS
def test_openai_stream_ends_with_an_error_object(server: LiveServer, model: str) -> None:
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key=server.token or "x",
                           max_retries=0)
    text = []
    with pytest.raises(openai.APIError) as err:
        for chunk in client.chat.completions.create(model=model, messages=ASK, stream=True):
            text.append(chunk.choices[0].delta.content or "")
    assert "".join(text) == "".join(SENT)
    assert _why(model) in err.value.message and f"{model!r}" in err.value.message
    assert err.value.body["type"] == "server_error" and err.value.body["code"] == 502


@MODELS
def test_anthropic_stream_ends_with_an_error_event(server: LiveServer, model: str) -> None:
    client = anthropic.Anthropic(base_url=server.base_url, api_key=server.token or "x",
                                 max_retries=0)
    text = []
    with pytest.raises(anthropic.APIStatusError) as err:
        with client.messages.stream(model=model, messages=ASK, max_tokens=16) as stream:
            for piece in stream.text_stream:
                text.append(piece)
    assert "".join(text) == "".join(SENT)
    assert err.value.body["type"] == "error"
    assert err.value.body["error"]["type"] == "api_error"
    assert _why(model) in err.value.body["error"]["message"]


@MODELS
def test_responses_stream_ends_failed(server: LiveServer, model: str) -> None:
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key=server.token or "x",
                           max_retries=0)
    events = list(client.responses.create(model=model, input="Say hello", stream=True))
    assert events[-1].type == "response.failed"
    assert _why(model) in events[-1].response.error.message
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == "".join(SENT)


@MODELS
def test_ollama_stream_ends_with_an_error_line(server: LiveServer, model: str) -> None:
    client = ollama.Client(host=server.base_url,
                           headers={"Authorization": f"Bearer {server.token}"})
    text = []
    with pytest.raises(ollama.ResponseError) as err:
        for part in client.chat(model=model, messages=ASK, stream=True):
            text.append(part.message.content)
    assert "".join(text) == "".join(SENT) and _why(model) in err.value.error


@MODELS
@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/messages", "/api/chat",
                                   "/v1/responses"])
def test_a_whole_answer_is_a_502_naming_the_upstream(server: LiveServer, model: str,
                                                     route: str) -> None:
    body = {"model": model, "messages": ASK, "max_tokens": 16, "stream": False,
            "input": "Say hello"}
    if route == "/v1/responses":
        del body["messages"], body["max_tokens"]
    status, out = server.request("POST", route, body)
    assert status == 502, out
    message = out["error"] if route == "/api/chat" else out["error"]["message"]
    assert _why(model) in message and f"{model!r}" in message
