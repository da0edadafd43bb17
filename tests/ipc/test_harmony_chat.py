"""/v1/chat/completions on a tiny gpt-oss model with a harmony template: the reply's
channels come back as llama-server returns them (reasoning apart as reasoning_content,
the final channel as content, a call to a declared tool as tool_calls), whole and
streamed token by token. The random model's reply is shaped by a grammar naming harmony's tokens."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from specd.daemon.serving.engine import EngineConfig
from specd.ort_models import native_ops

from live_server import LiveServer, live_server_in
from tiny_moe import write_tiny_gpt_oss

pytestmark = pytest.mark.skipif(native_ops.library() is None,
                                reason=f"no specd kernels: {native_ops.unavailable_reason()}")

REPLY = ('start: <|channel|> "analysis" <|message|> /[a-z]{3,6}/ <|end|> <|start|> '
         '"assistant" <|channel|> "final" <|message|> /[a-z]{3,6}/')
CALL = ('start: <|channel|> "analysis" <|message|> /[a-z]{3,6}/ <|end|> <|start|> '
        '"assistant to=functions.get_weather" <|channel|> "commentary " <|constrain|> '
        '"json" <|message|> "{\\"city\\": \\"" /[a-z]{2,5}/ "\\"}"')
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    path: Path = write_tiny_gpt_oss(tmp_path_factory.mktemp("oss") / "m.gguf", harmony=True)
    cfg = EngineConfig(target=str(path), spec_type="ngram", n_ctx=256, slots=1)
    with live_server_in(tmp_path_factory, "harmony", cfg) as srv:
        yield srv


def _ask(srv: LiveServer, grammar: str, **kw: object) -> dict:
    status, out = srv.request("POST", "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 160,
        "temperature": 0, "grammar": grammar, **kw})
    assert status == 200, out
    return out


def test_reasoning_and_content_come_apart(server: LiveServer) -> None:
    msg = _ask(server, REPLY)["choices"][0]["message"]
    assert msg["reasoning_content"].isalpha() and msg["content"].isalpha(), msg
    assert "<|" not in msg["content"] + msg["reasoning_content"]


def test_a_call_to_a_declared_tool_is_a_tool_call(server: LiveServer) -> None:
    choice = _ask(server, CALL, tools=[WEATHER])["choices"][0]
    assert "tool_calls" in choice["message"], choice
    call = choice["message"]["tool_calls"][0]["function"]
    assert choice["finish_reason"] == "tool_calls" and call["name"] == "get_weather"
    assert set(json.loads(call["arguments"])) == {"city"}
    assert choice["message"]["reasoning_content"].isalpha()


def test_streamed_deltas_add_up_to_the_whole_reply(server: LiveServer) -> None:
    whole = _ask(server, REPLY)["choices"][0]["message"]
    status, text = server.request("POST", "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 160,
        "temperature": 0, "grammar": REPLY, "stream": True})
    assert status == 200
    deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in text.splitlines()
              if line.startswith("data: {") and json.loads(line[6:])["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == whole[
        "reasoning_content"]
    # streamed token by token as llama-server streams it, not held to the reply's end
    assert sum(bool(d.get("reasoning_content")) for d in deltas) > 1
    assert sum(bool(d.get("content")) for d in deltas) > 1
    assert "".join(d.get("content") or "" for d in deltas) == whole["content"]


def _stream_lines(srv: LiveServer, body: dict) -> list[dict]:
    status, text = srv.request("POST", "/v1/chat/completions", {**body, "stream": True})
    assert status == 200
    return [json.loads(line[6:]) for line in text.splitlines()
            if line.startswith("data: {") and json.loads(line[6:])["choices"]]


def test_a_call_streams_its_arguments_piece_by_piece(server: LiveServer) -> None:
    """As llama-server streams a harmony call: its id and name first, then its
    arguments in more than one piece, adding up to the whole reply's."""
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 160,
            "temperature": 0, "grammar": CALL, "tools": [WEATHER]}
    whole = _ask(server, CALL, tools=[WEATHER])["choices"][0]["message"]["tool_calls"][0]
    chunks = _stream_lines(server, body)
    pieces = [p for c in chunks for p in c["choices"][0]["delta"].get("tool_calls", [])]
    assert pieces[0]["function"]["name"] == "get_weather" and pieces[0]["id"]
    assert all("name" not in p["function"] for p in pieces[1:])
    assert len(pieces) > 2 and {p["index"] for p in pieces} == {0}
    args = "".join(p["function"]["arguments"] for p in pieces)
    assert json.loads(args) == json.loads(whole["function"]["arguments"])
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_anthropic_and_responses_stream_the_call(server: LiveServer) -> None:
    anthropic = pytest.importorskip("anthropic")
    openai = pytest.importorskip("openai")
    tool = {"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}
    client = anthropic.Anthropic(base_url=server.base_url, api_key=server.token or "u",
                                 max_retries=0)
    ask = {"model": "m", "max_tokens": 160, "messages": [{"role": "user", "content": "hi"}],
           "tools": [tool], "extra_body": {"grammar": CALL, "temperature": 0}}
    whole = client.messages.create(**ask)
    with client.messages.stream(**ask) as stream:
        events = list(stream)
        final = stream.get_final_message()
    parts = [e.delta.partial_json for e in events if e.type == "content_block_delta"
             and e.delta.type == "input_json_delta"]
    assert len(parts) > 1
    assert [b.type for b in final.content] == [b.type for b in whole.content] == [
        "thinking", "tool_use"]
    assert final.content[1].input == whole.content[1].input and final.stop_reason == "tool_use"
    oai = openai.OpenAI(base_url=server.base_url + "/v1", api_key=server.token or "u",
                        max_retries=0)
    ask_r = {"model": "m", "input": "hi", "max_output_tokens": 160, "temperature": 0,
             "tools": [{"type": "function", **WEATHER["function"]}],
             "extra_body": {"grammar": CALL}}
    resp = oai.responses.create(**ask_r)
    with oai.responses.stream(**ask_r) as stream:
        events = list(stream)
        done = stream.get_final_response()
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(deltas) > 1
    assert [o.type for o in done.output] == [o.type for o in resp.output] == [
        "reasoning", "function_call"]
    assert json.loads(done.output[1].arguments) == json.loads(resp.output[1].arguments)
