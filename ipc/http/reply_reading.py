"""How a chat reply's text is read into reasoning, content and tool calls, shared by the
dialects, whole or while it streams: by the template's chat format where it has a reader
of its own (daemon/text/chat_formats.py: think tags, harmony, ...), else by the default
tool-call reading (content and calls, no reasoning). The request's reasoning budget
rides on its constraint (`ReplyReading.budgeted`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from specd.daemon.serving.facade import ServiceFacade
from specd.daemon.serving.upstream import OutputFormat
from specd.daemon.serving.upstream_facade import UpstreamFacade
from specd.daemon.text.chat_formats import ChatFormat, ParsedReply, chat_format
from specd.daemon.text.grammar import Grammar
from specd.daemon.text.reasoning import END, REASONING_FORMATS, START, opens_thinking
from specd.daemon.text.reasoning_budget import ReasoningBudget, partial_utf8_ids
from specd.daemon.text.reply_stream import CallReader, ContentStream, ReplyStream, default_parse
from specd.daemon.text.tool_calls import ToolCallStream

from ..validation import BadRequest, get

# how many of the prompt's last tokens are read for a think tag the prompt left open
_PROMPT_TAIL = 64


def reasoning_format(svc: ServiceFacade, body: dict[str, Any]) -> str:
    """The request's `reasoning_format`, else the server's (--reasoning-format)."""
    fmt = get(body, "reasoning_format", str, svc.reasoning_format)
    if fmt not in REASONING_FORMATS:
        raise BadRequest(f"'reasoning_format' must be one of {', '.join(REASONING_FORMATS)}, "
                         f"got {fmt!r}", param="reasoning_format")
    return fmt


def reasoning_budget(svc: ServiceFacade, body: dict[str, Any]) -> int:
    """The request's budget for its reasoning in tokens, llama-server's fields
    (`reasoning_budget_tokens`, `thinking_budget_tokens`), else the server's
    (--reasoning-budget); -1: none."""
    for key in ("reasoning_budget_tokens", "thinking_budget_tokens"):
        if body.get(key) is not None:
            return get(body, key, int, -1, lo=-1)
    return svc.reasoning_budget


@dataclass
class ReplyReading:
    """A chat format with a reply reader of its own (None: the default reading), the
    request's tools it reads calls of (None: none offered), whether the prompt left
    the reply inside the reasoning, and the reader of calls without a format (the
    template's, where its think tags stay content)."""

    fmt: ChatFormat | None
    tools: list[dict[str, Any]] | None
    in_thinking: bool = False
    calls: CallReader = ToolCallStream

    @classmethod
    def for_chat(cls, svc: ServiceFacade, body: dict[str, Any],
                 tools: list[dict[str, Any]] | None, prompt: Any) -> ReplyReading:
        """The reading of the reply to a chat request `body` whose prompt is `prompt`
        (token ids; anything else, an upstream's, is not read for an opened tag)."""
        fmt = chat_format(svc.chat_template)
        how = reasoning_format(svc, body)
        thinks = fmt is not None and fmt.thinks
        if fmt is not None and thinks and (how == "none" or how == "deepseek-legacy"
                                           and get(body, "stream", bool, False)):
            return cls(None, tools, calls=fmt.calls)  # the tags stay in the content
        opened = (thinks and isinstance(prompt, list) and bool(prompt)
                  and opens_thinking(svc.tokenizer.decode(prompt[-_PROMPT_TAIL:])))
        return cls(fmt, tools, opened)

    def stream(self, names: set[str] | None) -> ReplyStream:
        """A reader of one streamed reply (calls of `names`' tools)."""
        if self.fmt is not None:
            return self.fmt.stream(self.tools if names is not None else None, self.in_thinking)
        return ContentStream(names, self.calls)

    def parse(self, text: str, names: set[str] | None) -> ParsedReply:
        """The reply's reasoning, content and calls (of `names`' tools)."""
        if self.fmt is not None:
            return self.fmt.parse(text, self.tools if names is not None else None,
                                  self.in_thinking)
        return default_parse(text, names, self.calls)

    async def budgeted(self, svc: ServiceFacade, body: dict[str, Any],
                       grammar: Grammar | OutputFormat | None
                       ) -> Grammar | OutputFormat | None:
        """The request's constraint with its reasoning budget kept beside it (none
        without think tags, a budget, or a local model; no constraint: any text)."""
        budget = reasoning_budget(svc, body)
        if (budget < 0 or self.fmt is None or not self.fmt.thinks
                or isinstance(svc, UpstreamFacade) or isinstance(grammar, OutputFormat)):
            return grammar
        tok = svc.tokenizer
        message = get(body, "reasoning_budget_message", str, svc.reasoning_budget_message)
        start, end, said = (tuple(tok.encode(t, add_bos=False, add_eos=False,
                                             parse_special=True)) if t else ()
                            for t in (START, END, message))
        base = grammar if grammar is not None else await svc.compile_constraint(
            "regex", r"(?s:.*)")
        return base.with_budget(ReasoningBudget(start, end, budget, self.in_thinking, said,
                                                partial_utf8_ids(tok)))
