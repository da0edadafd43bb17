"""Chat formats whose replies are read by a parser of their own (as llama.cpp's
`common_chat_params_init_*` pick one from the template), beside the default tool-call
reading of tool_calls.py: a registry from a template's source to the format.

A format names the control tokens its replies are written with (`preserved_tokens`:
their text stays in the reply, as llama.cpp's server keeps a format's preserved tokens)
and parses a whole reply into reasoning, content and tool calls.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import harmony, muse_glimmer_chat
from .muse_glimmer_chat import ParsedReply


@dataclass(frozen=True)
class ChatFormat:
    name: str
    detect: Callable[[str], bool]  # the template's source is this format's
    preserved_tokens: tuple[str, ...]
    parse: Callable[[str, list[dict[str, Any]] | None], ParsedReply]  # (reply, tools)


FORMATS = (
    ChatFormat("muse-glimmer", muse_glimmer_chat.is_muse_glimmer_template,
               muse_glimmer_chat.PRESERVED_TOKENS, muse_glimmer_chat.parse_reply),
    ChatFormat("harmony", harmony.is_harmony_template, harmony.PRESERVED_TOKENS,
               harmony.parse_reply),
)


def chat_format(template: str | None) -> ChatFormat | None:
    """The format of the chat template `template` (None: the default reading)."""
    return next((f for f in FORMATS if template and f.detect(template)), None)


__all__ = ["FORMATS", "ChatFormat", "ParsedReply", "chat_format"]
