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
  the arguments as written (JSON; one that does not parse leaves the message out);
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
from .reasoning import partial_tag
from .reply_delta import CallDelta, ReplyDelta
from .reply_stream import read_whole
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


def _message(part: str) -> _Message | None:
    """The message after one `<|start|>` (its body to `<|end|>` or the reply's end); None
    while its header has no `<|message|>` yet."""
    header, sep, rest = part.partition(MESSAGE)
    if not sep:
        return None
    header = _ROLE.sub("", header)
    channels = header.split(CHANNEL)[1:]
    channel = channels[-1].split()[0] if channels and channels[-1].split() else ""
    if CONSTRAIN in channel:
        channel = channel.split(CONSTRAIN)[0]
    # the last recipient wins, ignoring a stray "to=assistant"
    recipients = [r for r in _RECIPIENT.findall(header) if r != "assistant"]
    return _Message(channel, recipients[-1] if recipients else "", rest.partition(END)[0])


def _messages(text: str) -> list[_Message]:
    """The reply's messages, in order; a header without <|message|> yet is left out."""
    return [m for part in text.split(START) if (m := _message(part)) is not None]


def parse_reply(text: str, tools: list[dict[str, Any]] | None) -> ParsedReply:
    """A whole reply's content (None: nothing but calls), reasoning (None: none) and calls
    of the request's `tools` (None: none offered, calls are not taken); the module
    docstring says where each message goes."""
    return read_whole(HarmonyStream(tools), text)


# control tokens a streamed body may end in the middle of (held back until told apart)
_TAGS = (START, END, CHANNEL, MESSAGE, CONSTRAIN, "<|return|>", "<|call|>")


class HarmonyStream:
    """A harmony reply read as it streams (reply_stream.ReplyStream), as llama-server
    streams it: each message's body passed on as it comes, to the reasoning (analysis),
    the content (final, or commentary without a recipient) or, addressed to one of the
    request's `tools` (None: none offered), a call's arguments (its name first); the
    calls whose arguments parse are the reply's, once it is complete."""

    def __init__(self, tools: list[dict[str, Any]] | None):
        self.names = tool_names(tools) if tools is not None else set()
        self.text = ""
        self.base = 0  # where the message being read starts (after its <|start|>)
        self.sent = 0  # characters of its body passed on
        self.calls: list[ToolCall] = []  # the calls begun, their arguments so far
        self.call: int | None = None  # the index of the message's call (None: not one)

    def feed(self, piece: str) -> ReplyDelta:
        self.text += piece
        out = ReplyDelta()
        while True:
            nxt = self.text.find(START, self.base)
            part = self.text[self.base:] if nxt < 0 else self.text[self.base:nxt]
            m = _message(part)
            if m is not None:
                body = m.body
                if nxt < 0 and END not in part.partition(MESSAGE)[2]:
                    body = body[:len(body) - max(partial_tag(body, t) for t in _TAGS)]
                self._route(m, body[self.sent:], out)
                self.sent = max(self.sent, len(body))
            if nxt < 0:
                return out
            self.base, self.sent, self.call = nxt + len(START), 0, None

    def _route(self, m: _Message, text: str, out: ReplyDelta) -> None:
        if m.recipient:
            fn = m.recipient.removeprefix("functions.")
            if not m.recipient.startswith("functions.") or fn not in self.names:
                return  # a builtin tool's (python, ...): not the client's
            if self.call is None:  # the call begins: its name and id
                self.call = len(self.calls)
                self.calls.append(ToolCall(name=fn, arguments=""))
                call = self.calls[self.call]
                out.calls.append(CallDelta(self.call, "", call.name, call.id))
            if text:
                self.calls[self.call].arguments += text
                out.calls.append(CallDelta(self.call, text))
        elif text and m.channel == "analysis":
            out.reasoning += text
        elif text:
            out.content += text

    def held(self) -> str:
        return ""

    def finish(self) -> tuple[ReplyDelta, list[ToolCall]]:
        out = ReplyDelta()
        m = _message(self.text[self.base:])
        if m is not None:
            self._route(m, m.body[self.sent:], out)
        return out, [c for c in self.calls if _parses(c.arguments)]


def _parses(arguments: str) -> bool:
    """Whether a call's arguments are JSON (a call cut short, or malformed, is left out)."""
    try:
        json.loads(arguments)
    except ValueError:
        return False
    return True
