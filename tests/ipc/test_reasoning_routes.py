"""Reasoning kept apart from the answer on every dialect, whole and streamed, with the
official clients against a live server: a tiny model with llama.cpp's Qwen3 template
(the model opens <think> itself) and its DeepSeek-R1 distill template (the prompt opens
it), the random model's reply shaped by a grammar into reasoning then an answer. The
reasoning streams as it is written: in more than one delta on every route."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from specd.daemon.serving.engine import EngineConfig

import llama_cpp_convert
from live_server import LiveServer, live_server_in

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
ollama = pytest.importorskip("ollama")

WORDS = r'/[a-z]{3,6}( [a-z]{3,6}){5}/'
# Qwen3: the model writes the tags; the R1 distill: the prompt opened <think>
QWEN3_REPLY = f'start: "<think>\\n" {WORDS} "\\n</think>\\n\\n" /[a-z]{{3,6}}/'
OPENED_REPLY = f'start: {WORDS} "\\n</think>\\n\\n" /[a-z]{{3,6}}/'
THOUGHT = re.compile(r"[a-z]{3,6}( [a-z]{3,6}){5}")
ANSWER = re.compile(r"[a-z]{3,6}")
ASK = [{"role": "user", "content": "hi"}]


def _server(tmp_path_factory: pytest.TempPathFactory, factory: Any, name: str
            ) -> Iterator[LiveServer]:
    path = llama_cpp_convert.source() / "models" / "templates" / name
    if not path.is_file():
        pytest.skip(f"llama.cpp's template {name} is not at {path}")
    model = factory(arch="qwen2", weight_type="Q8_0", seed=5, context_length=1024)
    cfg = EngineConfig(target=str(model), spec_type="ngram", n_ctx=512, slots=1,
                       chat_template=Path(path).read_text())
    with live_server_in(tmp_path_factory, name.split(".")[0], cfg) as srv:
        yield srv


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory, tiny_model_factory: Any
          ) -> Iterator[LiveServer]:
    yield from _server(tmp_path_factory, tiny_model_factory, "Qwen-Qwen3-0.6B.jinja")


@pytest.fixture(scope="module")
def r1(tmp_path_factory: pytest.TempPathFactory, tiny_model_factory: Any
       ) -> Iterator[LiveServer]:
    yield from _server(tmp_path_factory, tiny_model_factory,
                       "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja")


def _openai(srv: LiveServer) -> Any:
    return openai.OpenAI(base_url=srv.base_url + "/v1", api_key=srv.token or "u",
                         max_retries=0)


def _chat(srv: LiveServer, grammar: str, **kw: Any) -> tuple[Any, list[Any]]:
    """(the whole message, the streamed chunks' deltas) of one chat request."""
    client = _openai(srv)
    ask: dict[str, Any] = {"model": "m", "messages": ASK, "max_tokens": 120,
                           "temperature": 0}
    extra = {"grammar": grammar, **kw}
    whole = client.chat.completions.create(**ask, extra_body=extra).choices[0].message
    chunks = client.chat.completions.create(**ask, stream=True, extra_body=extra)
    return whole, [c.choices[0].delta for c in chunks if c.choices]


@pytest.mark.parametrize(("which", "grammar"), [("qwen3", QWEN3_REPLY),
                                                ("r1", OPENED_REPLY)])
def test_openai_reasoning_content_whole_and_streamed(which: str, grammar: str,
                                                     request: Any) -> None:
    whole, deltas = _chat(request.getfixturevalue(which), grammar)
    thought = whole.model_extra["reasoning_content"]
    assert THOUGHT.fullmatch(thought) and ANSWER.fullmatch(whole.content), whole
    pieces = [d.model_extra.get("reasoning_content") for d in deltas]
    pieces = [p for p in pieces if p]
    assert len(pieces) > 1 and "".join(pieces) == thought
    assert "".join(d.content or "" for d in deltas) == whole.content


def test_reasoning_format_none_leaves_the_tags_in_the_content(r1: LiveServer) -> None:
    """none: the tags in the content; deepseek-legacy: apart whole, in the content
    streamed (llama.cpp's reasoning_in_content); another: a 400."""
    whole, deltas = _chat(r1, OPENED_REPLY, reasoning_format="none")
    assert "reasoning_content" not in (whole.model_extra or {})
    assert "\n</think>\n\n" in whole.content
    assert "".join(d.content or "" for d in deltas) == whole.content
    legacy, streamed = _chat(r1, OPENED_REPLY, reasoning_format="deepseek-legacy")
    assert legacy.model_extra["reasoning_content"] and "</think>" not in legacy.content
    assert "\n</think>\n\n" in "".join(d.content or "" for d in streamed)
    with pytest.raises(openai.BadRequestError, match="reasoning_format"):
        _chat(r1, OPENED_REPLY, reasoning_format="sometimes")


def test_anthropic_thinking_block_whole_and_streamed(qwen3: LiveServer) -> None:
    client = anthropic.Anthropic(base_url=qwen3.base_url, api_key=qwen3.token or "u",
                                 max_retries=0)
    ask: dict[str, Any] = {"model": "m", "max_tokens": 120, "messages": ASK,
                           "extra_body": {"grammar": QWEN3_REPLY, "temperature": 0}}
    msg = client.messages.create(**ask)
    assert [b.type for b in msg.content] == ["thinking", "text"], msg.content
    assert THOUGHT.fullmatch(msg.content[0].thinking)
    assert ANSWER.fullmatch(msg.content[1].text)
    with client.messages.stream(**ask) as stream:
        events = list(stream)
        final = stream.get_final_message()
    thinking = [e.delta.thinking for e in events if e.type == "content_block_delta"
                and e.delta.type == "thinking_delta"]
    assert len(thinking) > 1 and "".join(thinking) == msg.content[0].thinking
    starts = [e.content_block.type for e in events if e.type == "content_block_start"]
    assert starts == ["thinking", "text"]
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in msg.content]


def test_responses_reasoning_item_whole_and_streamed(qwen3: LiveServer) -> None:
    client = _openai(qwen3)
    ask: dict[str, Any] = {"model": "m", "input": "hi", "max_output_tokens": 120,
                           "temperature": 0, "extra_body": {"grammar": QWEN3_REPLY}}
    resp = client.responses.create(**ask)
    assert [o.type for o in resp.output] == ["reasoning", "message"], resp.output
    thought = resp.output[0].content[0].text
    assert THOUGHT.fullmatch(thought) and ANSWER.fullmatch(resp.output_text)
    with client.responses.stream(**ask) as stream:
        events = list(stream)
        final = stream.get_final_response()
    deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == thought
    assert [o.type for o in final.output] == ["reasoning", "message"]
    assert final.output[0].content[0].text == thought
    assert final.output_text == resp.output_text


def test_ollama_thinking_whole_and_streamed(r1: LiveServer) -> None:
    """The R1 template opens <think> in the prompt: a reply that never closes it (the
    random model's, without a grammar) is all thinking, streamed as it comes."""
    headers = {"Authorization": f"Bearer {r1.token}"} if r1.token else None
    client = ollama.Client(host=r1.base_url, headers=headers)
    model = client.list().models[0].model  # (as an app picks it)
    ask: dict[str, Any] = {"model": model, "messages": ASK,
                           "options": {"num_predict": 24, "temperature": 0}}
    whole = client.chat(**ask)
    assert whole.message.thinking and whole.message.content == ""
    parts = list(client.chat(stream=True, **ask))
    thinking = [p.message.thinking for p in parts if p.message.thinking]
    assert len(thinking) > 1 and "".join(thinking) == whole.message.thinking
    assert "".join(p.message.content for p in parts) == ""
    generated = client.generate(model=model, prompt="hi",
                                options={"num_predict": 24, "temperature": 0})
    assert generated.thinking == whole.message.thinking and generated.response == ""


def _n_tokens(srv: LiveServer, text: str) -> int:
    status, out = srv.request("POST", "/tokenize", {"content": text})
    assert status == 200, out
    return len(out["tokens"])


@pytest.mark.parametrize("budget", [4, 12])
def test_anthropic_budget_tokens_close_the_thinking(r1: LiveServer, budget: int) -> None:
    """The R1 template opens the reasoning and the random model never closes it: with
    thinking.budget_tokens the end tag is forced once the budget is spent, and the
    reply goes on as the answer; without a budget it is all thinking."""
    client = anthropic.Anthropic(base_url=r1.base_url, api_key=r1.token or "u",
                                 max_retries=0)
    ask: dict[str, Any] = {"model": "m", "max_tokens": 40, "messages": ASK,
                           "extra_body": {"temperature": 0}}
    assert [b.type for b in client.messages.create(**ask).content] == ["thinking"]
    # a budget past max_tokens: the same reasoning, never closed
    free = client.messages.create(**ask, thinking={"type": "enabled", "budget_tokens": 99})
    assert [b.type for b in free.content] == ["thinking"]
    msg = client.messages.create(**ask, thinking={"type": "enabled",
                                                  "budget_tokens": budget})
    assert [b.type for b in msg.content] == ["thinking", "text"], msg.content
    assert 0 < _n_tokens(r1, msg.content[0].thinking) <= budget
    assert free.content[0].thinking.startswith(msg.content[0].thinking)
    with client.messages.stream(**ask, thinking={"type": "enabled",
                                                 "budget_tokens": budget}) as stream:
        final = stream.get_final_message()
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in msg.content]


def test_openai_thinking_budget_tokens_zero_closes_at_once(r1: LiveServer) -> None:
    client = _openai(r1)
    msg = client.chat.completions.create(
        model="m", messages=ASK, max_tokens=20, temperature=0,
        extra_body={"thinking_budget_tokens": 0}).choices[0].message
    assert "reasoning_content" not in (msg.model_extra or {}) and msg.content
    with pytest.raises(openai.BadRequestError, match="thinking_budget_tokens"):
        client.chat.completions.create(model="m", messages=ASK, max_tokens=4,
                                       extra_body={"thinking_budget_tokens": -2})


def test_the_budget_message_closes_the_reasoning(r1: LiveServer) -> None:
    """llama-server's reasoning_budget_message: written before the forced end tag, the
    last words of the reasoning."""
    msg = _openai(r1).chat.completions.create(
        model="m", messages=ASK, max_tokens=40, temperature=0,
        extra_body={"thinking_budget_tokens": 3,
                    "reasoning_budget_message": " Enough thinking."}).choices[0].message
    thought = msg.model_extra["reasoning_content"]
    assert thought.endswith(" Enough thinking.") and msg.content
    assert _n_tokens(r1, thought.removesuffix(" Enough thinking.")) <= 3


# DeepSeek-R1's own call syntax after the reasoning (the prompt opened <think>)
R1_CALL = ('start: ' + WORDS + ' "\\n</think>\\n\\n<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>'
           'function<｜tool▁sep｜>get_weather\\n```json\\n{\\"city\\": \\"Paris\\"}\\n```'
           '<｜tool▁call▁end｜><｜tool▁calls▁end｜>"')
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object",
                                          "properties": {"city": {"type": "string"}}}}}


def test_r1_tool_calls_whole_and_streamed(r1: LiveServer) -> None:
    """A reply in R1's call syntax is OpenAI tool_calls (its reasoning apart), whole and
    streamed, with no text of the section in a delta; without tools it is content."""
    # (the tiny model's vocabulary spells the section's tokens in many pieces)
    whole, deltas = _chat(r1, R1_CALL, tools=[WEATHER], max_tokens=400)
    assert THOUGHT.fullmatch(whole.model_extra["reasoning_content"])
    assert not whole.content
    assert [(c.function.name, c.function.arguments) for c in whole.tool_calls] == [
        ("get_weather", '{"city": "Paris"}')]
    streamed = [c for d in deltas for c in d.tool_calls or []]
    assert [(c.function.name, c.function.arguments) for c in streamed] == [
        ("get_weather", '{"city": "Paris"}')]
    assert not "".join(d.content or "" for d in deltas)
    assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas) == \
        whole.model_extra["reasoning_content"]
    # reasoning_format "none": the tags stay in the content, the calls are still read
    kept, _ = _chat(r1, R1_CALL, tools=[WEATHER], max_tokens=400, reasoning_format="none")
    assert kept.content.endswith("</think>") and len(kept.tool_calls) == 1
    plain, _ = _chat(r1, R1_CALL, max_tokens=400)
    assert "<｜tool▁calls▁begin｜>" in plain.content and not plain.tool_calls


def test_a_forced_call_with_thinking_off_is_read_on_r1(r1: LiveServer) -> None:
    """A named tool_choice forces specd's tagged calls; with R1's thinking off (its
    template closes the reasoning in the prompt) the R1 format reads them as calls."""
    # (no arguments: the random model's would run to max_tokens)
    now = {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {}, "additionalProperties": False}}}
    out = _openai(r1).chat.completions.create(
        model="m", messages=ASK, max_tokens=200, temperature=0, tools=[WEATHER, now],
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        parallel_tool_calls=False,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    message = out.choices[0].message
    assert [(c.function.name, json.loads(c.function.arguments))
            for c in message.tool_calls or []] == [("get_time", {})], message
