"""Tool calls in a chat reply, as OpenAI's `message.tool_calls`.

Chat templates that take `tools` (Qwen2.5 and Qwen2.5-Coder, Hermes 2/3, SmolLM2, ...)
ask the model to answer with each call as JSON inside tags (the Hermes format):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Others answer with the bare object (with "arguments" or, as Llama 3.x templates ask,
"parameters"), or with it in a ```json block, as Qwen2.5-Coder-1.5B-Instruct does beside
its own template's instructions. Those are taken as calls only when the whole reply is
one such object (or an array of them). Every call, tagged or not, must name one of the
request's tools (clients look the name up), or the reply stays content.

`parse_tool_calls` splits a whole reply into its content (the text before the first call,
None when there is none) and its calls. `ToolCallStream` does it while streaming: text
passes on until a call begins (a tail that may be the start of a tag is held back, and
a reply that can still be a bare call, `{"name": "` and the start of a declared tool's
name, bare or after "[" or a ```json fence, is held whole), and the calls come at the end.
Bare calls must name their tool first, as models write them, so that a JSON answer
streams once it cannot be one. A call whose
JSON does not parse (cut off by max_tokens, or malformed) leaves the reply as content.

`forced_call_grammar` is what tool_choice "required" or a named function constrains the
reply with: tagged calls whose arguments follow each tool's JSON schema.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from .grammar import JSON_WHITESPACE

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|\Z)", re.S)
_JSON_STRING_BODY = re.compile(r'(?:[^"\\]|\\.)*(?:\\\Z)?', re.S)  # up to an unescaped quote
_FENCED = re.compile(r"```(?:json)?[ \t]*\n(.*?)\n?```", re.S)


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def as_openai(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "type": "function",
                               "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


def _function(tool: dict[str, Any]) -> dict[str, Any]:
    """A tool's function: {"type": "function", "function": {...}} as OpenAI sends them,
    or the function object alone."""
    return tool["function"] if isinstance(tool.get("function"), dict) else tool


def _functions(tools: list[dict[str, Any]] | None) -> list[tuple[str, dict[str, Any]]]:
    """(name, function) of each tool with a string name."""
    return [(fn["name"], fn) for fn in map(_function, tools or [])
            if isinstance(fn.get("name"), str)]


def check_tools(tools: list[dict[str, Any]]) -> None:
    """ValueError naming the first tool whose function has no name (a non-empty string):
    a call to it could not be told apart, nor a grammar force one."""
    for i, tool in enumerate(tools):
        name = _function(tool).get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"tools[{i}]: a function needs a 'name', a non-empty string")


def tool_names(tools: list[dict[str, Any]] | None) -> set[str]:
    """Names of the functions a request's `tools` declare."""
    return {name for name, _ in _functions(tools)}


def _call(obj: Any) -> ToolCall | None:
    """{"name": ..., "arguments" | "parameters": {...} or a JSON string} as a call."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        if json_value(args) is NOT_JSON:
            return None
        text = args
    elif isinstance(args, dict):
        text = json.dumps(args, ensure_ascii=False)
    else:
        return None
    return ToolCall(obj["name"], text)


def forced_call_grammar(tools: list[dict[str, Any]], only: str | None = None,
                        parallel: bool = True) -> str:
    """llguidance Lark text whose outputs are tagged calls of the request's tools (or of
    the function `only`; one call unless `parallel`), arguments per each tool's JSON
    schema: what tool_choice "required" or a named function asks for. Each tool's
    parameters are their own %json rule, so their "#" and "$defs" references resolve
    against the tool's schema; arguments are always an object, as OpenAI sends them."""
    calls: list[str] = []
    rules: list[str] = []
    for name, fn in _functions(tools):
        if only is not None and name != only:
            continue
        params = fn.get("parameters")
        schema = ({**params, "type": "object"} if isinstance(params, dict)
                  and params.get("type", "object") == "object" else {"type": "object"})
        schema["x-guidance"] = {"whitespace_pattern": JSON_WHITESPACE}
        k = len(calls)
        head = json.dumps('{"name": ' + json.dumps(name) + ', "arguments": ')
        calls.append(f"call{k}")
        rules.append(f'call{k}: {head} args{k} "}}"\nargs{k}: %json {json.dumps(schema)}\n')
    start = 'start: block ("\\n" block)*\n' if parallel else "start: block\n"
    return (start + f'block: "{OPEN}\\n" call "\\n{CLOSE}"\n'
            f"call: {' | '.join(calls) or 'NONE'}\n" + "".join(rules))


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


NOT_JSON = object()


def json_value(text: str) -> Any:
    """The JSON value of `text`, or NOT_JSON: malformed, nested past Python's recursion
    limit (a model stuck on "[" writes that), or with NaN / Infinity, which strict JSON
    clients cannot read back from the arguments."""
    try:
        return json.loads(text, parse_constant=_no_constant)
    except (ValueError, RecursionError):
        return NOT_JSON


def parse_tool_calls(text: str, names: set[str] | None) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a whole reply; no calls: (text, []), as where the request
    offered no tools (`names` None)."""
    if names is None:
        return text, []
    start = text.find(OPEN)
    if start >= 0:
        calls = [_call(json_value(m.group(1).strip())) for m in _BLOCK.finditer(text, start)]
        if calls and all(c is not None and declared_call(c, names) for c in calls):
            content = text[:start].strip()
            return content or None, [c for c in calls if c is not None]
        return text, []
    bare = _bare_calls(text.strip(), names)
    return (None, bare) if bare else (text, [])


def declared_call(call: ToolCall | None, names: set[str]) -> bool:
    """A call of one of the request's tools: clients look the name up and fail on any
    other (with no names known, any non-empty name)."""
    return call is not None and bool(call.name) and (not names or call.name in names)


def _bare_calls(text: str, names: set[str]) -> list[ToolCall]:
    """The calls a whole reply holds as a JSON object or array, bare or in a ```json
    block, when each is a call of one of `names` and the first begins with its name;
    else none."""
    fenced = _FENCED.fullmatch(text)
    body = fenced.group(1) if fenced else text
    obj = json_value(body) if text[:1] in "{[`" and _may_be_call_json(body, names) else NOT_JSON
    items = obj if isinstance(obj, list) else [obj]
    calls = [_call(o) for o in items]
    if not items or not all(c is not None and declared_call(c, names) for c in calls):
        return []
    return [c for c in calls if c is not None]


def _may_be_call_json(text: str, names: set[str]) -> bool:
    """Whether JSON beginning so can still be a call, `{"name": "<a declared tool>"...`
    (or an array whose first item is one): models write the name first, and a reply
    that cannot be one streams on at once instead of being held to its end."""
    i, n = 0, len(text)

    def space(i: int) -> int:
        while i < n and text[i] in " \t\r\n":
            i += 1
        return i

    i = space(i)
    if i < n and text[i] == "[":
        i = space(i + 1)
    for lit in ("{", '"name"', ":", '"'):
        part = text[i:i + len(lit)]
        if not lit.startswith(part):
            return False
        if len(part) < len(lit):
            return True  # the text ends inside the head
        i = i + len(lit) if lit == '"' else space(i + len(lit))
    raw = _JSON_STRING_BODY.match(text, i)
    assert raw is not None  # matches the empty string at least
    if raw.end() < n:  # the name is closed
        name = json_value('"' + raw.group(0) + '"')
        return isinstance(name, str) and (not names or name in names)
    if "\\" in raw.group(0) or not names:
        return True  # an escape not yet complete: kept until the name ends
    return any(t.startswith(raw.group(0)) for t in names)


def _may_open_bare_call(text: str, names: set[str]) -> bool:
    """Whether a reply beginning so may still turn out to be a bare call."""
    t = text.lstrip()
    if not t or "```".startswith(t):
        return True
    if t[0] in "{[":
        return _may_be_call_json(t, names)
    if not t.startswith("```"):
        return False
    line, newline, rest = t[3:].partition("\n")
    lang = line.strip()
    if not newline:
        return "json".startswith(lang)
    return lang in ("", "json") and _may_be_call_json(rest, names)


def _held_tail(text: str) -> int:
    """Length of the longest end of `text` that could be the start of OPEN."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-n:]):
            return n
    return 0


class ToolCallStream:
    """Content pieces in, content out as soon as it cannot be part of a call."""

    def __init__(self, names: set[str]):
        self.names = names
        self.text = ""  # the reply so far
        self.sent = 0  # characters of it passed on as content

    def feed(self, piece: str) -> str:
        """The content this piece lets through ("" while a call may be forming)."""
        self.text += piece
        if OPEN in self.text[self.sent:]:
            end = self.text.find(OPEN, self.sent)
        elif self.sent == 0 and _may_open_bare_call(self.text, self.names):
            return ""  # nothing but space yet, or a bare call may be forming
        else:
            end = len(self.text) - _held_tail(self.text)
        out, self.sent = self.text[self.sent:end], max(self.sent, end)
        return out

    def held(self) -> str:
        """The text not passed on yet (sent as content when the reply ends in an error)."""
        return self.text[self.sent:]

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(content not yet passed on, calls) once the reply is complete."""
        content, calls = parse_tool_calls(self.text, self.names)
        if calls:
            return "", calls  # what preceded the first call has been sent already
        return self.held(), []
