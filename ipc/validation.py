"""Reading request JSON fields with clear 400 errors."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from typing import Any

from aiohttp import web


class BadRequest(Exception):
    def __init__(self, message: str, *, status: int = 400, code: str = "invalid_request_error",
                 param: str | None = None):
        super().__init__(message)
        self.status, self.code, self.param = status, code, param


async def json_body(request: web.Request) -> dict[str, Any]:
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise BadRequest(f"request body too large (limit {request.client_max_size} bytes)",
                         status=413) from None
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
        return [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return stop
    raise BadRequest("'stop' must be a string or an array of strings", param="stop")


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
