"""Ollama's requests in the shared layer's terms: the model name checked, `options` and
`format` as the fields the shared parsers read, a chat as chat_inputs reads one,
`keep_alive`; and what Ollama's routes share: its error shape, its timestamps."""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any

from specd.daemon.serving.durations import parse_duration
from specd.daemon.serving.facade import ServiceFacade

from ..validation import BadRequest, get
from .media_inputs import base64_image_part

# Ollama's options the shared parser reads under the same names
SAMPLING_OPTIONS = ("temperature", "top_k", "top_p", "min_p", "seed", "repeat_penalty",
                    "repeat_last_n", "presence_penalty", "frequency_penalty", "num_predict",
                    "stop")
# samplers specd does not have: accepted only at the value that turns them off
NEUTRAL_OPTIONS = {"mirostat": 0, "typical_p": 1.0, "tfs_z": 1.0}


# -- what Ollama's routes share -----------------------------------------------------------
def error_body(status: int, message: str, code: str, param: str | None) -> dict[str, Any]:
    """Ollama's error: {"error": message} (make_middlewares' error shape for /api)."""
    return {"error": message}


def served_model(svc: ServiceFacade, body: dict[str, Any]) -> str:
    """The model the request names (`model`, or older clients' `name`), as it named it;
    a 404 unless a local model answers to it (with or without Ollama's ":latest")."""
    name = body.get("model") or body.get("name")
    if not isinstance(name, str) or not name:
        raise BadRequest("model is required", param="model")
    if name not in svc.served_names and name.removesuffix(":latest") not in svc.served_names:
        raise BadRequest(f"model '{name}' not found", status=404, param="model")
    return name


def timestamp(t: float | None = None) -> str:
    """An RFC 3339 time in UTC, as Ollama writes `created_at` (now, by default)."""
    return datetime.fromtimestamp(time.time() if t is None else t, UTC).isoformat().replace(
        "+00:00", "Z")


def keep_alive(body: dict[str, Any]) -> float | None:
    """`keep_alive` in seconds (negative: forever; 0: unload once idle), from a number of
    seconds or a Go duration ("5m", "1h30m", "-1"); None where the request sets none
    (the daemon's --keep-alive)."""
    value = body.get("keep_alive")
    if value is None:
        return None
    if isinstance(value, int | float | str):
        try:
            return parse_duration(value)
        except ValueError:
            pass
    raise BadRequest("'keep_alive' must be a number of seconds or a duration such as "
                     "\"5m\"", param="keep_alive")


# -- translation --------------------------------------------------------------------------
def sampling_fields(body: dict[str, Any]) -> dict[str, Any]:
    """The request's `options` and `format` as the fields the shared parsers read
    (generation_params with max_key "num_predict", stop_list, constraint)."""
    options = body.get("options") or {}
    if not isinstance(options, dict):
        raise BadRequest("'options' must be an object", param="options")
    for name, neutral in NEUTRAL_OPTIONS.items():
        if options.get(name) not in (None, neutral):
            raise BadRequest(f"option '{name}' is not supported by specd", param=name)
    # the context is set when the daemon starts (/api/show gives it): checked, not applied
    get(options, "num_ctx", int, None, lo=1)
    fields = {k: options[k] for k in SAMPLING_OPTIONS if k in options}
    if fields.get("num_predict") == -2:  # "until the context is full": no limit of its own
        fields["num_predict"] = -1
    fmt = body.get("format")
    if fmt == "json":
        fields["response_format"] = {"type": "json_object"}
    elif isinstance(fmt, dict):
        fields["response_format"] = {"type": "json_schema", "json_schema": {"schema": fmt}}
    elif fmt not in (None, ""):
        raise BadRequest("'format' must be \"json\" or a JSON schema", param="format")
    return fields


def image_parts(item: dict[str, Any], param: str) -> list[dict[str, Any]]:
    """A message's (or /api/generate's) `images`, base64 files, as image_url parts."""
    images = item.get("images") or []
    if not isinstance(images, list):
        raise BadRequest("'images' must be an array of base64 strings", param=param)
    return [base64_image_part(data, None, param) for data in images]


def with_images(content: Any, images: list[dict[str, Any]]) -> Any:
    """A message's content with its images before its text (as Ollama places them)."""
    if not images:
        return content
    text = content if isinstance(content, str) else ""
    return [*images, *([{"type": "text", "text": text}] if text else [])]


def chat_body(body: dict[str, Any]) -> dict[str, Any]:
    """An Ollama chat as the OpenAI-shaped chat `chat_inputs` reads: tool calls with their
    type, a tool result's `tool_name` as its `name`, `think` as the template's switch."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise BadRequest("'messages' must be an array of {role, content}", param="messages")
    out = []
    for i, m in enumerate(messages):
        # a call's message comes without content from Ollama's clients: null, as OpenAI's
        msg = {"role": m.get("role"), "content": with_images(
            m.get("content"), image_parts(m, f"messages[{i}].images"))}
        calls = m.get("tool_calls")
        if calls is not None:
            if not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
                raise BadRequest("'tool_calls' must be an array of {function: {name, "
                                 "arguments}}", param="messages")
            msg["tool_calls"] = [{"type": "function", **c} for c in calls]
        if m.get("tool_name") is not None:
            msg["name"] = m["tool_name"]
        if m.get("thinking"):
            msg["reasoning_content"] = m["thinking"]
        out.append(msg)
    chat: dict[str, Any] = {"messages": out, "tools": body.get("tools"),
                            # specd's own: Ollama has no way to force a call
                            "tool_choice": body.get("tool_choice")}
    think = body.get("think")
    if isinstance(think, bool):
        chat["chat_template_kwargs"] = {"enable_thinking": think}
    elif isinstance(think, str):  # gpt-oss's levels ("low", "medium", "high")
        chat["reasoning_effort"] = think
    elif think is not None:
        raise BadRequest("'think' must be a boolean or a level", param="think")
    return chat
