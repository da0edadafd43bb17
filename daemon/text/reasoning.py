"""Reasoning written between `<think>` and `</think>` (Qwen3, QwQ, DeepSeek-R1 and the
templates written after them), kept apart from the answer as llama.cpp's "deepseek"
reasoning format does (common/chat.cpp and its tests, tests/test-chat.cpp):

* the reply's reasoning is the text between the tags, stripped of the whitespace around
  it, and the answer is what follows `</think>`, without the whitespace that opens it;
* a template may open `<think>` in the prompt (its generation prompt ends with it: the
  DeepSeek-R1 distills, QwQ; or a prefilled reasoning is continued): the reply then
  starts inside the reasoning;
* a reply that does not open with the tag (after whitespace) is all answer, and reasoning
  the end tag never closes (cut off by max_tokens) is all reasoning.

`ThinkSplitter` does it on a stream, a piece at a time: what it passes on can no longer
change, and it holds back no more than a tail that may be the start of a tag (and the
whitespace that may end the reasoning).
"""

from __future__ import annotations

from .reply_delta import ReplyDelta

START, END = "<think>", "</think>"
PRESERVED_TOKENS = (START, END)
# --reasoning-format / a request's reasoning_format: "none" leaves the tags in the content;
# "deepseek" (and "auto", llama-server's default) puts the reasoning in reasoning_content;
# "deepseek-legacy" as "deepseek", but a streamed reply keeps its tags in the content
REASONING_FORMATS = ("none", "auto", "deepseek", "deepseek-legacy")


def is_thinking_template(template: str) -> bool:
    """Whether a chat template writes its model's reasoning between the think tags."""
    return START in template and END in template


def opens_thinking(prompt_text: str) -> bool:
    """Whether a rendered prompt (its end at least) leaves the reply inside the
    reasoning: a `<think>` that no `</think>` follows (its generation prompt ends with
    one, or an assistant's prefilled reasoning is continued), as llama.cpp's parser sees
    the generation prompt prefixed to the reply."""
    at = prompt_text.rfind(START)
    return at >= 0 and END not in prompt_text[at:]


def partial_tag(text: str, tag: str) -> int:
    """The length of the longest tail of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ThinkSplitter:
    """Reply pieces in, (reasoning, content) out, each as soon as it is settled.

    States: "open" (nothing but whitespace yet: the reply may still open the tag),
    "thinking" (inside the reasoning) and "answer" (after it, or a reply without one)."""

    def __init__(self, in_thinking: bool = False):
        self.state = "thinking" if in_thinking else "open"
        self.pending = ""  # text received, not yet passed on
        self.reasoned = False  # some reasoning has been passed on
        self.answered = False  # some content has been passed on

    def feed(self, piece: str) -> ReplyDelta:
        self.pending += piece
        out = ReplyDelta()
        while True:
            if self.state == "open":
                head = self.pending.lstrip()
                if head.startswith(START):
                    self.pending, self.state = head[len(START):], "thinking"
                elif START.startswith(head):  # whitespace, or the start of the tag
                    return out
                else:
                    self.state = "answer"
            elif self.state == "thinking":
                if not self.reasoned:
                    self.pending = self.pending.lstrip()
                at = self.pending.find(END)
                if at >= 0:
                    out.reasoning += self.pending[:at].rstrip()
                    self.reasoned = self.reasoned or at > 0
                    self.pending, self.state = self.pending[at + len(END):], "answer"
                    continue
                body = self.pending[:len(self.pending) - partial_tag(self.pending, END)]
                sent = body.rstrip()  # (trailing whitespace may be the reasoning's end)
                out.reasoning += sent
                self.reasoned = self.reasoned or bool(sent)
                self.pending = self.pending[len(sent):]
                return out
            else:
                if not self.answered:
                    self.pending = self.pending.lstrip()
                out.content += self.pending
                self.answered = self.answered or bool(self.pending)
                self.pending = ""
                return out

    def held(self) -> str:
        """The text not passed on yet."""
        return self.pending

    def finish(self) -> ReplyDelta:
        """What was held back, once the reply is complete."""
        if self.state == "thinking":  # never closed: all reasoning
            rest, self.pending = self.pending.rstrip(), ""
            return ReplyDelta(reasoning=rest)
        rest, self.pending = self.pending, ""
        return ReplyDelta(content=rest if self.answered else rest.lstrip())


def split_thinking(text: str, in_thinking: bool = False) -> tuple[str | None, str]:
    """A whole reply's (reasoning, None where it has none; content)."""
    splitter = ThinkSplitter(in_thinking)
    a, b = splitter.feed(text), splitter.finish()
    reasoning = a.reasoning + b.reasoning
    return reasoning or None, a.content + b.content
