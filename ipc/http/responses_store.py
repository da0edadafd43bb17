"""The conversations `previous_response_id` continues: each stored response's items
(the conversation's input and output so far), in memory, for the identity that made it
(an OS user, a token's holder) and no other; past a bound on responses or bytes, the
least recently used go first."""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any

from aiohttp import web

MAX_RESPONSES = 256
MAX_BYTES = 64 << 20  # the stored conversations, as JSON


class ResponseStore:
    """Conversations by (identity, response id), least recently used first."""

    def __init__(self, max_responses: int = MAX_RESPONSES, max_bytes: int = MAX_BYTES):
        self.max_responses, self.max_bytes = max_responses, max_bytes
        self._held: OrderedDict[tuple[str, str], tuple[list[dict[str, Any]], int]] = (
            OrderedDict())
        self._bytes = 0

    def put(self, identity: str, response_id: str, items: list[dict[str, Any]]) -> None:
        """Keep a response's conversation (one larger than the whole bound is not kept).
        Items are shared with the conversations continuing it, never changed."""
        size = len(json.dumps(items, separators=(",", ":")))
        if size > self.max_bytes:
            return
        self._drop((identity, response_id))
        self._held[(identity, response_id)] = (items, size)
        self._bytes += size
        while len(self._held) > self.max_responses or self._bytes > self.max_bytes:
            self._drop(next(iter(self._held)))

    def get(self, identity: str, response_id: str) -> list[dict[str, Any]] | None:
        """The conversation, if `identity` stored it (another's is as if it did not
        exist)."""
        held = self._held.get((identity, response_id))
        if held is None:
            return None
        self._held.move_to_end((identity, response_id))
        return held[0]

    def __len__(self) -> int:
        return len(self._held)

    def _drop(self, key: tuple[str, str]) -> None:
        held = self._held.pop(key, None)
        if held is not None:
            self._bytes -= held[1]


RESPONSES = web.AppKey("responses", ResponseStore)
