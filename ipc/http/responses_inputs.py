"""The Responses API's request in chat terms: `input` items (after the stored conversation
they continue) as chat messages, function tools and tool_choice as chat's, `text.format`
as `response_format`. The shared chat layer (chat_inputs, parsing.constraint) reads the
result as it reads a chat completion's body."""

from __future__ import annotations

from typing import Any

from ..validation import BadRequest, get
from .media_inputs import image_part

ROLES = ("user", "assistant", "system", "developer")
TEXT_PARTS = ("input_text", "output_text", "text")
# what a chat request's 400 names, as the Responses request names it
RENAMED = {"messages": "input", "response_format": "text.format"}


def input_items(value: Any) -> list[dict[str, Any]]:
    """The request's `input` as items (a text is one user message), each checked and
    reduced to what the conversation needs (text parts as chat's)."""
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    if not isinstance(value, list):
        raise BadRequest("'input' must be a string or an array of items", param="input")
    items = (_item(x, f"input[{i}]") for i, x in enumerate(value))
    return [x for x in items if x is not None]


def _item(item: Any, where: str) -> dict[str, Any] | None:
    """One input item (None: a reasoning item, which the model is not shown)."""
    if not isinstance(item, dict):
        raise BadRequest(f"'{where}' must be an object", param=where)
    kind = item.get("type", "message" if "role" in item else None)
    if kind == "message":
        if item.get("role") not in ROLES:
            raise BadRequest(f"'{where}.role' must be one of {', '.join(ROLES)}",
                             param=f"{where}.role")
        return {"type": "message", "role": item["role"],
                "content": _content(item.get("content"), f"{where}.content")}
    if kind == "function_call":
        for field in ("call_id", "name", "arguments"):
            if not isinstance(item.get(field), str):
                raise BadRequest(f"'{where}.{field}' must be a string",
                                 param=f"{where}.{field}")
        return {k: item[k] for k in ("type", "call_id", "name", "arguments")}
    if kind == "function_call_output":
        if not isinstance(item.get("call_id"), str):
            raise BadRequest(f"'{where}.call_id' must be a string", param=f"{where}.call_id")
        return {"type": kind, "call_id": item["call_id"],
                "output": _content(item.get("output"), f"{where}.output")}
    if kind == "reasoning":
        return None
    raise BadRequest(f"'{where}.type' {kind!r} is not supported (message, function_call, "
                     "function_call_output)", param=f"{where}.type")


def _content(value: Any, where: str) -> str | list[dict[str, Any]]:
    """A message's content for the template: a text, or its text parts as chat's."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise BadRequest(f"'{where}' must be a string or an array of content parts",
                         param=where)
    parts: list[dict[str, Any]] = []
    for i, part in enumerate(value):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "input_image":  # its image_url (a data URL: the daemon fetches nothing)
            url = part.get("image_url")
            if not isinstance(url, str):
                raise BadRequest(f"'{where}[{i}]': an input_image part needs an 'image_url' "
                                 "(a data URL; file_id is not supported)",
                                 param=f"{where}[{i}]")
            parts.append(image_part(url))
            continue
        if kind in ("input_file", "input_audio"):
            raise BadRequest(f"'{where}[{i}]': {kind} parts are not supported (text and "
                             "input_image parts are)", param=f"{where}[{i}]")
        text = part.get("refusal") if kind == "refusal" else (
            part.get("text") if kind in TEXT_PARTS else None)
        if not isinstance(part, dict) or not isinstance(text, str):
            raise BadRequest(f"'{where}[{i}]' must be an input_text or output_text part "
                             "with a 'text'", param=f"{where}[{i}]")
        parts.append({"type": "text", "text": text})
    return parts


def messages(items: list[dict[str, Any]], instructions: str | None) -> list[dict[str, Any]]:
    """Chat messages of a conversation's items: `instructions` first as a system message,
    a developer's as a system message, function calls as the assistant's tool_calls (on
    the assistant message they follow), their outputs as tool messages."""
    out: list[dict[str, Any]] = []
    if instructions:
        out.append({"role": "system", "content": instructions})
    for item in items:  # as input_items gives them
        kind = item["type"]
        if kind == "message":
            role = "system" if item["role"] == "developer" else item["role"]
            out.append({"role": role, "content": item["content"]})
        elif kind == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": item["call_id"],
                        "content": item["output"]})
    return out


def chat_tools(value: Any) -> list[dict[str, Any]] | None:
    """Function tools ({type, name, description, parameters, strict}) as chat's."""
    if value is None:
        return None
    if not isinstance(value, list):
        raise BadRequest("'tools' must be an array", param="tools")
    out = []
    for i, tool in enumerate(value):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise BadRequest(f"'tools[{i}].type' {kind!r} is not supported: specd runs "
                             "function tools only", param=f"tools[{i}].type")
        fn = {k: tool[k] for k in ("name", "description", "parameters", "strict")
              if k in tool}
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(value: Any) -> Any:
    """tool_choice as chat's ({type: function, name} becomes {type, function: {name}})."""
    if value is None or value in ("auto", "none", "required"):
        return value
    if isinstance(value, dict) and value.get("type") == "function" and isinstance(
            value.get("name"), str):
        return {"type": "function", "function": {"name": value["name"]}}
    raise BadRequest("'tool_choice' must be 'auto', 'none', 'required' or {type: function, "
                     "name}", param="tool_choice")


def response_format(text: Any) -> dict[str, Any] | None:
    """`text.format` as chat's `response_format` (None: plain text)."""
    if text is None:
        return None
    if not isinstance(text, dict):
        raise BadRequest("'text' must be an object", param="text")
    fmt = text.get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        assert isinstance(fmt, dict)
        if not isinstance(fmt.get("schema"), dict):
            raise BadRequest("'text.format.schema' must be an object",
                             param="text.format.schema")
        return {"type": "json_schema", "json_schema": {
            "name": fmt.get("name"), "schema": fmt["schema"], "strict": fmt.get("strict")}}
    raise BadRequest("'text.format.type' must be text, json_object or json_schema",
                     param="text.format.type")


def chat_request(body: dict[str, Any], history: list[dict[str, Any]]
                 ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(the chat body the shared layer reads, this request's input items as stored)."""
    if "input" not in body and not history:
        raise BadRequest("'input' is required", param="input")
    items = input_items(body.get("input", []))
    reasoning = body.get("reasoning")
    effort = reasoning.get("effort") if isinstance(reasoning, dict) else None
    chat = {"messages": messages(history + items, get(body, "instructions", str, None)),
            "tools": chat_tools(body.get("tools")),
            "tool_choice": chat_tool_choice(body.get("tool_choice")),
            "parallel_tool_calls": get(body, "parallel_tool_calls", bool, True),
            "response_format": response_format(body.get("text")),
            # a response is a new assistant turn, whatever the conversation ends with
            "continue_final_message": False, "add_generation_prompt": True}
    for field in ("chat_template_kwargs", "json_schema", "grammar", "regex"):
        if field in body:  # specd's and llama-server's own extensions
            chat[field] = body[field]
    if isinstance(effort, str):
        chat["reasoning_effort"] = effort
    if not chat["messages"]:
        raise BadRequest("'input' is empty", param="input")
    return chat, items


def renamed(exc: BadRequest) -> BadRequest:
    """A 400 of the shared chat layer naming the Responses request's field."""
    new = RENAMED.get(exc.param or "")
    if new is None:
        return exc
    message = str(exc).replace(f"'{exc.param}'", f"'{new}'")
    return BadRequest(message, status=exc.status, code=exc.code, param=new)
