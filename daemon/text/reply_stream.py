"""A chat reply read while it streams: each piece's reasoning and content passed on as
soon as they are settled (and a call's pieces, where the format streams them), the tool
calls once the reply is complete. One interface for
every chat format (chat_formats.py picks the reader of a template), used by every
dialect:

* `ContentStream`: the default reading: content, and calls in it (tool_calls.py);
* `ThinkingStream`: reasoning between the think tags (reasoning.py), then the default
  reading of the answer;
* `WholeStream`: a format parsed only whole (its reply held to its end);
* harmony.HarmonyStream: gpt-oss's channels.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from .muse_glimmer_chat import ParsedReply
from .reasoning import ThinkSplitter
from .reply_delta import ReplyDelta
from .tool_calls import ToolCall, ToolCallStream, parse_tool_calls


class ReplyStream(Protocol):
    def feed(self, piece: str) -> ReplyDelta:
        """What this piece of the reply settles."""
        ...

    def held(self) -> str:
        """The text not passed on yet (sent as content when the reply ends in an error)."""
        ...

    def finish(self) -> tuple[ReplyDelta, list[ToolCall]]:
        """What was held back, and the reply's calls, once it is complete."""
        ...


def read_whole(stream: ReplyStream, text: str) -> ParsedReply:
    """A whole reply read by `stream` (content None: nothing but calls)."""
    first = stream.feed(text)
    rest, calls = stream.finish()
    reasoning = first.reasoning + rest.reasoning
    content = first.content + rest.content
    return ParsedReply(None if calls and not content else content, reasoning or None, calls)


class ContentStream:
    """The default reading: all content, the calls of tools `names` taken out of it
    (None: none offered, the reply is content as it comes)."""

    def __init__(self, names: set[str] | None):
        self.names = names
        self.tools = None if names is None else ToolCallStream(names)

    def feed(self, piece: str) -> ReplyDelta:
        return ReplyDelta(content=piece if self.tools is None else self.tools.feed(piece))

    def held(self) -> str:
        return "" if self.tools is None else self.tools.held()

    def finish(self) -> tuple[ReplyDelta, list[ToolCall]]:
        if self.tools is None:
            return ReplyDelta(), []
        rest, calls = self.tools.finish()
        return ReplyDelta(content=rest), calls


class ThinkingStream:
    """Reasoning between the think tags, then the answer read by `ContentStream`;
    `in_thinking`: the prompt opened the reasoning."""

    def __init__(self, names: set[str] | None, in_thinking: bool):
        self.splitter = ThinkSplitter(in_thinking)
        self.answer = ContentStream(names)

    def feed(self, piece: str) -> ReplyDelta:
        split = self.splitter.feed(piece)
        return ReplyDelta(split.reasoning, self.answer.feed(split.content).content
                          if split.content else "")

    def held(self) -> str:
        return self.answer.held() + self.splitter.held()

    def finish(self) -> tuple[ReplyDelta, list[ToolCall]]:
        split = self.splitter.finish()
        content = self.answer.feed(split.content).content if split.content else ""
        rest, calls = self.answer.finish()
        return ReplyDelta(split.reasoning, content + rest.content), calls


class WholeStream:
    """A format whose replies are parsed only whole: nothing passes until the end."""

    def __init__(self, parse: Callable[[str], ParsedReply]):
        self.parse, self.text = parse, ""

    def feed(self, piece: str) -> ReplyDelta:
        self.text += piece
        return ReplyDelta()

    def held(self) -> str:
        return ""  # (a reply cut short is not this format's to show)

    def finish(self) -> tuple[ReplyDelta, list[ToolCall]]:
        parsed = self.parse(self.text)
        return ReplyDelta(parsed.reasoning or "", parsed.content or ""), parsed.calls


def default_parse(text: str, names: set[str] | None) -> ParsedReply:
    """The default reading of a whole reply (content and calls, no reasoning)."""
    content, calls = parse_tool_calls(text, names)
    return ParsedReply(content, None, calls)


__all__ = ["ContentStream", "ReplyDelta", "ReplyStream", "ThinkingStream", "WholeStream",
           "default_parse", "read_whole"]
