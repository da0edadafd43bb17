"""A chat reply read while it streams: each piece's reasoning and content passed on as
soon as they are settled (and a call's pieces, where the format streams them), the tool
calls once the reply is complete. One interface for
every chat format (chat_formats.py picks the reader of a template), used by every
dialect:

* `ContentStream`: content, and calls in it, read by a `CallStream` (the default:
  tool_calls.py's; DeepSeek-R1's syntax: deepseek_r1.py's);
* `ThinkingStream`: reasoning between the think tags (reasoning.py), then the answer
  read by a `ContentStream`;
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


class CallStream(Protocol):
    """Content pieces in, content out as soon as it cannot be part of a call; the calls
    once the reply is complete."""

    def feed(self, piece: str) -> str: ...

    def held(self) -> str: ...

    def finish(self) -> tuple[str, list[ToolCall]]: ...


# a reader of calls of the tools named
CallReader = Callable[[set[str]], CallStream]


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
    """All content, the calls of tools `names` taken out of it by `calls` (None: none
    offered, the reply is content as it comes)."""

    def __init__(self, names: set[str] | None, calls: CallReader = ToolCallStream):
        self.names = names
        self.tools = None if names is None else calls(names)

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
    """Reasoning between the think tags, then the answer read by `ContentStream` (its
    calls by `calls`); `in_thinking`: the prompt opened the reasoning."""

    def __init__(self, names: set[str] | None, in_thinking: bool,
                 calls: CallReader = ToolCallStream):
        self.splitter = ThinkSplitter(in_thinking)
        self.answer = ContentStream(names, calls)

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


def default_parse(text: str, names: set[str] | None,
                  calls: CallReader = ToolCallStream) -> ParsedReply:
    """A whole reply read without a format (content and calls, no reasoning); calls read
    by `calls` (the default: tool_calls.py's own parser of whole replies)."""
    if calls is not ToolCallStream:
        return read_whole(ContentStream(names, calls), text)
    content, found = parse_tool_calls(text, names)
    return ParsedReply(content, None, found)


__all__ = ["CallReader", "CallStream", "ContentStream", "ReplyDelta", "ReplyStream",
           "ThinkingStream", "WholeStream", "default_parse", "read_whole"]
