"""DeepSeek-R1's own tool-call syntax, as its chat template writes an assistant's calls and
llama.cpp's DeepSeek-R1 parser reads them (common/chat-diff-analyzer.cpp's patch for the
R1 distills, tests/test-chat.cpp):

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜>
    <｜tool▁call▁begin｜>function<｜tool▁sep｜>...<｜tool▁call▁end｜><｜tool▁calls▁end｜>

The text before the section is content; each call names one of the request's tools and
its arguments are JSON, or the whole reply stays content (cut off by max_tokens, or
malformed), as the default reading does (tool_calls.py). The section's opening also comes
in the spellings R1 distills are known to write (llama.cpp's older parser took them).

`R1CallStream` reads a streamed answer: text passes on until the section opens (a tail
that may be the start of its opening, and space, held back), the calls come at the end.
It reads the tagged calls (tool_calls.py) too: specd's grammar for tool_choice "required"
or a named function forces those, whatever the template.
"""

from __future__ import annotations

import json
import re

from .tool_calls import NOT_JSON, OPEN, ToolCall, declared_call, json_value, parse_tool_calls

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
# the section's opening as R1 models write it
_BEGINS = (CALLS_BEGIN, "<｜tool_calls_begin｜>", "<｜tool calls begin｜>",
           "<｜tool\\_calls\\_begin｜>", "<｜tool▁calls｜>")
PRESERVED_TOKENS = (CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP)
_BEGIN = re.compile("|".join(map(re.escape, _BEGINS)))
# what opens calls in a stream: R1's section, or the tagged calls specd's own grammar
# forces for tool_choice "required" or a named function (tool_calls.forced_call_grammar)
_OPENINGS = (*_BEGINS, OPEN)
_OPENING = re.compile("|".join(map(re.escape, _OPENINGS)))
# one call: its opening (optional, as llama.cpp reads it), the type, the name, the fenced JSON
_CALL = re.compile(r"\s*(?:" + re.escape(CALL_BEGIN) + r")?function" + re.escape(SEP)
                   + r"([^\n]+)\n```json\n(.*?)```\s*" + re.escape(CALL_END), re.S)
_SECTION_END = re.compile(r"\s*(?:" + re.escape(CALLS_END) + r")?\s*\Z")


def is_deepseek_r1_template(template: str) -> bool:
    """Whether a chat template writes calls in R1's syntax (its type, the separator, the
    name, a ```json block; DeepSeek-V3.1's calls have no fence and are not this)."""
    return CALLS_BEGIN in template and SEP in template and "```json" in template


def parse_r1_calls(text: str, names: set[str] | None) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a whole answer; no calls: (text, []), as where the request
    offered no tools (`names` None)."""
    found = _BEGIN.search(text) if names is not None else None
    if found is None:
        return text, []
    assert names is not None
    calls: list[ToolCall] = []
    at = found.end()
    while (m := _CALL.match(text, at)) is not None:
        args = json_value(m.group(2).strip())
        if args is NOT_JSON or not isinstance(args, dict):
            return text, []
        call = ToolCall(m.group(1).strip(), json.dumps(args, ensure_ascii=False))
        if not declared_call(call, names):
            return text, []
        calls.append(call)
        at = m.end()
    if not calls or not _SECTION_END.match(text, at):
        return text, []
    return text[:found.start()].strip() or None, calls


def _held_tail(text: str) -> int:
    """Length of the longest end of `text` that could be the start of calls' opening."""
    longest = max(map(len, _OPENINGS))
    for n in range(min(longest - 1, len(text)), 0, -1):
        if any(b.startswith(text[-n:]) for b in _OPENINGS):
            return n
    return 0


class R1CallStream:
    """Answer pieces in, content out as soon as it cannot be part of the calls section
    (reply_stream.CallStream); tagged calls (a forced call's) are read too."""

    def __init__(self, names: set[str]):
        self.names = names
        self.text = ""  # the answer so far
        self.sent = 0  # characters of it passed on as content
        self.section: int | None = None  # where the calls section opens, once it has

    def feed(self, piece: str) -> str:
        """The content this piece lets through ("" while the calls may be forming)."""
        self.text += piece
        if self.section is None and (m := _OPENING.search(self.text, self.sent)):
            self.section = m.start()
        if self.section is not None:
            end = self.section
        elif self.sent == 0 and not self.text.strip():
            return ""  # nothing but space yet: the answer may be calls alone
        else:
            end = len(self.text) - _held_tail(self.text)
        # space at the end waits: before the section it is not content
        end = max(self.sent, len(self.text[:end].rstrip()))
        out, self.sent = self.text[self.sent:end], end
        return out

    def held(self) -> str:
        """The text not passed on yet (sent as content when the reply ends in an error)."""
        return self.text[self.sent:]

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(content not yet passed on, calls) once the answer is complete."""
        _, calls = parse_r1_calls(self.text, self.names)
        if not calls and self.section is not None and self.text.startswith(OPEN, self.section):
            _, calls = parse_tool_calls(self.text, self.names)
        if calls:
            return "", calls  # what preceded the section has been sent already
        return self.held(), []
