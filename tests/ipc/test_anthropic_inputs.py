"""ipc/http/anthropic_inputs.py: a Messages request read as the chat request the shared
layer takes (messages, tools, tool_choice), and the 400s for what it cannot take."""

from __future__ import annotations

import json
from typing import Any

import pytest

from specd.ipc.http.anthropic_inputs import (
    chat_body,
    max_tokens,
    sampling_body,
    stop_body,
    tool_choice,
)
from specd.ipc.http.chat_inputs import chat_inputs
from specd.ipc.validation import BadRequest, stop_list

WEATHER = {"name": "get_weather", "description": "Weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                            "required": ["city"]}}


def _chat(**body: Any) -> dict[str, Any]:
    return chat_body({"messages": [{"role": "user", "content": "hi"}], **body})


def test_system_and_content_blocks_become_the_templates_messages() -> None:
    out = chat_body({"system": [{"type": "text", "text": "Be brief.",
                                 "cache_control": {"type": "ephemeral"}}],
                     "messages": [
                         {"role": "user", "content": [{"type": "text", "text": "What is"},
                                                      {"type": "text", "text": "2+2?"}]},
                         {"role": "assistant", "content": "4"},
                         {"role": "user", "content": "Thanks"}]})
    assert out["messages"] == [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": [{"type": "text", "text": "What is"},
                                     {"type": "text", "text": "2+2?"}]},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "Thanks"}]
    assert chat_body({"system": "Be brief.", "messages": [
        {"role": "user", "content": "hi"}]})["messages"][0] == {"role": "system",
                                                                 "content": "Be brief."}
    assert _chat(system="")["messages"] == [{"role": "user", "content": "hi"}]


def test_a_tool_round_trip_becomes_tool_calls_and_tool_messages() -> None:
    out = chat_body({"messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "The tool knows.", "signature": "x"},
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
             "input": {"city": "Paris"}}]},
        {"role": "user", "content": [
            {"type": "text", "text": "Here it is:"},
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
            {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
             "content": [{"type": "text", "text": "no such city"}]}]}]})
    user, assistant, tool1, tool2, text = out["messages"]
    assert assistant == {
        "role": "assistant", "content": [{"type": "text", "text": "Checking."}],
        "reasoning_content": "The tool knows.",
        "tool_calls": [{"id": "toolu_1", "type": "function", "function": {
            "name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}]}
    # the results answer the assistant's turn: before the user's own text
    assert tool1 == {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"}
    assert tool2 == {"role": "tool", "tool_call_id": "toolu_2",
                     "content": [{"type": "text", "text": "no such city"}]}
    assert text == {"role": "user", "content": [{"type": "text", "text": "Here it is:"}]}
    # a turn of calls alone: no content, as OpenAI's messages have it
    calls_only = chat_body({"messages": [{"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]})["messages"][0]
    assert calls_only["content"] is None and calls_only["tool_calls"]


def test_tools_and_tool_choice_as_the_shared_tool_machinery_takes_them() -> None:
    out = _chat(tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"})
    assert out["tools"] == [{"type": "function", "function": {
        "name": "get_weather", "description": "Weather in a city",
        "parameters": WEATHER["input_schema"]}}]
    chat = chat_inputs(out)
    assert chat.names == {"get_weather"} and chat.forced is not None
    assert "get_weather" in chat.forced
    assert tool_choice({"type": "auto"}) == ("auto", True)
    assert tool_choice({"type": "any", "disable_parallel_tool_use": True}) == (
        "required", False)
    assert tool_choice({"type": "none"}) == ("none", True)
    assert chat_inputs(_chat(tools=[WEATHER], tool_choice={"type": "none"})).tools is None
    assert chat_inputs(_chat(tools=[WEATHER])).forced is None  # auto
    with pytest.raises(BadRequest, match="not among the tools"):
        chat_inputs(_chat(tools=[WEATHER], tool_choice={"type": "tool", "name": "nope"}))
    with pytest.raises(BadRequest, match="tool_choice"):
        _chat(tools=[WEATHER], tool_choice="auto")  # OpenAI's shape, not Anthropic's
    with pytest.raises(BadRequest, match="server tool"):
        _chat(tools=[{"type": "web_search_20250305", "name": "web_search"}])
    with pytest.raises(BadRequest, match="name"):
        chat_inputs(_chat(tools=[{"input_schema": {"type": "object"}}]))


def test_thinking_switches_the_templates_thinking() -> None:
    assert _chat(thinking={"type": "disabled"})["chat_template_kwargs"] == {
        "enable_thinking": False}
    assert _chat(thinking={"type": "enabled", "budget_tokens": 50})[
        "chat_template_kwargs"] == {"enable_thinking": True}
    assert "chat_template_kwargs" not in _chat()


@pytest.mark.parametrize(("body", "match"), [
    ({"messages": []}, "non-empty"),
    ({}, "non-empty"),
    ({"messages": [{"role": "system", "content": "x"}]}, "'user' or 'assistant'"),
    ({"messages": [{"role": "user", "content": 3}]}, "string or an array"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {
        "type": "file", "file_id": "f"}}]}]}, "source must be {type: base64"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                                 "content": [{"type": "image"}]}]}]},
     "'image' blocks are not supported here"),
    ({"messages": [{"role": "user", "content": [{"type": "document"}]}]}, "'document'"),
    ({"messages": [{"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": "x"}]}]}, "'input' object"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result"}]}]}, "tool_use_id"),
    ({"messages": [{"role": "user", "content": "x"}], "system": 5}, "'system'"),
])
def test_what_cannot_be_read_is_a_400_naming_it(body: dict[str, Any], match: str) -> None:
    with pytest.raises(BadRequest, match=match) as err:
        chat_body(body)
    assert err.value.status == 400


def test_max_tokens_is_required_and_sampling_and_stops_keep_their_meaning() -> None:
    with pytest.raises(BadRequest, match="'max_tokens' is required"):
        max_tokens({})
    with pytest.raises(BadRequest, match="max_tokens"):
        max_tokens({"max_tokens": 0})
    assert max_tokens({"max_tokens": 7}) == 7
    assert sampling_body({"temperature": 0.5, "top_k": 4, "seed": 1, "metadata": {}},
                         max_tokens=7) == {"max_tokens": 7, "temperature": 0.5, "top_k": 4}
    assert stop_list(stop_body({"stop_sequences": ["\n", "END"]})) == ["\n", "END"]
    assert stop_list(stop_body({})) == []
    with pytest.raises(BadRequest, match="stop_sequences"):
        stop_body({"stop_sequences": "END"})
