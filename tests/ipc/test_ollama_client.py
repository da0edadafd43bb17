"""The official `ollama` Python client against a live server with a tiny model
(embeddings on): every route it calls, streamed and whole, parsed by its own types."""

from __future__ import annotations

import pytest

from specd.daemon.serving.engine import EngineConfig

from live_server import LiveServer, live_server_in

ollama = pytest.importorskip("ollama")

# an enum and no other properties, so that the random model's call ends
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "enum": ["Oslo", "Lima"]}}, "required": ["city"],
        "additionalProperties": False}}}


@pytest.fixture(scope="module")
def server(tiny_model_factory, tmp_path_factory):
    path = tiny_model_factory(arch="qwen2", weight_type="Q8_0", seed=5, context_length=1024)
    cfg = EngineConfig(target=str(path), spec_type="ngram", n_ctx=512, slots=2,
                       embeddings=True)
    with live_server_in(tmp_path_factory, "ollama-client", cfg) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: LiveServer):
    headers = {"Authorization": f"Bearer {server.token}"} if server.token else None
    return ollama.Client(host=server.base_url, headers=headers)


@pytest.fixture(scope="module")
def model(client) -> str:
    """The name the client finds in /api/tags, as an app picks it."""
    return client.list().models[0].model


def test_list_ps_and_show(client, model: str, server: LiveServer) -> None:
    [listed] = client.list().models
    assert listed.details.format == "gguf" and listed.size > 0 and listed.digest
    [loaded] = client.ps().models
    assert loaded.model == model and loaded.context_length == 512 and loaded.size_vram == 0
    shown = client.show(model)
    assert "completion" in shown.capabilities and "embedding" in shown.capabilities
    assert shown.modelinfo["qwen2.context_length"] == 512
    assert shown.details.family == "qwen2"


def test_chat_whole_and_streamed(client, model: str) -> None:
    ask = {"model": model, "messages": [{"role": "user", "content": "hi"}],
           "options": {"num_predict": 6, "temperature": 0}}
    whole = client.chat(**ask)
    assert whole.done and whole.done_reason == "length" and whole.eval_count == 6
    assert whole.message.role == "assistant" and whole.total_duration > 0
    parts = list(client.chat(stream=True, **ask))
    assert [p.done for p in parts][-1] is True and not any(p.done for p in parts[:-1])
    assert "".join(p.message.content or "" for p in parts) == whole.message.content
    assert parts[-1].prompt_eval_count == whole.prompt_eval_count


def test_generate_whole_and_streamed(client, model: str) -> None:
    ask = {"model": model, "prompt": "hello", "options": {"num_predict": 5, "seed": 3}}
    whole = client.generate(**ask)
    assert whole.done and whole.eval_count == 5 and whole.context
    parts = list(client.generate(stream=True, **ask))
    assert parts[-1].done and "".join(p.response for p in parts) == whole.response


def test_embed(client, model: str) -> None:
    out = client.embed(model=model, input=["a cat", "a dog"])
    assert len(out.embeddings) == 2 and len(out.embeddings[0]) > 8


def test_a_tool_call_parsed_by_the_clients_types(client, model: str) -> None:
    # Ollama's API cannot force a call, and a random model does not call on its own: the
    # client's own request method sends specd's tool_choice alongside what chat() sends
    ask = {"model": model, "stream": False, "tools": [TIME_TOOL],
           "tool_choice": {"type": "function", "function": {"name": "get_time"}},
           "options": {"num_predict": 300, "temperature": 0},
           "messages": [{"role": "user", "content": "time in Oslo?"}]}
    out = client._request(ollama.ChatResponse, "POST", "/api/chat", json=ask)
    [call] = out.message.tool_calls
    assert call.function.name == "get_time" and call.function.arguments["city"] in (
        "Oslo", "Lima")
    # the round trip: the call and its result sent back through chat() with the tools
    again = client.chat(model=model, tools=[TIME_TOOL], options={"num_predict": 3}, messages=[
        {"role": "user", "content": "time in Oslo?"}, out.message,
        {"role": "tool", "content": "12:00", "tool_name": "get_time"}])
    assert again.done


def test_an_unknown_model_is_a_404_response_error(client) -> None:
    with pytest.raises(ollama.ResponseError) as exc:
        client.chat(model="llama3:8b", messages=[{"role": "user", "content": "hi"}])
    assert exc.value.status_code == 404 and exc.value.error == "model 'llama3:8b' not found"
    with pytest.raises(ollama.ResponseError) as exc:
        client.show("llama3:8b")
    assert exc.value.status_code == 404
