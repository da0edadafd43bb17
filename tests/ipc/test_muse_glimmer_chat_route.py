"""muse-glimmer's chat format through specd's OpenAI chat route, with the official openai
client: a tiny muse-glimmer model with llama.cpp's template and the format's control
tokens, its reply forced by a grammar into reasoning then a tool call (as the model
writes them, control tokens and all), comes back as reasoning_content and tool_calls,
whole and streamed; the prompt is the template's (its preamble, tools and generation
prompt)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from specd.daemon.serving.engine import EngineConfig

from live_server import LiveServer, live_server_in
from tiny_muse_glimmer import write_chat_model

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
MARKUP = ('<atem:function_calls>\\n<atem:invoke name=\\"get_weather\\">\\n'
          '<atem:parameter name=\\"city\\">Paris</atem:parameter>\\n</atem:invoke>\\n'
          '</atem:function_calls>')


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    path = write_chat_model(tmp_path_factory.mktemp("muse") / "m.gguf")
    cfg = EngineConfig(target=str(path), spec_type="none", n_ctx=2048, slots=1)
    with live_server_in(tmp_path_factory, "muse_chat", cfg) as srv:
        yield srv


def _grammar(srv: LiveServer) -> str:
    """A Lark grammar forcing the reply (the control tokens by name): a reasoning
    message, then a call of get_weather."""
    return ('start: " to=self" <|message|> "Let me look it up" <|eom|> <|start|> '
            f'"assistant to=get_weather" <|message|> "{MARKUP}"')


def _client(srv: LiveServer) -> Any:
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=srv.base_url + "/v1", api_key="unused")


def test_reasoning_and_a_call_come_apart(server: LiveServer) -> None:
    r = _client(server).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Weather in Paris?"}], tools=TOOLS,
        max_tokens=200, temperature=0, extra_body={"grammar": _grammar(server)})
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls"
    assert msg.content is None and msg.model_extra["reasoning_content"] == "Let me look it up"
    (call,) = msg.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}


def test_streamed_the_same(server: LiveServer) -> None:
    chunks = list(_client(server).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Weather in Paris?"}], tools=TOOLS,
        max_tokens=200, temperature=0, stream=True,
        extra_body={"grammar": _grammar(server)}))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    thought = "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas)
    calls = [t for d in deltas for t in d.tool_calls or []]
    assert thought == "Let me look it up" and not "".join(d.content or "" for d in deltas)
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"})]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_the_prompt_is_the_templates(server: LiveServer) -> None:
    status, out = server.request("POST", "/apply-template", {
        "messages": [{"role": "user", "content": "Hi"}], "tools": TOOLS})
    assert status == 200, out
    prompt = out["prompt"]
    assert prompt.startswith("<|endoftext|><|start|>system<|message|>You are a helpful AI "
                             "assistant.")  # the template writes bos_token first
    assert '"name": "get_weather"' in prompt
    assert prompt.endswith("<|start|>user<|message|>Hi<|eot|><|start|>assistant")
