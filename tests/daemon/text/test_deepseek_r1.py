"""DeepSeek-R1's own tool-call syntax (daemon/text/deepseek_r1.py), read as llama.cpp's
DeepSeek-R1 parser reads it (tests/test-chat.cpp's cases): whole and streamed in pieces of
every size, after the reasoning, and what R1's templates (llama.cpp's copies of the
GGUFs' tokenizer.chat_template) write for an assistant's calls read back as those calls."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specd.daemon.text.chat_formats import DEEPSEEK_R1, THINKING, chat_format
from specd.daemon.text.chat_template import render_chat
from specd.daemon.text.deepseek_r1 import parse_r1_calls

import llama_cpp_convert

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object",
                                          "properties": {"city": {"type": "string"}}}}}
SPECIAL = {"type": "function", "function": {
    "name": "special_function", "parameters": {"type": "object",
                                               "properties": {"arg1": {"type": "integer"}}}}}
TOOLS = [WEATHER, SPECIAL]
NAMES = {"get_weather", "special_function"}
# test-chat.cpp's call, as the R1 distill's template case writes it (no newline before the
# closing fence)
SPECIAL_CALL = ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>"
                "special_function\n```json\n{\"arg1\": 1}```<｜tool▁call▁end｜>"
                "<｜tool▁calls▁end｜>")
TWO_CALLS = ("Let me look.\n\n<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function"
             "<｜tool▁sep｜>get_weather\n```json\n{\"city\": \"Paris\"}\n```"
             "<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>"
             "special_function\n```json\n{\"arg1\": 2}\n```<｜tool▁call▁end｜>"
             "<｜tool▁calls▁end｜>")
CASES = [
    # (the reply, the prompt opened <think>, reasoning, content, calls as (name, arguments))
    ("</think>" + SPECIAL_CALL, True, None, None, [("special_function", {"arg1": 1})]),
    (SPECIAL_CALL, False, None, None, [("special_function", {"arg1": 1})]),
    ("I need the weather.\n</think>\n\n" + TWO_CALLS, True, "I need the weather.",
     "Let me look.", [("get_weather", {"city": "Paris"}), ("special_function", {"arg1": 2})]),
    # R1's other spelling of the section's opening
    (SPECIAL_CALL.replace("<｜tool▁calls▁begin｜>", "<｜tool▁calls｜>"), False, None, None,
     [("special_function", {"arg1": 1})]),
    # not calls: an undeclared tool, arguments that are not JSON, cut off before the end
    (SPECIAL_CALL.replace("special_function", "rm_rf"), False, None,
     SPECIAL_CALL.replace("special_function", "rm_rf"), []),
    (SPECIAL_CALL.replace("{\"arg1\": 1}", "{arg1: 1}"), False, None,
     SPECIAL_CALL.replace("{\"arg1\": 1}", "{arg1: 1}"), []),
    (SPECIAL_CALL[:-40], False, None, SPECIAL_CALL[:-40], []),
    ("</think>Hello, world!\nWhat's up?", True, None, "Hello, world!\nWhat's up?", []),
    # the tagged call specd's grammar forces for tool_choice "required"
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     False, None, None, [("get_weather", {"city": "Paris"})]),
]


def _calls(calls: list) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize(("reply", "opened", "reasoning", "content", "calls"), CASES)
def test_a_whole_reply_as_llama_cpp_reads_it(reply: str, opened: bool, reasoning: str | None,
                                             content: str | None, calls: list) -> None:
    parsed = DEEPSEEK_R1.parse(reply, TOOLS, opened)
    assert (parsed.reasoning, parsed.content) == (reasoning, content)
    assert _calls(parsed.calls) == calls


@pytest.mark.parametrize("size", [1, 2, 3, 5, 17])
@pytest.mark.parametrize(("reply", "opened", "reasoning", "content", "calls"), CASES)
def test_streamed_pieces_give_what_the_whole_reply_gives(
        size: int, reply: str, opened: bool, reasoning: str | None, content: str | None,
        calls: list) -> None:
    """No piece passes on text of the calls' section; the calls come at the end."""
    stream = DEEPSEEK_R1.stream(TOOLS, opened)
    deltas = [stream.feed(reply[i:i + size]) for i in range(0, len(reply), size)]
    rest, found = stream.finish()
    said = "".join(d.content for d in deltas) + rest.content
    assert "".join(d.reasoning for d in deltas) + rest.reasoning == (reasoning or "")
    assert said.strip() == (content or "").strip()
    assert _calls(found) == calls
    if calls:
        assert "｜" not in "".join(d.content for d in deltas)


def test_without_tools_the_calls_are_text() -> None:
    parsed = DEEPSEEK_R1.parse(SPECIAL_CALL, None)
    assert parsed.content == SPECIAL_CALL and parsed.calls == []
    assert parse_r1_calls(SPECIAL_CALL, None) == (SPECIAL_CALL, [])


def _template(name: str) -> str:
    path = llama_cpp_convert.source() / "models" / "templates" / name
    if not path.is_file():
        pytest.skip(f"llama.cpp's template {name} is not at {path}")
    return Path(path).read_text()


R1_TEMPLATES = ["deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja",
                "deepseek-ai-DeepSeek-R1-Distill-Llama-8B.jinja", "llama-cpp-deepseek-r1.jinja"]


@pytest.mark.parametrize("name", R1_TEMPLATES)
def test_r1_templates_choose_the_format(name: str) -> None:
    assert chat_format(_template(name)) is DEEPSEEK_R1


def test_deepseek_v3_1_calls_are_not_r1s() -> None:
    """V3.1 writes calls without the type and the fence: not R1's syntax."""
    assert chat_format(_template("deepseek-ai-DeepSeek-V3.1.jinja")) is not DEEPSEEK_R1
    assert chat_format(_template("Qwen-QwQ-32B.jinja")) is THINKING


@pytest.mark.parametrize("name", ["deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja",
                                  "llama-cpp-deepseek-r1.jinja"])
def test_what_the_template_writes_for_calls_reads_back_as_them(name: str) -> None:
    """An assistant's calls rendered by R1's own template, cut where the assistant's turn
    begins and its end-of-sentence token, parse into the same calls."""
    calls = [{"id": "a", "type": "function", "function": {
                 "name": "get_weather", "arguments": json.dumps({"city": "Paris"})}},
             {"id": "b", "type": "function", "function": {
                 "name": "special_function", "arguments": json.dumps({"arg1": 1})}}]
    messages = [{"role": "user", "content": "weather?"},
                {"role": "assistant", "content": None, "tool_calls": calls}]
    text = render_chat(_template(name), messages, tools=TOOLS, add_generation_prompt=False)
    reply = text[text.rindex("<｜Assistant｜>") + len("<｜Assistant｜>"):]
    reply = reply.removesuffix("<｜end▁of▁sentence｜>")
    assert reply.startswith("<｜tool▁calls▁begin｜>"), reply
    parsed = DEEPSEEK_R1.parse(reply, TOOLS)
    assert parsed.content is None
    assert _calls(parsed.calls) == [("get_weather", {"city": "Paris"}),
                                    ("special_function", {"arg1": 1})]
