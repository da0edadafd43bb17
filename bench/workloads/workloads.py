"""The four request sequences of history speculation's benchmark (issue 55), each a list of
real HTTP requests to one daemon, built deterministically from the files named here.

    editor      50 /infill requests shaped as llama.vim sends them while a user types
                through a file: its newest request body (prefix lines, the current line
                up to the cursor as `prompt`, the suffix lines, ring chunks of another
                file as `input_extra`, `response_fields`, its sampler settings and time
                budgets), the cursor moving down the file
    agent       a 10-turn agent loop on one file: each turn's prompt holds the file's last
                version and asks for one change; the earlier turns' replies are
                `write_file` tool calls re-emitting the whole file
    regenerate  the same chat request three times at temperature 0.7
    fresh       ten prompts on unrelated subjects, nothing repeated

`Request.count(reply)` reads the tokens a reply generated (chat: usage; infill: llama.vim's
"timings/predicted_n").
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
TYPED = ROOT / "daemon" / "drafters" / "ngram.py"  # the file the editor session types through
NEIGHBOUR = ROOT / "daemon" / "drafters" / "composite.py"  # llama.vim's ring chunks
N_PREFIX, N_SUFFIX, CHUNK_LINES = 256, 64, 64  # llama.vim's defaults (ring_chunk_size 64)


@dataclass(frozen=True)
class Request:
    route: str
    body: dict[str, Any]

    def count(self, reply: dict[str, Any]) -> int:
        """Tokens the reply generated."""
        if self.route == "/infill":
            return int(reply.get("timings/predicted_n")
                       or reply.get("timings", {}).get("predicted_n", 0))
        return int(reply["usage"]["completion_tokens"])


def editor(n: int = 50) -> list[Request]:
    """llama.vim's /infill requests at n cursor stops down TYPED (every other line from
    line 20, the cursor after the line's first half)."""
    lines = TYPED.read_text().splitlines()
    near = NEIGHBOUR.read_text().splitlines()
    extra = [{"text": "\n".join(near[i:i + CHUNK_LINES]) + "\n", "time": 1700000000 + i,
              "filename": str(NEIGHBOUR.relative_to(ROOT))}
             for i in range(0, len(near), CHUNK_LINES)]
    out = []
    stops = [y for y in range(20, len(lines)) if lines[y].strip()]
    for k in range(n):
        y = stops[(2 * k) % len(stops)]
        line = lines[y]
        indent = len(line) - len(line.lstrip())
        x = indent + (len(line) - indent) // 2
        body = {
            "input_prefix": "\n".join(lines[max(0, y - N_PREFIX):y]) + "\n",
            "input_suffix": line[x:] + "\n" + "\n".join(lines[y + 1:y + 1 + N_SUFFIX]) + "\n",
            "input_extra": extra,
            "prompt": line[:x],
            "n_predict": 128,
            "n_indent": indent,
            "top_k": 40,
            "top_p": 0.99,
            "stream": False,
            "samplers": ["top_k", "top_p", "infill"],
            "cache_prompt": True,
            "t_max_prompt_ms": 500,
            "t_max_predict_ms": 1000,
            "response_fields": ["content", "timings/prompt_n", "timings/prompt_ms",
                                "timings/prompt_per_token_ms", "timings/prompt_per_second",
                                "timings/predicted_n", "timings/predicted_ms",
                                "timings/predicted_per_token_ms",
                                "timings/predicted_per_second", "truncated", "tokens_cached"],
        }
        out.append(Request("/infill", body))
    return out


AGENT_FILE = '''"""Inventory of a small shop."""

from dataclasses import dataclass


@dataclass
class Item:
    name: str
    price: float
    count: int


def total_value(items: list[Item]) -> float:
    """The value of everything in stock."""
    return sum(i.price * i.count for i in items)


def restock(items: list[Item], name: str, count: int) -> None:
    for i in items:
        if i.name == name:
            i.count += count
            return
    raise KeyError(name)


def cheapest(items: list[Item]) -> Item:
    return min(items, key=lambda i: i.price)
'''

# (what the turn asks, the edit that makes the next version: old -> new)
AGENT_CHANGES = [
    ("Add a docstring to restock.", ("    for i in items:\n        if i.name == name:\n"
                                     "            i.count += count",
                                     "    \"\"\"Add count units of the named item.\"\"\"\n"
                                     "    for i in items:\n        if i.name == name:\n"
                                     "            i.count += count")),
    ("Rename the field count to quantity.", ("count: int", "quantity: int")),
    ("Use quantity in total_value.", ("i.price * i.count", "i.price * i.quantity")),
    ("Use quantity in restock.", ("i.count += count", "i.quantity += count")),
    ("Add a docstring to cheapest.", ("    return min(items", "    \"\"\"The lowest-priced "
                                      "item.\"\"\"\n    return min(items")),
    ("Make cheapest raise ValueError on an empty list.",
     ("    return min(items", "    if not items:\n        raise ValueError(\"no items\")\n"
                              "    return min(items")),
    ("Add a field sku: str after name.", ("    name: str\n", "    name: str\n    sku: str\n")),
    ("Round total_value to cents.", ("return sum(i.price * i.quantity for i in items)",
                                     "return round(sum(i.price * i.quantity for i in items), 2)")),
    ("Rename restock to add_stock.", ("def restock(", "def add_stock(")),
    ("Add a module constant CURRENCY = \"EUR\" after the import.",
     ("from dataclasses import dataclass\n", "from dataclasses import dataclass\n\n"
                                             "CURRENCY = \"EUR\"\n")),
]
AGENT_TOOLS = [{"type": "function", "function": {
    "name": "write_file", "description": "Replace a file's whole content.",
    "parameters": {"type": "object", "properties": {
        "path": {"type": "string"}, "content": {"type": "string"}},
        "required": ["path", "content"]}}}]
AGENT_PATH = "shop/inventory.py"


def agent(turns: int = 10) -> list[Request]:
    """Turn k's chat: the earlier turns (each a change asked and its write_file call) and
    the file's version after them, with the next change to make."""
    versions = [AGENT_FILE]
    for _, (old, new) in AGENT_CHANGES:
        assert old in versions[-1], old
        versions.append(versions[-1].replace(old, new, 1))
    system = {"role": "system", "content": "You are a coding agent. Change files only by "
              "calling write_file with the file's whole new content."}
    out = []
    for k in range(min(turns, len(AGENT_CHANGES))):
        messages: list[dict[str, Any]] = [system]
        for j in range(k):
            messages += [
                {"role": "user", "content": f"In {AGENT_PATH}: {AGENT_CHANGES[j][0]}"},
                {"role": "assistant", "content": "", "tool_calls": [{
                    "id": f"call_{j}", "type": "function", "function": {
                        "name": "write_file", "arguments": json.dumps(
                            {"path": AGENT_PATH, "content": versions[j + 1]})}}]},
                {"role": "tool", "tool_call_id": f"call_{j}", "content": "written"}]
        messages.append({"role": "user", "content": (
            f"{AGENT_PATH} is now:\n```python\n{versions[k]}```\n"
            f"In {AGENT_PATH}: {AGENT_CHANGES[k][0]}")})
        out.append(Request("/v1/chat/completions", {
            "messages": messages, "tools": AGENT_TOOLS, "max_tokens": 768,
            "temperature": 0}))
    return out


def regenerate(times: int = 3) -> list[Request]:
    body = {"messages": [{"role": "user", "content": "Explain the difference between a "
                          "process and a thread, with an example of each, in a short "
                          "paragraph."}], "max_tokens": 256, "temperature": 0.7}
    return [Request("/v1/chat/completions", dict(body)) for _ in range(times)]


FRESH = ["Name three uses of copper.", "Write a haiku about autumn rain.",
         "How does a bicycle gear change work?", "Give a recipe for lentil soup.",
         "What causes the tides?", "Describe the rules of chess castling.",
         "Translate 'good morning' into five languages.", "Why is the sky blue?",
         "Suggest names for a grey cat.", "Summarise the plot of Hamlet in four lines."]


def fresh(n: int = 10) -> list[Request]:
    return [Request("/v1/chat/completions", {
        "messages": [{"role": "user", "content": p}], "max_tokens": 128, "temperature": 0})
        for p in FRESH[:n]]


WORKLOADS = {"editor": editor, "agent": agent, "regenerate": regenerate, "fresh": fresh}
