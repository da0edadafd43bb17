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
