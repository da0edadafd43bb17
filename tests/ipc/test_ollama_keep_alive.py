"""Ollama's keep_alive through the official `ollama` client against a live server: an
unload request, /api/ps before and after, a request's keep_alive (generating or
embedding), and the other dialects' view of an unloaded model."""

from __future__ import annotations

import time
from datetime import UTC, datetime

import pytest

from specd.daemon.serving.engine import EngineConfig

from live_server import LiveServer, live_server_in

ollama = pytest.importorskip("ollama")


@pytest.fixture(scope="module")
def server(tiny_model_factory, tmp_path_factory):
    path = tiny_model_factory(arch="qwen2", weight_type="Q8_0", seed=5, context_length=1024)
    cfg = EngineConfig(target=str(path), spec_type="ngram", n_ctx=512, slots=2,
                       embeddings=True)
    with live_server_in(tmp_path_factory, "ollama-keep-alive", cfg, keep_alive=300) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: LiveServer):
    headers = {"Authorization": f"Bearer {server.token}"} if server.token else None
    return ollama.Client(host=server.base_url, headers=headers)


def _unloaded(client) -> bool:
    return not client.ps().models


def _wait(cond, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert cond()


def test_keep_alive_0_unloads_and_the_next_request_reloads(client, server: LiveServer
                                                           ) -> None:
    model = client.list().models[0].model
    ask = {"model": model, "prompt": "hello", "options": {"num_predict": 8, "temperature": 0}}
    before = client.generate(**ask).response
    [loaded] = client.ps().models
    left = (loaded.expires_at - datetime.now(UTC)).total_seconds()
    assert loaded.model == model and 250 < left <= 300  # --keep-alive's 5 minutes
    out = client.generate(model=model, keep_alive=0)  # Ollama's unload request
    assert out.done and out.done_reason == "unload"
    _wait(lambda: _unloaded(client))
    assert client.list().models  # still listed: loaded again on use
    _, card = server.request("GET", "/v1/models")
    assert card["data"][0]["status"]["value"] == "unloaded"
    _, props = server.request("GET", "/props")
    assert props["loaded"] is False and props["is_sleeping"] is True
    assert client.generate(**ask).response == before  # reloaded, the same greedy text
    [again] = client.ps().models
    assert again.model == model
    _, card = server.request("GET", "/v1/models")
    assert card["data"][0]["status"]["value"] == "loaded"


def test_a_load_request_keeps_the_model_for_its_keep_alive(client) -> None:
    model = client.list().models[0].model
    out = client.chat(model=model, messages=[], keep_alive="1h")  # Ollama's load request
    assert out.done_reason == "load"
    [loaded] = client.ps().models
    assert 3500 < (loaded.expires_at - datetime.now(UTC)).total_seconds() <= 3600
    client.generate(model=model, prompt="hi", options={"num_predict": 2}, keep_alive=0.2)
    _wait(lambda: _unloaded(client))  # that request's keep_alive: 0.2 s once idle
    client.chat(model=model, messages=[], keep_alive=-1)
    [forever] = client.ps().models
    assert forever.expires_at.year > 2200  # never unloaded


def test_a_stream_running_when_unload_is_asked_runs_to_its_end(client) -> None:
    model = client.list().models[0].model
    ask = {"model": model, "prompt": "count", "stream": True,
           "options": {"num_predict": 64, "temperature": 0}}
    parts = client.generate(**ask)
    first = next(parts)
    assert client.generate(model=model, keep_alive=0).done_reason == "unload"
    rest = list(parts)
    assert rest[-1].done and rest[-1].eval_count == 64 and rest[-1].done_reason == "length"
    assert not first.done
    _wait(lambda: _unloaded(client))


def _expires_in(client) -> float:
    [loaded] = client.ps().models
    return (loaded.expires_at - datetime.now(UTC)).total_seconds()


def test_embedding_requests_take_keep_alive(client) -> None:
    model = client.list().models[0].model
    vector = client.embed(model=model, input="a cat", keep_alive="1h").embeddings[0]
    assert 3500 < _expires_in(client) <= 3600
    client.embed(model=model, input="a cat", keep_alive=0.2)
    _wait(lambda: _unloaded(client))  # 0.2 s once idle after it
    old = client.embeddings(model=model, prompt="a cat", keep_alive="2h").embedding
    assert 7100 < _expires_in(client) <= 7200  # the older route's keep_alive too
    client.embeddings(model=model, prompt="a cat", keep_alive=0)
    _wait(lambda: _unloaded(client))
    # reloaded on use: the same vectors (/api/embed's unit length, /api/embeddings' raw)
    again = client.embed(model=model, input="a cat").embeddings[0]
    assert again == pytest.approx(vector, abs=1e-5)
    assert len(old) == len(vector)
    assert 250 < _expires_in(client) <= 300  # none given: --keep-alive's


def test_a_bad_embedding_keep_alive_is_a_400(client) -> None:
    model = client.list().models[0].model
    for call in (lambda: client.embed(model=model, input="a", keep_alive="soon"),
                 lambda: client.embeddings(model=model, prompt="a", keep_alive="soon")):
        with pytest.raises(ollama.ResponseError) as err:
            call()
        assert err.value.status_code == 400 and "keep_alive" in err.value.error
