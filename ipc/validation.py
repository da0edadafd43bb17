"""Reading request JSON fields with clear 400 errors, and the limits on what a request
may ask for (each refusal names its limit)."""

from __future__ import annotations

import asyncio
import json
import math
import re
from collections.abc import Callable
from typing import Any

from aiohttp import web

BODY_TIMEOUT = web.AppKey("body_timeout", float)
DEFAULT_BODY_TIMEOUT = 60.0  # seconds for a request's body to arrive, once its headers have
BODY_BYTES = web.RequestKey("body_bytes", int)  # how many bytes the request's body had
MAX_STOP_STRINGS = 128
MAX_STOP_CHARS = 512  # in one stop string
MAX_TOOLS = 128
MAX_TOOLS_BYTES = 256 << 10  # the tools array, as JSON
MAX_CONSTRAINT_BYTES = 256 << 10  # a grammar, regex or JSON schema (as JSON)
MAX_CACHE_KEY_CHARS = 256


class BadRequest(Exception):
    def __init__(self, message: str, *, status: int = 400, code: str = "invalid_request_error",
                 param: str | None = None):
        super().__init__(message)
        self.status, self.code, self.param = status, code, param


async def json_body(request: web.Request) -> dict[str, Any]:
    timeout = request.app.get(BODY_TIMEOUT, DEFAULT_BODY_TIMEOUT)
    try:
        async with asyncio.timeout(timeout):
            raw = await request.read()
    except TimeoutError:
        raise BadRequest(f"the request body did not arrive within {timeout:g} s",
                         status=408, code="timeout") from None
    except web.HTTPRequestEntityTooLarge:
        raise BadRequest(f"request body too large (limit {request.client_max_size} bytes)",
                         status=413) from None
    request[BODY_BYTES] = len(raw)
    try:
        body = json.loads(raw or b"{}")
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(f"malformed JSON body: {exc}") from None
    except RecursionError:
        raise BadRequest("malformed JSON body: nested too deeply") from None
    if not isinstance(body, dict):
        raise BadRequest("the JSON body must be an object")
    return body


def get(body: dict[str, Any], name: str, kind: type[Any] | tuple[type[Any], ...],
        default: Any = None, *, lo: float | None = None, hi: float | None = None) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if float in kinds and isinstance(value, int) and not isinstance(value, bool):
        try:
            value = float(value)
        except OverflowError:
            raise BadRequest(f"'{name}' is out of range, got an integer of "
                             f"{len(str(value))} digits", param=name) from None
    if isinstance(value, bool) and bool not in kinds:
        raise BadRequest(f"'{name}' must be {_names(kinds)}, got a boolean", param=name)
    if not isinstance(value, kinds):
        raise BadRequest(f"'{name}' must be {_names(kinds)}, got {type(value).__name__}",
                         param=name)
    if isinstance(value, float) and not math.isfinite(value):  # JSON's NaN, Infinity
        raise BadRequest(f"'{name}' must be a finite number, got {value}", param=name)
    if lo is not None and value < lo or hi is not None and value > hi:
        raise BadRequest(f"'{name}' must be between {lo} and {hi}, got {value}", param=name)
    return value


def _names(kinds: tuple[type, ...]) -> str:
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
             list: "an array", dict: "an object"}
    return " or ".join(names.get(k, k.__name__) for k in kinds)


def stop_list(body: dict[str, Any]) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise BadRequest("'stop' must be a string or an array of strings", param="stop")
    if len(stop) > MAX_STOP_STRINGS:
        raise BadRequest(f"'stop' has {len(stop)} strings; the limit is {MAX_STOP_STRINGS}",
                         param="stop")
    longest = max((len(s) for s in stop), default=0)
    if longest > MAX_STOP_CHARS:
        raise BadRequest(f"a stop string has {longest} characters; the limit is "
                         f"{MAX_STOP_CHARS}", param="stop")
    return stop


def check_tools_size(tools: list[Any]) -> None:
    """A 400 for more tools, or a bigger tools array, than a request may declare."""
    if len(tools) > MAX_TOOLS:
        raise BadRequest(f"'tools' has {len(tools)} tools; the limit is {MAX_TOOLS}",
                         param="tools")
    size = json_size(tools, MAX_TOOLS_BYTES, "tools")
    if size > MAX_TOOLS_BYTES:
        raise BadRequest(f"'tools' is {size} bytes as JSON; the limit is {MAX_TOOLS_BYTES}",
                         param="tools")


def check_constraint_size(spec: Any, param: str) -> None:
    """A 400 for a grammar, regex or schema larger than MAX_CONSTRAINT_BYTES."""
    size = json_size(spec, MAX_CONSTRAINT_BYTES, param) if not isinstance(spec, str) else (
        utf8_size(spec))
    if size > MAX_CONSTRAINT_BYTES:
        raise BadRequest(f"'{param}' is {size} bytes; the limit is {MAX_CONSTRAINT_BYTES}",
                         param=param)


def json_size(value: Any, limit: int, param: str) -> int:
    """The bytes of `value` as compact JSON (one over `limit` where it nests too deeply
    to write)."""
    try:
        return len(json.dumps(value, separators=(",", ":")).encode())
    except RecursionError:
        raise BadRequest(f"'{param}' nests too deeply", param=param) from None


def utf8_size(text: str) -> int:
    """The bytes of `text` in UTF-8 (a lone surrogate counts as 3)."""
    return len(text.encode("utf-8", "surrogatepass"))


def check_text_bytes(texts: list[str], limit: int, param: str) -> None:
    """A 400 before any tokenizing when the texts together are longer than `limit`
    bytes: more than the context can hold (see prompt_byte_limit)."""
    total = 0
    for text in texts:
        total += len(text) if len(text) * 4 <= limit else utf8_size(text)
        if total > limit:
            raise BadRequest(f"'{param}' holds over {limit} bytes of text, more than the "
                             "context can hold (the limit: the context's tokens times the "
                             "longest token's bytes, at least 32)",
                             code="context_length_exceeded", param=param)


def texts_in(value: Any, depth: int = 0) -> list[str]:
    """Every string inside a JSON value (keys included), nested at most 200 deep."""
    if isinstance(value, str):
        return [value]
    if depth > 200:
        raise BadRequest("the request nests too deeply")
    if isinstance(value, dict):
        out = [k for k in value if isinstance(k, str)]
        for v in value.values():
            out += texts_in(v, depth + 1)
        return out
    if isinstance(value, list):
        return [t for v in value for t in texts_in(v, depth + 1)]
    return []


def cache_key(body: dict[str, Any]) -> str | None:
    """The client's `cache_key`: its requests share a cached prompt only with requests of
    the same key (within one user)."""
    key = get(body, "cache_key", str, None)
    if key is not None and len(key) > MAX_CACHE_KEY_CHARS:
        raise BadRequest(f"'cache_key' has {len(key)} characters; the limit is "
                         f"{MAX_CACHE_KEY_CHARS}", param="cache_key")
    return key


def token_list(value: Any, name: str, vocab: int) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                              for t in value):
        raise BadRequest(f"'{name}' must be a string or an array of token ids", param=name)
    bad = [t for t in value if not 0 <= t < vocab]
    if bad:
        raise BadRequest(f"'{name}' has token ids outside the vocabulary (0..{vocab - 1}): "
                         f"{bad[:5]}", param=name)
    return list(value)


def logit_bias(value: Any, encode: Callable[[str], list[int]], vocab: int) -> dict[int, float]:
    """`logit_bias` as OpenAI sends it ({"token id": bias}) or llama.cpp ([[token, bias],
    ...], a token given as text meaning each of its tokens; false meaning never): token
    id -> the bias added to its logit (biases for one token add up). Anything else, an id
    outside the vocabulary, or a bias that is not a finite number or false, is a 400."""
    name = "logit_bias"
    if isinstance(value, dict):  # keys: token ids as text (OpenAI), else text (llama.cpp)
        pairs: list[Any] = [[int(k) if _is_int(k) else k, v] for k, v in value.items()]
    elif isinstance(value, list):  # tokens: ids, or text
        pairs = value
    else:
        raise BadRequest(f"'{name}' must be an object {{token id: bias}} or an array of "
                         f"[token, bias] pairs", param=name)
    out: dict[int, float] = {}
    for pair in pairs:
        if not isinstance(pair, list) or len(pair) != 2:
            raise BadRequest(f"'{name}' array items must be [token, bias] pairs, got "
                             f"{json.dumps(pair)[:60]}", param=name)
        token, bias = pair
        if bias is False:
            bias = -math.inf
        elif isinstance(bias, bool) or not isinstance(bias, int | float) or not math.isfinite(
                float(bias)):
            raise BadRequest(f"'{name}' for token {token!r}: the bias must be a finite "
                             f"number or false, got {json.dumps(bias)}", param=name)
        if isinstance(token, str):
            ids = encode(token)  # llama.cpp: the tokens of this text
        elif isinstance(token, int) and not isinstance(token, bool):
            ids = [token]
        else:
            raise BadRequest(f"'{name}' tokens must be ids or text, got {json.dumps(token)}",
                             param=name)
        for t in ids:
            if not 0 <= t < vocab:
                raise BadRequest(f"'{name}' has a token id outside the vocabulary "
                                 f"(0..{vocab - 1}): {t}", param=name)
            out[t] = out.get(t, 0.0) + float(bias)
    return out


def _is_int(text: str) -> bool:
    """An integer written out ("15339", "-3"), as strtol reads a whole key."""
    return re.fullmatch(r"-?[0-9]+", text) is not None
