"""What a piece of a streamed chat reply settles: reasoning, content, and the calls'
pieces (reply_stream.ReplyStream gives them)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CallDelta:
    """A piece of a tool call as it streams: its place among the reply's calls, its name
    and id on its first piece, then its JSON arguments a piece at a time."""

    index: int
    arguments: str = ""
    name: str | None = None
    id: str | None = None


@dataclass
class ReplyDelta:
    """What one piece of a streamed reply adds to its reasoning, its content and its
    calls."""

    reasoning: str = ""
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.calls)
