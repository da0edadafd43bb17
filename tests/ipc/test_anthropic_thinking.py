"""Thinking blocks on /v1/messages, with the official anthropic SDK: a tiny muse-glimmer
model with llama.cpp's template, its reply forced by a grammar into reasoning then an
answer (or a call), comes back as a `thinking` block before the text (or the tool_use),
whole and streamed, as the SDK parses them; the request's `thinking` switches the
template's enable_thinking, as Qwen3's templates read it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from specd.daemon.serving.engine import EngineConfig

from live_server import LiveServer, live_server_in
from tiny_muse_glimmer import write_chat_model

anthropic = pytest.importorskip("anthropic")

WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                            "required": ["city"]}}
MARKUP = ('<atem:function_calls>\\n<atem:invoke name=\\"get_weather\\">\\n'
          '<atem:parameter name=\\"city\\">Paris</atem:parameter>\\n</atem:invoke>\\n'
          '</atem:function_calls>')
# reasoning, then the answer; reasoning, then a call of get_weather
ANSWER = ('start: " to=self" <|message|> "Let me think" <|eom|> <|start|> '
          '"assistant to=user" <|message|> "It is sunny" <|eot|>')
CALL = ('start: " to=self" <|message|> "Let me look it up" <|eom|> <|start|> '
        f'"assistant to=get_weather" <|message|> "{MARKUP}"')
ASK: dict[str, Any] = {"model": "m", "max_tokens": 200,
                       "messages": [{"role": "user", "content": "Weather in Paris?"}]}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    path = write_chat_model(tmp_path_factory.mktemp("muse") / "m.gguf")
    cfg = EngineConfig(target=str(path), spec_type="none", n_ctx=2048, slots=1)
    with live_server_in(tmp_path_factory, "muse_anthropic", cfg) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: LiveServer) -> Any:
    return anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)


def _body(grammar: str) -> dict[str, Any]:
    return {"temperature": 0, "grammar": grammar}


def test_the_reasoning_is_a_thinking_block_before_the_text(client: Any) -> None:
    msg = client.messages.create(**ASK, extra_body=_body(ANSWER))
    assert [b.type for b in msg.content] == ["thinking", "text"], msg.content
    thought, text = msg.content
    assert isinstance(thought, anthropic.types.ThinkingBlock)
    assert thought.thinking == "Let me think" and thought.signature == ""
    assert text.text == "It is sunny" and msg.stop_reason == "end_turn"


def test_streamed_as_a_thinking_block_with_its_signature(client: Any) -> None:
    with client.messages.stream(**ASK, extra_body=_body(ANSWER)) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [(e.type, getattr(getattr(e, "delta", None), "type", None)) for e in events
             if e.type.startswith("content_block")]
    assert kinds[:4] == [("content_block_start", None),
                         ("content_block_delta", "thinking_delta"),
                         ("content_block_delta", "signature_delta"),
                         ("content_block_stop", None)], kinds
    starts = [e for e in events if e.type == "content_block_start"]
    assert [(e.index, e.content_block.type) for e in starts] == [(0, "thinking"), (1, "text")]
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[0].thinking == "Let me think" and final.content[0].signature == ""
    assert final.content[1].text == "It is sunny"


def test_reasoning_then_a_call(client: Any) -> None:
    msg = client.messages.create(**ASK, tools=[WEATHER], extra_body=_body(CALL))
    assert [b.type for b in msg.content] == ["thinking", "tool_use"], msg.content
    assert msg.content[0].thinking == "Let me look it up"
    assert msg.content[1].name == "get_weather" and msg.content[1].input == {"city": "Paris"}
    assert msg.stop_reason == "tool_use"
    with client.messages.stream(**ASK, tools=[WEATHER], extra_body=_body(CALL)) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "tool_use"]
    assert final.content[1].input == {"city": "Paris"} and final.stop_reason == "tool_use"


def test_a_thinking_block_sent_back_is_the_assistants_reasoning(client: Any,
                                                                server: LiveServer) -> None:
    """The turn as the client passes it back (thinking block, signature and all)
    renders as the chat route renders the same turn with reasoning_content."""
    first = client.messages.create(**ASK, extra_body=_body(ANSWER))
    turn = [b.model_dump() for b in first.content]
    count = client.messages.count_tokens(model="m", messages=[
        *ASK["messages"], {"role": "assistant", "content": turn},
        {"role": "user", "content": "Thanks"}])
    status, out = server.request("POST", "/apply-template", {"messages": [
        *ASK["messages"],
        {"role": "assistant", "content": "It is sunny", "reasoning_content": "Let me think"},
        {"role": "user", "content": "Thanks"}]})
    assert status == 200, out
    status, tokens = server.request("POST", "/tokenize", {"content": out["prompt"]})
    assert status == 200, tokens
    assert count.input_tokens == len(tokens["tokens"])


THINKING_TEMPLATE = (
    "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:"
    "{% if enable_thinking is defined and not enable_thinking %} /no_think{% endif %}"
    "{% endif %}")


def _prompt_tokens(srv: LiveServer, kwargs: dict[str, Any]) -> int:
    """The length of the chat prompt the chat route renders with `kwargs`."""
    status, out = srv.request("POST", "/apply-template", {
        "messages": ASK["messages"], "chat_template_kwargs": kwargs})
    assert status == 200, out
    status, tokens = srv.request("POST", "/tokenize", {"content": out["prompt"]})
    assert status == 200, tokens
    return len(tokens["tokens"])


def test_thinking_switches_the_templates_enable_thinking(tiny_model_factory: Any,
                                                         tmp_path: Path) -> None:
    """`thinking` disabled renders the template with enable_thinking false (Qwen3's
    /no_think), enabled with it true; chat_template_kwargs pass through beside it."""
    from live_server import live_server

    path = tiny_model_factory(arch="qwen2", weight_type="Q8_0", seed=5, context_length=512)
    cfg = EngineConfig(target=str(path), spec_type="none", n_ctx=512, slots=1,
                       chat_template=THINKING_TEMPLATE)
    with live_server(cfg, tmp_path) as srv:
        client = anthropic.Anthropic(base_url=srv.base_url, api_key="u", max_retries=0)

        def count(**kw: Any) -> int:
            return int(client.messages.count_tokens(
                model="m", messages=ASK["messages"], **kw).input_tokens)

        on, off = (_prompt_tokens(srv, {"enable_thinking": v}) for v in (True, False))
        assert on < off
        assert count() == on
        assert count(thinking={"type": "enabled", "budget_tokens": 2048}) == on
        assert count(thinking={"type": "disabled"}) == off
        assert count(thinking={"type": "adaptive"}) == on
        assert count(extra_body={"chat_template_kwargs": {"enable_thinking": False}}) == off


@pytest.mark.parametrize("thinking", [{"type": "sometimes"}, "on",
                                      {"type": "enabled", "budget_tokens": "many"}])
def test_a_bad_thinking_is_an_invalid_request(client: Any, thinking: Any) -> None:
    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.create(**ASK, extra_body={"thinking": thinking})
    assert err.value.body["error"]["type"] == "invalid_request_error"
