"""muse-glimmer's (Onyx) chat replies, parsed as llama.cpp's
`common_chat_params_init_muse_glimmer` does (common/parsers/muse-glimmer.cpp, build 11434).

The generation prompt ends in `<|start|>assistant`; the model writes one or more messages,
each ` to=<recipient><|message|>{body}` closed by `<|eom|>` (more follow, each opened by
`<|start|>assistant`) or `<|eot|>` (the end of the turn):

- ` to=self`: its reasoning (the preamble), closed by `<|eom|>`;
- ` to=user` (or no recipient): the answer;
- ` to=<tool>`: a call, its body ATEM markup:
  `<atem:function_calls> <atem:invoke name="NAME"> <atem:parameter name="ARG">VALUE
  </atem:parameter> ... </atem:invoke> </atem:function_calls>`; a value is the string as
  written where the tool's schema allows a string, else JSON.

A reply is its reasoning messages first, then either calls or an answer, and after an
answer closed by `<|eom|>` calls may follow ("inform then act"). Markup in an answer
closed by `<|eot|>`, or in the reasoning, stays text. A call must be one of the
request's tools and parse whole, or the reply is left as content, as where no tools were
offered (the answer then runs to the end). Those tokens are control tokens: the reply's
text keeps them (`PRESERVED_TOKENS`), as llama.cpp's server keeps a format's preserved
tokens.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from .tool_calls import ToolCall

START, MESSAGE, EOM, EOT = "<|start|>assistant", "<|message|>", "<|eom|>", "<|eot|>"
PRESERVED_TOKENS = (
    "<|start|>", "<|message|>", "<|eom|>", "<|eot|>", "<atem:function_calls>",
    "<atem:invoke", "<atem:parameter", "</atem:parameter>", "</atem:invoke>",
    "</atem:function_calls>")
_REASONING = " to=self" + MESSAGE
_CALL = re.compile(r'<atem:function_calls>\s*<atem:invoke name="([^"]*)">\s*'
                   r'((?:<atem:parameter name="[^"]*">.*?</atem:parameter>\s*)*)'
                   r'</atem:invoke>\s*</atem:function_calls>', re.S)
_PARAM = re.compile(r'<atem:parameter name="([^"]*)">(.*?)</atem:parameter>', re.S)


@dataclass
class ParsedReply:
    content: str | None
    reasoning: str | None = None
    calls: list[ToolCall] = field(default_factory=list)


def is_muse_glimmer_template(template: str) -> bool:
    """llama.cpp's detection of the format in a chat template's source."""
    return "<atem:function_calls>" in template and EOM in template


def parse_reply(text: str, tools: list[dict[str, Any]] | None) -> ParsedReply:
    """The reasoning, answer and calls of a whole reply (the text after the generation
    prompt, its control tokens kept); `tools`: the request's (None or []: no calls)."""
    rest, reasoning = _strip_start(text), []
    while rest.startswith(_REASONING) and EOM in rest:
        body, _, rest = rest[len(_REASONING):].partition(EOM)
        reasoning.append(body)
        rest = _strip_start(rest)
    thought = "".join(reasoning) or None
    schemas = _schemas(tools)
    if schemas:
        calls = _calls(rest, schemas)
        if calls is not None:
            return ParsedReply(None, thought, calls)
    recipient = " to=user" if rest.startswith(" to=user" + MESSAGE) else ""
    if not rest.startswith(recipient + MESSAGE):
        return ParsedReply(rest or None, thought)  # not this format's: left whole
    body = rest[len(recipient + MESSAGE):]
    ends = [i for i in (body.find(EOT), body.find(EOM)) if i >= 0]
    end = min(ends) if ends else len(body)
    answer, after = body[:end], body[end:]
    if schemas and after.startswith(EOM):
        calls = _calls(_strip_start(after[len(EOM):]), schemas)
        if calls is not None:
            return ParsedReply(answer, thought, calls)
    return ParsedReply(answer, thought)


def _strip_start(text: str) -> str:
    return text[len(START):] if text.startswith(START) else text


def _schemas(tools: list[dict[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """Each tool's name -> its parameters' schemas."""
    out: dict[str, dict[str, Any]] = {}
    for tool in tools or []:
        fn = tool.get("function", tool) if isinstance(tool, dict) else {}
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            params = fn.get("parameters") or {}
            props = params.get("properties") if isinstance(params, dict) else None
            out[fn["name"]] = props if isinstance(props, dict) else {}
    return out


def _calls(text: str, schemas: dict[str, dict[str, Any]]) -> list[ToolCall] | None:
    """Calls `text` is made of, each ` to=<name><|message|>` and its markup, separated by
    `<|eom|><|start|>assistant`; None where it is anything else."""
    calls: list[ToolCall] = []
    while True:
        if not text.startswith(" to=") or MESSAGE not in text:
            return None
        _, _, body = text.partition(MESSAGE)
        m = _CALL.match(body)
        if m is None or m.group(1) not in schemas:
            return None
        args = _arguments(m.group(2), schemas[m.group(1)])
        if args is None:
            return None
        calls.append(ToolCall(m.group(1), json.dumps(args, ensure_ascii=False,
                                                    separators=(",", ":"))))
        text = body[m.end():]
        if text in ("", EOT, EOM):
            return calls
        if not text.startswith(EOM + START):
            return None
        text = text[len(EOM + START):]


def _arguments(markup: str, props: dict[str, Any]) -> dict[str, Any] | None:
    """The parameters' values: a string as written where the schema allows one (or the
    tool does not declare it), else JSON; None where a value does not parse."""
    out: dict[str, Any] = {}
    for name, raw in _PARAM.findall(markup):
        if name in props and not _may_be_string(props[name]):
            try:
                out[name] = json.loads(raw)
            except ValueError:
                return None
        else:
            out[name] = raw
    return out


def _may_be_string(schema: Any) -> bool:
    """Whether a parameter's schema admits a string (no type: anything does)."""
    if not isinstance(schema, dict):
        return True
    kind = schema.get("type")
    if kind is None:
        options = schema.get("anyOf") or schema.get("oneOf")
        return not options or any(_may_be_string(o) for o in options)
    return kind == "string" or (isinstance(kind, list) and "string" in kind)
