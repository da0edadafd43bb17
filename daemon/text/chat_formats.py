"""Chat formats whose replies are read by a parser of their own (as llama.cpp's
`common_chat_params_init_*` pick one from the template), beside the default tool-call
reading of tool_calls.py: a registry from a template's source to the format.

A format names the control tokens its replies are written with (`preserved_tokens`:
their text stays in the reply, as llama.cpp's server keeps a format's preserved tokens)
and reads a reply into reasoning, content and tool calls, whole (`parse`) or as it
streams (`stream`, reply_stream.ReplyStream).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import deepseek_r1, harmony, muse_glimmer_chat, reasoning
from .muse_glimmer_chat import ParsedReply
from .reply_stream import CallReader, ReplyStream, ThinkingStream, WholeStream, read_whole
from .tool_calls import ToolCallStream, tool_names

Tools = list[dict[str, Any]] | None


@dataclass(frozen=True)
class ChatFormat:
    name: str
    detect: Callable[[str], bool]  # the template's source is this format's
    preserved_tokens: tuple[str, ...]
    # (the request's tools, None: no calls taken; the prompt opened the reasoning)
    stream: Callable[[Tools, bool], ReplyStream]
    whole: Callable[[str, Tools], ParsedReply] | None = None  # a parser of whole replies
    # the reply reasons between the think tags (reasoning.py): the request's
    # reasoning_format and budget apply, and the prompt may open the reasoning
    thinks: bool = False
    # the reader of the calls in its answer (read so also where the tags stay content)
    calls: CallReader = ToolCallStream

    def parse(self, text: str, tools: Tools, in_thinking: bool = False) -> ParsedReply:
        """A whole reply's reasoning, content and calls."""
        if self.whole is not None:
            return self.whole(text, tools)
        return read_whole(self.stream(tools, in_thinking), text)


def _held(parse: Callable[[str, Tools], ParsedReply]) -> Callable[[Tools, bool], ReplyStream]:
    """The stream of a format read only whole: its reply held to its end."""
    return lambda tools, _: WholeStream(lambda text: parse(text, tools))


def _thinking(calls: CallReader = ToolCallStream) -> Callable[[Tools, bool], ReplyStream]:
    """The stream of a format with think tags whose answer's calls `calls` reads."""
    return lambda tools, in_thinking: ThinkingStream(
        None if tools is None else tool_names(tools), in_thinking, calls)


THINKING = ChatFormat("think-tags", reasoning.is_thinking_template,
                      reasoning.PRESERVED_TOKENS, _thinking(), thinks=True)
# DeepSeek-R1 (and its distills): think tags, and calls in its own syntax
DEEPSEEK_R1 = ChatFormat("deepseek-r1", deepseek_r1.is_deepseek_r1_template,
                         reasoning.PRESERVED_TOKENS + deepseek_r1.PRESERVED_TOKENS,
                         _thinking(deepseek_r1.R1CallStream), thinks=True,
                         calls=deepseek_r1.R1CallStream)
FORMATS = (
    ChatFormat("muse-glimmer", muse_glimmer_chat.is_muse_glimmer_template,
               muse_glimmer_chat.PRESERVED_TOKENS, _held(muse_glimmer_chat.parse_reply),
               muse_glimmer_chat.parse_reply),
    ChatFormat("harmony", harmony.is_harmony_template, harmony.PRESERVED_TOKENS,
               lambda tools, _: harmony.HarmonyStream(tools)),
    DEEPSEEK_R1,
    THINKING,
)


def chat_format(template: str | None) -> ChatFormat | None:
    """The format of the chat template `template` (None: the default reading)."""
    return next((f for f in FORMATS if template and f.detect(template)), None)


__all__ = ["DEEPSEEK_R1", "FORMATS", "THINKING", "ChatFormat", "ParsedReply", "chat_format"]
