"""JSON as llama-server writes it: compact (no space after ',' or ':') and UTF-8 as is.

Editor plugins match responses with patterns such as llama.vim's `"content"\\s*:"`, so
the separators are part of the protocol, not cosmetics.
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

_SEPARATORS = (",", ":")


def dumps(payload: Any) -> str:
    """Compact JSON text; non-ASCII characters as they are (a lone surrogate, which UTF-8
    cannot carry, makes the whole text ASCII with \\u escapes instead)."""
    text = json.dumps(payload, ensure_ascii=False, separators=_SEPARATORS)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(payload, separators=_SEPARATORS)
    return text


def json_response(payload: Any, *, status: int = 200) -> web.Response:
    return web.json_response(payload, status=status, dumps=dumps)
