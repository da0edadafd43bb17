"""The official anthropic SDK against a real server on loopback (a tiny random-weight
model): messages, a stream, a tool-use round trip, count_tokens, errors in Anthropic's
shape, and the token sent as x-api-key where one is required."""

from __future__ import annotations

from typing import Any

import pytest

from specd.daemon.serving.engine import EngineConfig

from live_server import LiveServer, live_server, live_server_in

anthropic = pytest.importorskip("anthropic")

WEATHER = {"name": "get_weather", "description": "Weather in a city",
           "input_schema": {"type": "object", "additionalProperties": False,
                            "properties": {"city": {"enum": ["Paris", "Tokyo"]}},
                            "required": ["city"]}}
# sampling settings go in extra_body: the SDK's signatures dropped them (newer Claude
# models take none), the API still reads them
ASK = {"model": "specd", "extra_body": {"temperature": 0},
       "messages": [{"role": "user", "content": "Say hello"}]}


@pytest.fixture(scope="module")
def tiny_path(tiny_model_factory):
    return tiny_model_factory(arch="qwen2", weight_type="Q8_0", seed=5, context_length=1024)


@pytest.fixture(scope="module")
def server(tiny_path, tmp_path_factory):
    cfg = EngineConfig(target=str(tiny_path), spec_type="ngram", n_ctx=512, slots=1)
    with live_server_in(tmp_path_factory, "anthropic", cfg) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: LiveServer):
    return anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)


def _text(msg: Any) -> str:
    return "".join(b.text for b in msg.content if b.type == "text")


def test_messages_create_answers_as_the_chat_completion_does(client, server) -> None:
    msg = client.messages.create(max_tokens=12, system="Be brief.", **ASK)
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_")
    assert msg.model == server.service.engine.model_name
    assert msg.stop_reason in ("end_turn", "max_tokens")
    assert 0 < msg.usage.output_tokens <= 12
    # the same chat through OpenAI's route: the same prompt, the same greedy reply
    status, chat = server.request("POST", "/v1/chat/completions", {
        "max_tokens": 12, "temperature": 0, "messages": [
            {"role": "system", "content": "Be brief."}, *ASK["messages"]]})
    assert status == 200, chat
    assert _text(msg) == chat["choices"][0]["message"]["content"]
    assert msg.usage.output_tokens == chat["usage"]["completion_tokens"]
    assert (msg.usage.input_tokens + msg.usage.cache_read_input_tokens
            == chat["usage"]["prompt_tokens"])
    count = client.messages.count_tokens(model="specd", system="Be brief.",
                                         messages=ASK["messages"])
    assert count.input_tokens == chat["usage"]["prompt_tokens"]


def test_messages_stream_gives_the_text_and_the_final_message(client) -> None:
    whole = client.messages.create(max_tokens=10, **ASK)
    with client.messages.stream(max_tokens=10, **ASK) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "message_delta" in kinds
    streamed = "".join(e.delta.text for e in events
                       if e.type == "content_block_delta" and e.delta.type == "text_delta")
    assert streamed == _text(final) == _text(whole)
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_a_tool_use_round_trip(client) -> None:
    ask = {"model": "specd", "max_tokens": 200, "extra_body": {"temperature": 0},
           "tools": [WEATHER],
           "messages": [{"role": "user", "content": "Weather in Paris?"}]}
    # one call (a random model forced to call may go on calling until max_tokens)
    forced = {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}
    msg = client.messages.create(tool_choice=forced, **ask)
    assert msg.stop_reason == "tool_use", msg.model_dump()
    use = next(b for b in msg.content if b.type == "tool_use")
    assert use.name == "get_weather" and use.id.startswith("toolu_")
    assert use.input["city"] in ("Paris", "Tokyo")
    with client.messages.stream(
            tool_choice={"type": "any", "disable_parallel_tool_use": True}, **ask) as stream:
        final = stream.get_final_message()
    streamed = [b for b in final.content if b.type == "tool_use"]
    assert final.stop_reason == "tool_use"
    assert [(b.name, set(b.input)) for b in streamed] == [("get_weather", {"city"})]
    # the result goes back: the conversation goes on through the template
    follow = client.messages.create(**{**ask, "messages": [
        *ask["messages"],
        {"role": "assistant", "content": [b.model_dump() for b in msg.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                      "content": "sunny, 25 C"}]}]})
    assert follow.type == "message" and follow.stop_reason in ("end_turn", "max_tokens",
                                                               "tool_use")
    with_result = client.messages.count_tokens(model="specd", tools=[WEATHER], messages=[
        *ask["messages"],
        {"role": "assistant", "content": [b.model_dump() for b in msg.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                      "content": "sunny, 25 C"}]}])
    alone = client.messages.count_tokens(model="specd", tools=[WEATHER],
                                         messages=ask["messages"])
    assert with_result.input_tokens > alone.input_tokens


def test_stop_sequences_name_the_one_that_stopped(client) -> None:
    whole = client.messages.create(max_tokens=12, **ASK)
    text = _text(whole)
    if len(text) < 4:
        pytest.skip("the tiny model's greedy reply is too short to stop inside")
    stop = text[2:4]
    msg = client.messages.create(max_tokens=12, stop_sequences=[stop], **ASK)
    assert (msg.stop_reason, msg.stop_sequence) == ("stop_sequence", stop)
    assert _text(msg) == text[:text.index(stop)]


def test_errors_come_in_anthropics_shape(client, server) -> None:
    with pytest.raises(anthropic.BadRequestError, match="'max_tokens' is required") as err:
        client.messages.create(max_tokens=anthropic.NOT_GIVEN, timeout=60, **ASK)
    assert err.value.body == {"type": "error", "error": {
        "type": "invalid_request_error", "message": "'max_tokens' is required"}}
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": "iVBORw0KGgo="}}
    with pytest.raises(anthropic.BadRequestError, match="takes no images: start it with --mmproj"):
        client.messages.create(max_tokens=5, model="specd", messages=[
            {"role": "user", "content": [image, {"type": "text", "text": "What is this?"}]}])
    status, body = server.request("GET", "/v1/messages")
    assert status == 405 and body["type"] == "error"
    assert body["error"]["type"] == "invalid_request_error"
    status, body = server.request("POST", "/v1/messages", raw=b"{not json")
    assert status == 400 and body["error"]["type"] == "invalid_request_error"
    status, body = server.request("POST", "/v1/chat/completions", {"messages": []})
    assert status == 400 and "type" not in body  # OpenAI's routes keep OpenAI's shape


def test_a_full_queue_is_an_overloaded_error(tiny_path, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("SPECD_STATE_DIR", str(tmp_path / "state"))
    cfg = EngineConfig(target=str(tiny_path), spec_type="none", n_ctx=256, slots=1)
    with live_server(cfg, tmp_path, max_queue=0) as srv:
        client = anthropic.Anthropic(base_url=srv.base_url, api_key="x", max_retries=0)
        with pytest.raises(anthropic.APIStatusError) as err:
            client.messages.create(max_tokens=4, **ASK)
    assert err.value.status_code == 503
    assert err.value.body["error"]["type"] == "overloaded_error"


def test_the_token_as_x_api_key_where_one_is_required(tiny_path, tmp_path,
                                                      monkeypatch) -> None:
    monkeypatch.setenv("SPECD_STATE_DIR", str(tmp_path / "state"))
    cfg = EngineConfig(target=str(tiny_path), spec_type="none", n_ctx=256, slots=1)
    with live_server(cfg, tmp_path, require_token=True) as srv:
        assert srv.token
        good = anthropic.Anthropic(base_url=srv.base_url, api_key=srv.token, max_retries=0)
        assert good.messages.create(max_tokens=3, **ASK).type == "message"
        bearer = anthropic.Anthropic(base_url=srv.base_url, auth_token=srv.token,
                                     max_retries=0)
        assert bearer.messages.count_tokens(**{k: v for k, v in ASK.items()
                                               if k != "extra_body"}).input_tokens > 0
        wrong = anthropic.Anthropic(base_url=srv.base_url, api_key="wrong", max_retries=0)
        with pytest.raises(anthropic.AuthenticationError) as err:
            wrong.messages.create(max_tokens=3, **ASK)
    assert err.value.body["error"]["type"] == "authentication_error"
    assert "X-Api-Key" in err.value.body["error"]["message"]
