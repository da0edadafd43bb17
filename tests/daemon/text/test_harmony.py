"""gpt-oss's harmony replies parsed as llama-server's gpt-oss parser parses them: the cases
of llama.cpp's tests/test-chat.cpp (GPT-OSS format tests), the format found from the
template, and the vocabulary's end-of-generation tokens as llama.cpp's vocabulary takes
them."""

from __future__ import annotations

import json

import pytest

from specd.daemon.text.chat_formats import chat_format
from specd.daemon.text.detokenize import IncrementalDetokenizer
from specd.daemon.text.harmony import parse_reply
from specd.daemon.text.tokenizer import Tokenizer
from specd.ort_models.gguf_file import GGUFFile

from tiny_moe import HARMONY_TEMPLATE, write_tiny_gpt_oss

TOOLS = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
         for n in ("special_function", "edit")]
HELLO = "Hello, world!\nWhat's up?"
THINKING = "I'm\nthinking"

# (reply after the prompt's <|start|>assistant, tools, content, reasoning, calls)
CASES = [
    ("<|channel|>final<|message|>" + HELLO, None, HELLO, "", []),
    ("<|channel|>commentary<|message|>" + HELLO, None, HELLO, "", []),
    (f"<|channel|>analysis<|message|>{THINKING}<|end|><|start|>assistant<|channel|>final"
     f"<|message|>{HELLO}", None, HELLO, THINKING, []),
    (f"<|channel|>analysis<|message|>{THINKING}", None, "", THINKING, []),
    (' to=functions.special_function<|channel|>analysis<|message|>{"arg1": 1}', TOOLS, "",
     "", [("special_function", {"arg1": 1})]),
    ('<|channel|>analysis to=functions.special_function<|message|>{"arg1": 1}', TOOLS, "",
     "", [("special_function", {"arg1": 1})]),
    (' to=functions.special_function<|channel|>analysis <|constrain|>json<|message|>'
     '{"arg1": 1}', TOOLS, "", "", [("special_function", {"arg1": 1})]),
    ('<|channel|>commentary to=functions.special_function<|message|>{"arg1": 1}', TOOLS, "",
     "", [("special_function", {"arg1": 1})]),
    (f"<|channel|>analysis<|message|>{THINKING}<|end|><|start|>assistant to=functions."
     'special_function<|channel|>analysis<|message|>{"arg1": 1}', TOOLS, "", THINKING,
     [("special_function", {"arg1": 1})]),
    ("<|channel|>analysis<|message|>Thinking about edit...<|end|><|start|>assistant"
     "<|channel|>commentary to=functions.edit <|constrain|>json<|message|>"
     '{"oldString": "if (part < railCount - 1) {", "newString": "if (part < 4) {", '
     '"replaceAll": false}', TOOLS, "", "Thinking about edit...",
     [("edit", {"oldString": "if (part < railCount - 1) {", "newString": "if (part < 4) {",
                "replaceAll": False})]),
    ("<|channel|>analysis<|message|>I need to output the invoice details in JSON<|end|>"
     '<|start|>assistant<|channel|>final <|constrain|>json<|message|>{"amount": 123.45}',
     None, '{"amount": 123.45}', "I need to output the invoice details in JSON", []),
    # unsolicited calls to builtin tools: no content (llama.cpp: "no good way to handle")
    ("<|channel|>analysis<|message|>I will execute python to say hello<|end|>"
     "<|start|>assistant to=container.exec<|channel|>commentary<|message|>python3 -c 'x'",
     None, "", "I will execute python to say hello", []),
    ("<|channel|>analysis<|message|>I will execute python to say hello<|end|>"
     "<|start|>assistant<|channel|>commentary to=python <|constrain|>code<|message|>x()",
     None, "", "I will execute python to say hello", []),
    # a stray "<|channel|>commentary to=assistant" before a channel
    (f"<|channel|>commentary to=assistant<|channel|>analysis<|message|>{THINKING}<|end|>"
     f"<|start|>assistant<|channel|>final<|message|>{HELLO}", None, HELLO, THINKING, []),
    (f"<|channel|>analysis<|message|>{THINKING}<|end|><|start|>assistant<|channel|>"
     f"commentary to=assistant<|channel|>final<|message|>{HELLO}", None, HELLO, THINKING,
     []),
]


@pytest.mark.parametrize("text, tools, content, reasoning, calls", CASES)
def test_replies_parse_as_llama_cpp_expects(text: str, tools: list | None, content: str,
                                            reasoning: str, calls: list) -> None:
    reply = parse_reply(text, tools)
    assert (reply.content, reply.reasoning) == (content or (None if calls else ""),
                                                reasoning or None)
    assert [(c.name, json.loads(c.arguments)) for c in reply.calls] == calls


def test_a_call_to_an_undeclared_tool_or_with_bad_json_is_no_call() -> None:
    text = '<|channel|>commentary to=functions.other<|message|>{"a": 1}'
    assert parse_reply(text, TOOLS).calls == []
    text = '<|channel|>commentary to=functions.edit<|message|>{"a": '
    assert parse_reply(text, TOOLS).calls == []
    text = '<|channel|>commentary to=functions.edit<|message|>{"a": 1}'
    assert parse_reply(text, None).calls == []  # no tools offered


def test_the_template_and_the_vocabulary_are_harmonys(tmp_path) -> None:
    """A template naming <|channel|> is harmony's format; in a vocabulary with <|return|>
    and <|call|>, <|end|> ends a message, not the generation (llama.cpp's vocabulary),
    and the detokenizer keeps the format's preserved tokens."""
    fmt = chat_format(HARMONY_TEMPLATE)
    assert fmt is not None and fmt.name == "harmony" and chat_format("{{ messages }}") is None
    tok = Tokenizer.from_metadata(
        GGUFFile(write_tiny_gpt_oss(tmp_path / "m.gguf", harmony=True)).metadata)
    ids = {t: tok.token_to_id(t) for t in ("<|end|>", "<|return|>", "<|call|>",
                                           "<|channel|>", "<|message|>")}
    assert ids["<|return|>"] in tok.eot_ids and ids["<|call|>"] in tok.eot_ids
    assert ids["<|end|>"] not in tok.eot_ids
    keep = frozenset(tok.token_to_id(t) for t in fmt.preserved_tokens)
    assert {ids["<|channel|>"], ids["<|message|>"], ids["<|end|>"]} <= keep
    detok = IncrementalDetokenizer(tok, skip_special=True, keep=keep)
    text = "".join(detok.push(i) for i in [ids["<|channel|>"], *tok.encode("final"),
                                           ids["<|message|>"], *tok.encode("hi"),
                                           ids["<|return|>"]])
    assert text == "<|channel|>final<|message|>hi"


@pytest.mark.parametrize("size", [1, 3])
@pytest.mark.parametrize(("reply", "tools", "content", "reasoning", "calls"), CASES)
def test_streamed_as_llama_server_streams_it(reply: str, tools: list | None, content: str,
                                             reasoning: str, calls: list, size: int) -> None:
    """Read a few characters at a time: the reasoning and content deltas add up to the
    whole reply's, a body passed on as it comes (no more held than a partial control
    token), the calls at the end."""
    from specd.daemon.text.harmony import HarmonyStream

    stream = HarmonyStream(tools)
    deltas = [stream.feed(reply[i:i + size]) for i in range(0, len(reply), size)]
    rest, got = stream.finish()
    assert "".join(d.reasoning for d in deltas) + rest.reasoning == reasoning
    assert "".join(d.content for d in deltas) + rest.content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls
    # each call streamed: its name and id first, then its arguments piece by piece
    pieces = [c for d in deltas for c in d.calls] + rest.calls
    for k, call in enumerate(got):
        mine = [p for p in pieces if p.index == k]
        assert (mine[0].name, mine[0].id) == (call.name, call.id)
        assert all(p.name is None for p in mine[1:])
        assert "".join(p.arguments for p in mine) == call.arguments
        if size == 1:
            assert len(mine) > 2
    if len(reasoning) > 4 * size:
        assert sum(bool(d.reasoning) for d in deltas) > 1
    assert "<|" not in rest.content + rest.reasoning
