"""Tool calls parsed out of chat replies (the Hermes <tool_call> format, bare JSON)."""

from __future__ import annotations

import json

import pytest

from specd.daemon.text.tool_calls import (
    ToolCallStream,
    forced_call_grammar,
    parse_tool_calls,
    tool_names,
)

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {}}}]
NAMES = tool_names(TOOLS)

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_tool_names() -> None:
    assert NAMES == {"get_weather", "get_time"}
    assert tool_names(None) == set()


def test_a_tagged_call_with_text_before_it() -> None:
    content, calls = parse_tool_calls("Let me look.\n" + CALL, NAMES)
    assert content == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"})]
    assert calls[0].id.startswith("call_")
    assert calls[0].as_openai(0) == {"index": 0, "id": calls[0].id, "type": "function",
                                     "function": {"name": "get_weather",
                                                  "arguments": calls[0].arguments}}


def test_several_calls_and_string_arguments() -> None:
    text = (CALL + "\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": \"{\\\"tz\\\": "
            "\\\"UTC\\\"}\"}\n</tool_call>")
    content, calls = parse_tool_calls(text, NAMES)
    assert content is None
    assert [c.name for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[1].arguments) == {"tz": "UTC"}
    assert calls[0].id != calls[1].id


def test_a_call_cut_off_before_its_closing_tag_still_counts_if_its_json_is_whole() -> None:
    _, calls = parse_tool_calls(CALL[: -len("</tool_call>")], NAMES)
    assert [c.name for c in calls] == ["get_weather"]


@pytest.mark.parametrize("text", [
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',  # cut by max_tokens
    "<tool_call>not json</tool_call>",
    '<tool_call>{"arguments": {}}</tool_call>',  # no name
    '<tool_call>{"name": "f", "arguments": 3}</tool_call>',
    '<tool_call>{"name": "f", "arguments": "{bad"}</tool_call>',
])
def test_malformed_calls_leave_the_reply_as_content(text: str) -> None:
    assert parse_tool_calls(text, NAMES) == (text, [])


@pytest.mark.parametrize("text", [
    "[" * 1200,  # a model stuck on one token: past json's recursion limit
    '{"a":' * 1200,
    "<tool_call>" + "[" * 1200,
    '<tool_call>{"name": "get_time", "arguments": "' + "[" * 1200 + '"}</tool_call>',
    '<tool_call>{"name": "get_time", "arguments": "{\\"t\\": NaN}"}</tool_call>',
    '<tool_call>{"name": "get_time", "arguments": {"t": NaN}}</tool_call>',  # not JSON
    '{"name": "get_time", "arguments": {"t": -Infinity}}',
    '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',  # not a declared tool
    '<tool_call>{"name": "", "arguments": {}}</tool_call>',
])
def test_replies_that_are_no_calls_of_the_request_stay_content(text: str) -> None:
    assert parse_tool_calls(text, NAMES) == (text, [])
    assert _stream(_pieces(text, 50)) == (text, [])


def test_a_bare_json_call_only_for_a_declared_tool() -> None:
    _, calls = parse_tool_calls(' {"name": "get_time", "parameters": {"tz": "UTC"}}', NAMES)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_time", {"tz": "UTC"})]
    other = '{"name": "Ada", "arguments": {}}'  # JSON the user may have asked for
    assert parse_tool_calls(other, NAMES) == (other, [])
    assert parse_tool_calls("plain answer", NAMES) == ("plain answer", [])
    # a request that offered no tools: a call-shaped reply is its text
    assert parse_tool_calls(' {"name": "get_time", "parameters": {}}', None) == (
        ' {"name": "get_time", "parameters": {}}', [])


def test_a_call_in_a_json_block_as_qwen_coder_answers() -> None:
    """Qwen2.5-Coder-1.5B-Instruct, asked for the weather with a get_weather tool through
    its own template, answers (greedy) with this, not <tool_call> tags."""
    text = ('```json\n{\n  "name": "get_weather",\n  "arguments": {\n    "city": "Paris"\n'
            '  }\n}\n```')
    content, calls = parse_tool_calls(text, NAMES)
    assert content is None
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"})]
    two = '[{"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": {}}]'
    assert [c.name for c in parse_tool_calls(two, NAMES)[1]] == ["get_time", "get_weather"]
    code = "```json\n{\"city\": \"Paris\"}\n```"  # JSON, but no call
    assert parse_tool_calls(code, NAMES) == (code, [])
    mixed = '[{"name": "get_time", "arguments": {}}, {"name": "rm_rf", "arguments": {}}]'
    assert parse_tool_calls(mixed, NAMES) == (mixed, [])


def test_a_code_answer_streams_at_once() -> None:
    """Only a reply that may still be a bare call is held: a code block in another
    language, or one whose first line is not JSON, passes on as it comes."""
    s = ToolCallStream(NAMES)
    assert s.feed("``") == "" and s.feed("`") == ""
    assert s.feed("py") == "```py"  # not json
    assert s.feed("thon\n") == "thon\n"
    s = ToolCallStream(NAMES)
    assert s.feed("```json\n") == "" and s.feed("  ") == ""
    assert s.feed('"a"') == '```json\n  "a"'
    s = ToolCallStream(NAMES)
    assert s.feed("Sure") == "Sure"


def test_a_json_answer_streams_once_it_cannot_be_a_call() -> None:
    """Under tools, JSON that is not `{"name": "<declared tool>"...` passes on as soon as
    it shows that, not at the end of the reply."""
    for text, held in (('{"city": "Paris"}', 2), ('{"name": "Ada"}', 10),
                       ('[1, 2]', 1), ('```json\n{"a": 1}\n```', 9)):
        s = ToolCallStream(NAMES)
        out = "".join(s.feed(c) for c in text)
        assert out == text[: len(out)] and len(out) >= len(text) - held
        assert s.finish() == (text[len(out):], [])
    s = ToolCallStream(NAMES)
    assert "".join(s.feed(c) for c in '{ "name" : "get_w') == ""  # may still be a call
    first_key_later = '{"arguments": {}, "name": "get_time"}'  # not how models write calls
    assert parse_tool_calls(first_key_later, NAMES) == (first_key_later, [])


def test_escaped_names_of_bare_calls() -> None:
    """A name written with JSON escapes (as json.dumps with ensure_ascii writes it) is the
    name it decodes to, streamed or whole."""
    names = {"get_weather", "météo", 'say"hi'}
    for text, name in (('{"name": "get\\u005fweather", "arguments": {}}', "get_weather"),
                       ('{"name": "m\\u00e9t\\u00e9o", "arguments": {}}', "météo"),
                       ('{"name": "say\\"hi", "arguments": {}}', 'say"hi')):
        assert [c.name for c in parse_tool_calls(text, names)[1]] == [name]
        s = ToolCallStream(names)
        assert "".join(s.feed(c) for c in text) == ""
        assert [c.name for c in s.finish()[1]] == [name]


def test_forced_call_grammar(tiny_tok) -> None:
    """tool_choice required / named: each tool's parameters are their own JSON document
    ($defs and "#" resolve in it), arguments are always an object, one call unless
    parallel calls are allowed."""
    from specd.daemon.text.grammar import compile_constraint

    tools = [{"type": "function", "function": {"name": "tree", "parameters": {
        "type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}},
                                         "tag": {"$ref": "#/$defs/Tag"}},
        "$defs": {"Tag": {"type": "string", "maxLength": 3}}}}},
        {"type": "function", "function": {"name": "free", "parameters": {}}}]

    def accepts(grammar: str, text: str) -> bool:
        st = compile_constraint("lark", grammar, tiny_tok).start()
        for t in tiny_tok.encode(text, add_bos=False, parse_special=False):
            if not st.is_allowed(t):
                return False
            st.consume(t)
        return st.is_accepting()

    g = forced_call_grammar(tools)
    call = ('<tool_call>\n{"name": "tree", "arguments": {"kids": [{"kids": []}], '
            '"tag": "a"}}\n</tool_call>')
    assert accepts(g, call)
    assert accepts(g, call + "\n" + call)
    assert not accepts(forced_call_grammar(tools, parallel=False), call + "\n" + call)
    assert not accepts(g, call.replace('{"kids": []}', "3"))  # "#" is the tool's schema
    assert not accepts(g, call.replace('"a"', '"abcd"'))  # and $defs its $defs
    assert accepts(g, '<tool_call>\n{"name": "free", "arguments": {}}\n</tool_call>')
    assert not accepts(g, '<tool_call>\n{"name": "free", "arguments": 58}\n</tool_call>')
    assert not accepts(forced_call_grammar(tools, "free"), call)


def _stream(pieces: list[str]) -> tuple[str, list]:
    s = ToolCallStream(NAMES)
    sent = "".join(s.feed(p) for p in pieces)
    rest, calls = s.finish()
    return sent + rest, calls


def _pieces(text: str, size: int = 3) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)]


def test_streaming_passes_text_on_and_holds_a_call_back() -> None:
    s = ToolCallStream(NAMES)
    assert s.feed("Let me ") == "Let me "
    assert s.feed("look. <tool") == "look. "  # "<tool" may open a call: held
    assert s.feed("_call>\n{\"name\": ") == ""
    assert s.feed('"get_weather", "arguments": {}}</tool_call>') == ""
    rest, calls = s.finish()
    assert rest == "" and [c.name for c in calls] == ["get_weather"]


@pytest.mark.parametrize("size", [1, 2, 5, 100])
def test_streamed_replies_equal_whole_ones(size: int) -> None:
    for text in ("Hello <tool world>, a < b", "Let me look.\n" + CALL, CALL,
                 '{"name": "get_time", "arguments": {}}', '{"name": "x"', "<tool_call>oops",
                 "ends with <tool_ca", '```json\n{"name": "get_time", "arguments": {}}\n```',
                 "```python\nprint(1)\n```", "```json\n[1, 2]\n```",
                 '[{"name": "get_time", "arguments": {}}]', '{"city": "Paris"}'):
        content, calls = parse_tool_calls(text, NAMES)
        sent, streamed = _stream(_pieces(text, size))
        assert [(c.name, c.arguments) for c in streamed] == [(c.name, c.arguments)
                                                              for c in calls]
        if not calls:
            assert sent == text
        else:
            assert sent.strip() == (content or "")
