"""Reasoning between think tags, as llama.cpp reads it (tests/test-chat.cpp's cases for
the QwQ, DeepSeek-R1 distill and llama.cpp DeepSeek-R1 templates, reasoning format
"deepseek"): whole, and streamed a piece at a time, each piece's reasoning and content
passed on once settled and adding up to the whole; the format found from llama.cpp's own
templates, and whether their prompt opens the reasoning."""

from __future__ import annotations

from pathlib import Path

import pytest

from specd.daemon.text.chat_formats import DEEPSEEK_R1, THINKING, chat_format
from specd.daemon.text.chat_template import render_chat
from specd.daemon.text.reasoning import END, ThinkSplitter, opens_thinking, split_thinking
from specd.daemon.text.reply_stream import ThinkingStream

import llama_cpp_convert

HELLO = "Hello, world!\nWhat's up?"
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}

# (reply, the prompt opened <think>, reasoning, content): test-chat.cpp's
CASES = [
    ("Let me think about this...\n</think>\nThe answer is 42.", True,
     "Let me think about this...", "The answer is 42."),                   # QwQ
    ("</think>Hello, world!", True, None, "Hello, world!"),               # QwQ
    ("</think>" + HELLO, True, None, HELLO),                              # R1 distills
    ("I'm\nthinking</think>" + HELLO, True, "I'm\nthinking", HELLO),      # R1 distills
    # Qwen3 (the model opens the tag itself), and a reply without reasoning
    ("<think>\nI'm\nthinking\n</think>\n\n" + HELLO, False, "I'm\nthinking", HELLO),
    ("<think>\n\n</think>\n\n" + HELLO, False, None, HELLO),
    (HELLO, False, None, HELLO),
    # cut off before the end tag: all reasoning
    ("<think>\nI'm\nthinking", False, "I'm\nthinking", ""),
    ("I'm\nthinking", True, "I'm\nthinking", ""),
    # whitespace before the tag; a tag that is not the reply's start stays content
    ("  <think>a</think>b", False, "a", "b"),
    ("Hi <think>a</think>b", False, None, "Hi <think>a</think>b"),
]


@pytest.mark.parametrize(("reply", "opened", "reasoning", "content"), CASES)
def test_whole_replies_as_llama_cpp_reads_them(reply: str, opened: bool,
                                               reasoning: str | None, content: str) -> None:
    assert split_thinking(reply, opened) == (reasoning, content)
    parsed = THINKING.parse(reply, None, opened)
    assert (parsed.reasoning, parsed.content) == (reasoning, content)


def _pieces(text: str, size: int) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)]


@pytest.mark.parametrize("size", [1, 2, 3, 7])
@pytest.mark.parametrize(("reply", "opened", "reasoning", "content"), CASES)
def test_streamed_pieces_add_up_to_the_whole(reply: str, opened: bool,
                                             reasoning: str | None, content: str,
                                             size: int) -> None:
    splitter = ThinkSplitter(opened)
    thought, said, n_thought = "", "", 0
    for piece in _pieces(reply, size):
        delta = splitter.feed(piece)
        thought, said = thought + delta.reasoning, said + delta.content
        n_thought += bool(delta.reasoning)
        # held back: at most a tail that may start the end tag, after whitespace
        held = splitter.held()
        if splitter.state == "thinking" and held.strip():
            assert len(held.strip()) < len(END) and END.startswith(held.strip()), held
    rest = splitter.finish()
    assert (thought + rest.reasoning or None, said + rest.content) == (reasoning, content)
    if reasoning and len(reasoning) > 2 * size:
        assert n_thought > 1  # the reasoning streamed, not held to the end tag


def test_content_after_the_reasoning_is_read_for_tool_calls() -> None:
    reply = ('<think>\nweather\n</think>\n\n<tool_call>\n{"name": "get_weather", '
             '"arguments": {"city": "Paris"}}\n</tool_call>')
    parsed = THINKING.parse(reply, [WEATHER])
    assert parsed.reasoning == "weather" and parsed.content is None
    assert [(c.name, c.arguments) for c in parsed.calls] == [("get_weather",
                                                             '{"city": "Paris"}')]
    stream = ThinkingStream({"get_weather"}, False)
    deltas = [stream.feed(p) for p in _pieces(reply, 2)]
    rest, calls = stream.finish()
    assert "".join(d.reasoning for d in deltas) + rest.reasoning == "weather"
    assert "".join(d.content for d in deltas) + rest.content == ""
    assert [c.name for c in calls] == ["get_weather"]


def _template(name: str) -> str:
    path = llama_cpp_convert.source() / "models" / "templates" / name
    if not path.is_file():
        pytest.skip(f"llama.cpp's template {name} is not at {path}")
    return Path(path).read_text()


# (llama.cpp's template, its prompt opens <think> with thinking on)
THINKING_TEMPLATES = [("Qwen-Qwen3-0.6B.jinja", False), ("Qwen-QwQ-32B.jinja", True),
                      ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja", True),
                      ("deepseek-ai-DeepSeek-R1-Distill-Llama-8B.jinja", True),
                      ("llama-cpp-deepseek-r1.jinja", True)]


@pytest.mark.parametrize(("name", "opened"), THINKING_TEMPLATES)
def test_llama_cpp_thinking_templates_are_found(name: str, opened: bool) -> None:
    template = _template(name)
    # the DeepSeek-R1 templates: think tags and calls in R1's syntax (test_deepseek_r1.py)
    assert chat_format(template) is (DEEPSEEK_R1 if "r1" in name.lower() else THINKING)
    assert chat_format(template).thinks
    prompt = render_chat(template, [{"role": "user", "content": "hi"}],
                         enable_thinking=True)
    assert opens_thinking(prompt) is opened, prompt[-40:]


def test_a_continued_reasoning_is_read_as_reasoning() -> None:
    """test-chat.cpp's continuation cases: the assistant's prefilled reasoning continued
    (continue_final_message) leaves the reply in the reasoning; a prefilled answer (the
    reasoning closed before it) leaves it in the content."""
    template = _template("Qwen-QwQ-32B.jinja")
    user = {"role": "user", "content": "hi"}

    def prompt(last: str) -> str:
        return render_chat(template, [user, {"role": "assistant", "content": last}],
                           add_generation_prompt=False, continue_final_message=True)

    assert opens_thinking(prompt("<think>\nI'm"))
    assert split_thinking(" thinking\n</think>\n" + HELLO, True) == ("thinking", HELLO)
    assert not opens_thinking(prompt("<think>I'm thinking</think>Hello, world!"))


def test_qwen3_with_thinking_off_closes_the_reasoning_in_the_prompt() -> None:
    """Qwen3's template writes an empty think block with enable_thinking false: the
    reply is all content."""
    prompt = render_chat(_template("Qwen-Qwen3-0.6B.jinja"),
                         [{"role": "user", "content": "hi"}], enable_thinking=False)
    assert prompt.rstrip().endswith("</think>") and not opens_thinking(prompt)


@pytest.mark.parametrize("name", ["meta-llama-Llama-3.1-8B-Instruct.jinja",
                                  "Qwen-Qwen2.5-7B-Instruct.jinja"])
def test_templates_without_reasoning_keep_the_default_reading(name: str) -> None:
    assert chat_format(_template(name)) is None
