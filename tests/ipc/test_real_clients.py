"""Real clients' requests on a real vocabulary: Qwen2.5-Coder-0.5B-Instruct behind a live
server, through the official OpenAI SDK (the behaviour bugs that only showed on it)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from specd.daemon.serving.engine import EngineConfig

from live_server import LiveServer, live_server

pytestmark = pytest.mark.slow

QWEN = "qwen2.5-coder-0.5b-instruct"


@pytest.fixture(scope="module")
def qwen(tmp_path_factory: pytest.TempPathFactory) -> LiveServer:
    from conftest import fetched_model

    tmp = tmp_path_factory.mktemp("qwen")
    mp = pytest.MonkeyPatch()
    mp.setenv("SPECD_STATE_DIR", str(tmp / "state"))
    cfg = EngineConfig(target=str(fetched_model(QWEN)), spec_type="ngram", n_ctx=1024,
                       slots=1, embeddings=True)
    with live_server(cfg, tmp) as srv:
        yield srv
    mp.undo()


@pytest.fixture(scope="module")
def client(qwen: LiveServer):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=qwen.base_url + "/v1", api_key="unused")


TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "description": "The current time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}


def test_forced_tool_call_on_qwen_whose_tag_is_a_special_token(client) -> None:
    """Qwen's <tool_call> is one user-defined token (151657); the forced-call grammar
    ended after it with grammar_dead_end and no call."""
    ask = {"model": "", "max_tokens": 60, "temperature": 0,
           "messages": [{"role": "user", "content": "What time is it in Tokyo?"}]}
    for tools, choice in (([TIME_TOOL], "required"),
                          ([WEATHER_TOOL, TIME_TOOL],
                           {"type": "function", "function": {"name": "get_time"}})):
        out = client.chat.completions.create(tools=tools, tool_choice=choice, **ask)
        assert out.choices[0].finish_reason == "tool_calls", out
        calls = out.choices[0].message.tool_calls
        assert calls[0].function.name == "get_time"
        assert isinstance(json.loads(calls[0].function.arguments)["city"], str)
        chunks = list(client.chat.completions.create(tools=tools, tool_choice=choice,
                                                     stream=True, **ask))
        streamed = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or []]
        assert [t.function.name for t in streamed] == ["get_time"]
        assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_logit_bias_bans_a_real_token(client, qwen: LiveServer) -> None:
    ask = {"model": "gpt-3.5-turbo", "max_tokens": 12, "temperature": 0,
           "messages": [{"role": "user", "content": "What is the capital of France? "
                                                    "One word."}]}
    plain = client.chat.completions.create(**ask).choices[0].message.content
    assert "Paris" in plain
    tok = qwen.service.tokenizer
    banned = {t for text in ("Paris", " Paris") for t in tok.encode(text, add_bos=False)[:1]}
    out = client.chat.completions.create(logit_bias={str(t): -100 for t in banned}, **ask)
    assert not banned & set(tok.encode(out.choices[0].message.content, add_bos=False)), out
    assert out.choices[0].message.content != plain


def test_logprobs_on_qwen_are_a_distribution(client) -> None:
    out = client.chat.completions.create(
        model="", max_tokens=8, temperature=0.7, seed=5, logprobs=True, top_logprobs=5,
        messages=[{"role": "user", "content": "Name a colour."}])
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    for t in content:
        assert t.logprob <= 0 and len(t.top_logprobs) == 5
        assert sum(math.exp(x.logprob) for x in t.top_logprobs) <= 1 + 1e-6
        assert t.logprob <= t.top_logprobs[0].logprob + 1e-12  # sampled: at most the top


def test_embeddings_on_qwen_put_a_paraphrase_nearer(client) -> None:
    out = client.embeddings.create(model="", input=[
        "The cat sat on the mat.", "A cat was sitting on the rug.",
        "Quarterly revenue rose by four percent."])
    a, b, c = (np.array(d.embedding) for d in out.data)  # unit vectors [E]
    assert a @ b > a @ c and a @ b > b @ c, (a @ b, a @ c, b @ c)
