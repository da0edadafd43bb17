"""ipc/http/responses_inputs.py: a Responses request in chat terms, read by the shared
chat layer (chat_inputs) as a chat completion's body is."""

from __future__ import annotations

import pytest

from specd.ipc.http.chat_inputs import chat_inputs
from specd.ipc.http.responses_inputs import chat_request, input_items, renamed
from specd.ipc.validation import BadRequest

TOOL = {"type": "function", "name": "get_weather", "description": "Weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        "strict": True}


def test_a_string_input_is_one_user_message_after_the_instructions() -> None:
    chat, items = chat_request({"input": "hi", "instructions": "Be brief."}, [])
    assert chat["messages"] == [{"role": "system", "content": "Be brief."},
                                {"role": "user", "content": "hi"}]
    assert items == [{"type": "message", "role": "user", "content": "hi"}]
    assert chat["add_generation_prompt"] and not chat["continue_final_message"]


def test_items_become_messages_tool_calls_and_tool_results() -> None:
    items = input_items([
        {"role": "developer", "content": "Use tools."},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "Weather"},
                     {"type": "input_text", "text": "in Paris?"}]},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Paris"}', "id": "fc_1", "status": "completed"},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}])
    chat, _ = chat_request({"input": [], "tools": [TOOL]}, items)
    assert chat["messages"] == [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": [{"type": "text", "text": "Weather"},
                                     {"type": "text", "text": "in Paris?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Checking."}],
         "tool_calls": [{"id": "call_1", "type": "function", "function": {
             "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    # a call with no assistant text before it is an assistant message of its own
    alone, _ = chat_request({"input": [items[3], items[4]]}, [])
    assert alone["messages"][0] == {"role": "assistant", "content": None,
                                    "tool_calls": [alone["messages"][0]["tool_calls"][0]]}


def test_the_stored_conversation_comes_before_the_new_input() -> None:
    history = input_items("first")
    chat, items = chat_request({"input": "second"}, history)
    assert [m["content"] for m in chat["messages"]] == ["first", "second"]
    assert items == input_items("second")  # only the new items are this request's
    follow, _ = chat_request({}, history)  # no input: the conversation as it was
    assert follow["messages"] == [{"role": "user", "content": "first"}]


def test_tools_tool_choice_and_text_format_as_chats() -> None:
    chat, _ = chat_request({
        "input": "x", "tools": [TOOL], "parallel_tool_calls": False,
        "tool_choice": {"type": "function", "name": "get_weather"},
        "text": {"format": {"type": "json_schema", "name": "a", "strict": True,
                            "schema": {"type": "object"}}}}, [])
    assert chat["tools"] == [{"type": "function", "function": {
        k: TOOL[k] for k in ("name", "description", "parameters", "strict")}}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert chat["response_format"] == {"type": "json_schema", "json_schema": {
        "name": "a", "schema": {"type": "object"}, "strict": True}}
    # which the shared chat layer reads: a grammar forcing one call of the named tool
    read = chat_inputs(chat)
    assert read.names == {"get_weather"} and read.forced is not None
    assert 'start: block\n' in read.forced
    for fmt, want in (({"type": "text"}, None), ({"type": "json_object"},
                                                  {"type": "json_object"})):
        assert chat_request({"input": "x", "text": {"format": fmt}}, [])[0][
            "response_format"] == want
    none, _ = chat_request({"input": "x", "tools": [TOOL], "tool_choice": "none"}, [])
    assert chat_inputs(none).names is None


@pytest.mark.parametrize("body, param, match", [
    ({}, "input", "required"),
    ({"input": 3}, "input", "must be a string"),
    ({"input": []}, "input", "empty"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role", "must be one of"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "u"}]}]},
     "input[0].content[0]", "needs an 'image_url'"),
    ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]},
     "input[0].content[0]", "with a 'text'"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]},
     "input[0].arguments", "must be a string"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id",
     "must be a string"),
    ({"input": [{"type": "web_search_call"}]}, "input[0].type", "not supported"),
    ({"input": "x", "tools": {}}, "tools", "must be an array"),
    ({"input": "x", "tools": [{"type": "file_search"}]}, "tools[0].type",
     "function tools only"),
    ({"input": "x", "tool_choice": {"type": "function"}}, "tool_choice", "must be"),
    ({"input": "x", "text": "json"}, "text", "must be an object"),
    ({"input": "x", "text": {"format": {"type": "json_schema"}}}, "text.format.schema",
     "must be an object"),
    ({"input": "x", "text": {"format": {"type": "xml"}}}, "text.format.type", "must be"),
])
def test_a_bad_request_names_its_field(body, param, match) -> None:
    with pytest.raises(BadRequest, match=match) as caught:
        chat_request(body, [])
    assert caught.value.param == param


def test_the_chat_layers_400s_name_the_responses_fields() -> None:
    exc = renamed(BadRequest("'messages' holds over 9 bytes", param="messages", code="c"))
    assert (str(exc), exc.param, exc.code) == ("'input' holds over 9 bytes", "input", "c")
    assert renamed(BadRequest("bad", param="response_format")).param == "text.format"
    same = BadRequest("x", param="tools")
    assert renamed(same) is same
