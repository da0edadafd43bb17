"""gpt-oss's harmony chat format: a reply's messages split into content, reasoning and tool
calls, as llama-server's gpt-oss parser (common/parsers/gpt-oss.cpp) returns them.

A harmony reply is a run of messages after the prompt's `<|start|>assistant`, each a header
then `<|message|>`, its body, and `<|end|>` (the last one ends the generation instead, with
`<|return|>` or `<|call|>`):

    <|channel|>analysis<|message|>I'm thinking<|end|>
    <|start|>assistant<|channel|>final<|message|>Hello!
    <|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json
    <|message|>{"city": "Paris"}            (one line in the reply)

The header names the channel (`<|channel|>NAME`, the last one where a stray
`<|channel|>commentary to=assistant` precedes it) and may name a recipient (` to=X`, in
the role part or after the channel). A body goes to:

* `reasoning_content`: the analysis channel without a recipient;
* `tool_calls`: a recipient `functions.NAME` naming one of the request's tools, its body
  the arguments (JSON; one that does not parse leaves the message out);
* nowhere: any other recipient (builtin tools such as `python` or `container.exec`);
* `content`: the final and commentary channels (a commentary without a recipient is a
  preamble the user sees).

Registered in chat_formats.py: the control tokens the parser reads (`PRESERVED_TOKENS`)
stay in the reply's text.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from .muse_glimmer_chat import ParsedReply
from .tool_calls import ToolCall, tool_names

CHANNEL, MESSAGE, START, END, CONSTRAIN = (
    "<|channel|>", "<|message|>", "<|start|>", "<|end|>", "<|constrain|>")
PRESERVED_TOKENS = (CHANNEL, MESSAGE, START, END, CONSTRAIN)  # llama.cpp's for gpt-oss
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_ROLE = re.compile(r"^\s*(assistant)\b")


def is_harmony_template(template: str) -> bool:
    """Whether a chat template writes harmony (llama.cpp: the source holds <|channel|>)."""
    return CHANNEL in template


@dataclass
class _Message:
    channel: str
    recipient: str
    body: str


def _messages(text: str) -> list[_Message]:
    """The reply's messages, in order; a header without <|message|> yet is left out."""
    out: list[_Message] = []
    for part in text.split(START):
        header, sep, rest = part.partition(MESSAGE)
        if not sep:
            continue
        header = _ROLE.sub("", header)
        channels = header.split(CHANNEL)[1:]
        channel = channels[-1].split()[0] if channels and channels[-1].split() else ""
        if CONSTRAIN in channel:
            channel = channel.split(CONSTRAIN)[0]
        # the last recipient wins, ignoring a stray "to=assistant"
        recipients = [r for r in _RECIPIENT.findall(header) if r != "assistant"]
        body = rest.partition(END)[0]
        out.append(_Message(channel, recipients[-1] if recipients else "", body))
    return out


def parse_reply(text: str, tools: list[dict[str, Any]] | None) -> ParsedReply:
    """A whole reply's content (None: nothing but calls), reasoning (None: none) and calls
    of the request's `tools` (None: none offered, calls are not taken); the module
    docstring says where each message goes."""
    names = tool_names(tools) if tools is not None else set()
    content, reasoning, calls = "", "", []
    for m in _messages(text):
        if m.recipient:
            fn = m.recipient.removeprefix("functions.")
            if m.recipient.startswith("functions.") and fn in names:
                call = _call(fn, m.body)
                if call is not None:
                    calls.append(call)
        elif m.channel == "analysis":
            reasoning += m.body
        else:
            content += m.body
    return ParsedReply(content or (None if calls else ""), reasoning or None, calls)


def _call(name: str, body: str) -> ToolCall | None:
    try:
        args = json.loads(body)
    except ValueError:
        return None
    return ToolCall(name=name, arguments=json.dumps(args, ensure_ascii=False))
