"""How a chat reply's text is read into reasoning, content and tool calls, shared by the
dialects: by the template's chat format where it has a parser of its own
(daemon/text/chat_formats.py: the reply is read whole), else by the default tool-call
reading (content and calls, no reasoning)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from specd.daemon.text.chat_formats import ChatFormat, ParsedReply, chat_format
from specd.daemon.text.tool_calls import parse_tool_calls


@dataclass
class ReplyReading:
    """A chat format with a reply parser of its own (None: the default reading), and the
    request's tools it reads calls of (None: none offered)."""

    fmt: ChatFormat | None
    tools: list[dict[str, Any]] | None

    @classmethod
    def of(cls, template: str | None, tools: list[dict[str, Any]] | None) -> ReplyReading:
        """The reading of replies written by chat template `template`."""
        return cls(chat_format(template), tools)

    @property
    def whole(self) -> bool:
        """Whether a reply is read only once complete (a streamed one is held)."""
        return self.fmt is not None

    def parse(self, text: str, names: set[str] | None) -> ParsedReply:
        """The reply's reasoning, content and calls (of `names`' tools)."""
        if self.fmt is not None:
            return self.fmt.parse(text, self.tools if names is not None else None)
        content, calls = parse_tool_calls(text, names)
        return ParsedReply(content, None, calls)
