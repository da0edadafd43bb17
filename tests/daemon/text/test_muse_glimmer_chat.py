"""muse-glimmer's chat format: replies parsed as llama.cpp's muse-glimmer chat parser
parses them (each case of its tests/test-chat.cpp "Muse Glimmer format tests", with the
same expectations), and its template (models/templates/muse-glimmer.jinja from llama.cpp's
source, where it is there) rendered by specd, a rendered tool-calling turn parsed back."""

from __future__ import annotations

import json

import pytest

from specd.daemon.text.chat_template import render_chat
from specd.daemon.text.muse_glimmer_chat import (
    ParsedReply,
    is_muse_glimmer_template,
    parse_reply,
)

from tiny_muse_glimmer import llama_cpp_template

SPECIAL_FUNCTION = [{"type": "function", "function": {
    "name": "special_function", "description": "I'm special",
    "parameters": {"type": "object", "properties": {"arg1": {"type": "integer"}},
                   "required": ["arg1"]}}}]
CALL_MARKUP = ('<atem:function_calls>\n<atem:invoke name="special_function">\n'
               '<atem:parameter name="arg1">1</atem:parameter>\n</atem:invoke>\n'
               '</atem:function_calls>')
HELLO = "Hello, world!\nWhat's up?"


def _calls(r: ParsedReply) -> list[tuple[str, object]]:
    return [(c.name, json.loads(c.arguments)) for c in r.calls]


def test_a_plain_answer() -> None:
    r = parse_reply(f" to=user<|message|>{HELLO}<|eot|>", None)
    assert (r.content, r.reasoning, r.calls) == (HELLO, None, [])


def test_a_tool_call_as_the_first_message() -> None:
    r = parse_reply(" to=special_function<|message|>" + CALL_MARKUP, SPECIAL_FUNCTION)
    assert r.content is None and _calls(r) == [("special_function", {"arg1": 1})]
    assert r.calls[0].arguments == '{"arg1":1}'  # llama.cpp's bytes


def test_inform_then_act() -> None:
    """The answer closed by <|eom|> stops there, and the call after it is parsed."""
    r = parse_reply(f" to=user<|message|>{HELLO}<|eom|><|start|>assistant to=special_function"
                    "<|message|>" + CALL_MARKUP, SPECIAL_FUNCTION)
    assert r.content == HELLO and _calls(r) == [("special_function", {"arg1": 1})]


def test_markup_quoted_in_an_answer_stays_content() -> None:
    r = parse_reply(" to=user<|message|>You invoke it like this:\n" + CALL_MARKUP + "<|eot|>",
                    SPECIAL_FUNCTION)
    assert r.content == "You invoke it like this:\n" + CALL_MARKUP and r.calls == []


def test_structured_output_straight_to_the_answer() -> None:
    text = '{"amount": 123.45, "date": "2025-12-03"}'
    assert parse_reply(" to=user<|message|>" + text, None).content == text


def test_reasoning_then_the_answer() -> None:
    r = parse_reply(" to=self<|message|>I need to output the invoice details in JSON<|eom|>"
                    '<|start|>assistant to=user<|message|>{"amount": 123.45}', None)
    assert r.reasoning == "I need to output the invoice details in JSON"
    assert r.content == '{"amount": 123.45}'


def test_tool_markup_in_the_reasoning_is_reasoning() -> None:
    r = parse_reply(" to=self<|message|>I could use " + CALL_MARKUP + " here<|eom|>"
                    "<|start|>assistant to=user<|message|>Hello!<|eot|>", SPECIAL_FUNCTION)
    assert r.reasoning == "I could use " + CALL_MARKUP + " here"
    assert r.content == "Hello!" and r.calls == []


def test_parallel_calls_and_string_arguments() -> None:
    """Calls separated by <|eom|><|start|>assistant; a string parameter as written
    (spaces and newlines kept), a number as JSON."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"},
                                         "days": {"type": "integer"}}}}}]
    call = ('<atem:function_calls>\n<atem:invoke name="get_weather">\n<atem:parameter '
            'name="city">{}</atem:parameter>\n<atem:parameter name="days">{}'
            '</atem:parameter>\n</atem:invoke>\n</atem:function_calls>')
    r = parse_reply(" to=get_weather<|message|>" + call.format("Paris ", 2) +
                    "<|eom|><|start|>assistant to=get_weather<|message|>" +
                    call.format("New\nYork", 3), tools)
    assert _calls(r) == [("get_weather", {"city": "Paris ", "days": 2}),
                         ("get_weather", {"city": "New\nYork", "days": 3})]


@pytest.mark.parametrize("tools", [None, [{"type": "function", "function": {
    "name": "other", "parameters": {}}}]])
def test_an_undeclared_or_unoffered_call_stays_content(tools: object) -> None:
    text = " to=special_function<|message|>" + CALL_MARKUP
    r = parse_reply(text, tools)  # type: ignore[arg-type]
    assert r.calls == [] and r.content == text


def _template() -> str:
    return llama_cpp_template().read_text()


def test_the_template_is_recognised_and_renders_its_preamble() -> None:
    template = _template()
    assert is_muse_glimmer_template(template)
    assert not is_muse_glimmer_template("{{ messages }}<|eom|>")
    text = render_chat(template, [{"role": "user", "content": "What is 2+2?"}],
                       tools=SPECIAL_FUNCTION, current_date="2026-01-05")
    assert text.startswith("<|start|>system<|message|>You are a helpful AI assistant.\n"
                           "Knowledge cutoff: 2026-01-04.\nCurrent date: 2026-01-05.\n\n"
                           "Reasoning strength: high.\n\nIn this environment you have")
    assert '// Function schemas\n{"name": "special_function"' in text
    assert '# Valid recipients: "self", "special_function.*", "user".<|eot|>' in text
    assert text.endswith("<|start|>user<|message|>What is 2+2?<|eot|><|start|>assistant")


def test_a_rendered_tool_turn_parses_back() -> None:
    """An assistant turn with reasoning and a call (OpenAI's JSON-string arguments),
    rendered by the template, is the reply the parser reads back into the same call."""
    template = _template()
    user = {"role": "user", "content": "Call it"}
    turn = {"role": "assistant", "content": None, "reasoning_content": "Let me call it",
            "tool_calls": [{"id": "c1", "type": "function", "function": {
                "name": "special_function", "arguments": '{"arg1": 1}'}}]}
    before = render_chat(template, [user], tools=SPECIAL_FUNCTION, current_date="x")
    after = render_chat(template, [user, turn], add_generation_prompt=False,
                        tools=SPECIAL_FUNCTION, current_date="x")
    assert after.startswith(before)
    r = parse_reply(after[len(before):], SPECIAL_FUNCTION)
    assert r.reasoning == "Let me call it" and r.content is None
    assert _calls(r) == [("special_function", {"arg1": 1})]
