"""Anthropic's Messages request as the chat request the shared layer reads: `system`,
content blocks, tool_use / tool_result and thinking blocks become the chat template's
messages; `tools` and `tool_choice` those of OpenAI's shape (daemon/text/tool_calls.py
reads them); `stop_sequences` and the sampling fields keep their meaning."""

from __future__ import annotations

import json
from typing import Any

from ..validation import BadRequest, get
from .media_inputs import base64_image_part, image_part

# the sampling settings a request may give; the fields read nowhere here (metadata,
# service_tier, cache_control on blocks, ...) change nothing that specd does
SAMPLING_FIELDS = ("temperature", "top_p", "top_k")


def chat_body(body: dict[str, Any]) -> dict[str, Any]:
    """The chat request (OpenAI's shape, what chat_inputs takes) a Messages request asks
    for: its messages, tools, tool_choice and template variables."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty array of {role, content}",
                         param="messages")
    out: dict[str, Any] = {"messages": system_messages(body.get("system"))}
    for i, message in enumerate(messages):
        out["messages"] += chat_messages(message, i)
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise BadRequest("'tools' must be an array of tools", param="tools")
        out["tools"] = [function_tool(t, i) for i, t in enumerate(tools)]
    if body.get("tool_choice") is not None:
        out["tool_choice"], parallel = tool_choice(body["tool_choice"])
        out["parallel_tool_calls"] = parallel
    kwargs = body.get("chat_template_kwargs")  # passed through, as llama-server does
    if kwargs is not None:
        out["chat_template_kwargs"] = kwargs
    enable = thinking_switch(body.get("thinking"))
    if enable is not None:
        out["chat_template_kwargs"] = {**(kwargs if isinstance(kwargs, dict) else {}),
                                       "enable_thinking": enable}
    if enable:  # the reasoning's budget, as llama-server passes it on
        out["thinking_budget_tokens"] = body["thinking"].get("budget_tokens",
                                                             DEFAULT_THINKING_BUDGET)
    return out


# `thinking` types: whether each turns the template's thinking on (None: the template's
# default, as where the model decides how much to think)
THINKING_TYPES: dict[str, bool | None] = {
    "enabled": True, "disabled": False, "adaptive": None, "between_tools": None}


# llama-server's budget for {type: enabled} without budget_tokens
DEFAULT_THINKING_BUDGET = 10000


def thinking_switch(thinking: Any) -> bool | None:
    """The template's `enable_thinking` that `thinking` asks for (None: left to the
    template); its `budget_tokens` checked (chat_body passes it on)."""
    if thinking is None:
        return None
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if kind not in THINKING_TYPES:
        raise BadRequest("'thinking' must be {type: enabled, budget_tokens}, {type: "
                         "disabled}, {type: adaptive} or {type: between_tools}",
                         param="thinking")
    get(thinking, "budget_tokens", int, None, lo=0)
    return THINKING_TYPES[kind]


def sampling_body(body: dict[str, Any], *, max_tokens: int) -> dict[str, Any]:
    """The fields generation_params reads: max_tokens and the sampling settings."""
    return {"max_tokens": max_tokens, **{k: body[k] for k in SAMPLING_FIELDS if k in body}}


def max_tokens(body: dict[str, Any]) -> int:
    """`max_tokens`, required as Anthropic's API requires it."""
    value = get(body, "max_tokens", int, None, lo=1, hi=1 << 20)
    if value is None:
        raise BadRequest("'max_tokens' is required", param="max_tokens")
    return int(value)


def stop_body(body: dict[str, Any]) -> dict[str, Any]:
    """`stop_sequences` as the shared layer's `stop`."""
    stop = body.get("stop_sequences")
    if stop is not None and not (isinstance(stop, list)
                                 and all(isinstance(s, str) for s in stop)):
        raise BadRequest("'stop_sequences' must be an array of strings",
                         param="stop_sequences")
    return {"stop": stop}


# -- messages -----------------------------------------------------------------------------
def system_messages(system: Any) -> list[dict[str, Any]]:
    """`system`, a string or text blocks, as the chat's system message (none if empty)."""
    if system is None or system == "" or system == []:
        return []
    if isinstance(system, str):
        return [{"role": "system", "content": system}]
    if isinstance(system, list):
        return [{"role": "system", "content": [_text_part(b, "system") for b in system]}]
    raise BadRequest("'system' must be a string or an array of text blocks", param="system")


def chat_messages(message: Any, i: int) -> list[dict[str, Any]]:
    """One Messages message as chat messages: a user's tool_result blocks become tool
    messages (first, as they answer the assistant turn before), its other blocks one user
    message; an assistant's text, thinking and tool_use blocks one assistant message."""
    where = f"messages[{i}]"
    if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
        raise BadRequest(f"{where}: a message needs a 'role', 'user' or 'assistant'",
                         param="messages")
    role, content = message["role"], message.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise BadRequest(f"{where}: 'content' must be a string or an array of blocks",
                         param="messages")
    blocks = [_block(b, f"{where}.content[{k}]") for k, b in enumerate(content)]
    if role == "user":
        tools = [_tool_message(b, where) for b in blocks if b["type"] == "tool_result"]
        parts = [_image_part(b, where) if b["type"] == "image" else _text_part(b, where)
                 for b in blocks if b["type"] != "tool_result"]
        return tools + ([{"role": "user", "content": parts}] if parts or not tools else [])
    out: dict[str, Any] = {"role": "assistant", "content": None}
    texts = [_text_part(b, where) for b in blocks if b["type"] == "text"]
    if texts:
        out["content"] = texts
    thinking = [b.get("thinking") for b in blocks if b["type"] == "thinking"]
    if any(isinstance(t, str) and t for t in thinking):  # as reasoning_content (Qwen3's)
        out["reasoning_content"] = "\n".join(t for t in thinking if isinstance(t, str))
    calls = [_tool_call(b, where) for b in blocks if b["type"] == "tool_use"]
    if calls:
        out["tool_calls"] = calls
    others = {b["type"] for b in blocks} - {"text", "thinking", "redacted_thinking",
                                            "tool_use"}
    if others:
        raise BadRequest(f"{where}: {sorted(others)[0]!r} blocks are not supported in an "
                         "assistant message", param="messages")
    if out["content"] is None and not calls:
        out["content"] = ""
    return [out]


def _block(block: Any, where: str) -> dict[str, Any]:
    if not isinstance(block, dict) or not isinstance(block.get("type"), str):
        raise BadRequest(f"{where}: a content block needs a 'type'", param="messages")
    return block


def _image_part(block: dict[str, Any], where: str) -> dict[str, Any]:
    """An image block as OpenAI's image_url part: a base64 source as a data URL, a url
    source as the URL (refused where remote: the daemon fetches nothing)."""
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64":
        assert isinstance(source, dict)
        return base64_image_part(source.get("data"), source.get("media_type"), where)
    if kind == "url" and isinstance(source, dict) and isinstance(source.get("url"), str):
        return image_part(source["url"])
    raise BadRequest(f"{where}: an image block's source must be {{type: base64, "
                     "media_type, data}}", param="messages")


def _text_part(block: Any, where: str) -> dict[str, Any]:
    """A text block as OpenAI's text part (the chat template joins them)."""
    block = _block(block, where)
    if block["type"] != "text" or not isinstance(block.get("text"), str):
        raise BadRequest(f"{where}: {block['type']!r} blocks are not supported here (text "
                         "blocks with a 'text' string are)", param="messages")
    return {"type": "text", "text": block["text"]}


def _tool_message(block: dict[str, Any], where: str) -> dict[str, Any]:
    """A tool_result block as a tool message: its content a string or text blocks."""
    use_id = block.get("tool_use_id")
    if not isinstance(use_id, str):
        raise BadRequest(f"{where}: a tool_result needs a 'tool_use_id'", param="messages")
    content = block.get("content", "")
    if isinstance(content, list):
        content = [_text_part(b, where + " tool_result") for b in content]
    elif not isinstance(content, str):
        raise BadRequest(f"{where}: a tool_result's 'content' must be a string or an array "
                         "of text blocks", param="messages")
    return {"role": "tool", "tool_call_id": use_id, "content": content}


def _tool_call(block: dict[str, Any], where: str) -> dict[str, Any]:
    """A tool_use block as OpenAI's tool call (its arguments JSON text)."""
    if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str) or (
            not isinstance(block.get("input", {}), dict)):
        raise BadRequest(f"{where}: a tool_use needs an 'id', a 'name' and an 'input' "
                         "object", param="messages")
    return {"id": block["id"], "type": "function",
            "function": {"name": block["name"],
                         "arguments": json.dumps(block.get("input", {}), ensure_ascii=False)}}


# -- tools --------------------------------------------------------------------------------
def function_tool(tool: Any, i: int) -> dict[str, Any]:
    """A client tool ({name, description, input_schema}) as OpenAI's function tool;
    Anthropic's server tools (web search, code execution, ...) run on Anthropic's side,
    and are refused."""
    if not isinstance(tool, dict):
        raise BadRequest(f"tools[{i}] must be an object", param="tools")
    kind = tool.get("type", "custom")
    if kind != "custom":
        raise BadRequest(f"tools[{i}]: {kind!r} is a server tool, which specd does not "
                         "run (client tools, with an 'input_schema', are supported)",
                         param="tools")
    schema = tool.get("input_schema", {"type": "object"})
    if not isinstance(schema, dict):
        raise BadRequest(f"tools[{i}]: 'input_schema' must be an object", param="tools")
    fn: dict[str, Any] = {"name": tool.get("name"), "parameters": schema}
    if isinstance(tool.get("description"), str):
        fn["description"] = tool["description"]
    return {"type": "function", "function": fn}


def tool_choice(choice: Any) -> tuple[Any, bool]:
    """Anthropic's tool_choice as OpenAI's, and whether calls may be parallel."""
    kind = choice.get("type") if isinstance(choice, dict) else None
    parallel = not (isinstance(choice, dict) and choice.get("disable_parallel_tool_use"))
    if kind in ("auto", "none"):
        return kind, parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise BadRequest("'tool_choice' must be {type: auto}, {type: any}, {type: none} or "
                     "{type: tool, name}", param="tool_choice")
